"""PyTorch's own ops behind the kernels' interface: differentiable, any device.

Training, CUDA and machines without a C compiler run these; their rounding may change with the
row count, so exactness then rests on the self-check in `d3d.exactness`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from d3d.cache import store

# The KV slots a forward writes: a layer's keys (B, H_kv, capacity, D), or tiled, and values (the
# same, or split: d3d.cache) and the first slot to write; None without a cache.
KVSlots = tuple[torch.Tensor, torch.Tensor, int]


class TorchKernels:
    """PyTorch's ops: differentiable, any device; rounding may depend on the row count."""

    name = "torch"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) @ weight (N, K)ᵀ + bias, then + residual (..., N) when given."""
        out = F.linear(x, weight, bias)
        return out if residual is None else residual + out

    @staticmethod
    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   slots: KVSlots | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split qkv (B, T, (H + 2 H_kv) D), rotate q and k, store k and v in the KV slots.

        Returns q (B, T, H, D) and the keys/values attention reads, (B, H_kv, S, D): every cached
        slot plus the new ones (only the new ones without slots). cos, sin: (B, T, 1, D).
        """
        batch, length, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = rotate(q.reshape(batch, length, heads, dim), cos, sin)
        k = rotate(k.reshape(batch, length, kv_heads, dim), cos, sin).transpose(1, 2)
        v = v.reshape(batch, length, kv_heads, dim).transpose(1, 2)
        if slots is not None:
            k, v = store(*slots, k, v)
        return q, k, v

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, T, H, D) over k/v (B, H_kv, S, D) → (B, T, H, D); mask (B, T, S), None = causal."""
        length, keys = q.shape[1], k.shape[2]
        if mask is None:
            rows = torch.arange(length, device=q.device)[:, None] + (keys - length)
            mask = (torch.arange(keys, device=q.device)[None] <= rows)[None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=q.shape[2] != k.shape[1])
        return out.transpose(1, 2)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, T, H, D): x·cos + rotate_half(x)·sin, each product rounded to x's dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
