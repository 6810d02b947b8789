"""models.tokenizer: the remembered AutoTokenizer class gives the same tokenizer, without importing PyTorch."""

import json
import os
import subprocess
import sys

import pytest

from stare_jax.models import gguf, tokenizer
from tests import gguf_fixtures
from tests.e2e_helpers import ROOT, subprocess_env

TEXTS = ["3 + 4 * 5 = 23", "Using the numbers [3, 5, 7], create an equation that equals 22.", "<eos> héllo\n  x"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private stare-jax cache directory for one test."""
    path = str(tmp_path / "cache")
    monkeypatch.setenv(tokenizer.CACHE_ENV, path)
    return path


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    """Directories converted from tiny GGUF files: a llama one (TokenizersBackend, chat template) and a qwen2 one."""
    root = tmp_path_factory.mktemp("tok")
    dirs = {}
    for arch in ("llama", "qwen2"):
        src = str(root / f"{arch}.gguf")
        gguf_fixtures.write_gguf(src, arch=arch)
        dirs[arch] = gguf.convert(src, str(root / arch))
    return dirs


def _same(a, b):
    assert type(a) is type(b)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.special_tokens_map == b.special_tokens_map
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.chat_template == b.chat_template
    for text in TEXTS:
        for special in (True, False):
            assert a.encode(text, add_special_tokens=special) == b.encode(text, add_special_tokens=special)
        ids = a.encode(text)
        assert a.batch_decode([ids], skip_special_tokens=True) == b.batch_decode([ids], skip_special_tokens=True)
    if a.chat_template:
        msgs = [{"role": "user", "content": TEXTS[1]}]
        assert (a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                == b.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def _dirs(tiny_model, gguf_dirs):
    return {"embedded_qwen2": tiny_model[0], **gguf_dirs}


def test_the_remembered_class_loads_what_auto_tokenizer_loads(tiny_model, gguf_dirs, cache):
    from transformers import AutoTokenizer

    for name, path in _dirs(tiny_model, gguf_dirs).items():
        auto = AutoTokenizer.from_pretrained(path)
        key = tokenizer.class_key(path)
        entry = os.path.join(cache, "tokenizer_classes", f"{key}.json")
        assert not os.path.exists(entry)
        first = tokenizer.load_tokenizer(path)  # AutoTokenizer, and its choice written
        with open(entry) as f:
            assert json.load(f) == {"module": type(auto).__module__, "class": type(auto).__qualname__}, name
        second = tokenizer.load_tokenizer(path)  # the remembered class, called directly
        _same(auto, first)
        _same(auto, second)
    # The embedded model is a qwen2 directory whose tokenizer_config names TokenizersBackend:
    # AutoTokenizer maps the model type to its own class, and so does the remembered entry.
    assert type(tokenizer.load_tokenizer(tiny_model[0])).__name__ == "Qwen2Tokenizer"


def test_a_later_process_imports_neither_pytorch_nor_the_auto_classes(tiny_model, cache):
    code = ("import sys, json; from stare_jax.models import hf; t = hf.load_tokenizer_dir(sys.argv[1]); "
            "print(json.dumps([type(t).__name__, 'torch' in sys.modules, "
            "'transformers.models.auto.tokenization_auto' in sys.modules, t.encode('3 + 4')]))")
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code, tiny_model[0]], cwd=ROOT, capture_output=True, text=True,
                           env=subprocess_env(1, **{tokenizer.CACHE_ENV: cache}), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, later = runs
    assert first[2] is True  # the first process asked AutoTokenizer
    assert later[1:3] == [False, False]
    assert later[0] == first[0] == "Qwen2Tokenizer" and later[3] == first[3]


def test_a_damaged_or_stale_entry_falls_back_to_auto_tokenizer_and_is_rewritten(gguf_dirs, cache):
    path = gguf_dirs["llama"]
    key = tokenizer.class_key(path)
    entry = os.path.join(cache, "tokenizer_classes", f"{key}.json")
    os.makedirs(os.path.dirname(entry))
    for damage in ('{"module": "transformers.no_such_module", "class": "X"}', "{not json", ""):
        with open(entry, "w") as f:
            f.write(damage)
        tok = tokenizer.load_tokenizer(path)
        assert type(tok).__name__ == "TokenizersBackend"
        with open(entry) as f:
            assert json.load(f)["class"] == "TokenizersBackend"


def test_the_key_follows_the_files_that_decide_the_class(gguf_dirs, tmp_path):
    import shutil

    path = shutil.copytree(gguf_dirs["llama"], str(tmp_path / "copy"))
    key = tokenizer.class_key(path)
    assert key == tokenizer.class_key(gguf_dirs["llama"])  # content, not location
    cfg = os.path.join(path, "config.json")
    with open(cfg) as f:
        c = json.load(f)
    c["model_type"] = "qwen2"
    with open(cfg, "w") as f:
        json.dump(c, f)
    changed = tokenizer.class_key(path)
    assert changed != key
    os.remove(os.path.join(path, "tokenizer.json"))  # which tokenizer files exist counts too
    assert tokenizer.class_key(path) not in (key, changed)


def test_an_unwritable_cache_still_loads_the_tokenizer(gguf_dirs, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(tokenizer.CACHE_ENV, str(blocker))
    assert type(tokenizer.load_tokenizer(gguf_dirs["llama"])).__name__ == "TokenizersBackend"
