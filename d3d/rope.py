"""Rotary position embeddings: each position's rotation angles, as one table computed at load (a
position's rotation is then one table row, the same bits in any forward), with the scalings
transformers applies (default, linear, llama3)."""

from __future__ import annotations

import math

import torch

from d3d.config import ModelConfig


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


def rope_table(config: ModelConfig) -> torch.Tensor:
    """(2, positions, D) fp32: cos and sin of every position's rotation angles."""
    freqs = torch.arange(config.max_position_embeddings, dtype=torch.float32)[:, None] * rope_inverse_frequencies(config)
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((angles.cos(), angles.sin()))
