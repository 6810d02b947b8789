"""Arithmetic word problems: the natural-language task of the real-model recipe (GSM-style, generated).

Problems are generated deterministically from (seed, split, index) by templates, with a difficulty
ladder set by the knobs of `ArithConfig`:

    ops 1, bare          "What is 7 + 5?"
    ops 1, word          "Mia has 7 apples. She buys 5 more apples. How many apples does Mia have now?"
    ops 2, word, 1 dist. "Leo has 9 pens. Ava has 4 cups. Leo gives away 3 pens. Then he buys 6 more
                          pens. How many pens does Leo have now?"

Every intermediate and final value is a non-negative integer (subtraction never goes below zero),
and the ground truth is that integer as a string, checked by the math verifier on the response's
final answer (`stare_jax.rewards.functions.final_answer_reward`: the last `\\boxed{}` if any, else
the last number).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

#: The instruction appended to each question (chosen by measurement on SmolLM2-135M-Instruct:
#: docs/real_model.md). The reward reads the response's last number, so "The answer is 12." counts.
INSTRUCTION = "Answer with just the number."

_NAMES = [("Tom", "he"), ("Mia", "she"), ("Leo", "he"), ("Ava", "she"), ("Sam", "he"), ("Zoe", "she"),
          ("Ben", "he"), ("Lily", "she"), ("Max", "he"), ("Emma", "she"), ("Jack", "he"), ("Nora", "she"),
          ("Owen", "he"), ("Ella", "she"), ("Noah", "he"), ("Ruby", "she")]
_OBJECTS = ["apples", "pens", "books", "cards", "marbles", "stickers", "cookies", "shells", "coins", "balloons",
            "pencils", "stamps", "toy cars", "eggs", "flowers", "candies"]
_CONTAINERS = ["boxes", "bags", "jars", "baskets", "packs", "plates"]
OPS = "+-*"


@dataclasses.dataclass(frozen=True)
class ArithConfig:
    """Difficulty knobs: `min_ops..max_ops` operations (uniform) on integers `1..max_number`, drawn from
    `ops`; a share `word_frac` of problems told as a story (the rest as a bare expression); and up to
    `distractors` irrelevant sentences with their own numbers in each story."""

    min_ops: int = 1
    max_ops: int = 1
    max_number: int = 9
    ops: str = "+-"
    word_frac: float = 1.0
    distractors: int = 0

    def validate(self) -> "ArithConfig":
        """Raises ValueError on inconsistent knobs; returns self."""
        if not 1 <= self.min_ops <= self.max_ops <= 6:
            raise ValueError(f"need 1 <= min_ops <= max_ops <= 6, got {self.min_ops}, {self.max_ops}")
        if not 2 <= self.max_number <= 1000:
            raise ValueError(f"max_number must be in [2, 1000], got {self.max_number}")
        if not self.ops or any(o not in OPS for o in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be a non-empty set of {OPS!r}, got {self.ops!r}")
        if not 0.0 <= self.word_frac <= 1.0:
            raise ValueError(f"word_frac must be in [0, 1], got {self.word_frac}")
        if not 0 <= self.distractors <= 3:
            raise ValueError(f"distractors must be in [0, 3], got {self.distractors}")
        return self


@dataclasses.dataclass(frozen=True)
class ArithProblem:
    """A generated problem: its text, its answer, and the expression it encodes."""

    question: str
    answer: int
    expression: str

    @property
    def ground_truth(self) -> str:
        """What the verifier compares the final answer with."""
        return str(self.answer)


def _rng(seed: int, split: str, index: int) -> random.Random:
    digest = hashlib.sha256(f"arith/{seed}/{split}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _steps(rng: random.Random, cfg: ArithConfig) -> tuple[int, list[tuple[str, int]]]:
    """A start value and a list of (op, operand) whose running value stays a non-negative integer."""
    n_ops = rng.randint(cfg.min_ops, cfg.max_ops)
    value = rng.randint(2, cfg.max_number)
    steps = []
    for _ in range(n_ops):
        ops = list(cfg.ops)
        if value < 2 and "-" in ops and len(ops) > 1:
            ops.remove("-")
        op = rng.choice(ops)
        if op == "+":
            b = rng.randint(1, cfg.max_number)
            value += b
        elif op == "-":
            b = rng.randint(1, max(1, min(value, cfg.max_number)))
            value -= b
        else:
            b = rng.randint(2, max(2, min(cfg.max_number, 9)))
            value *= b
        steps.append((op, b))
    return value, steps


def _expression(start: int, steps: list[tuple[str, int]]) -> str:
    text = str(start)
    for i, (op, b) in enumerate(steps):
        if op == "*" and i > 0:
            text = f"({text})"
        text = f"{text} {op} {b}"
    return text


def _story(rng: random.Random, cfg: ArithConfig, start: int, steps: list[tuple[str, int]]) -> str:
    (name, pron), (other, _) = rng.sample(_NAMES, 2)
    obj, other_obj = rng.sample(_OBJECTS, 2)
    Pron = pron.capitalize()
    sentences = []
    first_op = steps[0][0]
    if first_op == "*":  # "Mia has 3 bags with 4 apples in each bag."
        container = rng.choice(_CONTAINERS)
        sentences.append(f"{name} has {start} {container} with {steps[0][1]} {obj} in each.")
        rest = steps[1:]
    else:
        sentences.append(f"{name} has {start} {obj}.")
        rest = steps
    for i, (op, b) in enumerate(rest):
        lead = Pron if i == 0 and first_op != "*" else f"Then {pron}"
        if op == "+":
            verb = rng.choice(["buys", "finds", "gets"])
            sentences.append(f"{lead} {verb} {b} more {obj}.")
        elif op == "-":
            verb = rng.choice([f"gives {b} {obj} to {other}", f"loses {b} {obj}", f"uses {b} {obj}"])
            sentences.append(f"{lead} {verb}.")
        else:
            sentences.append(f"{lead} ends up with {b} times as many {obj}.")
    for _ in range(rng.randint(0, cfg.distractors)):
        d_name = rng.choice([n for n, _ in _NAMES if n not in (name,)])
        pos = rng.randint(1, len(sentences))
        sentences.insert(pos, f"{d_name} has {rng.randint(1, cfg.max_number)} {other_obj}.")
    sentences.append(f"How many {obj} does {name} have now?")
    return " ".join(sentences)


def generate_problem(seed: int, index: int, *, config: ArithConfig = ArithConfig(), split: str = "train"
                     ) -> ArithProblem:
    """Problem `index` of `split` for `seed`: the same arguments always give the same problem."""
    rng = _rng(seed, split, index)
    answer, steps = _steps(rng, config)
    start = answer
    for op, b in reversed(steps):  # recover the start value for the text
        start = start - b if op == "+" else start + b if op == "-" else start // b
    expression = _expression(start, steps)
    if rng.random() < config.word_frac:
        question = _story(rng, config, start, steps)
    else:
        question = f"What is {expression}?"
    return ArithProblem(question=question, answer=answer, expression=expression)


def evaluate_expression(expression: str) -> int:
    """The value of a generated expression (integers, + - * and parentheses only)."""
    import ast

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(f"not a generated expression: {expression!r}")

    return ev(ast.parse(expression, mode="eval"))
