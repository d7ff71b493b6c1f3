"""The decoder's arithmetic: row-exact C kernels for inference, PyTorch ops for training.

Two implementations of one small interface — `linear`, `attention`, `rms_norm`, `silu_mul`,
`rope_store` — and, in the row-exact kernels only, `forward`: a whole cached decoder forward in one
C call (each stage the body of the per-op kernel, so the same bits):

- `RowExactKernels` (CPU inference; `binding`): the C kernels (`rowexact.c` and its headers),
  compiled once per machine (`build`). A row's result is a fixed sequence of IEEE operations
  whatever the number of rows in the call, so a k-token verification is bit-identical to k
  one-token steps by construction, on any CPU. Each linear weight is read as a `WeightStream`
  (`packing`): itself, a column-packed copy, or a GGUF's quantized blocks.
- `TorchKernels` (training, CUDA, and where no C compiler exists; `torch_ops`): PyTorch's own ops,
  differentiable; their rounding may change with the row count, so exactness then rests on the
  self-check in `d3d.exactness`.

This package computes; it is handed tensors and sizes and knows nothing of tokens or caches.
"""

from d3d.kernels.binding import RowExactKernels, row_exact_kernels
from d3d.kernels.build import KernelBuildError, build, cpu_flags_line
from d3d.kernels.layer_table import LayerTable
from d3d.kernels.packing import WEIGHT_FORMATS, HugePageArena, StreamPart, WeightStream
from d3d.kernels.segments import DecoderShape, Segment
from d3d.kernels.structs import LAYER_SLOTS, LINEAR_SLOTS
from d3d.kernels.torch_ops import KVSlots, TorchKernels

__all__ = ["LAYER_SLOTS", "LINEAR_SLOTS", "DecoderShape", "HugePageArena", "KVSlots", "KernelBuildError",
           "LayerTable", "RowExactKernels", "Segment", "StreamPart", "TorchKernels", "WEIGHT_FORMATS", "WeightStream", "build",
           "cpu_flags_line", "row_exact_kernels"]
