"""What the linear kernels read for each weight — its stream — and the memory it lives in.

A weight (N, K) reaches the kernels as a `WeightStream`: a format (formats.h) and the tensor of
bytes in that format. A bf16 or fp32 weight streams as itself (PLAIN) or, where the build packs,
as a column-packed copy (PACKED: 16 output columns per 64-byte step; AVX-512) or, for bf16 on AVX2,
a lane-packed one (LANE_PACKED: 16 output columns per step of one lane's chain); a GGUF's quantized weight
streams as its blocks, repacked once at load (U4, S4, I8, U6; `d3d.quantized`) — and, for 1-4-row
calls where the build takes packed pair dot products, as those blocks grouped 16 rows at a time
(G4, G8: made by the kernels, `RowExactKernels`). Copies live in huge pages where the OS grants them.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from dataclasses import dataclass

import torch

from d3d.memory import huge_mapping

# formats.h's enum, by name
WEIGHT_FORMATS = {"plain": 0, "packed": 1, "u4": 2, "i8": 3, "u6": 4, "s4": 5, "g4": 6, "g8": 7, "a4": 8, "lane_packed": 9, "t4": 10, "ql": 12, "quad_packed": 13, "qs": 14}
QUANTIZED_FORMATS = ("u4", "i8", "u6", "s4")
BLOCK = 32  # weights of a row per block of every quantized format
BLOCK_BYTES = {"u4": 24, "i8": 36, "u6": 32, "s4": 20}  # formats.h's block structs


@dataclass(frozen=True)
class StreamPart:
    """A run of a weight's rows in one format."""

    format: str  # a WEIGHT_FORMATS name
    data: torch.Tensor  # the rows' bytes in that format (a plain weight: the weight itself)
    rows: int
    source: str = ""  # what it was made from: a GGUF type ("Q4_1"), or "" for the weight's own values

    @property
    def quantized(self) -> bool:
        return self.format in QUANTIZED_FORMATS


MAX_PARTS = 3  # formats.h's d3d_weight


@dataclass(frozen=True)
class WeightStream:
    """One weight (N, K) as the linear kernels read it: its rows in up to MAX_PARTS runs, each in
    its own format (a fused projection whose parts a GGUF quantized differently)."""

    parts: tuple[StreamPart, ...]

    def __post_init__(self) -> None:
        assert 1 <= len(self.parts) <= MAX_PARTS, len(self.parts)
        assert len(self.parts) == 1 or all(part.quantized for part in self.parts), "runs of quantized rows only"
        assert all(part.rows % 4 == 0 for part in self.parts[:-1]), "a run must not split a block of 4 rows"

    @classmethod
    def whole(cls, format: str, data: torch.Tensor, rows: int, source: str = "") -> "WeightStream":
        return cls((StreamPart(format, data, rows, source),))

    @property
    def format(self) -> str:
        """The format every part shares, or "mixed"."""
        formats = {part.format for part in self.parts}
        return formats.pop() if len(formats) == 1 else "mixed"

    @property
    def quantized(self) -> bool:
        return all(part.quantized for part in self.parts)

    @property
    def source(self) -> str:
        """What the parts were made from, e.g. "Q4_1" or "Q4_K+Q6_K"."""
        return "+".join(dict.fromkeys(part.source or part.format for part in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() * part.data.element_size() for part in self.parts)


def check_blocks(part: StreamPart, width: int) -> None:
    """A quantized part must hold whole blocks of (rows, width) weights, contiguous."""
    assert part.quantized and width % BLOCK == 0, (part.format, width)
    expected = part.rows * (width // BLOCK) * BLOCK_BYTES[part.format]
    assert part.data.dtype == torch.uint8 and part.data.is_contiguous() and part.data.numel() == expected, (
        f"{part.format} part of {part.data.numel()} bytes for ({part.rows}, {width}); expected {expected}")


MADV_POPULATE_WRITE = 23  # Linux 5.14 on: fault a range's pages in, writable, without writing them


def _populate(block: torch.Tensor) -> None:
    """Fault in the pages of a mapping's tensor (madvise through ctypes, which lets go of the GIL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(block.data_ptr()), ctypes.c_size_t(block.numel()), MADV_POPULATE_WRITE)
    except (OSError, AttributeError):  # no libc madvise here: pages fault in as they are written
        pass


class HugePageArena:
    """Memory for packed weights, in transparent huge pages where the OS grants them.

    A decoding step streams every weight once, and 2 MB pages spare it a TLB miss every 4 KB
    (measured on AMD EPYC Zen 4: a step's linear layers ~10% faster). Tensors are slices of 64 MB
    anonymous mappings; a mapping is unmapped when its last slice is gone.
    """

    CHUNK = 64 << 20
    ALIGN = 64

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # uint8 view of the current mapping
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not hasattr(mmap, "MAP_ANONYMOUS"):
            return torch.empty(shape, dtype=dtype)
        size = math.prod(shape) * dtype.itemsize
        with self._lock:
            if self._chunk is None or self._used + size > self._chunk.numel():  # the chunk (or reserve) is full
                if size > self.CHUNK:
                    return huge_mapping(size).view(dtype).view(shape)
                self._chunk, self._used = huge_mapping(self.CHUNK), 0
            block = self._chunk[self._used:self._used + size]
            self._used += -(-size // self.ALIGN) * self.ALIGN
        return block.view(dtype).view(shape)

    def reserve(self, size: int) -> None:
        """Map `size` bytes for the copies made next, and have a thread of its own fault their pages in
        meanwhile (Linux's MADV_POPULATE_WRITE: the pages are made, not written). A fresh huge page is
        the dearest part of a load on a VM that hands freed memory back to its host (AMD EPYC Zen 3 VM:
        ~4 ms a MB, 2.4 s of the embedded target's ~4 s load), and the load has Python to run meanwhile."""
        if not hasattr(mmap, "MAP_ANONYMOUS") or size <= 0:
            return
        block = huge_mapping(size)
        with self._lock:
            self._chunk, self._used = block, 0
        threading.Thread(target=_populate, args=(block,), name="d3d-populate", daemon=True).start()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values in the arena."""
        return self.empty(tensor.shape, tensor.dtype).copy_(tensor)


def padded_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """A copy of the weight (N, K) with zero rows up to a multiple of `multiple`."""
    rows, width = weight.shape
    padded = torch.zeros(-(-rows // multiple) * multiple, width, dtype=weight.dtype)
    padded[:rows] = weight.detach()
    return padded


def column_packed(weight: torch.Tensor, arena: HugePageArena) -> torch.Tensor:
    """The weight (N, K) in the packed layout: 16 output columns per 64-byte step — fp32
    (N/16, K, 16), bf16 (N/16, K/2, 16, 2) — with N zero-padded to a multiple of 64."""
    width = weight.shape[1]
    padded = padded_rows(weight, 64)  # whole 4-group tiles
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    return arena.copy(padded.view(-1, 16, width // pair, pair).transpose(1, 2))


def quad_packed(weight: torch.Tensor, arena: HugePageArena) -> torch.Tensor:
    """The bf16 weight (N, K), K a multiple of 8, in the quads' layout (formats.h's QUAD_PACKED): per 16
    output columns (N zero-padded) and per step of 8 of K, 4 quads of 4 columns × 8 values —
    (N/16, K/8, 4, 4, 8)."""
    width = weight.shape[1]
    assert weight.dtype == torch.bfloat16 and width % 8 == 0, (weight.dtype, width)
    return arena.copy(padded_rows(weight, 16).view(-1, 4, 4, width // 8, 8).permute(0, 3, 1, 2, 4))


LANE_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)  # a step's columns, as vpunpck{l,h}wd widen them


def lane_packed(weight: torch.Tensor, arena: HugePageArena) -> torch.Tensor:
    """The bf16 weight (N, K), K a multiple of 16, in the lane-packed layout (formats.h's LANE_PACKED):
    (N/16, 16 lanes, K/16 steps, 16 columns in LANE_ORDER), with N zero-padded to a multiple of 16."""
    width = weight.shape[1]
    assert weight.dtype == torch.bfloat16 and width % 16 == 0, (weight.dtype, width)
    blocks = padded_rows(weight, 16).view(-1, 16, width // 16, 16)[:, list(LANE_ORDER)]  # (block, column, step, lane)
    return arena.copy(blocks.permute(0, 3, 2, 1))
