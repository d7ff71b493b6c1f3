"""A block's rows computed as they are read: the target's logits of a verification, a prefix at a time.

Verification reads a block's rows in order and stops at the first rejected draft (`d3d.verify`):
row i judges draft i, and no row after the first rejection is read. Where the vocabulary head is
row-exact (the row-exact kernels: a row's logits have the same bits whichever rows share the call),
the head need not run over rows nobody reads: `LazyRows` holds the rows computed so far — a prefix
— and computes further rows when one past it is read, at least doubling the prefix each time (a
fully accepted block of 16 drafts takes a few head calls, not 16). A 17-row verification whose
second draft is rejected then pays the head for its first rows only: the head is a fifth of the
weights of SmolLM2-135M and, past one row, its arithmetic grows with every row it is run over.

This module knows nothing of models: it holds a function from a range of rows to those rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch


class LazyRows:
    """Rows (length, ...) of which a prefix is computed; reading a row past it computes more.

    Indexing with an int or a slice (step 1) reads like a tensor's first dimension and returns
    tensors. `compute(begin, end)` gives rows [begin, end); `ready()` how many rows are cheap to
    have already (a mapped view's source's computed prefix), so that a first read computes them all.
    """

    def __init__(self, length: int, compute: Callable[[int, int], torch.Tensor], computed: torch.Tensor | None = None,
                 ready: Callable[[], int] = lambda: 0,
                 argmax: Callable[[int, int], torch.Tensor] | None = None,
                 argmaxes: torch.Tensor | None = None) -> None:
        assert computed is None or computed.shape[0] <= length, "more rows computed than there are"
        self.length = length
        self._compute = compute
        self._rows = computed
        self._ready = ready
        self._argmax = argmax  # rows [begin, end)'s argmax without their rows, where cheaper (see `argmaxes`)
        # the first rows' argmaxes, known already (computed with other sequences' in one call)
        self._argmaxes = argmaxes if argmaxes is not None else torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.length

    @property
    def num_computed(self) -> int:
        return 0 if self._rows is None else self._rows.shape[0]

    def _extend(self, stop: int) -> None:
        have = self.num_computed
        if stop <= have:
            return
        end = min(self.length, max(stop, 2 * have, self._ready()))
        rows = self._compute(have, end)
        assert rows.shape[0] == end - have, f"computed {rows.shape[0]} rows for [{have}, {end})"
        self._rows = rows if self._rows is None else torch.cat([self._rows, rows])

    def __getitem__(self, index: int | slice) -> torch.Tensor:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                raise IndexError("LazyRows reads slices of step 1")
            self._extend(stop)
            return self._rows[start:stop] if self._rows is not None else self._compute(0, 0)
        i = operator.index(index)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"row {index} of {self.length}")
        self._extend(i + 1)
        return self._rows[i]

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> LazyRows:
        """Rows of `function` applied to these rows, computed as they are read, over whole computed
        prefixes of these (`function` must treat each row on its own: argmax, probabilities)."""
        return LazyRows(self.length, lambda begin, end: function(self[begin:end]), ready=lambda: self.num_computed)

    def argmaxes(self, argmax: Callable[[torch.Tensor], torch.Tensor]) -> LazyRows:
        """Each row's `argmax` (a function of rows, e.g. `greedy_ids`), as read: those known already,
        then from the computed rows where they are, past them from this object's own `argmax` of a
        range of rows where it has one (a certified greedy head, `d3d.models.Decoder.greedy_ids`: the
        same ids without the rows; each call reads the whole approximate head, so a range is one
        call, at least doubling as rows are) — the rows are then never computed."""
        if self._argmax is None:
            return self.map(argmax)
        known = self._argmaxes

        def ids(begin: int, end: int) -> torch.Tensor:
            pieces, start = [known[begin:end]], max(begin, len(known))
            have = min(self.num_computed, end)
            if start < have:
                pieces.append(argmax(self._rows[start:have]))
                start = have
            if start < end:
                pieces.append(self._argmax(start, end))
            return torch.cat(pieces)

        return LazyRows(self.length, ids, ready=lambda: max(self.num_computed, len(known)))


def argmax_rows(rows: torch.Tensor | LazyRows, argmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | LazyRows:
    """`each_row(rows, argmax)`, through `LazyRows.argmaxes` for rows computed as read."""
    return rows.argmaxes(argmax) if isinstance(rows, LazyRows) else argmax(rows)


def each_row(rows: torch.Tensor | LazyRows, function: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | LazyRows:
    """`function` over the rows, at once for a tensor, as read for `LazyRows`."""
    return rows.map(function) if isinstance(rows, LazyRows) else function(rows)
