"""A decoding step's fused forward with its arguments built once (`ForwardPlan`).

`RowExactKernels.forward_segments` builds its C structs, checks its caches and sizes its buffers at
every call. For a decoding loop — one sequence, a few causal rows after its own cache, every step —
that work is the same each time, and it runs right after the previous step, whose weights' stream has
left nothing of Python or torch in the caches: on an AMD EPYC Zen 4, ~0.7 ms of Python before and
between the C calls of a ~6 ms one-token step (~0.15 ms where it runs warm), ~0.37 ms through a plan
(docs/performance.md). A plan holds that sequence's `SegmentArgs` and `ForwardArgs`, its buffers and its
scratch, and a step sets only its row count, start, positions and output: the same C call, so the
same bits.

This module computes; `d3d.models.Decoder` decides when a forward takes a plan.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch

from d3d.cache import slots_of
from d3d.kernels.segments import DecoderShape
from d3d.kernels.structs import ForwardArgs, Layer, SegmentArgs

if TYPE_CHECKING:
    from d3d.kernels.binding import RowExactKernels
    from d3d.kernels.layer_table import LayerTable

MAX_ROWS = 32  # rows a plan's buffers hold: a one-token step, a verification of up to 31 drafts


class ForwardPlan:
    """`forward_segments` over one segment of up to `MAX_ROWS` causal rows after a cache of batch size
    one (its `keys`, `values`: (L, 1, …)), capturing nothing, with the table, shape, rope table and final
    norm of its build: `run` gives what `forward_segments` gives for the same rows, bit for bit
    (tested). It holds the cache weakly: a plan does not keep a finished request's cache alive."""

    def __init__(self, kernels: RowExactKernels, table: LayerTable, shape: DecoderShape, cache_keys: torch.Tensor,
                 cache_values: torch.Tensor, rope: torch.Tensor, final_norm: torch.Tensor) -> None:
        keys, values, dtype = cache_keys[:, 0], cache_values[:, 0], cache_keys.dtype  # the segment's views
        assert rope.dtype == dtype
        self.kernels, self.table, self.rope, self.final_norm = kernels, table, rope, final_norm
        self.cache = weakref.ref(cache_keys), weakref.ref(cache_values)
        self.threads, self.epoch = torch.get_num_threads(), kernels.epoch
        self.slots = slots_of(keys, values)
        hidden = final_norm.shape[0]
        self.segment = SegmentArgs()
        kernels.segment_cache(self.segment, keys, values, dtype, shape.head_dim)
        self.segment.k_cache, self.segment.v_cache = keys.data_ptr(), values.data_ptr()
        self.x = torch.empty(MAX_ROWS, hidden, dtype=dtype)  # the residual stream, updated in place
        self.positions = (ctypes.c_int64 * MAX_ROWS)()
        self.work = torch.empty(shape.work_elements(MAX_ROWS, hidden), dtype=dtype)
        self.scratch = torch.empty(max(1, kernels.library.d3d_linear_scratch(
            MAX_ROWS, shape.linear_width(hidden), self.threads)), dtype=torch.float32)
        self.scores, self.scored_keys = torch.empty(0), 0
        self.args = ForwardArgs(
            ctypes.cast(ctypes.addressof(table.structs), ctypes.POINTER(Layer)), table.layers, hidden, shape.heads,
            shape.kv_heads, shape.head_dim, shape.intermediate, shape.eps, shape.head_dim ** -0.5,
            self.x.data_ptr(), rope.data_ptr(), ctypes.addressof(self.positions), rope.shape[1],
            ctypes.pointer(self.segment), 1, 0, final_norm.data_ptr(), 0, self.work.data_ptr(), 0,
            self.scratch.data_ptr(), self.threads)
        self.forward = kernels._fn("forward", dtype)

    def fits(self, kernels: RowExactKernels, table: LayerTable, cache_keys: torch.Tensor, cache_values: torch.Tensor,
             rope: torch.Tensor, final_norm: torch.Tensor) -> bool:
        """Whether this plan runs these: the same objects it was built over (the cache still alive), no
        stream given since, and the same thread count."""
        return (table is self.table and self.cache[0]() is cache_keys and self.cache[1]() is cache_values
                and rope is self.rope and final_norm is self.final_norm and kernels is self.kernels
                and kernels.epoch == self.epoch and torch.get_num_threads() == self.threads)

    def _size_scores(self, keys: int) -> None:
        """Scores for a segment of MAX_ROWS rows over `keys` keys (grown by doubling, up to the cache's slots)."""
        keys = min(max(keys, 2 * self.scored_keys), self.slots)
        probe = SegmentArgs(MAX_ROWS, max(0, keys - MAX_ROWS))
        size = self.kernels.library.d3d_segments_scratch(ctypes.byref(probe), 1, self.args.heads,
                                                         self.args.kv_heads, self.args.head_dim)
        self.scores = torch.empty(max(1, size), dtype=torch.float32)
        self.args.scores, self.scored_keys = self.scores.data_ptr(), keys

    def run(self, rows: int, start: int, keep: int | None = None) -> torch.Tensor:
        """The final-normed hidden states (rows, hidden) of the rows whose embeddings the caller put in
        `x[:rows]`, stored at slots start … start + rows - 1 (reserved by the caller); with `keep`, only
        the last `keep` rows' (the others undefined: `RowExactKernels.forward`)."""
        assert 0 < rows <= MAX_ROWS and start + rows <= self.slots, "rows past the plan or the cache"
        assert keep is None or 0 <= keep <= rows, f"keep {keep} of {rows} rows"
        if start + rows > self.scored_keys:
            self._size_scores(start + rows)
        for row in range(rows):
            self.positions[row] = start + row
        out = torch.empty(rows, self.x.shape[1], dtype=self.x.dtype)
        self.segment.rows, self.segment.start = rows, start
        self.args.rows, self.args.out, self.args.keep_rows = rows, out.data_ptr(), rows if keep is None else keep
        self.forward(ctypes.byref(self.args))
        return out
