"""The bf16 pair contract of attention.h (AVX-512 BF16 builds: `pair_chains`, `PAIR_SUMS`) computed step
by step in fp32 tensors: what tests/test_kernels.py holds those kernels' bits to."""

from __future__ import annotations

import torch

from d3d.kernels import RowExactKernels


def fold_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """rowexact.c's fold_lanes over the last dimension (16 lanes), in fp32."""
    t8 = lanes[..., :8] + lanes[..., 8:]
    t4 = t8[..., :4] + t8[..., 4:]
    return (t4[..., 0] + t4[..., 2]) + (t4[..., 1] + t4[..., 3])


def pair_attention(kernels: RowExactKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """attention.h's pair contract (pair_chains, PAIR_SUMS) step by step in fp32 tensors, for one
    batch row of bf16 q (1, T, H, D), k and v (1, H_kv, S, D): each score the chain over the pairs of
    d, odd element first, times the scale; p = bf16(exp_fixed(x - top)), their total over 16 lanes in
    key order, folded; each output the chain over the pairs of keys, odd key first, times 1 / total,
    rounded to bf16. (Every product here is of two bf16 values, so exact in fp32: an fp32 addition
    after it is the instruction's fused step; no subnormal arises from these inputs.)"""
    if len(q) > 1:
        return torch.cat([pair_attention(kernels, q[b:b + 1], k[b:b + 1], v[b:b + 1], None if mask is None else mask[b:b + 1])
                          for b in range(len(q))])
    _, T, H, D = q.shape
    S, group = k.shape[2], H // k.shape[1]
    qf, kf, vf = q[0].float(), k[0].float(), v[0].float()
    visible = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    if mask is not None:
        visible = mask[0].bool()
    ends = torch.tensor([int(row.nonzero().max()) + 1 if row.any() else 0 for row in visible])
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    for h in range(H):
        keys, values = kf[h // group], vf[h // group]
        x = torch.zeros(T, S)
        for i in range(D // 2):
            x = x + qf[:, h, 2 * i + 1, None] * keys[None, :, 2 * i + 1]
            x = x + qf[:, h, 2 * i, None] * keys[None, :, 2 * i]
        x = torch.where(visible, x * torch.tensor(D ** -0.5, dtype=torch.float32), torch.tensor(float("-inf")))
        top = x.max(dim=1, keepdim=True).values
        p = torch.where(visible, kernels.exp_fixed(x - top), torch.zeros(())).to(torch.bfloat16).float()
        p = torch.cat([p, torch.zeros(T, 1 + 15 + S % 2)], dim=1)  # a zero past the last key, whole lanes
        lanes = torch.zeros(T, 16)
        for s0 in range(0, S, 16):
            lanes = lanes + torch.where(torch.arange(s0, s0 + 16)[None, :] < ends[:, None], p[:, s0:s0 + 16], torch.zeros(()))
        total = fold_lanes(lanes)
        inv = torch.where(total > 0, 1.0 / total, torch.zeros(()))
        padded = torch.cat([values, torch.zeros(1, D)])
        o = torch.zeros(T, D)
        for s in range(0, S, 2):
            seen = (s < ends)[:, None]
            step = o + p[:, s + 1, None] * padded[None, s + 1]
            step = step + p[:, s, None] * padded[None, s]
            o = torch.where(seen, step, o)
        out[:, h] = (o * inv[:, None]).to(torch.bfloat16)
    return out[None]
