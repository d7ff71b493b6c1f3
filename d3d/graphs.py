"""Decoding forwards of one fixed shape on a GPU: every step and every verification as the same R rows,
captured once as a CUDA graph (`FixedRows`).

On a GPU, PyTorch's kernels choose their algorithms by shape, so a token's logits may change with the
row count (the exactness check then verifies row by row, `d3d.exactness`), and a 135M-parameter step is
bound by its ~400 kernel launches, not by its bytes. Both have one answer. Every decoding forward of up
to R rows — a one-token step, a verification of up to R − 1 drafts — runs as R rows: the rows past the
real ones repeat the last of them (the same id and position, so the same keys and values, written to
the same slot; a longer prompt goes in pieces of R), attention reads the cache's every slot under a mask (slot ≤ the row's position), and the
head runs over R rows too (`fixed_rows_linear`). For one shape a matmul and attention compute each row
from its own input alone, whatever the other rows hold, so a row's logits are the same bits in a step
and in a verification: row-exact by construction, as the CPU kernels are (`d3d.kernels`), and checked on
the running GPU all the same (`d3d.exactness`). And the shape never changes, so on CUDA the whole
forward is captured once per cache as a graph and each step is one replay: a verification of 16 drafts
costs what a one-token step does.

Where it runs: a target on a CUDA device (`Decoder.fixed_rows` None, the default: R = FIXED_ROWS;
D3D_GRAPHS=0 turns it off), or wherever `Decoder.fixed_rows` is set to a row count — on the CPU the same
forward runs eagerly, without a graph (the test suite's form of it; the row-exact kernels are the
CPU's path). Caches with split values or tiled keys (the CPU kernels' layouts) are not read this way.

This module computes forwards; `d3d.models.Decoder` decides when a forward takes this path.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from d3d.cache import KVCache, slots_of
from d3d.kernels import TorchKernels

FIXED_ROWS = 32  # rows of every decoding forward on a GPU: a step, a verification of up to 31 drafts


def fixed_rows_of(decoder: Any) -> int:
    """The row count `decoder`'s decoding forwards take (0: their own shapes): its `fixed_rows` where
    set, else FIXED_ROWS on a CUDA device unless D3D_GRAPHS is "0". Only for PyTorch's ops."""
    rows = getattr(decoder, "fixed_rows", None)
    if rows is not None:
        return rows
    return FIXED_ROWS if decoder.device.type == "cuda" and os.environ.get("D3D_GRAPHS", "1") != "0" else 0


def fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """x (..., K) @ weightᵀ over at most `rows` rows of x, as one call of exactly `rows` rows (padded with
    copies of the last): each row's result the same bits however many rows come with it."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    assert 0 < count <= rows, f"{count} rows in a call of {rows}"
    padded = torch.cat([flat, flat[-1:].expand(rows - count, -1)]) if count < rows else flat
    return torch.nn.functional.linear(padded, weight)[:count].reshape(*x.shape[:-1], weight.shape[0])


class FixedRows:
    """The final-normed hidden states of up to `rows` causal rows after a cache (batch size one, plain
    layout), computed as exactly `rows` rows over the cache's every slot (module docstring); captured
    as a CUDA graph on its first run on a GPU, eager elsewhere. Holds static buffers for the ids and
    positions, and the cache's tensors (not the cache: `runner_for` keeps one per live cache)."""

    def __init__(self, decoder: Any, cache: KVCache, rows: int) -> None:
        assert cache.batch_size == 1 and not cache.split and not cache.tiled, "a plain cache of one sequence"
        self.decoder, self.rows, self.keys, self.values = decoder, rows, cache.keys, cache.values
        device = cache.keys.device
        self.ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.steps = torch.arange(rows, device=device)
        self.slots = torch.arange(slots_of(cache.keys, cache.values), device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # the graph's output buffer (1, rows, hidden)
        self.captures = device.type == "cuda"

    def _forward(self) -> torch.Tensor:
        """(1, rows, hidden) from the static ids and positions, each layer's keys and values stored at
        the rows' positions first: everything here has one shape, so it can be captured."""
        decoder, kernels, positions = self.decoder, TorchKernels, self.positions
        x = decoder.embed(self.ids)
        cos, sin = decoder.rope(positions, x.dtype)
        mask = self.slots[None, None, :] <= positions[:, :, None]  # (1, rows, slots)
        for index, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            q, k, v = attention.project(layer.input_layernorm(x, kernels), cos, sin, None, index, kernels)
            self.keys[index].index_copy_(2, positions[0], k)
            self.values[index].index_copy_(2, positions[0], v)
            out = kernels.attention(q, self.keys[index], self.values[index], mask)
            x = kernels.linear(out.reshape(1, self.rows, -1), attention.o_proj.weight, attention.o_proj.bias, x)
            x = layer.mlp(layer.post_attention_layernorm(x, kernels), x, kernels)
        return decoder.norm(x, kernels)

    def _capture(self) -> None:
        """Warm up on a side stream (PyTorch's recipe: the allocator and the kernels' first calls), then
        record one forward. The warm-up writes the keys and values the replay writes: the same slots."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.hidden = self._forward()

    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The hidden states (T, hidden) of ids (T,) at positions start … start + T − 1, their keys and
        values stored at those slots (reserved by the caller); T ≤ rows."""
        count = ids.shape[0]
        assert 0 < count <= self.rows and start + count <= self.slots.shape[0], "rows past the shape or the cache"
        self.ids[0, :count].copy_(ids)
        self.ids[0, count:].copy_(ids[-1:].expand(self.rows - count))
        torch.clamp(self.steps + start, max=start + count - 1, out=self.positions[0])
        if not self.captures:
            return self._forward()[0, :count]
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.hidden[0, :count].clone()  # the buffer is the next replay's


_runners: weakref.WeakKeyDictionary[KVCache, FixedRows] = weakref.WeakKeyDictionary()


def runner_for(decoder: Any, cache: KVCache, rows: int) -> FixedRows | None:
    """The `FixedRows` of this decoder, cache and row count (made on first use; gone with the cache),
    or None where the cache's layout is not plain or holds more than one sequence."""
    if cache.batch_size != 1 or cache.split or cache.tiled:
        return None
    runner = _runners.get(cache)
    if runner is None or runner.decoder is not decoder or runner.rows != rows or runner.keys is not cache.keys:
        runner = _runners[cache] = FixedRows(decoder, cache, rows)
    return runner


def fixed_rows_hidden(decoder: Any, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor | None:
    """The final-normed hidden states (T, hidden) — (1, hidden) with `last_only` — of ids (T,) after
    `cache` through `FixedRows` (T slots reserved here; a prompt longer than the rows in pieces of
    them, so that its keys and values are the bits its tokens' steps would store: a prefix reused from
    an earlier request, or a prompt that arrives in parts, decodes as the whole would), or None where
    that path does not apply: fixed rows off, or a cache it cannot read."""
    rows = fixed_rows_of(decoder)
    runner = runner_for(decoder, cache, rows) if rows else None
    if runner is None:
        return None
    start, count = cache.reserve(ids.shape[0]), ids.shape[0]
    first = (count - 1) // rows * rows if last_only else 0  # the pieces before it only store their keys and values
    pieces = [runner.run(ids[begin:begin + rows], start + begin) for begin in range(0, count, rows)]
    hidden = torch.cat(pieces[first // rows:]) if len(pieces) > 1 else pieces[0]
    return hidden[-1:] if last_only else hidden
