"""The embedded model: a tiny Qwen2 policy with a character-level tokenizer, in Hugging Face format.

`create_embedded_model(path, ...)` writes a directory that both `stare_jax.models.from_pretrained`
and `transformers.AutoTokenizer.from_pretrained` load, without any download:

    config.json, model.safetensors, generation_config.json   (stare_jax.models.save_pretrained)
    tokenizer.json, tokenizer_config.json                     (transformers.PreTrainedTokenizerFast)
    stare_embedded.json                                       (the arguments; written last = complete)

The tokenizer has one token per character of the countdown alphabet plus `<pad>` (0), `<bos>` (1),
`<eos>` (2) and `<unk>` (3); encoding with special tokens prepends `<bos>`; decoding concatenates
characters (see `build_char_tokenizer` for why it is spelled byte-level). Weights are random, unless `warmup_steps > 0`: then the policy is first fitted by
next-token cross-entropy to generated countdown problems and their reference answers, so RL starts
from a policy that gets some rewards (a randomly initialised one almost never emits a correct
answer followed by EOS, and GRPO with dynamic sampling then has nothing to learn from).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time

import numpy as np

from stare_jax.tasks import countdown

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
MARKER_FILE = "stare_embedded.json"
_FORMAT_VERSION = 1


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable ASCII maps to itself, space to 'Ġ')."""
    from tokenizers import pre_tokenizers
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = {b: chr(c) for b, c in zip(bs, cs)}
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    return table


def build_char_tokenizer(chars: str = countdown.ALPHABET, *, model_max_length: int = 128):
    """A `transformers.PreTrainedTokenizerFast` with one token per character of `chars` (ASCII).

    Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then `chars` in order. Encoding with
    `add_special_tokens=True` prepends `<bos>`; padding is on the left; it has no chat template.

    Tokens are spelled in GPT-2's byte-level alphabet (space is 'Ġ') with a ByteLevel
    pre-tokenizer and decoder: transformers 5 loads any `model_type: qwen2` directory with its
    `Qwen2Tokenizer`, which imposes exactly that pipeline on `tokenizer.json`, so the saved
    directory tokenizes identically whichever class loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars) or not chars or not all(32 <= ord(c) < 127 for c in chars):
        raise ValueError(f"chars must be non-empty, unique, printable ASCII; got {chars!r}")
    table = _byte_level_alphabet()
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + [table[ord(c)] for c in chars])}
    # BPE without merges = one token per (byte-level) character.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", truncation_side="left", model_max_length=model_max_length)


@dataclasses.dataclass(frozen=True)
class EmbeddedSpec:
    """Everything that determines the embedded model directory (stored in `stare_embedded.json`)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = True
    seed: int = 0
    warmup_steps: int = 0
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3
    task: dict = dataclasses.field(default_factory=lambda: dataclasses.asdict(countdown.CountdownConfig()))
    chars: str = countdown.ALPHABET
    format_version: int = _FORMAT_VERSION

    def to_json(self) -> dict:
        """The spec as a JSON-able dict (the marker file's content)."""
        return dataclasses.asdict(self)


def is_complete(path: str) -> bool:
    """True when `path` holds a finished embedded model (its marker file exists)."""
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def create_embedded_model(path: str, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, intermediate_size: int = 256,
                          max_position_embeddings: int = 128, tie_word_embeddings: bool = True,
                          seed: int = 0, warmup_steps: int = 0, warmup_batch_size: int = 64,
                          warmup_lr: float = 3e-3,
                          task_config: countdown.CountdownConfig = countdown.CountdownConfig(),
                          overwrite: bool = False, wait_s: float = 1800.0) -> str:
    """Writes the tiny Qwen2 + character tokenizer HF directory at `path` and returns `path`.

    Idempotent: when `path` already holds a complete model made with the same arguments it does
    nothing; with different arguments it raises ValueError (or rebuilds when `overwrite`). The
    directory is written under a temporary name and renamed, so an interrupted call leaves no
    half-written `path`. `warmup_steps > 0` fits the random policy to reference answers first
    (see the module doc). In a multi-process JAX run only process 0 writes (as `save_pretrained`
    does); the other processes wait up to `wait_s` for it to appear on the shared filesystem.
    Without a shared filesystem, create it on every host before `jax.distributed.initialize`.
    """
    spec = EmbeddedSpec(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings,
                        tie_word_embeddings=tie_word_embeddings, seed=seed, warmup_steps=warmup_steps,
                        warmup_batch_size=warmup_batch_size, warmup_lr=warmup_lr,
                        task=dataclasses.asdict(task_config.validate()))
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and num_heads "
                         f"by num_kv_heads ({num_kv_heads})")
    path = os.path.abspath(path)
    if is_complete(path):
        with open(os.path.join(path, MARKER_FILE)) as f:
            existing = json.load(f)
        if existing == spec.to_json():
            return path
        if not overwrite:
            diff = sorted(k for k in set(existing) | set(spec.to_json()) if existing.get(k) != spec.to_json().get(k))
            raise ValueError(f"{path} holds an embedded model made with different arguments ({', '.join(diff)}); "
                             "pass overwrite=True or use another directory")
        shutil.rmtree(path)
    elif os.path.isdir(path) and os.listdir(path):
        raise ValueError(f"{path} exists, is not empty and is not a complete embedded model; remove it first")

    import jax
    if jax.process_index() != 0:
        deadline = time.monotonic() + wait_s
        while not is_complete(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {jax.process_index()}: {path} did not appear within {wait_s:.0f}s "
                                   "(process 0 writes it; is the filesystem shared?)")
            time.sleep(1.0)
        return path

    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(tmp, spec, task_config)
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write(out: str, spec: EmbeddedSpec, task_config: countdown.CountdownConfig) -> None:
    from stare_jax.models import ModelConfig, Policy, build_model, save_pretrained

    tokenizer = build_char_tokenizer(spec.chars, model_max_length=spec.max_position_embeddings)
    cfg = ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.hidden_size // spec.num_heads, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=spec.tie_word_embeddings, qkv_bias=True,
        max_position_embeddings=spec.max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    model = build_model(cfg, seed=spec.seed)
    if spec.warmup_steps > 0:
        model = _warmup(model, tokenizer, spec, task_config)
    save_pretrained(Policy(model=model, config=cfg, tokenizer=tokenizer), out)
    with open(os.path.join(out, MARKER_FILE), "w") as f:
        json.dump(spec.to_json(), f, indent=2)


def sft_batch(tokenizer, pairs: list[tuple[str, str]], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, loss_mask) int32 [N, seq_len] of `<bos> prompt answer <eos>`,
    left-padded; loss_mask marks the answer and EOS tokens (the targets of next-token loss)."""
    ids = np.full((len(pairs), seq_len), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(pairs), seq_len), np.int32)
    loss = np.zeros((len(pairs), seq_len), np.int32)
    for i, (prompt, answer) in enumerate(pairs):
        p = tokenizer.encode(prompt, add_special_tokens=True)
        a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        seq = (p + a)[-seq_len:]
        n = len(seq)
        ids[i, seq_len - n:] = seq
        mask[i, seq_len - n:] = 1
        loss[i, seq_len - min(n, len(a)):] = 1
    return ids, mask, loss


def _warmup(model, tokenizer, spec: EmbeddedSpec, task_config: countdown.CountdownConfig):
    """Supervised next-token fit on `spec.warmup_steps` batches of (prompt, reference answer)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    seq_len = 48
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, spec.warmup_lr, min(50, spec.warmup_steps // 5), spec.warmup_steps),
        weight_decay=0.01))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, state = nnx.split((model, opt))

    def step(state, ids, mask, loss_mask):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(ids[:, :-1], mask[:, :-1]).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
            w = loss_mask[:, 1:].astype(jnp.float32)
            return (ce * w).sum() / jnp.maximum(w.sum(), 1.0)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    step = jax.jit(step, donate_argnums=0)

    t0 = time.time()
    b = spec.warmup_batch_size
    # The distinct-answers filter only shapes RL problems; skipping it makes generation ~40x faster.
    task_config = dataclasses.replace(task_config, min_solutions=1)
    for s in range(spec.warmup_steps):
        pairs = [(p.prompt, ref) for p, ref in (
            countdown.generate_problem(spec.seed, s * b + i, config=task_config, split="warmup") for i in range(b))]
        state, loss = step(state, *map(jnp.asarray, sft_batch(tokenizer, pairs, seq_len)))
        if s % 100 == 0 or s == spec.warmup_steps - 1:
            log.info("embedded warmup step %d/%d loss %.4f (%.1fs)", s + 1, spec.warmup_steps, float(loss),
                     time.time() - t0)
    model, _ = nnx.merge(graphdef, jax.block_until_ready(state))
    return model
