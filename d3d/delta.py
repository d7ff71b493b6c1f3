"""A drafter's copied layers stored as their difference from the target layers they were copied from.

A deep drafter starts as a copy of the target's layers, and training moves its weights little: on
the 30-layer SmolLM2 drafter, the difference is ~1.7% of each matrix's norm (docs/training.md). So
little that rounding the drafter's own weights to 4-bit blocks puts them back on the target's grid
(Q4_1: teacher-forced τ 1.73, the untrained copy's 1.75, against 2.40), while the *difference* in
4-bit GGUF Q4_0 blocks keeps the drafter (2.41): a 212 MB bf16 drafter becomes ~60 MB.

`encode` turns each such matrix of a drafter's state into Q4_0 blocks of (weight − base), stored under
`<name>@delta_q4_0`; `decode` adds them back. The base is the target's matrix rounded to bf16 —
the same values whether the target was loaded in bf16 or fp32 — and the sum is computed in fp32 and
rounded once, from the blocks' exact values (gguf-py's reference decoding): the same weights on
every machine. A decoded drafter is a slightly different drafter (each weight within a block step
of the difference); every draft is still verified, so the output is the target's as always. The bases' fingerprint
(`base_fingerprint`) is stored beside the blocks, so a drafter is never rebuilt on another
target's weights (a fine-tune sharing the tokenizer would pass every other check).

This module reads and writes tensors; it loads no file and runs no model.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

SUFFIX = "@delta_q4_0"
BLOCK, BLOCK_BYTES = 32, 18  # weights per Q4_0 block, and its bytes (an fp16 scale, 16 bytes of nibbles)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def base_name(name: str, target_layers: list[int]) -> str | None:
    """The target's parameter a drafter matrix `name` was copied from ("layers.J.…"), or None."""
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) >= len(target_layers):
        return None
    return f"layers.{target_layers[int(match.group(1))]}.{match.group(2)}"


def _base(target_state: dict[str, torch.Tensor], name: str, target_layers: list[int],
          shape: torch.Size) -> torch.Tensor | None:
    source = base_name(name, target_layers)
    base = target_state.get(source) if source is not None else None
    if base is None or base.shape != shape or base.dim() != 2 or shape[1] % BLOCK:
        return None
    return base.detach().to(torch.bfloat16).float().cpu()


def bases(state: dict[str, torch.Tensor], target_state: dict[str, torch.Tensor],
          target_layers: list[int]) -> dict[str, torch.Tensor | None]:
    """The bf16 base of each `<name>@delta_q4_0` in `state` (`encode`'s output), by matrix name —
    None where the target lacks it or shapes it otherwise. Computed once for a load's check and decode."""
    out = {}
    for stored_name in sorted(name for name in state if name.endswith(SUFFIX)):
        blocks, name = state[stored_name], stored_name.removesuffix(SUFFIX)
        shape = torch.Size((blocks.shape[0], blocks.shape[1] // BLOCK_BYTES * BLOCK))
        out[name] = _base(target_state, name, target_layers, shape)
    return out


def encode(state: dict[str, torch.Tensor], target_state: dict[str, torch.Tensor],
           target_layers: list[int]) -> dict[str, torch.Tensor]:
    """`state` with every matrix copied from a target layer replaced by its difference's Q4_0 blocks
    (uint8, one row of blocks per row); everything else as it was."""
    out = {}
    for name, value in state.items():
        base = _base(target_state, name, target_layers, value.shape) if value.is_floating_point() else None
        if base is None:
            out[name] = value
            continue
        difference = (value.detach().float().cpu() - base).numpy().astype(np.float32)
        out[name + SUFFIX] = torch.from_numpy(quants.quantize(difference, GGMLQuantizationType.Q4_0))
    return out


def decode(state: dict[str, torch.Tensor], bases: dict[str, torch.Tensor | None], target_layers: list[int],
           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`encode`'s output back to a state: each `<name>@delta_q4_0` becomes `<name>` = base (`bases`)
    + the blocks' values, in `dtype`. A difference without its base (another target) raises ValueError."""
    out = {}
    for name, value in state.items():
        if not name.endswith(SUFFIX):
            out[name] = value
            continue
        name = name.removesuffix(SUFFIX)
        base = bases[name]
        if base is None:
            raise ValueError(f"{name} is stored as its difference from the target's "
                             f"{base_name(name, target_layers)}, which this target lacks or shapes otherwise")
        out[name] = (base + dequantize(value)).to(dtype)
    return out


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks (rows, n · 18 bytes) → their values (rows, n · 32) in fp32: d · (q − 8), each
    product exact in fp32 (an fp16 scale times a 4-bit integer) — gguf-py's reference values, at
    torch's speed."""
    rows = blocks.shape[0]
    grouped = blocks.reshape(rows, -1, BLOCK_BYTES)
    scale = grouped[..., :2].contiguous().view(torch.float16).float()  # (rows, n, 1)
    nibbles = grouped[..., 2:]
    low, high = (nibbles & 0x0F).to(torch.int8) - 8, (nibbles >> 4).to(torch.int8) - 8
    return (torch.cat([low, high], dim=-1).float() * scale).reshape(rows, -1)


def base_fingerprint(bases: dict[str, torch.Tensor | None]) -> str:
    """A hash of the bf16 bases (`bases`) the differences are taken from; a base the target lacks
    (or shapes otherwise) hashes as missing."""
    digest = hashlib.sha256()
    for name in sorted(bases, key=lambda name: name + SUFFIX):  # stored names' order, as files were hashed
        base = bases[name]
        digest.update(name.encode())
        if base is None:
            digest.update(b"missing")
        else:
            digest.update(str(tuple(base.shape)).encode())
            digest.update(base.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:20]
