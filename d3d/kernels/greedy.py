"""The certified greedy head: each row's argmax of the vocabulary head's logits, computing the exact
logits of only the few vocabulary rows that can hold it (greedy.h).

Greedy decoding reads nothing of a row's logits but their argmax. `greedy.h` bounds every logit
from an approximate head (the weights' 8-bit codes per block with each block's largest error, the
hidden state's 16-bit codes, exact integer sums) and keeps the vocabulary rows whose bound reaches
the best one's; their exact logits come from the head's own stream, through the same linear
kernel over a run of 4 of its rows (a quantized stream holds each row's blocks in place, so a run
is a pointer into it), and the first of the largest is the argmax — the index `greedy_ids` takes
from the full logits, ties included. The bound is checked on random rows against the full head
when a head is prepared (`GreedyHead.check`), and the path is used only where it is faster than the
exact head on the running machine (`GreedyHead.max_rows`: on an AMD EPYC Zen 3, one row 1.0 ms
against 1.6 ms over SmolLM2-135M's Q8_0 head).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from d3d.kernels.packing import BLOCK, BLOCK_BYTES, WEIGHT_FORMATS, StreamPart
from d3d.kernels.structs import Weight

CAP = 64  # candidates a row may have before it takes the exact head instead (SmolLM2-135M: 9 at most)
RUN = 4  # rows of a quantized stream kept together: a run of them is a pointer into it
ROWS = 4  # rows of hidden state one pass over the codes takes (greedy.h's GREEDY_ROWS)


@dataclass
class GreedyHead:
    """One head weight (V, K) prepared for `greedy.h`: its codes, block scales and block errors, and
    the stream part whose runs of rows give the exact logits."""

    codes: torch.Tensor  # (V, K) int8
    scale: torch.Tensor  # (V, K / 32) fp32
    error: torch.Tensor  # (V, K / 32) fp32, >= |w - scale · code| over each block
    part: StreamPart
    max_rows: int = ROWS  # calls of more rows take the exact head (set by `time_against`)

    @classmethod
    def of(cls, weight: torch.Tensor, part: StreamPart, chunk: int = 4096) -> "GreedyHead":
        """The codes of `weight`'s exact values (bf16): any code per weight will do — each block's
        error is measured afterwards, exactly (fp64), and rounded up to fp32 — so they are found in fp32."""
        vocab, width = weight.shape
        blocks = width // BLOCK
        codes = torch.empty(vocab, width, dtype=torch.int8)
        scale = torch.empty(vocab, blocks, dtype=torch.float32)
        error = torch.empty(vocab, blocks, dtype=torch.float32)
        for first in range(0, vocab, chunk):  # bounded temporaries
            w = weight[first:first + chunk].detach().float().view(-1, blocks, BLOCK)
            s = w.abs().amax(-1) / 127
            q = torch.round(w / torch.where(s > 0, s, torch.ones_like(s))[..., None]).clamp(-127, 127)
            exact = (w.double() - q.double() * s.double()[..., None]).abs().amax(-1)
            e = exact.float()
            e = torch.where(e.double() < exact, torch.nextafter(e, torch.full_like(e, float("inf"))), e)
            codes[first:first + chunk] = q.to(torch.int8).view(-1, width)
            scale[first:first + chunk], error[first:first + chunk] = s, e
        return cls(codes, scale, error, part)

    def candidates(self, library: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, CAP) candidate vocabulary rows and their counts (M,) for x (M, K) fp32; a count of -1:
        the row takes the exact head."""
        rows, width = x.shape
        vocab = self.codes.shape[0]
        found = torch.empty(rows, CAP, dtype=torch.int64)
        counts = torch.empty(rows, dtype=torch.int64)
        library.d3d_greedy_candidates(x.data_ptr(), rows, width, self.codes.data_ptr(), self.scale.data_ptr(),
                                      self.error.data_ptr(), vocab, CAP, found.data_ptr(), counts.data_ptr(),
                                      torch.get_num_threads())
        return found, counts

    def run_of(self, first: int, rows: int) -> Weight:
        """The descriptor of rows first … first+rows-1 of the stream part (first a multiple of RUN)."""
        part = self.part
        row_bytes = self.codes.shape[1] // BLOCK * BLOCK_BYTES[part.format]
        weight = Weight()
        weight.parts[0].data = part.data.data_ptr() + first * row_bytes
        weight.parts[0].format, weight.parts[0].rows = WEIGHT_FORMATS[part.format], rows
        return weight


def supports(part: StreamPart, weight: torch.Tensor) -> bool:
    """Whether a head's stream part can give runs of its rows: quantized, one part for the whole bf16 weight."""
    return part.quantized and weight.dtype == torch.bfloat16 and part.rows == weight.shape[0] and \
        weight.shape[1] % BLOCK == 0


def argmax_ids(head: GreedyHead, library: ctypes.CDLL, linear_run: Callable[[torch.Tensor, Weight, int], list[float]],
               full_ids: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (M,) over x (M, K) bf16: from its candidates' exact logits, or from the full
    head (`full_ids`) for rows with too many candidates. `linear_run(x_row, run, rows)`: the exact
    logits of one row over a run of the head's rows."""
    found, counts = head.candidates(library, x.float().contiguous())
    vocab = head.codes.shape[0]
    counts, ids = counts.tolist(), [0] * len(counts)
    fallback = [m for m, count in enumerate(counts) if count < 0]
    if fallback:
        for m, token in zip(fallback, full_ids(x[fallback]).tolist()):
            ids[m] = token
    for m, count in enumerate(counts):
        if count < 0:
            continue
        row = x[m:m + 1]
        best, best_value, runs = -1, 0.0, {}
        for v in found[m, :count].tolist():  # ascending: the first of equal maxima wins, as `greedy_ids`
            first = v - v % RUN
            if first not in runs:
                rows = min(RUN, vocab - first)
                runs[first] = linear_run(row, head.run_of(first, rows), rows)
            value = runs[first][v - first]
            if best < 0 or value > best_value:
                best, best_value = v, value
        ids[m] = best
    return torch.tensor(ids, dtype=torch.int64)


def check(ids_of: Callable[[torch.Tensor], torch.Tensor], full_ids: Callable[[torch.Tensor], torch.Tensor],
          width: int) -> bool:
    """Whether the certified argmax equals the full head's on random rows (a few scales, and a row of
    zeros — every logit tied), on this machine."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, width, generator=generator) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [30.0], [1.0]])
    rows[5] = 0.0
    x = rows.to(torch.bfloat16)
    return torch.equal(ids_of(x), full_ids(x))


def fastest_rows(ids_of: Callable[[torch.Tensor], torch.Tensor], full_ids: Callable[[torch.Tensor], torch.Tensor],
                 width: int, repeats: int = 5) -> int:
    """The most rows (0 … ROWS) for which the certified head beat the exact one (≤ 0.95 of its time,
    the best of `repeats` alternated calls each), on this machine now."""
    x = (torch.randn(ROWS, width, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    best = 0
    for rows in range(1, ROWS + 1):
        times: dict[Any, float] = {ids_of: float("inf"), full_ids: float("inf")}
        for _ in range(repeats):
            for fn in (ids_of, full_ids):
                started = time.perf_counter()
                fn(x[:rows])
                times[fn] = min(times[fn], time.perf_counter() - started)
        if times[ids_of] > 0.95 * times[full_ids]:
            break
        best = rows
    return best
