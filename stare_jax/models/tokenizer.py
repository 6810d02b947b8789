"""A model directory's tokenizer, exactly as `transformers.AutoTokenizer` loads it, without its start-up cost.

`AutoTokenizer.from_pretrained(path)` picks a tokenizer class from the directory's files
(`tokenizer_config.json`, `config.json`: transformers 5 maps a `model_type` such as qwen2 to its
own class, which imposes its own pipeline on `tokenizer.json`) and then calls that class's
`from_pretrained(path)`. Choosing imports transformers' configuration machinery, which imports
PyTorch whenever it is installed: ~5.6 s of every training, evaluation or export process's start
on a 2-core host, against ~1.6 s for a whole process that imports and loads the chosen class by
itself (SmolLM2's `TokenizersBackend`, the AMD EPYC host of docs/performance.md).

So the class AutoTokenizer chose is remembered, keyed by the content that decides it (the two
files' bytes, which tokenizer files exist, the transformers version), under the stare-jax cache
directory; a later process with the same key imports that class directly and calls the same
`from_pretrained(path)`. The result is the same object either way (the tests compare pipelines,
special tokens, templates and encodings). Classes from a directory's own code (`auto_map`) are
never remembered; an unreadable or stale entry falls back to `AutoTokenizer` and is rewritten.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import threading

log = logging.getLogger(__name__)

CACHE_ENV = "STARE_JAX_CACHE_DIR"
# The files AutoTokenizer's choice reads, and those whose presence it may test.
_DECIDING_FILES = ("tokenizer_config.json", "config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def cache_dir() -> str:
    """The stare-jax cache directory: $STARE_JAX_CACHE_DIR, else $XDG_CACHE_HOME/stare_jax, else
    ~/.cache/stare_jax."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "stare_jax")


def has_tokenizer_files(path: str) -> bool:
    """True when `path` holds any file a Hugging Face tokenizer loads from."""
    return any(os.path.isfile(os.path.join(path, f)) for f in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def class_key(path: str) -> str:
    """The key of AutoTokenizer's class choice for directory `path`: a SHA-256 of the transformers
    version, the bytes of its tokenizer_config.json and config.json, and which tokenizer files exist."""
    import transformers

    h = hashlib.sha256(f"transformers {transformers.__version__}\n".encode())
    for name in _DECIDING_FILES:
        p = os.path.join(path, name)
        h.update(f"{name}\n".encode())
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(f.read())
        h.update(b"\0")
    h.update(" ".join(n for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))).encode())
    return h.hexdigest()


def _entry_path(key: str) -> str:
    return os.path.join(cache_dir(), "tokenizer_classes", f"{key}.json")


def _remembered_class(key: str):
    """The class remembered under `key`, or None (no entry, unreadable, or not importable)."""
    try:
        with open(_entry_path(key)) as f:
            entry = json.load(f)
        return getattr(importlib.import_module(entry["module"]), entry["class"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None


def _remember(key: str, cls) -> None:
    """Writes `cls` under `key` (atomically; a cache that cannot be written is only logged)."""
    if not cls.__module__.startswith("transformers."):
        return  # a directory's own code (auto_map): let AutoTokenizer resolve it every time
    path = _entry_path(key)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"module": cls.__module__, "class": cls.__qualname__}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("cannot remember the tokenizer class in %s: %s", path, e)
        try:
            os.remove(tmp)
        except OSError:
            pass


def load_tokenizer(path: str):
    """The tokenizer of Hugging Face directory `path`, equal to `AutoTokenizer.from_pretrained(path)`:
    the class AutoTokenizer chose for this content before, called directly, else AutoTokenizer
    (and its choice remembered)."""
    key = class_key(path)
    cls = _remembered_class(key)
    if cls is not None:
        return cls.from_pretrained(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    _remember(key, type(tokenizer))
    return tokenizer
