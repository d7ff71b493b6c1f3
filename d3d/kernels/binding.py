"""The compiled row-exact kernels, called through ctypes over CPU tensors in bf16 or fp32.

A row's result is a fixed sequence of IEEE operations whatever the number of rows in the call
(see rowexact.c), so a k-token verification is bit-identical to k one-token steps by construction,
on any CPU. They have no backward. `forward` runs a whole cached decoder in one C call over a
`LayerTable` (`layer_table`: every layer's named tensors, each linear weight as its `WeightStream`) with the
arguments in one `ForwardArgs` struct that mirrors the C one.

This module computes; it is handed weights, activations and KV slots as tensors and knows nothing
of caches, tokens or models.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from d3d.cache import covering_tiles, is_split, is_tiled, slots_of
from d3d.config import MAX_HEAD_DIM
from d3d.kernels import greedy
from d3d.kernels.build import KernelBuildError, build
from d3d.kernels.packing import HugePageArena, WeightStream
from d3d.kernels.segments import DecoderShape, Segment, contiguous_from, value_strides
from d3d.kernels.structs import ForwardArgs, Layer, SegmentArgs, Weight
from d3d.kernels.torch_ops import KVSlots, TorchKernels
from d3d.kernels.weights import WeightStreams
from d3d.sampling import greedy_ids

if TYPE_CHECKING:
    from d3d.kernels.layer_table import LayerTable


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


KEPT_SCRATCH = 16 << 20  # bytes of a forward's scratch kept per thread and role (larger: fresh each call)
KEEP_ROWS = 32  # the most rows a forward can keep past its last layer's keys and values (attention.h's QUERY_BLOCK)


def _each_float(function, x: torch.Tensor) -> torch.Tensor:
    """A C function (in, out, n) of each element, over fp32 x."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    function(x.data_ptr(), out.data_ptr(), x.numel())
    return out


class RowExactKernels(WeightStreams):
    """The compiled row-exact kernels, over CPU tensors in bf16 or fp32 (no autograd)."""

    name = "row-exact"

    # Stage names of the fused forward's profile (the STAGE_ enum in rowexact.c).
    STAGES = ("norm", "qkv", "rope_store", "attention", "o", "gate_up", "silu_mul", "down")
    # The passes of attention (attention.h; the last only on AMX tiles), timed within the "attention" stage.
    ATTENTION_PASSES = ("scores", "softmax", "sums", "softmax_and_sums")

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.library, self.path = library, path
        i64, f32, ptr, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
        for suffix in ("bf16", "f32"):
            getattr(library, f"d3d_linear_{suffix}").argtypes = [ptr, i64, ctypes.POINTER(Weight), ptr, ptr, ptr,
                                                                 i64, i64, i64, ptr, i32]
            getattr(library, f"d3d_rope_store_{suffix}").argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,
                                                                      i64, i64, i64, i64, i64, i64, i64, i64]
            getattr(library, f"d3d_attention_{suffix}").argtypes = [
                ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, f32, ptr, i32]
            getattr(library, f"d3d_rms_norm_{suffix}").argtypes = [ptr, ptr, ptr, i64, i64, f32, i32]
            getattr(library, f"d3d_silu_mul_{suffix}").argtypes = [ptr, ptr, i64, i64, i32]
            getattr(library, f"d3d_forward_{suffix}").argtypes = [ctypes.POINTER(ForwardArgs)]
        library.d3d_packed_linear.argtypes = [i32]
        library.d3d_lane_packed_linear.argtypes = []
        library.d3d_tiled_keys.argtypes = [i32, i64]
        if hasattr(library, "d3d_pair_scores"):  # (not in an older build, e.g. one of scripts/rows_ab.py's)
            library.d3d_pair_scores.argtypes = [i64]
            library.d3d_exp_fixed.argtypes = [ptr, ptr, i64]
        if hasattr(library, "d3d_exp_below"):
            library.d3d_exp_below.argtypes = [ptr, ptr, i64]
        library.d3d_linear_scratch.argtypes = [i64, i64, i32]
        library.d3d_linear_scratch.restype = i64
        library.d3d_attention_scratch.argtypes = [i64, i64, i64, i64, i64, i64]
        library.d3d_attention_scratch.restype = i64
        library.d3d_segments_scratch.argtypes = [ctypes.POINTER(SegmentArgs), i64, i64, i64, i64]
        library.d3d_segments_scratch.restype = i64
        library.d3d_group_pack.argtypes = [ctypes.c_void_p, i64, i64, ctypes.c_void_p]
        library.d3d_group_pack.restype = i64
        library.d3d_group_format.argtypes = [ctypes.c_void_p, i64]
        library.d3d_group_format.restype = i64
        library.d3d_dequantize.argtypes = [ptr, i64, ptr, i64, i64]
        library.d3d_dequantize_reference.argtypes = [ptr, i64, ptr, i64, i64]
        for suffix in ("bf16", "f32"):
            getattr(library, f"d3d_linear_reference_{suffix}").argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
        library.d3d_greedy_candidates.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, i32]
        library.d3d_greedy_ids.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i32]
        library.d3d_greedy_ids.restype = i64
        library.d3d_greedy_weights.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i32]
        if hasattr(library, "d3d_greedy_lanes"):  # (not in an older build: its greedy head is off here)
            library.d3d_greedy_lanes.restype = i64
        for suffix in ("bf16", "f32"):
            getattr(library, f"d3d_argmax_{suffix}").argtypes = [ptr, i64, i64, ptr]
            getattr(library, f"d3d_argmax_{suffix}").restype = i64
        library.d3d_struct_sizes.argtypes = [i32]
        library.d3d_struct_sizes.restype = i64
        if tuple(map(library.d3d_struct_sizes, range(3))) != tuple(map(ctypes.sizeof, (ForwardArgs, Layer, SegmentArgs))):
            raise KernelBuildError("the kernels' argument structs do not match d3d/kernels/binding.py")
        self._functions: dict[tuple[str, torch.dtype], Any] = {}  # (kind, dtype) → C function
        self.packs = {dtype: bool(library.d3d_packed_linear(dtype == torch.bfloat16))
                      for dtype in (torch.bfloat16, torch.float32)}
        # AVX2: bf16 weights whose width is a multiple of 16 are read from a lane-packed copy (the
        # same reduction as plain ones: the lanes)
        self.lane_packs = bool(library.d3d_lane_packed_linear())
        # id(weight) → (weakref to it, its version when the stream was made, the stream); an entry
        # goes when its weight does, and is dropped after an in-place update of the weight
        self._streams: dict[int, tuple[weakref.ref, int, WeightStream]] = {}
        self.epoch = 0  # bumped whenever a weight is given a stream of its own (LayerTable rebuilds)
        self._dense: dict[tuple[str, int], tuple[weakref.ref, int, WeightStream]] = {}  # (format, id(weight)) → its copy
        # Calls of several rows over a quantized weight read its bf16 values instead (formats.h's
        # d3d_weight.dense): the same bits, less arithmetic. False decodes the blocks at every row
        # count (for tests and measurements).
        self.dense_rows = True
        # Calls of a few rows over a quantized weight read a grouped copy of its blocks where this path
        # has one — AVX-512 BF16: U4 and I8 blocks 16 rows at a time (formats.h's G4, G8); the AVX2
        # lanes: U4 and S4 blocks as tables of their 16 values (T4). The same bits. False leaves them
        # to the blocks and the bf16 values (for tests and measurements).
        self.grouped_rows = bool(library.d3d_grouped_linear())
        # (id, amx, quads) → the grouped copy
        self._grouped: dict[tuple[int, bool, bool], tuple[weakref.ref, int, WeightStream | None]] = {}
        self._descriptors: dict = {}  # id(weight) → its descriptor and streams (`_weight`)
        self.arena = HugePageArena()
        self._kept_scratch = threading.local()  # `_scratch_for`'s buffers, per thread (the AMX check below uses them)
        library.d3d_amx.argtypes = [i32]
        library.d3d_amx.restype = i32
        library.d3d_kernel_path.restype = ctypes.c_char_p
        # AVX-512 BF16 with VBMI, without the tiles: 4-bit blocks looked up in quads of 4 columns
        # (formats.h's QL), on unless D3D_QUADS is "0" — on an AMD
        # EPYC Zen 4 a one-token step 0.8 of the grouped blocks', a 17-row verification the same, AR 1.14x
        # and the default 1.02x faster end to end (docs/performance.md)
        if hasattr(library, "d3d_quads"):  # (not in an older build, e.g. one of scripts/rows_ab.py's)
            library.d3d_quads.argtypes, library.d3d_quads.restype = [i32], i32
        self.quads = False
        self.set_quads(os.environ.get("D3D_QUADS", "1") != "0")
        # Intel's AMX tiles for every bf16 linear, where the build, the CPU and Linux allow it and
        # D3D_AMX is not "0" — kept only if its rows pass `_amx_refusal`'s check.
        self.amx_refused: str | None = None
        self.amx = bool(library.d3d_amx(int(os.environ.get("D3D_AMX", "1") != "0")))
        if self.amx:
            self.amx_refused = self._amx_refusal()
            if self.amx_refused is not None:
                self.amx = bool(library.d3d_amx(0))
                print(f"d3d: AMX tiles not used: {self.amx_refused}; the AVX-512 path instead", file=sys.stderr)
        self.path_name = library.d3d_kernel_path().decode()
        self.greedy = greedy.GreedyHeads(self)  # the certified greedy heads (d3d.kernels.greedy)

    def tiles_keys(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this build reads a cache's keys tiled (d3d.cache; attention.h), for keys of this
        dtype and head_dim: a tiled cache passes only where it does."""
        return bool(self.library.d3d_tiled_keys(int(dtype == torch.bfloat16), head_dim))

    def pair_scores(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this build's attention of this dtype and head_dim scores (and, where a KV head's
        query heads are summed together, weighs V) by bf16 pair dot products — attention.h's
        pair_chains and PAIR_SUMS, AVX-512 BF16 without the AMX tiles —, not by fp32 chains: a
        contract of its own, whose bits tests/test_kernels.py's `pair_attention` computes step by step."""
        return hasattr(self.library, "d3d_pair_scores") and dtype == torch.bfloat16 \
            and bool(self.library.d3d_pair_scores(head_dim))

    def exp_fixed(self, x: torch.Tensor) -> torch.Tensor:
        """The softmax's exp (rowexact.c's exp_fixed) of each element of fp32 x."""
        return _each_float(self.library.d3d_exp_fixed, x)

    def exp_below(self, x: torch.Tensor) -> torch.Tensor:
        """The vector softmax's exp (rowexact.c's exp_below16, for x ≤ 0) of each element of fp32 x."""
        return _each_float(self.library.d3d_exp_below, x)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the last dimension of bf16 or fp32 logits — `d3d.sampling.greedy_ids`'s
        index, the first of the largest (greedy.h's d3d_argmax), without their fp32 copy; rows holding
        a NaN take greedy_ids' answer."""
        if logits.dtype not in (torch.bfloat16, torch.float32) or logits.shape[-1] == 0:
            return greedy_ids(logits)
        rows = logits if logits.dim() == 2 and logits.is_contiguous() else logits.reshape(-1, logits.shape[-1]).contiguous()
        ids = torch.empty(rows.shape[0], dtype=torch.int64)
        function = self.library.d3d_argmax_bf16 if logits.dtype == torch.bfloat16 else self.library.d3d_argmax_f32
        if function(rows.data_ptr(), rows.shape[0], rows.shape[1], ids.data_ptr()):
            unordered = (ids < 0).nonzero().flatten()
            ids[unordered] = greedy_ids(rows[unordered])
        return ids if logits.dim() == 2 else ids.reshape(logits.shape[:-1])

    def _key_layout(self, keys: torch.Tensor, values: torch.Tensor, head_dim: int) -> int:
        """attention.h's k_tiled for a cache's keys beside their values; tiled keys need a build that reads them."""
        if abs(keys.dim() - values.dim()) > 1:
            raise ValueError(f"keys of {keys.dim()} dimensions beside values of {values.dim()}: tiled keys go "
                             "with split values (d3d.cache)")
        if not is_tiled(keys, values):
            return 0
        if not self.tiles_keys(keys.dtype, head_dim):
            raise ValueError(f"tiled keys, which the {self.path_name} build does not read (d3d.cache: tile_keys)")
        return 1

    def set_amx(self, on: bool) -> bool:
        """Switch this process between the AMX tiles and the AVX-512 path (measurements: a process
        keeps to one path, whose bits differ from the other's); returns whether the tiles are on.
        The layer tables are rebuilt, so each path reads its own grouped copies."""
        self.amx = bool(self.library.d3d_amx(int(on)))
        self.path_name = self.library.d3d_kernel_path().decode()
        self.epoch += 1
        return self.amx

    def set_quads(self, on: bool) -> bool:
        """Switch this process's 4-bit weights to the quads (QL, and their bf16 values in quads for calls
        of many rows) or back to the grouped blocks (G4) where the build has them; returns whether they are
        on. As `set_amx`: the bits differ, the layer tables are rebuilt, each form has its own copies."""
        self.quads = hasattr(self.library, "d3d_quads") and bool(self.library.d3d_quads(int(on)))
        self.path_name = self.library.d3d_kernel_path().decode()
        self.epoch += 1
        return self.quads

    def _amx_refusal(self) -> str | None:
        """Why the AMX path must not be used here, or None: each row of a 35-row linear (two full row
        tiles and a partial one, five column groups, a bias) must be the row alone's bits, and within
        bf16 rounding of the AVX-512 path's values."""
        generator = torch.Generator().manual_seed(0)
        weight, bias, x = (torch.randn(*shape, generator=generator).to(torch.bfloat16) for shape in ((80, 96), (80,), (35, 96)))
        tiles = self.linear(x, weight, bias)
        alone = torch.cat([self.linear(x[i:i + 1], weight, bias) for i in range(len(x))])
        if not torch.equal(tiles.view(torch.int16), alone.view(torch.int16)):
            return "a row's bits changed with the rows beside it"
        self.library.d3d_amx(0)
        try:
            lanes = self.linear(x, weight, bias)
        finally:
            self.library.d3d_amx(1)
        if not torch.allclose(tiles.float(), lanes.float(), rtol=2e-2, atol=2e-2):
            worst = float((tiles.float() - lanes.float()).abs().max())
            return f"its products differ from the AVX-512 path's by up to {worst:.3g}"
        return None

    def stage_seconds(self, reset: bool = False) -> dict[str, float]:
        """Seconds the fused forward spent per stage so far (zeros unless built with `profile`)."""
        return self._seconds("d3d_stage_seconds", self.STAGES, reset)

    def attention_pass_seconds(self, reset: bool = False) -> dict[str, float]:
        """Seconds attention spent per pass so far, within `stage_seconds`' "attention" (zeros unless
        built with `profile`)."""
        count = ctypes.c_int64.in_dll(self.library, "d3d_attention_passes").value
        assert count == len(self.ATTENTION_PASSES), f"the kernels time {count} attention passes"
        return self._seconds("d3d_attention_pass_seconds", self.ATTENTION_PASSES, reset)

    def _seconds(self, symbol: str, names: tuple[str, ...], reset: bool) -> dict[str, float]:
        """The kernels' timer array `symbol`, one double per name; zeroed after reading with `reset`."""
        table = (ctypes.c_double * len(names)).in_dll(self.library, symbol)
        spent = dict(zip(names, table))
        if reset:
            ctypes.memset(table, 0, ctypes.sizeof(table))
        return spent

    def same_streams(self, library: ctypes.CDLL, path: Path, lane_packs: bool | None = None) -> "RowExactKernels":
        """Another build of these kernels (e.g. the profiling one) reading the weights' streams as
        this one does; `lane_packs=False`: reading bf16 weights as stored instead of lane-packed
        (its own copies; for measurements)."""
        other = RowExactKernels(library, path)
        other._streams, other._dense, other.arena, other.epoch = self._streams, self._dense, self.arena, self.epoch + 1
        if other.path_name == self.path_name:  # another path makes grouped copies of its own forms
            other._grouped = self._grouped
        if lane_packs is not None and lane_packs != self.lane_packs:
            other._dense, other.lane_packs = {}, lane_packs
        return other

    # One library per process: a copied or pickled decoder shares it.
    def __deepcopy__(self, memo: dict) -> "RowExactKernels":
        return self

    def __reduce__(self):
        return row_exact_kernels, ()

    def _fn(self, kind: str, dtype: torch.dtype):
        try:
            return self._functions[kind, dtype]
        except KeyError:
            if dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(f"row-exact kernels run bf16 or fp32, not {dtype}") from None
            suffix = "bf16" if dtype == torch.bfloat16 else "f32"
            function = self._functions[kind, dtype] = getattr(self.library, f"d3d_{kind}_{suffix}")
            return function

    # ---- weight streams ----

    def _attention_scratch(self, batch: int, length: int, heads: int, kv_heads: int, keys: int,
                           dim: int) -> torch.Tensor:
        """The attention's scores of one block of queries, and their softmax sums (attention.h)."""
        return self._scratch_for("scores", self.library.d3d_attention_scratch(batch, length, heads, kv_heads, keys, dim),
                                 torch.float32)

    def _scratch(self, rows: int, width: int) -> torch.Tensor:
        """A linear's scratch over `rows` rows of inputs up to `width` wide (linear.h)."""
        return self._scratch_for("linear", self.library.d3d_linear_scratch(rows, width, torch.get_num_threads()),
                                 torch.float32)

    def _scratch_for(self, role: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
        """At least `elements` of scratch for `role` — what a forward writes and reads back within one
        call —, kept for the calling thread and grown when too small, up to KEPT_SCRATCH bytes (a
        larger one is fresh). A fresh buffer each call was a torch allocation each: slow right after
        a forward, whose weights' stream leaves nothing of torch in the caches."""
        kept = self._kept_scratch.__dict__
        buffer = kept.get(role)
        if buffer is not None and buffer.numel() >= elements and buffer.dtype == dtype:
            return buffer
        buffer = torch.empty(max(elements, 1), dtype=dtype)
        if buffer.numel() * buffer.element_size() <= KEPT_SCRATCH:
            kept[role] = buffer
        return buffer

    # ---- the operations ----

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        *lead, width = x.shape
        x2 = x.reshape(-1, width)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        assert weight.is_contiguous() and weight.shape[1] == width and weight.dtype == x.dtype
        out = torch.empty(*lead, weight.shape[0], dtype=x.dtype)
        if residual is not None:
            residual = residual.contiguous()
            assert residual.shape == out.shape and residual.dtype == out.dtype
        descriptor, _ = self._weight(weight)
        scratch = self._scratch(x2.shape[0], width)
        self._fn("linear", x.dtype)(x2.data_ptr(), x2.stride(0), ctypes.byref(descriptor), _ptr(bias), _ptr(residual),
                                    out.data_ptr(), x2.shape[0], weight.shape[0], width, scratch.data_ptr(),
                                    torch.get_num_threads())
        return out

    def linear_reference(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, K) @ weight (N, K)ᵀ (+ bias, + residual) by the plain layout's chains (dot_block_*), whatever
        this build's own path: where a weight takes the lanes or the quads, every kernel must give these bits."""
        x, weight = x.contiguous(), weight.contiguous()
        residual = residual.contiguous() if residual is not None else None
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        self._fn("linear_reference", x.dtype)(x.data_ptr(), x.shape[1], weight.data_ptr(), _ptr(bias), _ptr(residual),
                                              out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1],
                                              torch.get_num_threads())
        return out

    def forward(self, table: LayerTable, shape: DecoderShape, x: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                mask: torch.Tensor | None, final_norm: torch.Tensor,
                capture: Sequence[int] = (), keep: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer and the final norm over x (B, T, hidden) in one C call; returns the normed hidden
        states and, for each layer index in `capture` (ascending), the residual stream after that layer.
        The same kernels as the per-op calls, so the same bits (tested); capturing splits the call at
        the captured layers and changes no bit either. With `keep` (B = 1, no capture), only the last
        `keep` rows' outputs are computed (≤ KEEP_ROWS; 0: the call stores its keys and values only) —
        a prompt's prefill reads its last row — and the other rows of the result are undefined.

        rope: (2, P, D) cos/sin tables in x's dtype; positions (B, T) rows of them (past P - 1: its last). keys,
        values: the KV cache (L, B, H_kv, capacity, D), or split or tiled (d3d.cache); the new tokens' go
        to slots start … start+T-1.
        Each batch row is a segment of `forward_segments`.
        """
        batch, length, _ = x.shape
        assert keys.shape[1] == batch, "KV batch rows != x's"
        if mask is not None:
            assert mask.shape == (batch, length, start + length), f"mask {tuple(mask.shape)}"
        segments = [Segment(length, keys[:, b], values[:, b], start, None if mask is None else mask[b])
                    for b in range(batch)]
        return self.forward_segments(table, shape, x, rope, positions, segments, final_norm, capture, keep)

    def segment_cache(self, struct: SegmentArgs, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype,
                      head_dim: int) -> None:
        """A segment's cache fields of `struct` (d3d_segment) from its keys and values — views of one
        sequence's cache (`Segment`) — checked against the forward's dtype and the kernels' limits."""
        assert keys.dtype == dtype == values.dtype and keys.stride()[:2] == values.stride()[:2]
        assert contiguous_from(keys, 2), "a cache's slots must be contiguous"
        assert head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} above {MAX_HEAD_DIM}"
        struct.v_row, struct.v_part = value_strides(keys, values)
        struct.k_tiled = self._key_layout(keys, values, head_dim)
        struct.kv_layer, struct.kv_head = keys.stride(0), keys.stride(1)

    def forward_segments(self, table: LayerTable, shape: DecoderShape, x: torch.Tensor, rope: torch.Tensor,
                         positions: torch.Tensor, segments: Sequence[Segment], final_norm: torch.Tensor,
                         capture: Sequence[int] = (), keep: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` over x (M, hidden) — or (B, T, hidden), M = B·T, its rows in order —: the rows of
        several sequences, each `Segment` after its own cache — every linear layer runs once over all M
        rows, attention per segment. positions (M,), or (B, T). The outputs have x's shape. Row-exact
        kernels make each row's bits those of its sequence decoded alone."""
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        assert sum(segment.rows for segment in segments) == rows, "segment rows != x's rows"
        if keep is None:
            keep = rows
        assert not capture or keep == rows, "captured layers read every row"
        assert keep == rows or 0 <= keep <= min(KEEP_ROWS, segments[-1].rows), f"keep {keep} of {rows} rows"
        structs = (SegmentArgs * len(segments))()
        masks = []  # kept alive through the call
        for struct, segment in zip(structs, segments):
            self.segment_cache(struct, segment.keys, segment.values, x.dtype, shape.head_dim)
            assert segment.start + segment.rows <= slots_of(segment.keys, segment.values), "KV slots out of range"
            mask = segment.mask
            if mask is not None:
                mask = mask.to(torch.uint8).contiguous()
                assert mask.shape == (segment.rows, segment.start + segment.rows), f"mask {tuple(mask.shape)}"
                masks.append(mask)
            struct.rows, struct.start, struct.mask = segment.rows, segment.start, _ptr(mask)
        x = x.contiguous().clone()  # the residual stream, updated in place by the kernel
        positions = positions.contiguous()
        heads, dim = shape.heads, shape.head_dim
        work = self._scratch_for("work", shape.work_elements(rows, hidden), x.dtype)
        scores = self._scratch_for(
            "scores", self.library.d3d_segments_scratch(structs, len(segments), heads, shape.kv_heads, dim), torch.float32)
        scratch = self._scratch(rows, shape.linear_width(hidden))
        out = torch.empty_like(x)
        captured, first = [], 0
        for last in [*capture, table.layers - 1]:  # layers first … last in one call
            if last < first:  # the last layer was captured: nothing left to run
                continue
            for struct, segment in zip(structs, segments):  # layer `first`'s slots
                struct.k_cache = segment.keys.data_ptr() + first * segment.keys.stride(0) * segment.keys.element_size()
                struct.v_cache = segment.values.data_ptr() + first * segment.values.stride(0) * segment.values.element_size()
            args = ForwardArgs(
                ctypes.cast(ctypes.addressof(table.structs) + first * ctypes.sizeof(Layer), ctypes.POINTER(Layer)),
                last + 1 - first, hidden, heads, shape.kv_heads, dim, shape.intermediate, shape.eps, dim ** -0.5,
                x.data_ptr(), rope.data_ptr(), positions.data_ptr(), rope.shape[1], structs, len(segments), rows,
                final_norm.data_ptr(), out.data_ptr(), work.data_ptr(), scores.data_ptr(), scratch.data_ptr(),
                torch.get_num_threads(), keep if last == table.layers - 1 else rows)
            self._fn("forward", x.dtype)(ctypes.byref(args))
            if last in capture:
                captured.append(x.clone())
            first = last + 1
        return out, captured

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   slots: KVSlots | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`TorchKernels.rope_store` in one call, the same bits (IEEE products and sums, rounded alike);
        over a tiled cache the keys so far come back as the tiles holding them (`attention` reads them)."""
        if slots is None:
            return TorchKernels.rope_store(qkv, cos, sin, heads, kv_heads, slots)
        keys, values, start = slots  # keys (B, H_kv, capacity, D) or tiled, values the same or split; contiguous
        batch, length, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        assert keys.is_contiguous() and values.is_contiguous() and start + length <= slots_of(keys, values)
        assert dim <= MAX_HEAD_DIM, f"head_dim {dim} above {MAX_HEAD_DIM}"
        v_row, v_part = value_strides(keys, values)
        k_tiled = self._key_layout(keys, values, dim)
        qkv = qkv.contiguous()
        q = torch.empty(batch, length, heads, dim, dtype=qkv.dtype)
        cos, sin = cos.reshape(batch * length, dim).contiguous(), sin.reshape(batch * length, dim).contiguous()
        self._fn("rope_store", qkv.dtype)(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                          keys.data_ptr(), values.data_ptr(), batch, length, heads, kv_heads, dim,
                                          start, keys.stride(0), keys.stride(1), v_row, v_part, k_tiled)
        end = start + length
        if k_tiled:  # the tiles that hold slots 0 … end-1 (attention reads how many from the values)
            return q, covering_tiles(keys, end), values[..., :end, :]
        return q, keys[:, :, :end], values[..., :end, :]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, T, H, D) over k (B, H_kv, S, D) — or a tiled cache's (B, H_kv, ⌈S / KEY_TILE⌉, D / 2,
        KEY_TILE, 2) — and v, the same or a split cache's (B, H_kv, D / V_PART, S, V_PART) → (B, T, H, D);
        mask (B, T, S), None = causal."""
        batch, length, heads, dim = q.shape
        kv_heads, keys = k.shape[1], slots_of(k, v)
        if is_split(k, v):  # a split cache's slice: slices of d, slots contiguous within each
            assert k[0, 0].is_contiguous() and k.stride()[:2] == v.stride()[:2] and v.stride(-1) == 1
        elif k.stride(-1) != 1 or k.stride(-2) != dim or k.stride() != v.stride():  # a cache slice passes as is
            k, v = k.contiguous(), v.contiguous()
        k_tiled = self._key_layout(k, v, dim)
        v_row, v_part = value_strides(k, v)
        assert dim <= MAX_HEAD_DIM, f"head_dim {dim} above {MAX_HEAD_DIM}"
        q = q.contiguous()
        if mask is not None:
            mask = mask.to(torch.uint8).contiguous()
            assert mask.shape == (batch, length, keys), f"mask {tuple(mask.shape)}"
        out = torch.empty_like(q)
        threads = torch.get_num_threads()
        scratch = self._attention_scratch(batch, length, heads, kv_heads, keys, dim)
        self._fn("attention", q.dtype)(q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(mask), out.data_ptr(),
                                       batch, length, heads, kv_heads, keys, dim, k.stride(0), k.stride(1),
                                       v_row, v_part, k_tiled, dim ** -0.5, scratch.data_ptr(), threads)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self._fn("rms_norm", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                      x.shape[-1], eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        *lead, width = gate_up.shape
        out = torch.empty(*lead, width // 2, dtype=gate_up.dtype)
        self._fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // width,
                                            width // 2, torch.get_num_threads())
        return out


_lock = threading.Lock()
_loaded: RowExactKernels | KernelBuildError | None = None


def row_exact_kernels() -> RowExactKernels:
    """The compiled kernels for this machine, built on first call; raises KernelBuildError."""
    global _loaded
    with _lock:
        if _loaded is None:
            # torch's own libgomp is loaded first, so the kernels share its OpenMP thread pool.
            try:
                path = build()
                _loaded = RowExactKernels(ctypes.CDLL(str(path)), path)
            except (KernelBuildError, OSError) as error:
                _loaded = error if isinstance(error, KernelBuildError) else KernelBuildError(str(error))
        if isinstance(_loaded, KernelBuildError):
            raise _loaded
        return _loaded


__all__ = ["DecoderShape", "RowExactKernels", "Segment", "row_exact_kernels"]
