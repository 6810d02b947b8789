"""Ad hoc: scripts/bench_update.py with update.CPU_UPDATE_COMPILER_OPTIONS replaced by $UPDATE_OPTIONS (JSON)."""
import json, os, runpy, sys
sys.path.insert(0, "/work/main/scripts")
from stare_jax.rl import update
opts = json.loads(os.environ.get("UPDATE_OPTIONS", "null"))
if opts is not None:
    update.CPU_UPDATE_COMPILER_OPTIONS.clear(); update.CPU_UPDATE_COMPILER_OPTIONS.update(opts)
print("options:", update.CPU_UPDATE_COMPILER_OPTIONS, file=sys.stderr)
sys.argv = ["bench_update.py", *sys.argv[1:]]
runpy.run_path("/work/main/scripts/bench_update.py", run_name="__main__")
