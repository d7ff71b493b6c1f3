"""Native Llama / Qwen2 / Qwen3-family decoder over a preallocated KV cache.

RMSNorm, RoPE (default, linear and llama3 scaling), grouped-query attention, SwiGLU, Qwen3 q/k
norm and Qwen2 q/k/v bias, tied or untied embeddings — the same arithmetic as transformers'
modelling code, so logits match it for the same weights. Attention takes an arbitrary boolean
mask over (cached + new) positions, which block drafting, packed async branches and training use.

This module is the model only: it never samples, never tokenizes and owns no generation loop.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from d3d.cache import KVCache
from d3d.config import ModelConfig
from d3d.masks import causal_mask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        # q, k and v in one matmul (transformers' q_proj/k_proj/v_proj, concatenated at load time):
        # a decoding step is ~200 small matmuls, and each call costs overhead on top of its bytes.
        self.widths = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                       self.num_kv_heads * self.head_dim]
        self.qkv_proj = nn.Linear(hidden, sum(self.widths), bias=bias)
        # Qwen2 biases q/k/v only; Llama and Qwen3 with attention_bias bias o_proj too.
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden,
                                bias=bias and config.family != "qwen2")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer_index: int) -> torch.Tensor:
        batch, length, _ = x.shape  # (B, T, hidden)
        q, k, v = self.qkv_proj(x).split(self.widths, dim=-1)
        q = q.reshape(batch, length, self.num_heads, self.head_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.write(layer_index, k, v)  # (B, H_kv, S, D), S = cached + T
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, q (B, H, T, D) over k/v (B, H_kv, S, D); mask (B, T, S) True = attend.

    With no mask, the T queries are the last T positions and attend causally, each one computed
    alone over exactly the keys it sees. A query then goes through the same kernel with the same
    shapes whether it shares the forward with 15 others (verification) or not (one decoding step),
    so its attention output is bit-identical; a masked multi-row call is not (fused kernels block
    the key axis by the whole call's length). With oneDNN's bf16 GEMM, which is row-count
    invariant on CPU, whole bf16 forwards are then bit-identical to one-token steps (measured: 0
    logit difference on SmolLM2); MKL's fp32 sgemm is not (~1e-6). The loop costs ~20% of a
    16-token verify here.
    """
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    length, keys = q.shape[2], k.shape[2]
    if length == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    rows = [F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :keys - length + i + 1],
                                           v[:, :, :keys - length + i + 1], enable_gqa=gqa)
            for i in range(length)]
    return torch.cat(rows, dim=2)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)  # fused
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache, layer_index):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer_index)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A causal decoder: token ids (or embeddings) + positions + cache + mask → logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        # Causal forwards of at most this many tokens attend row by row (bit-identical to one-token
        # steps, see `attend`); verification blocks fit under it, prefills do not. 0 turns it off.
        self.invariant_rows = 64

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, capacity: int | None = None, batch_size: int = 1) -> KVCache:
        capacity = capacity or self.config.max_position_embeddings
        if capacity > self.config.max_position_embeddings:
            raise ValueError(f"cache of {capacity} exceeds the model's context of "
                             f"{self.config.max_position_embeddings} positions")
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, batch_size, self.dtype, self.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # (B, T, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def hidden_states(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layers and final norm over embeddings (B, T, hidden) at positions (B, T)."""
        batch, length, _ = embeds.shape
        assert positions.shape == (batch, length), f"positions {tuple(positions.shape)} != {(batch, length)}"
        if cache is not None:
            cache.reserve(length)
        if mask is None and length > self.invariant_rows:
            # Long causal inputs (prefill, training) take one fused masked call; see `attend`.
            mask = causal_mask(length, cache.length if cache is not None else 0, embeds.device)
            mask = mask[None].expand(batch, -1, -1)
        if mask is not None:
            expected = (batch, length, length + (cache.length if cache is not None else 0))
            assert tuple(mask.shape) == expected, f"mask {tuple(mask.shape)} != {expected}"
        cos, sin = self.rope(positions, embeds.dtype)
        x = embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, index)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, mask: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T); with `last_only`, logits (B, 1, V) of the last position."""
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            positions = positions[None].expand(input_ids.shape[0], -1)
        hidden = self.hidden_states(self.embed_tokens(input_ids), positions, cache, mask)
        if last_only:
            hidden = hidden[:, -1:]
        return self.logits(hidden)
