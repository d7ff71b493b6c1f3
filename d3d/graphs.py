"""Decoding forwards of one fixed shape on a GPU: every step and every verification as the same R rows,
captured once as a CUDA graph (`FixedRows`).

On a GPU, PyTorch's kernels choose their algorithms by shape, so a token's logits may change with the
row count (the exactness check then verifies row by row, `d3d.exactness`), and a 135M-parameter step is
bound by its ~400 kernel launches, not by its bytes. Both have one answer. Every decoding forward of up
to R rows — a one-token step, a verification of up to R − 1 drafts — runs as R rows: the rows past the
real ones repeat the last of them (the same id and position; their keys and values taken from it, written
to its slot; a longer prompt goes in pieces of R), attention reads the cache's every slot under a mask
(slot ≤ the row's position), and the head runs in calls of R rows too (`fixed_rows_linear`). For one shape a matmul and attention compute each row
from its own input alone, whatever the other rows hold, so a row's logits are the same bits in a step
and in a verification: row-exact by construction, as the CPU kernels are (`d3d.kernels`), and checked on
the running GPU all the same (`d3d.exactness`, over every row of the fixed rows). Forwards that also
give the residual stream after some layers (DFlash-style drafters read it) take the same rows. And the
shape never changes, so on CUDA the whole forward is captured as a graph over a cache's storage and each
step is one replay — a verification of 16 drafts costs what a one-token step does —; a GPU decoder's
caches come from a pool (`pooled_cache`), so a new request replays the graph an ended one captured.

Where it runs: a target on a CUDA device (`Decoder.fixed_rows` None, the default: R = FIXED_ROWS;
D3D_GRAPHS=0 turns it off), or wherever `Decoder.fixed_rows` is set to a row count — on the CPU the same
forward runs eagerly, without a graph (the test suite's form of it; the row-exact kernels are the
CPU's path). Caches with split values or tiled keys (the CPU kernels' layouts) are not read this way.

This module computes forwards; `d3d.models.Decoder` decides when a forward takes this path.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from d3d.cache import KVCache, slots_of
from d3d.kernels import TorchKernels

FIXED_ROWS = 32  # rows of every decoding forward on a GPU: a step, a verification of up to 31 drafts
IDLE_CACHES = 8  # pooled caches (and their graphs) kept idle per slot count, per decoder


def fixed_rows_of(decoder: Any) -> int:
    """The row count `decoder`'s decoding forwards take (0: their own shapes): its `fixed_rows` where
    set, else FIXED_ROWS on a CUDA device unless D3D_GRAPHS is "0". Only for PyTorch's ops."""
    if decoder.fixed_rows is not None:
        return decoder.fixed_rows
    return FIXED_ROWS if decoder.device.type == "cuda" and os.environ.get("D3D_GRAPHS", "1") != "0" else 0


def fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """x (..., K) @ weightᵀ in calls of exactly `rows` rows (the last padded with copies of its last
    row): each row's result the same bits however many rows come with it."""
    flat = x.reshape(-1, x.shape[-1])
    outs = []
    for begin in range(0, flat.shape[0], rows):
        part = flat[begin:begin + rows]
        count = part.shape[0]
        padded = torch.cat([part, part[-1:].expand(rows - count, -1)]) if count < rows else part
        outs.append(torch.nn.functional.linear(padded, weight)[:count])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FixedRows:
    """The final-normed hidden states of up to `rows` causal rows after a cache (batch size one, plain
    layout) — and the residual stream after `feature_layers`, for drafters that read it —, computed as
    exactly `rows` rows over the cache's every slot (module docstring); captured as a CUDA graph on
    its first run on a GPU, eager elsewhere. Holds static buffers for the ids, positions and padding,
    and the cache's tensors (not the cache), and its decoder weakly (pooled storage outlives requests)."""

    def __init__(self, decoder: Any, keys: torch.Tensor, values: torch.Tensor, rows: int,
                 feature_layers: tuple[int, ...] = ()) -> None:
        self._decoder = weakref.ref(decoder)
        self.rows, self.keys, self.values, self.feature_layers = rows, keys, values, feature_layers
        device = keys.device
        with torch.inference_mode(False):  # plain tensors, whatever mode the first request ran in
            self._buffers(device, slots_of(keys, values))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the graph's output buffers
        self.captures = device.type == "cuda"

    def _buffers(self, device: torch.device, slots: int) -> None:
        rows = self.rows
        self.ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.source = torch.zeros(rows, dtype=torch.long, device=device)  # the real row each row's keys come from
        self.steps = torch.arange(rows, device=device)
        self.slots = torch.arange(slots, device=device)

    def serves(self, decoder: Any, keys: torch.Tensor, rows: int, feature_layers: tuple[int, ...]) -> bool:
        return (self._decoder() is decoder and self.keys is keys and self.rows == rows
                and self.feature_layers == feature_layers)

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(1, rows, hidden) and the features (1, rows, len · hidden; None without) from the static ids
        and positions, each layer's keys and values stored at the rows' positions first — a padding
        row's taken from the real row it repeats, so that duplicate slots get one value: everything
        here has one shape, so it can be captured."""
        decoder, kernels, positions = self._decoder(), TorchKernels, self.positions
        x = decoder.embed(self.ids)
        cos, sin = decoder.rope(positions, x.dtype)
        mask = self.slots[None, None, :] <= positions[:, :, None]  # (1, rows, slots)
        features = []
        for index, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            q, k, v = attention.project(layer.input_layernorm(x, kernels), cos, sin, None, index, kernels)
            self.keys[index].index_copy_(2, positions[0], k.index_select(2, self.source))
            self.values[index].index_copy_(2, positions[0], v.index_select(2, self.source))
            out = kernels.attention(q, self.keys[index], self.values[index], mask)
            x = kernels.linear(out.reshape(1, self.rows, -1), attention.o_proj.weight, attention.o_proj.bias, x)
            x = layer.mlp(layer.post_attention_layernorm(x, kernels), x, kernels)
            if index in self.feature_layers:
                features.append(x)
        return decoder.norm(x, kernels), torch.cat(features, -1) if features else None

    def _capture(self) -> None:
        """Warm up on a side stream (PyTorch's recipe: the allocator and the kernels' first calls), then
        record one forward on it, on the cache's GPU. The warm-up writes the keys and values the replay
        writes: the same slots. A capture that fails leaves this runner eager, said once."""
        stream = torch.cuda.Stream(device=self.keys.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                outputs = self._forward()
        except RuntimeError as error:
            torch.cuda.set_stream(current)  # a failed capture_end leaves the capture stream current
            self.captures = False
            warnings.warn(f"d3d: capturing the decoding forward as a CUDA graph failed ({error}); running it "
                          "eagerly in fixed rows (the same bits, more launches)", stacklevel=2)
            return
        self.graph, self.outputs = graph, outputs

    def run(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states (T, hidden) and features (T, len · hidden; None without) of ids (T,) at
        positions start … start + T − 1, their keys and values stored at those slots (reserved by the
        caller); T ≤ rows."""
        count = ids.shape[0]
        assert 0 < count <= self.rows and start + count <= self.slots.shape[0], "rows past the shape or the cache"
        with torch.cuda.device(self.keys.device) if self.keys.device.type == "cuda" else nullcontext():
            self.ids[0, :count].copy_(ids)
            self.ids[0, count:].copy_(ids[-1:].expand(self.rows - count))
            torch.clamp(self.steps, max=count - 1, out=self.source)
            torch.add(self.source, start, out=self.positions[0])
            if self.captures and self.graph is None:
                self._capture()
            if self.graph is None:
                hidden, features = self._forward()
                return hidden[0, :count], None if features is None else features[0, :count]
            self.graph.replay()
            hidden, features = self.outputs  # the buffers are the next replay's
            return hidden[0, :count].clone(), None if features is None else features[0, :count].clone()


class _Pooled:
    """A pooled cache's storage, the runners captured over it (by rows and feature layers), and the
    addresses of the weights they were captured with."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.runners: dict[tuple[int, tuple[int, ...]], FixedRows] = {}
        self.weights: tuple[int, ...] = ()


_pools: weakref.WeakKeyDictionary[Any, dict[tuple, list[_Pooled]]] = weakref.WeakKeyDictionary()
_runners: weakref.WeakKeyDictionary[KVCache, dict] = weakref.WeakKeyDictionary()  # unpooled caches' runners


def pooled_cache(decoder: Any, capacity: int) -> KVCache:
    """A cache of one sequence for a GPU decoder in fixed rows, over storage of a power-of-two slot count
    (≥ capacity) that an ended request left, zeroed — with the graphs captured over it, so a new request
    replays instead of capturing again (a capture synchronises the device and empties PyTorch's
    allocator), unless the decoder's weights have moved since (graphs hold their addresses). Up to
    IDLE_CACHES idle storages are kept per slot count; a cache's slots past `capacity` hold zeros."""
    c = decoder.config
    slots = max(64, 1 << (capacity - 1).bit_length())
    idle = _pools.setdefault(decoder, {}).setdefault((slots, decoder.dtype, decoder.device), [])
    try:
        entry = idle.pop()
        entry.keys.zero_(), entry.values.zero_()  # nothing an earlier request left (a NaN would poison the mask)
    except IndexError:
        shape = (c.num_layers, 1, c.num_kv_heads, slots, c.head_dim)
        with torch.inference_mode(False):
            entry = _Pooled(*(torch.zeros(shape, dtype=decoder.dtype, device=decoder.device) for _ in range(2)))
    weights = tuple(p.data_ptr() for p in decoder.parameters())
    if weights != entry.weights:
        entry.runners, entry.weights = {}, weights
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, 1, decoder.dtype, decoder.device,
                    storage=(entry.keys, entry.values))
    cache.pooled = entry
    weakref.finalize(cache, _release, idle, entry)
    return cache


def _release(idle: list[_Pooled], entry: _Pooled) -> None:
    if len(idle) < IDLE_CACHES:
        idle.append(entry)


def runner_for(decoder: Any, cache: KVCache, rows: int, feature_layers: tuple[int, ...] = ()) -> FixedRows | None:
    """The `FixedRows` of this decoder, cache, row count and feature layers (made on first use; kept with
    a pooled cache's storage, else gone with the cache), or None where the cache's layout is not plain or
    holds more than one sequence."""
    if cache.batch_size != 1 or cache.split or cache.tiled:
        return None
    pooled = cache.pooled
    runners = pooled.runners if pooled is not None else _runners.setdefault(cache, {})
    runner = runners.get((rows, feature_layers))
    if runner is None or not runner.serves(decoder, cache.keys, rows, feature_layers):
        runner = runners[rows, feature_layers] = FixedRows(decoder, cache.keys, cache.values, rows, feature_layers)
    return runner


def fixed_rows_hidden(decoder: Any, ids: torch.Tensor, cache: KVCache, last_only: bool = False,
                      feature_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The final-normed hidden states (T, hidden) — (1, hidden) with `last_only` — of ids (T,) after
    `cache` through `FixedRows`, and the residual stream after `feature_layers` at every row (T, len ·
    hidden; None without) — T slots reserved here; a prompt longer than the rows goes in pieces of
    them, so that its keys and values are the bits its tokens' steps would store (a prefix reused from
    an earlier request, or a prompt that arrives in parts, decodes as the whole would) —, or None where
    that path does not apply: fixed rows off, or a cache it cannot read."""
    rows = fixed_rows_of(decoder) if not torch.is_grad_enabled() else 0  # decoding, never a forward to train
    runner = runner_for(decoder, cache, rows, tuple(feature_layers)) if rows else None
    if runner is None:
        return None
    start, count = cache.reserve(ids.shape[0]), ids.shape[0]
    pieces = [runner.run(ids[begin:begin + rows], start + begin) for begin in range(0, count, rows)]
    hidden = torch.cat([piece[0] for piece in pieces]) if len(pieces) > 1 else pieces[0][0]
    features = None if not feature_layers else torch.cat([piece[1] for piece in pieces]) if len(pieces) > 1 \
        else pieces[0][1]
    return (hidden[-1:] if last_only else hidden), features
