"""Ad hoc: scripts/bench_decode_layout.py with the rollout compiled under $ROLLOUT_OPTIONS (JSON) on a CPU."""
import json, os, runpy, sys
sys.path.insert(0, "/work/main/scripts")
from stare_jax import gpu_gemm
opts = json.loads(os.environ.get("ROLLOUT_OPTIONS", "{}"))
real = gpu_gemm.compiler_options
def patched(phase, choice, *, platform, dtype, **kw):
    out = real(phase, choice, platform=platform, dtype=dtype, **kw)
    return {**out, **opts} if phase == "rollout" and platform == "cpu" else out
gpu_gemm.compiler_options = patched
print("rollout options:", opts, file=sys.stderr)
sys.argv = ["bench_decode_layout.py", *sys.argv[1:]]
runpy.run_path("/work/main/scripts/bench_decode_layout.py", run_name="__main__")
