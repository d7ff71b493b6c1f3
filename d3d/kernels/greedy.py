"""The certified greedy head: each row's argmax of the vocabulary head's logits, computing the exact
logits of only the few vocabulary rows that can hold it (greedy.h).

Greedy decoding reads nothing of a row's logits but their argmax. `greedy.h` bounds every logit
from an approximate head (the weights' 8-bit codes per block with each block's largest error, the
hidden state's 16-bit codes, exact integer sums) and keeps the vocabulary rows whose bound reaches
the best one's; their exact logits come from the head's own stream, through the same linear
kernel over a run of 4 of its rows (a quantized stream holds each row's blocks in place, so a run
is a pointer into it) — or, where the head has a grouped copy (G8, AVX-512 BF16), over the
candidate's 16-column group of it, as the full head's one-row call reads it — and the first of the
largest is the argmax — the index `greedy_ids` takes from the full logits, ties included. The bound
is checked on random rows against the full head when a head is prepared (`check`), and the path is
used for the row counts where it is faster than the exact head on the running machine
(`GreedyHead.rows`, `faster_rows`: over SmolLM2-135M's Q8_0 head, one row 1.0 ms against 1.6 on an
AMD EPYC Zen 3; on a Zen 4, whose pass takes 16 vocabulary rows in a vector's lanes, whole greedy
steps 0.95 / 0.92 / 0.93 / 0.95 of the full head's at 1 / 2 / 3 / 4 rows). `GreedyHeads` holds a
kernels object's heads, one per head weight, and says where the path is on (`GreedyHeads.on`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from d3d.kernels.packing import BLOCK, WEIGHT_FORMATS, HugePageArena, StreamPart
from d3d.sampling import greedy_ids

SWEEP_BYTES = 64 << 20  # what `faster_rows` reads between calls: more than the last-level caches hold
CAP = 64  # candidates a row may have before it takes the exact head instead (SmolLM2-135M: 9 at most; greedy.h's GREEDY_CAP)
ROWS = 4  # rows of hidden state one pass over the codes takes (greedy.h's GREEDY_ROWS)


@dataclass
class GreedyHead:
    """One head weight (V, K) prepared for `greedy.h`: its codes, block scales and block errors, each
    vocabulary row's largest error and scale, and the stream part whose runs of rows give the exact
    logits. Where the build takes 16 vocabulary rows in a vector's lanes (AVX-512 VNNI; `lanes` 16),
    the codes (padded to a multiple of 16 rows) are in that pass's layout and `lane_scale` holds the
    scales beside them; elsewhere the codes are (V, K) and `lane_scale` is empty."""

    codes: torch.Tensor  # (V padded to lanes, K) int8: row by row, or (groups, blocks, 8, 16 rows, 4 k) of code + 128
    scale: torch.Tensor  # (V, K / 32) fp32
    error: torch.Tensor  # (V, K / 32) fp32, >= |w - scale · code| over each block
    limits: torch.Tensor  # (V padded, 2) fp32: each row's largest error and largest scale (0 past V)
    lane_scale: torch.Tensor  # (V padded, K / 32) fp32 as (groups, blocks, 16 rows) where lanes is 16; else empty
    part: StreamPart
    grouped: StreamPart | None = None  # the kernels' grouped copy of the head (G8), whose groups give the exact logits
    rows: frozenset[int] = frozenset(range(1, ROWS + 1))  # the row counts it takes (set by `faster_rows`)

    @classmethod
    def of(cls, weight: torch.Tensor, part: StreamPart, library: ctypes.CDLL, arena: HugePageArena | None = None) -> "GreedyHead":
        """The codes of `weight`'s exact values (bf16), made by `greedy.h` (d3d_greedy_weights): any code
        per weight will do — each block's error is measured afterwards, exactly, and rounded up to
        fp32; in `arena`'s huge pages where given, as the streams (32 MB read per call on SmolLM2-135M)."""
        vocab, width = weight.shape
        lanes = library.d3d_greedy_lanes()
        padded, blocks = padded_rows(vocab, lanes), width // BLOCK
        empty = arena.empty if arena is not None else lambda shape, dtype: torch.empty(shape, dtype=dtype)
        codes, scale, error = empty((padded, width), torch.int8), empty((vocab, blocks), torch.float32), \
            empty((vocab, blocks), torch.float32)
        limits = empty((padded, 2), torch.float32)
        lane_scale = empty((padded, blocks) if lanes > 1 else (0, blocks), torch.float32)
        values = weight.detach().contiguous()
        library.d3d_greedy_weights(values.data_ptr(), vocab, width, codes.data_ptr(), scale.data_ptr(),
                                   error.data_ptr(), limits.data_ptr(), lane_scale.data_ptr(), torch.get_num_threads())
        return cls(codes, scale, error, limits, lane_scale, part)

    @staticmethod
    def bytes_of(vocab: int, width: int, lanes: int) -> int:
        """The arena bytes `of` takes for a (vocab, width) head on a build of `lanes` (d3d_greedy_lanes):
        the codes, scales, errors, limits and lane scales."""
        padded, blocks = padded_rows(vocab, lanes), width // BLOCK
        return padded * width + 2 * vocab * blocks * 4 + padded * 2 * 4 + (padded * blocks * 4 if lanes > 1 else 0)

    def bytes_read(self) -> int:
        """The bytes one call reads of its tables: the codes, the pass's scales and the limits (the
        errors, and on lanes builds the row-layout scales, of a few rows)."""
        pass_scales = self.lane_scale if self.lane_scale.numel() else self.scale
        return sum(t.numel() * t.element_size() for t in (self.codes, pass_scales, self.limits))

    def _tables(self) -> tuple[int, int, int, int, int, int]:
        return (self.codes.data_ptr(), self.scale.data_ptr(), self.error.data_ptr(), self.limits.data_ptr(),
                self.lane_scale.data_ptr(), self.scale.shape[0])

    def candidates(self, library: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, CAP) candidate vocabulary rows and their counts (M,) for x (M, K) fp32; a count of -1:
        the row takes the exact head."""
        rows, width = x.shape
        found = torch.empty(rows, CAP, dtype=torch.int64)
        counts = torch.empty(rows, dtype=torch.int64)
        library.d3d_greedy_candidates(x.data_ptr(), rows, width, *self._tables(), CAP, found.data_ptr(),
                                      counts.data_ptr(), torch.get_num_threads())
        return found, counts

    def ids(self, library: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Each row's argmax (M,) for x (M, K) bf16, contiguous, from its candidates' exact logits —
        each run of 4 of the head's rows through the linear kernel over one row, in one thread (a
        run is too little work to share; threads never change a result) — or -1 where the row takes
        the exact head; and how many rows do."""
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        grouped = self.grouped
        left = library.d3d_greedy_ids(x.data_ptr(), x.shape[0], x.shape[1], *self._tables(), self.part.data.data_ptr(),
                                      WEIGHT_FORMATS[self.part.format], grouped.data.data_ptr() if grouped else None,
                                      WEIGHT_FORMATS[grouped.format] if grouped else 0, ids.data_ptr(),
                                      torch.get_num_threads())
        return ids, left


def padded_rows(vocab: int, lanes: int) -> int:
    """The vocabulary rows a head's codes and limits hold: `vocab` to a multiple of the pass's lanes."""
    return -(-vocab // lanes) * lanes


def supports(part: StreamPart, weight: torch.Tensor) -> bool:
    """Whether a head's stream part can give runs of its rows: quantized, one part for the whole bf16 weight."""
    return part.quantized and weight.dtype == torch.bfloat16 and part.rows == weight.shape[0] and \
        weight.shape[1] % BLOCK == 0


class GreedyHeads:
    """A kernels object's greedy heads, one per head weight, prepared at its first use and again after
    the weight or any stream changes. On by default but where the AMX tiles are (D3D_GREEDY_HEAD=1
    turns it on there too, 0 off everywhere); used for the row counts where it was faster on this
    machine when prepared (`faster_rows`). AMD EPYC Zen 3 (AVX2): one row 1.0 against 1.6 ms. Zen 4
    (AVX-512 VNNI: 16 vocabulary rows in a vector's lanes, the candidates' logits from the head's
    grouped copy): every row count 1-4."""

    def __init__(self, kernels: Any) -> None:  # the RowExactKernels that holds it (binding imports this module)
        self.kernels = kernels
        wanted = os.environ.get("D3D_GREEDY_HEAD", "")
        current = hasattr(kernels.library, "d3d_greedy_lanes")  # (an older build's tables differ: off)
        self.on = current and (wanted == "1" or wanted != "0" and not kernels.path_name.startswith("amx"))
        self.lanes = kernels.library.d3d_greedy_lanes() if current else 1  # vocabulary rows in a pass's lanes
        # id(weight) → (weakref, (its version, the kernels' stream epoch), its head or None where the
        # path does not apply or lost its check)
        self._heads: dict[int, tuple[weakref.ref, tuple[int, int], GreedyHead | None]] = {}

    def ids(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax (M,) of `linear(x, weight, None)`'s logits — `greedy_ids`'s index, ties
        included — for x (M, K); None where the path is off, or not used for this weight or this many
        rows (the caller then takes the argmax of the full logits: the same ids)."""
        head = self.head(weight)
        if head is None or x.shape[0] not in head.rows or x.dtype != weight.dtype:
            return None
        return self.certified_ids(head, x, weight)

    def head(self, weight: torch.Tensor) -> GreedyHead | None:
        """`weight`'s greedy head, prepared once (checked against the full head and timed against it on
        this machine; kept at 0 rows when not faster), or None where the path is off, or the weight's
        stream gives no runs of rows, or the check failed."""
        if not self.on:
            return None
        kernels, key = self.kernels, id(weight)
        entry = self._heads.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == (weight._version, kernels.epoch):
            return entry[2]
        head, stream = None, kernels.stream(weight)
        if len(stream.parts) == 1 and supports(stream.parts[0], weight):
            head = GreedyHead.of(weight, stream.parts[0], kernels.library, kernels.arena)
            one_row = kernels.one_row_stream(weight)  # the grouped copy where the path has one
            head.grouped = one_row.parts[0] if one_row.format == "g8" else None
            width = weight.shape[1]
            certified = lambda x: self.certified_ids(head, x, weight)  # noqa: E731
            full = lambda x: self.full_ids(x, weight)  # noqa: E731
            if check(certified, full, width):
                head.rows = faster_rows(certified, full, width)
            else:
                print("d3d: the greedy head's argmax differs from the full head's on this machine; "
                      "the full head instead", file=sys.stderr)
                head = None
        self._heads[key] = (weakref.ref(weight, lambda _, key=key: self._heads.pop(key, None)),
                            (weight._version, kernels.epoch), head)
        return head

    def full_ids(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The argmax of the full head's logits: what the certified head must give."""
        return greedy_ids(self.kernels.linear(x, weight, None))

    def certified_ids(self, head: GreedyHead, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (M,) over x (M, K) bf16 from its candidates' exact logits (`GreedyHead.ids`),
        or from the full head for rows with too many."""
        ids, left = head.ids(self.kernels.library, x.contiguous())
        if left:
            fallback = (ids < 0).nonzero().flatten()
            ids[fallback] = self.full_ids(x[fallback], weight)
        return ids


def check(ids_of: Callable[[torch.Tensor], torch.Tensor], full_ids: Callable[[torch.Tensor], torch.Tensor],
          width: int) -> bool:
    """Whether the certified argmax equals the full head's on random rows (a few scales, and a row of
    zeros — every logit tied), on this machine."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, width, generator=generator) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [30.0], [1.0]])
    rows[5] = 0.0
    x = rows.to(torch.bfloat16)
    return torch.equal(ids_of(x), full_ids(x))


def faster_rows(ids_of: Callable[[torch.Tensor], torch.Tensor], full_ids: Callable[[torch.Tensor], torch.Tensor],
                width: int, repeats: int = 5) -> frozenset[int]:
    """The row counts (1 … ROWS) for which the certified head beat the exact one (≤ 0.95 of its time,
    the best of `repeats` alternated calls each), on this machine now — each call after a sweep of
    more memory than a CPU caches, as a decoding step's head comes after its layers' weights."""
    x = (torch.randn(ROWS, width, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    sweep = torch.zeros(SWEEP_BYTES // 4, dtype=torch.int32)
    faster = set()
    for rows in range(1, ROWS + 1):
        times: dict[Any, float] = {ids_of: float("inf"), full_ids: float("inf")}
        for _ in range(repeats):
            for fn in (ids_of, full_ids):
                sweep.add_(1)
                started = time.perf_counter()
                fn(x[:rows])
                times[fn] = min(times[fn], time.perf_counter() - started)
        if times[ids_of] <= 0.95 * times[full_ids]:
            faster.add(rows)
    return frozenset(faster)
