"""Reward functions and their registry.

A reward function is a module-level function `fn(response: str, ground_truth: str) -> float`.
The registry maps a short name to an import spec `"package.module:function"`; worker processes
import the function from the spec, so only importable (module-level) functions can be used.
`resolve_spec` also accepts a spec directly, which is how user code plugs in its own reward:

    register_reward("my_task", "my_pkg.rewards:score")      # or register_reward("my_task", score)
    RewardPool("my_task")  /  RewardPool("my_pkg.rewards:score")
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from stare_jax.rewards.extract import final_answer, last_boxed

RewardFn = Callable[[str, str], float]


def countdown_reward(response: str, ground_truth: str) -> float:
    """Countdown verifier: 1.0 iff the response is an expression over the problem's numbers
    (each at most once) equal to its target (`stare_jax.tasks.countdown.score`)."""
    from stare_jax.tasks.countdown import score
    return score(response, ground_truth)


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str):
    from math_verify import parse
    gt = ground_truth.strip()
    if "\\boxed" in gt or "$" in gt:
        gold = parse(gt)
    else:
        gold = parse(f"\\boxed{{{gt}}}")
        if not gold:
            gold = parse(gt)
    return gold


def _verify(answer: str | None, ground_truth: str) -> float:
    """1.0 iff `answer` (a final answer's text) is equivalent to the reference by math-verify
    (`verify(parse(gold), parse(answer))`, gold first); 0.0 when either side is missing or unparsable."""
    from math_verify import parse, verify
    if answer is None or not answer.strip():
        return 0.0
    gold = _parse_gold(str(ground_truth))
    if not gold:
        return 0.0
    pred = parse(f"\\boxed{{{answer}}}")
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def math_reward(response: str, ground_truth: str) -> float:
    """Math verifier: 1.0 iff the content of the response's last `\\boxed{}` is equivalent to the
    reference answer by math-verify; 0.0 when there is no box or either side does not parse.

    Uses `signal.alarm` inside math-verify: call it in a process's main thread (RewardPool does).
    """
    return _verify(last_boxed(response), ground_truth)


def final_answer_reward(response: str, ground_truth: str) -> float:
    """Short-answer math verifier: 1.0 iff the response's final answer (its last `\\boxed{}`, else its
    last number; `stare_jax.rewards.extract.final_answer`) is equivalent to the reference answer by
    math-verify, as in `math_reward`; 0.0 when there is no number or either side does not parse."""
    return _verify(final_answer(response), ground_truth)


REGISTRY: dict[str, str] = {
    "countdown": "stare_jax.rewards.functions:countdown_reward",
    "math": "stare_jax.rewards.functions:math_reward",
    "final_answer": "stare_jax.rewards.functions:final_answer_reward",
}

#: modules a built-in reward imports on its first call (a pool's forkserver imports them first:
#: `pool.preload_modules`)
FIRST_CALL_IMPORTS: dict[str, tuple[str, ...]] = {
    REGISTRY["countdown"]: ("stare_jax.tasks.countdown",),
    REGISTRY["math"]: ("math_verify",),
    REGISTRY["final_answer"]: ("math_verify",),
}


def function_spec(fn: Callable) -> str:
    """The import spec "module:qualname" of a module-level function (ValueError otherwise)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise ValueError(f"{fn!r} is not importable by name (define it at module level in an importable module)")
    return f"{module}:{qualname}"


def register_reward(name: str, fn_or_spec: "Callable | str", *, overwrite: bool = False) -> str:
    """Registers `fn_or_spec` (a module-level function or a "module:function" spec) under `name`;
    returns the spec. Re-registering a name needs `overwrite`."""
    spec = fn_or_spec if isinstance(fn_or_spec, str) else function_spec(fn_or_spec)
    if ":" not in spec:
        raise ValueError(f"a reward spec looks like 'package.module:function', got {spec!r}")
    if name in REGISTRY and REGISTRY[name] != spec and not overwrite:
        raise ValueError(f"reward {name!r} is already registered as {REGISTRY[name]!r}")
    REGISTRY[name] = spec
    return spec


def resolve_spec(name_or_spec: str) -> str:
    """A registered name or a "module:function" spec -> the spec."""
    if name_or_spec in REGISTRY:
        return REGISTRY[name_or_spec]
    if isinstance(name_or_spec, str) and ":" in name_or_spec:
        return name_or_spec
    raise ValueError(f"unknown reward {name_or_spec!r}; registered: {sorted(REGISTRY)} "
                     "(or give a 'package.module:function' spec)")


def load_function(spec: str) -> RewardFn:
    """Imports the function named by a "module:function" spec."""
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj


def get_reward_fn(name_or_spec: str) -> RewardFn:
    """The reward function of a registered name or spec (in this process)."""
    return load_function(resolve_spec(name_or_spec))
