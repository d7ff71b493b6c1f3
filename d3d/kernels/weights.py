"""What the linear kernels read for each weight: its stream (the weight itself, or a quantized
stream given to it), the copies made of it for this build's path (column- or lane-packed bf16
values; a quantized stream's grouped blocks in the form the path reads), and the C descriptor that
points into them (`d3d_weight`).

A weight always takes the same stream, copies and form whatever the row count of a call: that is
what keeps a row's bits the row alone's. `WeightStreams` is the part of `RowExactKernels` that keeps
them; it computes nothing.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch

from d3d.kernels.packing import (BLOCK, BLOCK_BYTES, WEIGHT_FORMATS, HugePageArena, WeightStream, check_blocks,
                                 column_packed, lane_packed, quad_packed)
from d3d.kernels.structs import Weight


class WeightStreams:
    """The streams and copies of the weights a `RowExactKernels` has been handed (its base class)."""

    library: ctypes.CDLL
    arena: HugePageArena
    packs: dict[torch.dtype, bool]
    lane_packs: bool
    dense_rows: bool
    grouped_rows: bool
    amx: bool
    quads: bool
    epoch: int
    _streams: dict[int, tuple[weakref.ref, int, WeightStream]]
    _dense: dict[tuple[str, int], tuple[weakref.ref, int, WeightStream]]  # (format, id(weight)) → its copy
    _grouped: dict[tuple[int, bool, bool], tuple[weakref.ref, int, WeightStream | None]]
    _descriptors: dict[int, tuple[weakref.ref, tuple[int, int], tuple, tuple[Weight, tuple[WeightStream | None, ...]]]]

    def _remember(self, weight: torch.Tensor, stream: WeightStream) -> WeightStream:
        key = id(weight)
        self._streams[key] = (weakref.ref(weight, lambda _, key=key: self._streams.pop(key, None)),
                              weight._version, stream)
        return stream

    def stream(self, weight: torch.Tensor) -> WeightStream:
        """What the linear kernels read for `weight` (N, K): a stream given to it (`use_stream`),
        else its column-packed copy where this build packs its dtype, else the weight itself.
        A weight always takes the same stream whatever the row count: that is the invariant."""
        entry = self._streams.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        return self._own_stream(weight)

    def _copied_form(self, dtype: torch.dtype, width: int) -> tuple[str, Callable, int] | None:
        """How this build copies a (N, width) weight of `dtype` — format, packing, the multiple N is
        padded to —, or None where its kernels read the weight as it is."""
        if self.packs[dtype] and not (dtype == torch.bfloat16 and width % 2):
            return "packed", column_packed, 64
        return ("lane_packed", lane_packed, 16) if self.lane_packs and dtype == torch.bfloat16 and width % 16 == 0 else None

    def copied_bytes(self, shapes: Iterable[tuple[int, int]], dtype: torch.dtype) -> int:
        """The bytes of the copies made of weights of these shapes (`HugePageArena.reserve` ahead of them)."""
        forms = [(rows, width, self._copied_form(dtype, width)) for rows, width in shapes]
        return sum(-(-rows // form[2]) * form[2] * width * dtype.itemsize for rows, width, form in forms if form)

    def _own_stream(self, weight: torch.Tensor) -> WeightStream:
        """The weight's own values as the kernels read them: column-packed where this build packs its
        dtype, lane-packed where its bf16 lanes read them so (each cached like any stream), else the
        weight itself."""
        rows, width = weight.shape
        if (form := self._copied_form(weight.dtype, width)) is None:
            return WeightStream.whole("plain", weight, rows)
        return self._copy(weight, form[0], form[1])

    def _copy(self, weight: torch.Tensor, format: str, pack: Callable) -> WeightStream:
        """The weight's values copied by `pack` into the arena in `format`, made once per weight, format
        and version."""
        key = (format, id(weight))
        entry = self._dense.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        packed = WeightStream.whole(format, pack(weight, self.arena), weight.shape[0])
        self._dense[key] = (weakref.ref(weight, lambda _, key=key: self._dense.pop(key, None)), weight._version, packed)
        return packed

    def use_stream(self, weight: torch.Tensor, stream: WeightStream) -> None:
        """Have the kernels read `stream` for `weight` from now on, until the weight changes in place.

        A quantized stream must decode to exactly the weight's values (checked here, every block):
        otherwise it would be a different model, and it is refused with ValueError."""
        rows, width = weight.shape
        if not stream.quantized:
            raise ValueError("only quantized streams are given to weights; plain and packed ones are made here")
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"a {stream.source} stream decodes to bf16 values; this weight is {weight.dtype}")
        if sum(part.rows for part in stream.parts) != rows:
            raise ValueError(f"a {stream.source} stream of {sum(p.rows for p in stream.parts)} rows for {rows}")
        first = 0
        for part in stream.parts:
            check_blocks(part, width)
            decoded, held = self.dequantize(part.data, part.format, part.rows, width), weight[first:first + part.rows]
            if not torch.equal(decoded.view(torch.int16), held.view(torch.int16)):  # bit for bit
                differ = int((decoded.view(torch.int16) != held.view(torch.int16)).sum())
                raise ValueError(f"the {part.source or part.format} stream decodes to {differ} values other "
                                 f"than the weight's (rows {first}-{first + part.rows - 1} of {rows} x {width})")
            first += part.rows
        self._remember(weight, stream)
        for key in [key for key in self._grouped if key[0] == id(weight)]:  # grouped from the stream it had
            del self._grouped[key]
        self.epoch += 1

    def dequantize(self, data: torch.Tensor, format: str, rows: int, width: int, reference: bool = False) -> torch.Tensor:
        """The bf16 values (rows, width) the kernels compute with for quantized blocks in `format`;
        `reference`: by the scalar decoder that defines them (the vector decoders must agree)."""
        out = torch.empty(rows, width, dtype=torch.bfloat16)
        function = self.library.d3d_dequantize_reference if reference else self.library.d3d_dequantize
        function(data.data_ptr(), WEIGHT_FORMATS[format], out.data_ptr(), rows, width)
        return out

    def prepare(self, weight: torch.Tensor) -> None:
        """Make now every copy a linear over `weight` may read (its stream, and for a quantized one
        the dense and grouped copies multi-row calls read), rather than on the first such call."""
        self._weight(weight)

    def _weight(self, weight: torch.Tensor) -> tuple[Weight, tuple[WeightStream | None, ...]]:
        """The C descriptor of the weight, and the streams it points into (keep them alive): made once
        per weight and kept while the weight, its version and this path's choices are (a linear call
        after a forward, whose stream leaves nothing of Python in the caches, spent ~60 µs remaking it)."""
        key = (self.epoch, self.dense_rows, self.grouped_rows, self.amx, self.quads)
        entry = self._descriptors.get(id(weight))
        now = (weight._version, weight.data_ptr())  # changed in place, or given other storage
        if entry is not None and entry[0]() is weight and entry[1] == now and entry[2] == key:
            return entry[3]
        made = self._make_weight(weight)
        at = id(weight)
        self._descriptors[at] = (weakref.ref(weight, lambda _, at=at: self._descriptors.pop(at, None)), now, key, made)
        return made

    def _make_weight(self, weight: torch.Tensor) -> tuple[Weight, tuple[WeightStream | None, ...]]:
        stream = self.stream(weight)
        if not stream.quantized or not self.dense_rows:
            return Weight.of(stream), (stream,)
        grouped = self._grouped_stream(weight, stream) if self.grouped_rows else None
        # quads (QL, QS) take their bf16 values in quads past a few rows, the same chains
        form = grouped.format if grouped is not None else None
        dense = self._copy(weight, "quad_packed", quad_packed) if form in ("ql", "qs") \
            else self._own_stream(weight)
        return Weight.of(stream, dense, grouped), (stream, dense, grouped)

    def one_row_stream(self, weight: torch.Tensor) -> WeightStream:
        """What a call of one row reads for `weight`: the grouped copy its descriptor carries (every
        path reads it at one row), else its stream."""
        streams = self._weight(weight)[1]  # (stream,) or (stream, dense, grouped)
        return streams[-1] if len(streams) == 3 and streams[-1] is not None else streams[0]

    def grouped_bytes(self, parts: Iterable[tuple[str, int]], width: int) -> int:
        """The bytes of the grouped copy that a stream of these (format, rows) runs, `width` wide, gets
        on this process's path (0: none; `HugePageArena.reserve` ahead of it)."""
        if not self.grouped_rows:
            return 0
        descriptor, rows = Weight(), 0
        for slot, (format, count) in zip(descriptor.parts, parts):
            slot.format, slot.rows = WEIGHT_FORMATS[format], count
            rows += count
        return int(self.library.d3d_group_pack(ctypes.byref(descriptor), rows, width, None))

    def arena_bytes(self, parts: Sequence[tuple[str, int]], width: int) -> int:
        """The bytes a quantized stream of these runs takes in the arena on this path: its grouped copy
        and the runs that copy leaves to their blocks (`in_arena`)."""
        return self.grouped_bytes(parts, width) + sum(rows * (width // BLOCK) * BLOCK_BYTES[format]
                                                      for format, rows in parts if self.in_arena(format, rows, width))

    def in_arena(self, format: str, rows: int, width: int) -> bool:
        """Whether a run of a quantized stream is copied into the arena's huge pages: unless this path
        makes a grouped copy of such a run, whose blocks are then read once, to make it
        (`d3d.quantized.use_gguf_streams`)."""
        return not self.grouped_bytes([(format, rows)], width)

    def _grouped_stream(self, weight: torch.Tensor, stream: WeightStream) -> WeightStream | None:
        """The quantized stream's blocks grouped 16 rows at a time in the form this process's path
        reads (G4/G8, or A4 while the AMX tiles are on; made once per stream and form), or None where
        its formats have no grouped form."""
        key = (id(weight), self.amx, self.quads)  # the form depends on the path (set_amx, set_quads)
        entry = self._grouped.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        rows, width = weight.shape
        descriptor = Weight.of(stream)
        format = self.library.d3d_group_format(ctypes.byref(descriptor), width)
        size = self.library.d3d_group_pack(ctypes.byref(descriptor), rows, width, None)
        grouped = None
        if size:
            data = self.arena.empty((size,), torch.uint8)
            self.library.d3d_group_pack(ctypes.byref(descriptor), rows, width, data.data_ptr())
            name = next(name for name, number in WEIGHT_FORMATS.items() if number == format)
            grouped = WeightStream.whole(name, data, rows, stream.source)
        self._grouped[key] = (weakref.ref(weight, lambda _, key=key: self._grouped.pop(key, None)),
                              weight._version, grouped)
        return grouped
