"""Static (hashable) views of the RL part of an ml_collections config.

The update step closes over these frozen dataclasses, so every branch they choose is resolved at
trace time. `RLSettings.from_config(config)` reads the keys listed in the RL-core issue; a key
missing from the config falls back to the paper default in `DEFAULTS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stare_jax import cpu_gemm, gpu_gemm
from stare_jax.models.packing import PACK_BUCKETS

DEFAULTS: dict[str, Any] = {
    "loss.name": "stare",
    "loss.agg": "token-mean",
    "loss.clip_low": 0.2,
    "loss.clip_high": 0.28,
    "loss.clip_c": 10.0,
    "loss.entropy_coef": 0.0,
    "loss.forking_rho": 0.2,
    "loss.clip_cov_ratio": 2e-4,
    "loss.clip_cov_lb": 1.0,
    "loss.clip_cov_ub": 5.0,
    "loss.kl_cov_ratio": 2e-3,
    "loss.kl_cov_coef": 1.0,
    "loss.kl_type": "none",
    "loss.kl_coef": 0.0,
    "loss.hapo_alpha": 0.2,
    "loss.hapo_phi": 2.0,
    "loss.entropy_adv_alpha": 0.4,
    "loss.entropy_adv_kappa": 2.0,
    "loss.w_reinforce_lambda": 0.1,
    "loss.quadrants": "",
    "advantage.scale": "group",
    "advantage.eps": 1e-6,
    "stare.enabled": True,
    "stare.variant": "O1",
    "stare.top_p_ratio": 0.1,
    "stare.top_p_ratio_minus": 0.0,
    "stare.w": 1.1,
    "stare.m": 0.9,
    "stare.target_entropy": 0.3,
    "stare.adaptive": False,
    "stare.alpha": 0.01,
    "stare.w_max": 1.5,
    "stare.m_min": 0.5,
    "stare.selection_scope": "global",
    "optim.lr": 1e-6,
    "optim.b1": 0.9,
    "optim.b2": 0.999,
    "optim.eps": 1e-8,
    "optim.weight_decay": 0.01,
    "optim.grad_clip": 1.0,
    "optim.warmup_steps": 0,
    "update.ppo_epochs": 1,
    "update.num_minibatches": 1,
    "update.grad_accum": 1,
    "update.share_prompt": True,
    "update.pack_tokens": 0,
    "update.pack_buckets": "linear",
    "update.old_stats": "sampler",
    "model.vocab_chunk": 8192,
    "model.vocab_keep_logits_mb": 0,
    "model.gpu_gemm": "auto",
    "model.cpu_gemm": "auto",
    "rollout.group_size": 8,
}


# Other spellings of a key, tried in order when the key itself is absent. `stare_jax/config.py`
# names the update section `ppo` because a ConfigDict section called `update` is shadowed by the
# `ConfigDict.update` method under attribute access.
ALIASES: dict[str, tuple[str, ...]] = {
    "update.ppo_epochs": ("ppo.epochs", "ppo.ppo_epochs"),
    "update.num_minibatches": ("ppo.num_minibatches",),
    "update.grad_accum": ("ppo.grad_accum",),
    "update.share_prompt": ("ppo.share_prompt",),
    "update.pack_tokens": ("ppo.pack_tokens",),
    "update.pack_buckets": ("ppo.pack_buckets",),
    "update.old_stats": ("ppo.old_stats",),
}

#: where a multi-step update's pre-update statistics come from (`update.old_stats`, rl/update.py)
OLD_STATS = ("sampler", "recompute")

_MISSING = object()


def _lookup(config, dotted: str):
    node = config
    for part in dotted.split("."):
        # Item access first: `update` is also a ConfigDict method, so `config.update` is not the section.
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            try:
                node = getattr(node, part)
            except AttributeError:
                return _MISSING
    return node


def get_key(config, dotted: str):
    """`config["a"]["b"]` for dotted key "a.b" (or one of its ALIASES), else DEFAULTS[dotted]."""
    for key in (dotted,) + ALIASES.get(dotted, ()):
        value = _lookup(config, key)
        if value is not _MISSING:
            return value
    return DEFAULTS[dotted]


def _choice(key: str, value: str, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {', '.join(sorted(allowed))}")
    return value


def _quadrants(text: str, parse) -> tuple:
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"loss.quadrants={text!r}: {e}; allowed: '' (all) or a comma-separated subset of "
                         f"PHR, PLR, NLR, NHR") from None


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The `loss.*` keys: policy-loss name, aggregation, clip ranges and baseline coefficients."""

    name: str = "stare"
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 10.0
    entropy_coef: float = 0.0
    forking_rho: float = 0.2
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    kl_type: str = "none"
    kl_coef: float = 0.0
    hapo_alpha: float = 0.2
    hapo_phi: float = 2.0
    entropy_adv_alpha: float = 0.4
    entropy_adv_kappa: float = 2.0
    w_reinforce_lambda: float = 0.1
    quadrants: tuple = ()  # polarity-entropy quadrants kept in the policy gradient; () = all tokens

    @property
    def uses_reference(self) -> bool:
        """Whether the loss needs log-probs of a frozen reference policy."""
        return self.kl_type != "none"


@dataclasses.dataclass(frozen=True)
class StareSettings:
    """The `stare.*` keys (DESIGN.md steps 1-5)."""

    enabled: bool = True
    variant: str = "O1"
    top_p_ratio: float = 0.1
    top_p_ratio_minus: float = 0.0  # L-'s fraction of T-; 0: top_p_ratio
    w: float = 1.1
    m: float = 0.9
    target_entropy: float = 0.3
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    selection_scope: str = "global"


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """The `optim.*` keys: AdamW hyper-parameters, global-norm clip and linear warmup."""

    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """Everything the update step reads from the config, frozen and hashable."""

    loss: LossSettings = LossSettings()
    stare: StareSettings = StareSettings()
    optim: OptimSettings = OptimSettings()
    advantage_scale: str = "group"
    advantage_eps: float = 1e-6
    ppo_epochs: int = 1
    num_minibatches: int = 1
    grad_accum: int = 1
    vocab_chunk: int = 8192
    vocab_keep_logits_mb: int = 0  # keep the vocabulary pass's logits for its backward up to this MiB a device
    group_size: int = 8
    share_prompt: bool = True
    pack_tokens: int = 0  # > 0: packed responses, capacity rounded up to this multiple (models.packing)
    pack_buckets: str = "linear"  # capacity buckets: multiples of pack_tokens, or its geometric ladder
    gpu_gemm: str = "auto"  # the update's products on a GPU: auto | xla | cublas (stare_jax.gpu_gemm)
    cpu_gemm: str = "auto"  # the update's products on a CPU: auto | ynnpack (stare_jax.cpu_gemm)
    old_stats: str = "sampler"  # a multi-step update's pre-update statistics: the sampler's, or a pre-pass

    @property
    def takes_sampler_stats(self) -> bool:
        """Whether the update reads the pre-update entropy and Q from the batch (the sampler's,
        `rollout.generate(token_stats=True)`) instead of a no-grad pre-pass: `old_stats = "sampler"`
        and more than one micro-batch or optimizer step (the single-pass update computes its own)."""
        return self.old_stats == "sampler" and (self.num_micro > 1 or self.num_updates > 1)

    @property
    def num_updates(self) -> int:
        """Optimizer steps per batch: epochs x mini-batches."""
        return self.ppo_epochs * self.num_minibatches

    @property
    def num_micro(self) -> int:
        """Micro-batches the batch is split into: mini-batches x accumulation steps."""
        return self.num_minibatches * self.grad_accum

    @classmethod
    def from_config(cls, config) -> "RLSettings":
        """Reads and validates the RL keys of an ml_collections ConfigDict (or nested dict)."""
        from stare_jax.config import parse_quadrants
        from stare_jax.rl import losses, stare  # registries; imported late to avoid cycles
        from stare_jax.rl.advantages import ADVANTAGE_SCALES

        g = lambda k: get_key(config, k)  # noqa: E731
        name = _choice("loss.name", str(g("loss.name")), losses.POLICY_LOSSES)
        loss = LossSettings(
            name=name,
            agg=_choice("loss.agg", str(g("loss.agg")), losses.AGGREGATIONS),
            clip_low=float(g("loss.clip_low")), clip_high=float(g("loss.clip_high")), clip_c=float(g("loss.clip_c")),
            entropy_coef=float(g("loss.entropy_coef")), forking_rho=float(g("loss.forking_rho")),
            clip_cov_ratio=float(g("loss.clip_cov_ratio")), clip_cov_lb=float(g("loss.clip_cov_lb")),
            clip_cov_ub=float(g("loss.clip_cov_ub")), kl_cov_ratio=float(g("loss.kl_cov_ratio")),
            kl_cov_coef=float(g("loss.kl_cov_coef")),
            kl_type=_choice("loss.kl_type", str(g("loss.kl_type")), set(losses.KL_ESTIMATORS) | {"none"}),
            kl_coef=float(g("loss.kl_coef")),
            hapo_alpha=float(g("loss.hapo_alpha")), hapo_phi=float(g("loss.hapo_phi")),
            entropy_adv_alpha=float(g("loss.entropy_adv_alpha")), entropy_adv_kappa=float(g("loss.entropy_adv_kappa")),
            w_reinforce_lambda=float(g("loss.w_reinforce_lambda")),
            quadrants=_quadrants(str(g("loss.quadrants")), parse_quadrants),
        )
        st = StareSettings(
            enabled=bool(g("stare.enabled")) or name == "stare",
            variant=_choice("stare.variant", str(g("stare.variant")), stare.VARIANTS),
            top_p_ratio=float(g("stare.top_p_ratio")), top_p_ratio_minus=float(g("stare.top_p_ratio_minus")),
            w=float(g("stare.w")), m=float(g("stare.m")),
            target_entropy=float(g("stare.target_entropy")), adaptive=bool(g("stare.adaptive")),
            alpha=float(g("stare.alpha")), w_max=float(g("stare.w_max")), m_min=float(g("stare.m_min")),
            selection_scope=_choice("stare.selection_scope", str(g("stare.selection_scope")), stare.SELECTION_SCOPES),
        )
        opt = OptimSettings(
            lr=float(g("optim.lr")), b1=float(g("optim.b1")), b2=float(g("optim.b2")), eps=float(g("optim.eps")),
            weight_decay=float(g("optim.weight_decay")), grad_clip=float(g("optim.grad_clip")),
            warmup_steps=int(g("optim.warmup_steps")),
        )
        out = cls(
            loss=loss, stare=st, optim=opt,
            advantage_scale=_choice("advantage.scale", str(g("advantage.scale")), ADVANTAGE_SCALES),
            advantage_eps=float(g("advantage.eps")),
            ppo_epochs=int(g("update.ppo_epochs")), num_minibatches=int(g("update.num_minibatches")),
            grad_accum=int(g("update.grad_accum")), vocab_chunk=int(g("model.vocab_chunk")),
            vocab_keep_logits_mb=int(g("model.vocab_keep_logits_mb")),
            group_size=int(g("rollout.group_size")), share_prompt=bool(g("update.share_prompt")),
            pack_tokens=int(g("update.pack_tokens")),
            pack_buckets=_choice("update.pack_buckets", str(g("update.pack_buckets")), PACK_BUCKETS),
            gpu_gemm=_choice("model.gpu_gemm", str(g("model.gpu_gemm")), gpu_gemm.CHOICES),
            cpu_gemm=_choice("model.cpu_gemm", str(g("model.cpu_gemm")), cpu_gemm.CHOICES),
            old_stats=_choice("update.old_stats", str(g("update.old_stats")), OLD_STATS),
        )
        for key, value in (("update.ppo_epochs", out.ppo_epochs), ("update.num_minibatches", out.num_minibatches),
                           ("update.grad_accum", out.grad_accum), ("model.vocab_chunk", out.vocab_chunk),
                           ("rollout.group_size", out.group_size)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if out.pack_tokens < 0:
            raise ValueError(f"update.pack_tokens must be >= 0 (0: no packing), got {out.pack_tokens}")
        if out.vocab_keep_logits_mb < 0:
            raise ValueError(f"model.vocab_keep_logits_mb must be >= 0 (0: recompute the logits), "
                             f"got {out.vocab_keep_logits_mb}")
        for key, value in (("loss.hapo_alpha", loss.hapo_alpha), ("loss.hapo_phi", loss.hapo_phi),
                           ("loss.entropy_adv_alpha", loss.entropy_adv_alpha),
                           ("loss.entropy_adv_kappa", loss.entropy_adv_kappa)):
            if not value > 0.0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if not 0.0 <= loss.w_reinforce_lambda <= 1.0:
            raise ValueError(f"loss.w_reinforce_lambda must be in [0, 1], got {loss.w_reinforce_lambda}")
        if not 0.0 < out.stare.top_p_ratio <= 1.0:
            raise ValueError(f"stare.top_p_ratio must be in (0, 1], got {out.stare.top_p_ratio}")
        if not 0.0 <= out.stare.top_p_ratio_minus <= 1.0:
            raise ValueError(f"stare.top_p_ratio_minus must be in [0, 1] (0: top_p_ratio), got "
                             f"{out.stare.top_p_ratio_minus}")
        return out
