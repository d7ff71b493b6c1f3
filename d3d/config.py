"""Dataclass configs: decoder architecture, drafter, sampling and generation.

Each config validates itself in `__post_init__` and round-trips through JSON, so checkpoints
carry their config and bad parameters fail with a clear `ValueError` before any work starts.
This module holds no behaviour beyond validation and (de)serialisation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["llama", "qwen2", "qwen3"]
BlockAttention = Literal["anchor_causal", "bidirectional", "causal"]
LabelShift = Literal["shifted", "unshifted"]
# "d3d": block-diffusion drafting, one pass per block; "ar": classic speculative decoding's drafter,
# one causal next-token pass per draft (the AR-drafter baseline, same depth and initialisation).
DrafterKind = Literal["d3d", "ar", "dflash"]
# The RoPE scalings d3d.models implements, and the rope_scaling keys each one reads.
ROPE_SCALING_KEYS = {"default": (), "linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


class ConfigError(ValueError):
    """A config or parameter that cannot be used; the message says which and why."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


class _JsonMixin:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build from parsed JSON, refusing unknown, missing and wrong-typed fields with a ConfigError."""
        _check(isinstance(data, dict), f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        unknown = set(data) - {f.name for f in fields}
        _check(not unknown, f"{cls.__name__}: unknown fields {sorted(unknown)}")
        missing = [f.name for f in fields if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        _check(not missing, f"{cls.__name__}: missing fields {missing}")
        hints = typing.get_type_hints(cls)
        for name, value in data.items():
            _check(_is_a(value, hints[name]), f"{cls.__name__}.{name}: expected {_describe(hints[name])}, "
                                              f"got {json.dumps(value, default=repr)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))


def _is_a(value: Any, hint: Any) -> bool:
    """Does a parsed JSON value fit a field's type hint? (A nested config may come as a dict.)"""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_is_a(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:  # JSON writes 2.0 as 2
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, _JsonMixin):
        return isinstance(value, (dict, hint))
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " or ".join(json.dumps(arg) for arg in typing.get_args(hint))
    return hint.__name__ if origin is None and isinstance(hint, type) else str(hint).replace("typing.", "")


MAX_HEAD_DIM = 512  # the widest head the row-exact attention kernel holds


@dataclass
class ModelConfig(_JsonMixin):
    """Architecture of a Llama / Qwen2 / Qwen3-family decoder."""

    vocab_size: int  # rows of the embedding and the LM head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # width of one head
    max_position_embeddings: int = 8192  # longest sequence the model supports (cache size cap)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict (llama3, linear) or None
    tie_word_embeddings: bool = True  # LM head shares the embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    mlp_bias: bool = False  # MLP projections carry a bias (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3)
    family: Family = "llama"  # which HF architecture this mirrors

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check(getattr(self, name) > 0, f"ModelConfig.{name} must be positive")
        _check(self.num_heads % self.num_kv_heads == 0,
               "ModelConfig.num_heads must be a multiple of num_kv_heads")
        # the row-exact attention keeps a head's query and output on the stack (d3d/kernels/attention.h)
        _check(self.head_dim <= MAX_HEAD_DIM, f"ModelConfig.head_dim {self.head_dim} exceeds {MAX_HEAD_DIM}, "
               "the most the row-exact kernels hold")
        _check(self.family in ("llama", "qwen2", "qwen3"), f"unsupported family {self.family!r}")
        _check(self.rms_norm_eps > 0 and self.rope_theta > 0, "ModelConfig.rms_norm_eps and rope_theta must be positive")
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        _check(kind in ROPE_SCALING_KEYS,
               f"unsupported rope scaling {kind!r} (supported: {', '.join(ROPE_SCALING_KEYS)})")
        missing = [key for key in ROPE_SCALING_KEYS[kind] if key not in scaling]
        _check(not missing, f"rope_scaling {kind!r} needs the keys {missing}")

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Read a transformers LlamaConfig / Qwen2Config / Qwen3Config."""
        model_type = getattr(hf_config, "model_type", "llama")
        _check(model_type in ("llama", "qwen2", "qwen3"),
               f"unsupported model type {model_type!r}: d3d supports llama, qwen2 and qwen3")
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads)
        rope = getattr(hf_config, "rope_parameters", None) or {}
        legacy_scaling = getattr(hf_config, "rope_scaling", None)
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(rope) if rope.get("rope_type", "default") != "default" else None
        if scaling is None and legacy_scaling and legacy_scaling.get("rope_type", "default") != "default":
            scaling = dict(legacy_scaling)
        if scaling is not None:
            scaling.pop("rope_theta", None)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 8192),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            family=model_type,
        )


@dataclass
class DrafterConfig(_JsonMixin):
    """A D3D block-diffusion drafter: which decoder it is and how it drafts."""

    model: ModelConfig  # the drafter's own decoder (usually fewer layers than the target)
    block_size: int = 16  # B: positions per verification block (anchor + B-1 drafts)
    mask_token_id: int = -1  # id of the MASK input; defaults to vocab_size (a new embedding row)
    target_layers: list[int] = field(default_factory=list)  # target layers each drafter layer was copied from
    target_vocab_size: int = 0  # the target vocabulary this drafter was made for
    tokenizer_fingerprint: str = ""  # hash of the target tokenizer's vocabulary ("" = unchecked)
    shared_embeddings: bool = True  # embedding / LM head / final norm are the target's, not stored
    block_attention: BlockAttention = "anchor_causal"  # attention inside a draft block
    denoising_steps: int = 1  # passes per block; later passes re-feed the argmax drafts
    labels: LabelShift = "shifted"  # block row i predicts position p+i+1 (shifted) or its own, p+i (unshifted)
    draft_vocab_size: int = 0  # drafts only among this many frequent tokens (0 = whole vocabulary)
    kind: DrafterKind = "d3d"  # "ar": next-token drafts one by one (no blocks, no MASK; block_size bounds k);
    # "dflash": D3D's blocks conditioned on the target's hidden states (d3d.dflash)
    feature_layers: list[int] = field(default_factory=list)  # dflash: target layers whose outputs condition it

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        if self.mask_token_id < 0:
            self.mask_token_id = self.model.vocab_size
        if self.target_vocab_size == 0:
            self.target_vocab_size = self.model.vocab_size
        _check(self.block_size >= 2, "block_size must be at least 2 (anchor + one draft)")
        _check(self.denoising_steps >= 1, "denoising_steps must be at least 1")
        _check(0 <= self.draft_vocab_size <= self.model.vocab_size,
               "draft_vocab_size must be between 0 (whole vocabulary) and the vocabulary size")
        _check(self.mask_token_id >= self.model.vocab_size,
               "mask_token_id must be a dedicated id outside the vocabulary the drafter emits")
        _check(self.block_attention in ("anchor_causal", "bidirectional", "causal"),
               f"unknown block_attention {self.block_attention!r}")
        _check(self.labels in ("shifted", "unshifted"), f"unknown labels {self.labels!r}")
        _check(self.kind in ("d3d", "ar", "dflash"), f"unknown drafter kind {self.kind!r} (d3d, ar or dflash)")
        _check((self.kind == "dflash") == bool(self.feature_layers),
               "feature_layers are the target layers a dflash drafter reads, and only a dflash drafter has them")
        _check(self.feature_layers == sorted(set(self.feature_layers)) and min(self.feature_layers, default=0) >= 0,
               f"feature_layers must be distinct layer indices in ascending order, got {self.feature_layers}")
        _check(self.kind != "ar" or (self.block_attention, self.labels, self.denoising_steps) == ("causal", "shifted", 1),
               "an AR drafter is causal with shifted labels and one step (block_attention 'causal', "
               f"labels 'shifted', denoising_steps 1), got {self.block_attention!r}, {self.labels!r}, "
               f"{self.denoising_steps}")


@dataclass
class SamplingConfig(_JsonMixin):
    """How a distribution is read off logits; the same transform applies to target and drafter."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 scales logits by 1/temperature
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set with this much probability mass (1 = all)
    seed: int | None = None  # seed of the sampling generator (None = nondeterministic)

    def __post_init__(self) -> None:
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationConfig(_JsonMixin):
    """When a generation stops."""

    max_new_tokens: int = 256  # tokens to generate at most
    eos_token_ids: list[int] = field(default_factory=list)  # ids that end generation (kept in output)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # greedy by default

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):
            self.sampling = SamplingConfig.from_dict(self.sampling)
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
