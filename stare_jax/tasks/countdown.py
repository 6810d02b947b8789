"""Countdown: the embedded synthetic task with verifiable rewards and several valid answers per prompt.

A problem is a multiset of small positive integers and a target. An answer is an arithmetic
expression over `+ - * /` and parentheses that uses each given number AT MOST ONCE (a number
that appears twice in the problem may be used twice) and evaluates exactly to the target.
"At most once" (rather than the classic "exactly once") keeps problems solvable and makes
several structurally different answers per prompt the norm, which is what GRPO needs.

Strings are short and character-level friendly:

    prompt        "3 5 7 2=24:"          (numbers, '=', target, ':')
    ground truth  "3 5 7 2=24"           (what the verifier is given; the prompt form also parses)
    answer        "(7-3)*(5+2)-4"...     followed by the tokenizer's EOS

Everything here is pure Python, deterministic and safe: the parser is a recursive descent over a
tiny grammar with exact `Fraction` arithmetic and hard length/depth/size limits; nothing is
`eval`-ed.

    expr   := term   (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := NUMBER | '(' expr ')'
    NUMBER := [0-9]{1,4}
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from fractions import Fraction
from typing import Iterator, Sequence

#: Characters that can appear in a prompt, ground truth or answer.
ALPHABET = "0123456789 =:+-*/()"
#: Hard limits of the answer parser.
MAX_ANSWER_CHARS = 64
MAX_DEPTH = 16
MAX_NUMBER_DIGITS = 4
#: |numerator| and denominator bound of every intermediate value (keeps Fractions small).
MAX_MAGNITUDE = 10 ** 9


@dataclasses.dataclass(frozen=True)
class CountdownProblem:
    """Numbers (each usable at most once) and the target an answer must evaluate to."""

    numbers: tuple[int, ...]
    target: int

    @property
    def prompt(self) -> str:
        """The model's prompt, e.g. "3 5 7 2=24:"."""
        return f"{self.ground_truth}:"

    @property
    def ground_truth(self) -> str:
        """The string the verifier receives, e.g. "3 5 7 2=24"."""
        return " ".join(str(n) for n in self.numbers) + f"={self.target}"


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
    """Difficulty knobs of the generator.

    Problems have `min_numbers..max_numbers` numbers drawn uniformly from `1..max_number`, and a
    target in `min_target..max_target` that is reachable, not one of the numbers, and has at
    least `min_solutions` structurally distinct answers.
    """

    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 9
    min_target: int = 2
    max_target: int = 50
    #: Reject problems with fewer structurally distinct answers (see `canonical_form`).
    min_solutions: int = 2

    def validate(self) -> "CountdownConfig":
        """Raises ValueError on inconsistent knobs; returns self."""
        if not 2 <= self.min_numbers <= self.max_numbers <= 6:
            raise ValueError(f"need 2 <= min_numbers <= max_numbers <= 6, got {self.min_numbers}, {self.max_numbers}")
        if not 2 <= self.max_number < 10 ** MAX_NUMBER_DIGITS:
            raise ValueError(f"max_number must be in 2..{10 ** MAX_NUMBER_DIGITS - 1}, got {self.max_number}")
        if not 1 <= self.min_target <= self.max_target < 10 ** MAX_NUMBER_DIGITS:
            raise ValueError(f"need 1 <= min_target <= max_target < {10 ** MAX_NUMBER_DIGITS}, "
                             f"got {self.min_target}, {self.max_target}")
        if self.min_solutions < 1:
            raise ValueError(f"min_solutions must be >= 1, got {self.min_solutions}")
        return self


class ParseError(ValueError):
    """The answer is not a well-formed expression within the parser's limits."""


# --------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class _Node:
    """Expression tree: a leaf (op None, value = the literal) or a binary operation."""

    value: Fraction
    op: str | None = None
    left: "_Node | None" = None
    right: "_Node | None" = None

    def leaves(self) -> list[int]:
        if self.op is None:
            return [int(self.value)]
        return self.left.leaves() + self.right.leaves()


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    """a op b, or None for division by zero or a value outside MAX_MAGNITUDE."""
    if op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    elif op == "*":
        r = a * b
    else:
        if b == 0:
            return None
        r = a / b
    if abs(r.numerator) > MAX_MAGNITUDE or r.denominator > MAX_MAGNITUDE:
        return None
    return r


class _Parser:
    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.depth = 0

    def parse(self) -> _Node:
        node = self.expr()
        if self.i != len(self.s):
            raise ParseError(f"unexpected {self.s[self.i]!r} at {self.i}")
        return node

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def binary(self, ops: str, sub) -> _Node:
        node = sub()
        while self.peek() and self.peek() in ops:
            op = self.s[self.i]
            self.i += 1
            right = sub()
            value = _apply(op, node.value, right.value)
            if value is None:
                raise ParseError("division by zero or value out of range")
            node = _Node(value, op, node, right)
        return node

    def expr(self) -> _Node:
        return self.binary("+-", self.term)

    def term(self) -> _Node:
        return self.binary("*/", self.factor)

    def factor(self) -> _Node:
        c = self.peek()
        if c == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ParseError("parentheses nested too deeply")
            self.i += 1
            node = self.expr()
            if self.peek() != ")":
                raise ParseError(f"expected ')' at {self.i}")
            self.i += 1
            self.depth -= 1
            return node
        j = self.i
        while j < len(self.s) and self.s[j].isascii() and self.s[j].isdigit():
            j += 1
        if j == self.i:
            raise ParseError(f"expected a number or '(' at {self.i}" + (f", got {c!r}" if c else ""))
        if j - self.i > MAX_NUMBER_DIGITS:
            raise ParseError(f"number longer than {MAX_NUMBER_DIGITS} digits at {self.i}")
        node = _Node(Fraction(int(self.s[self.i:j])))
        self.i = j
        return node


def _parse_tree(text: str) -> _Node:
    if not isinstance(text, str):
        raise ParseError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_ANSWER_CHARS:
        raise ParseError(f"answer longer than {MAX_ANSWER_CHARS} characters")
    if re.search(r"\d\s+\d", text):
        raise ParseError("numbers separated only by whitespace")
    compact = "".join(text.split())
    if not compact:
        raise ParseError("empty answer")
    bad = sorted(set(c for c in compact if c not in "0123456789+-*/()"))
    if bad:
        raise ParseError(f"characters outside the grammar: {''.join(bad)!r}")
    return _Parser(compact).parse()


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """Parses an answer: returns (exact value, literals used). Whitespace between tokens is ignored.

    Raises ParseError for anything outside the grammar (names, attributes, `**`, unary minus,
    unbalanced parentheses), inputs over MAX_ANSWER_CHARS, nesting over MAX_DEPTH, division by
    zero or intermediate values over MAX_MAGNITUDE.
    """
    node = _parse_tree(text)
    return node.value, node.leaves()


def parse_problem(text: "str | CountdownProblem") -> CountdownProblem:
    """Parses "3 5 7 2=24" (or the prompt form "3 5 7 2=24:") into a CountdownProblem."""
    if isinstance(text, CountdownProblem):
        return text
    if isinstance(text, bytes):
        text = text.decode()
    s = str(text).strip()
    if s.endswith(":"):
        s = s[:-1]
    left, sep, right = s.partition("=")
    try:
        numbers = tuple(int(x) for x in left.split())
        target = int(right)
    except ValueError:
        numbers, target = (), 0
    if not sep or not numbers or any(n <= 0 for n in numbers):
        raise ValueError(f"not a countdown problem: {text!r} (expected e.g. '3 5 7 2=24')")
    return CountdownProblem(numbers, target)


def _is_submultiset(used: Sequence[int], available: Sequence[int]) -> bool:
    pool = list(available)
    for n in used:
        if n not in pool:
            return False
        pool.remove(n)
    return True


def is_correct(answer: str, problem: "CountdownProblem | str") -> bool:
    """True iff `answer` parses, uses each given number at most once and equals the target."""
    problem = parse_problem(problem)
    try:
        value, used = parse_expression(answer)
    except ParseError:
        return False
    return value == problem.target and _is_submultiset(used, problem.numbers)


def score(response_text: str, problem: "CountdownProblem | str") -> float:
    """The verifiable reward: 1.0 for a correct answer, else 0.0.

    The whole response (surrounding whitespace stripped; the EOS already removed by decoding)
    must be the expression: trailing text makes it wrong.
    """
    return 1.0 if is_correct(response_text, problem) else 0.0


# --------------------------------------------------------------------------- rendering

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _render(node: _Node) -> str:
    """Expression string with the minimal parentheses that keep its left-to-right meaning."""
    if node.op is None:
        return str(int(node.value))
    p = _PREC[node.op]
    left = _render(node.left)
    if node.left.op is not None and _PREC[node.left.op] < p:
        left = f"({left})"
    right = _render(node.right)
    # Right operand: parenthesise a lower precedence op, and an equal one after '-' or '/'.
    if node.right.op is not None and (_PREC[node.right.op] < p or
                                      (_PREC[node.right.op] == p and node.op in "-/")):
        right = f"({right})"
    return f"{left}{node.op}{right}"


def canonical_form(answer: str) -> str:
    """A normal form of an answer that identifies reorderings by commutativity and associativity.

    Sums are flattened into sorted positive and negative terms, products into sorted numerator
    and denominator factors: "(3+5)*2", "2*(5+3)" and "2*(3+5)" share one form, "3*2+5*2" has
    another. Raises ParseError when the answer does not parse.
    """
    return _canon(_parse_tree(answer))


def _canon(node: _Node) -> str:
    if node.op is None:
        return str(int(node.value))
    if node.op in "+-":
        pos, neg = [], []
        _collect(node, +1, "+-", pos, neg)
        s = "+".join(sorted(pos))
        return f"[{s}" + "".join("-" + t for t in sorted(neg)) + "]"
    num, den = [], []
    _collect(node, +1, "*/", num, den)
    return "{" + "*".join(sorted(num)) + "".join("/" + t for t in sorted(den)) + "}"


def _collect(node: _Node, sign: int, ops: str, pos: list, neg: list) -> None:
    if node.op is not None and node.op in ops:
        _collect(node.left, sign, ops, pos, neg)
        _collect(node.right, sign if node.op == ops[0] else -sign, ops, pos, neg)
    else:
        (pos if sign > 0 else neg).append(_canon(node))


# --------------------------------------------------------------------------- solving


def iter_solutions(problem: "CountdownProblem | str") -> Iterator[str]:
    """Yields every answer expression (as rendered strings) reachable by combining pairs.

    Covers every subset of the numbers (at most once each) and every binary tree over it, with
    both operand orders of '-' and '/'; strings repeat when different trees render alike.
    Exponential in the count of numbers: fine up to 5, slow at 6.
    """
    problem = parse_problem(problem)
    target = Fraction(problem.target)
    leaves = [_Node(Fraction(n)) for n in problem.numbers]
    yield from _search(leaves, target)


def _search(items: list[_Node], target: Fraction) -> Iterator[str]:
    for i, j in itertools.combinations(range(len(items)), 2):
        a, b = items[i], items[j]
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        for op, x, y in (("+", a, b), ("*", a, b), ("-", a, b), ("-", b, a), ("/", a, b), ("/", b, a)):
            value = _apply(op, x.value, y.value)
            if value is None:
                continue
            node = _Node(value, op, x, y)
            if value == target:
                yield _render(node)
            if rest:
                yield from _search(rest + [node], target)


def solutions(problem: "CountdownProblem | str", *, distinct: bool = True, limit: int | None = None) -> list[str]:
    """All answers to `problem`, sorted; with `distinct`, one per `canonical_form` class.

    `limit` stops the search after that many (distinct) answers.
    """
    seen: dict[str, str] = {}
    for expr in iter_solutions(problem):
        key = canonical_form(expr) if distinct else expr
        if key not in seen or len(expr) < len(seen[key]):
            seen[key] = expr
        if limit is not None and len(seen) >= limit:
            break
    return sorted(seen.values(), key=lambda s: (len(s), s))


def count_solutions(problem: "CountdownProblem | str", *, limit: int | None = None) -> int:
    """Number of structurally distinct answers (see `canonical_form`), up to `limit`."""
    return len(solutions(problem, distinct=True, limit=limit))


# --------------------------------------------------------------------------- generation


def _rng(seed: int, index: int, split: str) -> random.Random:
    # String seeding is hashed with SHA-512: stable across Python versions and platforms.
    return random.Random(f"countdown:{seed}:{split}:{index}")


def generate_problem(seed: int, index: int = 0, *, config: CountdownConfig = CountdownConfig(),
                     split: str = "train") -> tuple[CountdownProblem, str]:
    """The `index`-th problem of the stream `(seed, split)`: (problem, one reference answer).

    Deterministic in (seed, split, index, config). The target is the value of a random
    expression over a random subset (size >= 2) of the numbers, a positive integer in
    `min_target..max_target` that is not itself one of the numbers and has at least
    `config.min_solutions` distinct answers; so every problem is solvable and the reference
    answer is verified before it is returned.
    """
    config.validate()
    rng = _rng(seed, index, split)
    for _ in range(10_000):
        k = rng.randint(config.min_numbers, config.max_numbers)
        numbers = [rng.randint(1, config.max_number) for _ in range(k)]
        for _ in range(20):
            m = k if rng.random() < 0.5 else rng.randint(2, k)
            items = [_Node(Fraction(n)) for n in rng.sample(numbers, m)]
            while len(items) > 1:
                a = items.pop(rng.randrange(len(items)))
                b = items.pop(rng.randrange(len(items)))
                op = rng.choice("+-*/")
                value = _apply(op, a.value, b.value)
                if value is None:
                    break
                items.append(_Node(value, op, a, b))
            if len(items) != 1:
                continue
            value = items[0].value
            if (value.denominator == 1 and config.min_target <= value <= config.max_target
                    and int(value) not in numbers):
                problem = CountdownProblem(tuple(numbers), int(value))
                if config.min_solutions > 1 and count_solutions(problem, limit=config.min_solutions) < config.min_solutions:
                    continue
                reference = _render(items[0])
                assert is_correct(reference, problem), (reference, problem)
                return problem, reference
    raise RuntimeError(f"could not generate a countdown problem with {config}")  # pragma: no cover


def generate_problems(seed: int, count: int, *, config: CountdownConfig = CountdownConfig(),
                      split: str = "train") -> list[tuple[CountdownProblem, str]]:
    """`generate_problem(seed, i)` for i in 0..count-1."""
    return [generate_problem(seed, i, config=config, split=split) for i in range(count)]
