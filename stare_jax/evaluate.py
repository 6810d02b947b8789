"""Evaluate a run's checkpoint (contract 6 of DESIGN.md).

    python -m stare_jax.evaluate --config configs/quickstart.py --workdir DIR [--n N] [--step K]

Samples N responses per evaluation prompt (eval.temperature, eval.top_p) from the latest (or
step K) usable checkpoint and writes DIR/eval/step_<k>.json with avg@N and unbiased pass@k per
dataset. A damaged latest checkpoint is skipped for the previous one (with a warning); a workdir
without checkpoints or a --step naming no usable one exits with status 2 and one line.
"""

from __future__ import annotations

import json
import sys


def _flag(argv, name, cast, default=None):
    for i, a in enumerate(argv):
        if a == f"--{name}" and i + 1 < len(argv):
            return cast(argv[i + 1])
        if a.startswith(f"--{name}="):
            return cast(a.split("=", 1)[1])
    return default


def _count(text: str) -> int:
    """--n's value as an integer >= 1, else a ConfigError naming it."""
    from stare_jax.config import ConfigError

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError("--n", f"got {text!r}; allowed: an integer >= 1")
    return n


def main(argv=None) -> None:
    """Parses flags, restores the checkpoint, evaluates, writes and prints the results."""
    argv = list(sys.argv if argv is None else argv)
    from stare_jax import config as config_lib
    from stare_jax.train import parse_workdir

    config_lib.exit_with_usage_if_asked(argv, __doc__)

    own = {"--workdir", "--n", "--step"}
    config_args = [a for i, a in enumerate(argv) if a.split("=")[0] not in own
                   and not (i > 0 and argv[i - 1] in own)]
    config = config_lib.load_config_or_exit(config_args, own_flags=("--workdir DIR", "--n N", "--step K"))
    workdir = parse_workdir(argv)
    from stare_jax import checkpoint as ckpt_lib
    from stare_jax import workdir as workdir_lib

    try:
        workdir_lib.check_workdir(workdir)
        config_lib.check_cache_dir(config)
        step = _flag(argv, "step", int)
        n = _flag(argv, "n", _count)
    except config_lib.ConfigError as e:
        print(str(e), file=sys.stderr)
        sys.exit(2)
    except workdir_lib.WorkdirError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:
        print(f"config error: --step: {e}; allowed: an integer checkpoint step", file=sys.stderr)
        sys.exit(2)
    if n is not None:
        config.eval.n = n
    from stare_jax.writers import configure_logging

    configure_logging()
    import jax

    from stare_jax import compilation, precision, trainer
    from stare_jax.models import MODEL_INPUT_ERRORS

    compilation.use_persistent_cache(config.compilation_cache_dir)  # this command's setting (or the env's)
    cli_eval = config.eval
    # Model and data come from the run's saved config; the evaluation settings from this command.
    try:
        config, policy, step = trainer.load_trained_policy(workdir, step=step)
    except (FileNotFoundError, ckpt_lib.CheckpointUnusableError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except MODEL_INPUT_ERRORS as e:  # the run's model directory, damaged since it trained
        print(f"model error: {e}", file=sys.stderr)
        sys.exit(2)
    for key, value in cli_eval.items():
        config.eval[key] = value
    tok = policy.tokenizer
    eos_ids = tuple(policy.config.eos_token_ids) or (tok.eos_token_id,)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    _, eval_sources = trainer.data_sources(config, workdir)
    from stare_jax.rewards import RewardSpecError
    from stare_jax.train import reward_error_line

    try:
        with precision.matmul_precision(config.model.matmul_precision):  # the run's own setting
            row = trainer._run_eval(config, policy.model, tok, eval_sources, jax.random.key(config.seed), step,
                                    workdir, eos_ids, pad_id, policy.mesh)
    except RewardSpecError as e:  # the run's reward module, gone or broken since it trained
        print(reward_error_line(e), file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a full disk writing eval/ (or the data), out of memory: one line
        from stare_jax.train import failure_line

        line = failure_line(e, workdir, resume=False)
        if line is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"step": step, **row}))


if __name__ == "__main__":
    from stare_jax import allocator

    allocator.reexec_if_wanted()  # oneTBB's malloc on a CPU host (STARE_JAX_MALLOC; allocator module)
    main()
