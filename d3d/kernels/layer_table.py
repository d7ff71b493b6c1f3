"""The C forward's table of a decoder's layers (rowexact.c's d3d_layer array): every layer's named
tensors, each linear weight as the descriptor of the stream the kernels read for it
(`kernels._weight` of the `RowExactKernels` it is built for). Built once per decoder and reused while
it is current."""

from __future__ import annotations

from typing import Any

import torch

from d3d.kernels.structs import LAYER_SLOTS, LINEAR_SLOTS, Layer


class LayerTable:
    """The C forward's table of every layer's tensors, with the streams its linears read.

    Built once and reused while `current()` holds: the same tensors, unchanged in place (their
    version counters), not moved (their data pointers), and no stream given since (`epoch`).
    """

    def __init__(self, kernels: Any, layers: list[dict[str, torch.Tensor | None]]) -> None:
        self.kernels, self.layers = kernels, len(layers)
        self.structs = (Layer * len(layers))()
        self.tensors: list[torch.Tensor] = []
        self.keep: list[Any] = []  # what the pointers point into
        for struct, row in zip(self.structs, layers):
            assert set(row) == set(LAYER_SLOTS), sorted(set(row) ^ set(LAYER_SLOTS))
            for slot, tensor in row.items():
                if tensor is None:
                    continue
                assert tensor.is_contiguous(), slot
                self.tensors.append(tensor)
                if slot in LINEAR_SLOTS:
                    descriptor, stream = kernels._weight(tensor)
                    self.keep.append(stream)
                    setattr(struct, slot, descriptor)
                else:
                    setattr(struct, slot, tensor.data_ptr())
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[int, list[tuple[int, int]]]:
        return self.kernels.epoch, [(t._version, t.data_ptr()) for t in self.tensors]

    def current(self) -> bool:
        return self._stamp() == self.stamp
