"""Answer extraction from model responses and reference solutions (pure Python, no heavy imports)."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, or None.

    Nested braces are matched (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`); escaped braces `\\{ \\}`
    do not count. The brace-less form `\\boxed 5` gives the token after the space. An unclosed
    last box falls back to the previous complete one.
    """
    if not isinstance(text, str):
        return None
    for m in reversed(list(_BOXED.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            content = _braced(text, i)
            if content is not None:
                return content.strip()
            continue
        if i > m.end() and i < len(text):  # "\boxed 5": up to whitespace or '$'
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                return token.group(0)
    return None


def _braced(text: str, start: int) -> str | None:
    """The text between text[start] == '{' and its matching '}', or None when unbalanced."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def gsm8k_final_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution: the text after the last `####`, without thousands
    separators (`"... #### 1,234"` -> `"1234"`); None when there is no `####`."""
    if not isinstance(text, str) or "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", answer):
        answer = answer.replace(",", "")
    return answer


_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|(?<![\w.])-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` ("-3", "1,234" -> "1234", "2.5"), or None.

    A trailing sentence period is not part of the number ("is 12." -> "12")."""
    if not isinstance(text, str):
        return None
    found = _NUMBER.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "")


def final_answer(text: str) -> str | None:
    """The response's final answer: the content of its last `\\boxed{}` when it has one, else its
    last number (for short-answer formats such as "Answer with just the number.")."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed
    return last_number(text)
