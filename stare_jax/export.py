"""Export a run's checkpoint as a Hugging Face directory (contract 6 of DESIGN.md).

    python -m stare_jax.export --workdir DIR --out OUT [--step K] [--dtype float32|bfloat16]

The checkpoint is restored onto one local device, whatever mesh wrote it, and written with
`stare_jax.models.save_pretrained` (config.json, safetensors, tokenizer) for `transformers`. The
restore is the one training uses: a damaged latest checkpoint is skipped for the previous one.
Bad input (no checkpoint, a --step naming none, --out an existing file, or the run's own workdir,
checkpoints or base model directory) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> None:
    """Restores the checkpoint and writes the HF directory."""
    parser = argparse.ArgumentParser(prog="python -m stare_jax.export", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = parser.parse_args(None if argv is None else argv[1:])
    from stare_jax.writers import configure_logging

    configure_logging()

    from stare_jax import checkpoint as ckpt_lib
    from stare_jax import trainer
    from stare_jax import workdir as workdir_lib
    from stare_jax.models import MODEL_INPUT_ERRORS, save_pretrained

    try:
        workdir_lib.check_workdir(args.out, flag="--out")
        workdir_lib.check_workdir(args.workdir)
        config, policy, step = trainer.load_trained_policy(args.workdir, step=args.step)
    except workdir_lib.WorkdirError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (FileNotFoundError, ckpt_lib.CheckpointUnusableError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except MODEL_INPUT_ERRORS as e:  # the run's model directory, damaged since it trained
        print(f"model error: {e}", file=sys.stderr)
        sys.exit(2)
    clash = _clobbers_the_run(args.out, args.workdir, trainer.model_directory(config, args.workdir, create=False))
    if clash:
        print(f"config error: --out: {args.out} {clash}; allowed: a directory outside the run's checkpoints and "
              f"base model (a new WORKDIR/export is fine)", file=sys.stderr)
        sys.exit(2)
    try:
        workdir_lib.check_workdir(args.out, create=True, flag="--out")
    except workdir_lib.WorkdirError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        save_pretrained(policy, args.out, dtype=args.dtype)
    except Exception as e:  # a full or failing disk: one line
        reason = workdir_lib.storage_reason(e)
        if reason is None:
            raise
        print(f"error: writing {args.out} failed: {reason}; free space (or fix the file system) and rerun",
              file=sys.stderr)
        sys.exit(1)
    print(f"exported step {step} of {args.workdir} to {args.out}")


def _clobbers_the_run(out: str, workdir: str, model_dir: str) -> str | None:
    """Why writing an export to `out` would overwrite the run it comes from, or None: `out` is the
    workdir (its config.json is the run's), inside its checkpoints, or the run's base model
    directory (which evaluate, export and a resume load), or inside it."""
    import os

    real = lambda p: os.path.realpath(os.path.abspath(p))  # noqa: E731
    out, workdir = real(out), real(workdir)
    inside = lambda path, root: path == root or path.startswith(root + os.sep)  # noqa: E731
    if out == workdir:
        return "is the run's workdir (its config.json and metrics.jsonl would be overwritten)"
    if inside(out, os.path.join(workdir, "checkpoints")):
        return "is inside the run's checkpoints"
    if model_dir and inside(out, real(model_dir)):
        return f"is the run's base model directory {model_dir}" + ("" if out == real(model_dir) else " or inside it")
    return None


if __name__ == "__main__":
    main()
