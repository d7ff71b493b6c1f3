"""The decoder's arithmetic: row-exact C kernels for inference, PyTorch ops for training.

Two implementations of one small interface — `linear`, `attention`, `rms_norm`, `silu_mul`,
`rope_store` — and, in the row-exact kernels only, `forward`: a whole cached decoder forward in one
C call (each stage the body of the per-op kernel, so the same bits), over a `LayerTable` of the
layers' weight pointers:

- `RowExactKernels` (CPU inference): `rowexact.c`, compiled once per machine with the local C
  compiler and cached under `$D3D_CACHE/kernels`. A row's result is a fixed sequence of IEEE
  operations whatever the number of rows in the call (see the C file), so a k-token verification
  is bit-identical to k one-token steps by construction, on any CPU. They have no backward.
- `TorchKernels` (training, CUDA, and where no C compiler exists): PyTorch's own ops, differentiable;
  their rounding may change with the row count, so exactness then rests on the self-check in
  `d3d.exactness`.

This module computes; it is handed the layers as a table of weights and knows nothing of tokens.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from d3d.cache import KVCache

SOURCE = Path(__file__).with_name("rowexact.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    """The row-exact kernels could not be compiled or loaded on this machine."""


class TorchKernels:
    """PyTorch's ops: differentiable, any device; rounding may depend on the row count."""

    name = "torch"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) @ weight (N, K)ᵀ + bias, then + residual (..., N) when given."""
        out = F.linear(x, weight, bias)
        return out if residual is None else residual + out

    @staticmethod
    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   cache: KVCache | None, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split qkv (B, T, (H + 2 H_kv) D), rotate q and k, store k and v in the cache.

        Returns q (B, T, H, D) and the keys/values attention reads, (B, H_kv, S, D): every cached
        slot plus the new ones (only the new ones without a cache). cos, sin: (B, T, 1, D).
        """
        batch, length, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = rotate(q.reshape(batch, length, heads, dim), cos, sin)
        k = rotate(k.reshape(batch, length, kv_heads, dim), cos, sin).transpose(1, 2)
        v = v.reshape(batch, length, kv_heads, dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.write(layer, k, v)
        return q, k, v

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, T, H, D) over k/v (B, H_kv, S, D) → (B, T, H, D); mask (B, T, S), None = causal."""
        length, keys = q.shape[1], k.shape[2]
        if mask is None:
            rows = torch.arange(length, device=q.device)[:, None] + (keys - length)
            mask = (torch.arange(keys, device=q.device)[None] <= rows)[None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=q.shape[2] != k.shape[1])
        return out.transpose(1, 2)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, T, H, D): x·cos + rotate_half(x)·sin, each product rounded to x's dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class RowExactKernels:
    """The compiled row-exact kernels, over CPU tensors in bf16 or fp32 (no autograd)."""

    name = "row-exact"

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.library, self.path = library, path
        i64, f32, ptr, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
        for suffix in ("bf16", "f32"):
            getattr(library, f"d3d_linear_{suffix}").argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
            packed = getattr(library, f"d3d_linear_packed_{suffix}", None)
            if packed is not None:
                packed.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
            getattr(library, f"d3d_rope_store_{suffix}").argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,
                                                                      i64, i64, i64, i64, i64]
            getattr(library, f"d3d_attention_{suffix}").argtypes = [
                ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, f32, ptr, i32]
            getattr(library, f"d3d_rms_norm_{suffix}").argtypes = [ptr, ptr, ptr, i64, i64, f32, i32]
            getattr(library, f"d3d_silu_mul_{suffix}").argtypes = [ptr, ptr, i64, i64, i32]
            getattr(library, f"d3d_forward_{suffix}").argtypes = [
                ptr, i64, i64, i64, i64, i64, i64, f32, f32, i32, ptr, ptr, ptr, i64,
                ptr, ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i32]
        library.d3d_packed_linear.argtypes = [i32]
        self._functions: dict[tuple[str, torch.dtype], Any] = {}  # (kind, dtype) → C function
        self.packs = {dtype: bool(library.d3d_packed_linear(dtype == torch.bfloat16))
                      for dtype in (torch.bfloat16, torch.float32)}
        # id(weight) → (weakref to it, its version when packed, the packed copy); an entry goes when
        # its weight does, and is repacked after an in-place update of the weight
        self._packed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        self.arena = HugePageArena()
        library.d3d_kernel_path.restype = ctypes.c_char_p
        self.path_name = library.d3d_kernel_path().decode()

    # Stage names of the fused forward's profile (the STAGE_ enum in rowexact.c).
    STAGES = ("norm", "qkv", "rope_store", "attention", "o", "gate_up", "silu_mul", "down")

    def stage_seconds(self, reset: bool = False) -> dict[str, float]:
        """Seconds the fused forward spent per stage so far (zeros unless built with `profile`)."""
        table = (ctypes.c_double * len(self.STAGES)).in_dll(self.library, "d3d_stage_seconds")
        spent = dict(zip(self.STAGES, table))
        if reset:
            ctypes.memset(table, 0, ctypes.sizeof(table))
        return spent

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

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight (N, K) in the layout of the packed kernel (None where this build has none):
        16 output columns per 64-byte step — fp32 (N/16, K, 16), bf16 (N/16, K/2, 16, 2) — with N
        zero-padded to a multiple of 64."""
        if not self.packs[weight.dtype] or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2):
            return None
        key = id(weight)
        entry = self._packed.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        rows, width = weight.shape
        padded = torch.zeros(-(-rows // 64) * 64, width, dtype=weight.dtype)  # whole 4-group tiles
        padded[:rows] = weight.detach()
        pair = 2 if weight.dtype == torch.bfloat16 else 1
        layout = padded.view(-1, 16, width // pair, pair).transpose(1, 2)
        packed = self.arena.empty(layout.shape, weight.dtype).copy_(layout)
        self._packed[key] = (weakref.ref(weight, lambda _, key=key: self._packed.pop(key, None)),
                             weight._version, packed)
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        *lead, width = x.shape
        x2 = x.reshape(-1, width)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        assert weight.is_contiguous() and weight.shape[1] == width and weight.dtype == x.dtype
        out = torch.empty(*lead, weight.shape[0], dtype=x.dtype)
        # A weight always takes the same kernel whatever the row count: that is the invariant.
        packed = self.packed(weight)
        kernel = self._fn("linear", x.dtype) if packed is None else self._fn("linear_packed", x.dtype)
        if residual is not None:
            residual = residual.contiguous()
            assert residual.shape == out.shape and residual.dtype == out.dtype
        kernel(x2.data_ptr(), x2.stride(0), (weight if packed is None else packed).data_ptr(), _ptr(bias),
               _ptr(residual), out.data_ptr(), x2.shape[0], weight.shape[0], width, torch.get_num_threads())
        return out

    def forward(self, table: "LayerTable", shape: "DecoderShape", x: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                final_norm: torch.Tensor, capture: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer and the final norm over x (B, T, hidden) in one C call; returns the normed hidden
        states and, for each layer index in `capture` (ascending), the residual stream after that layer.
        The same kernels as the per-op calls, so the same bits (tested); capturing splits the call at
        the captured layers and changes no bit either.

        rope: (2, P, D) cos/sin tables in x's dtype; positions (B, T) rows of them, below P; the
        new keys and values go to the cache's reserved slots.
        """
        batch, length, hidden = x.shape
        assert cache.pending == length, "forward() must follow reserve() with the same token count"
        keys, values = cache.keys, cache.values  # (L, B, H_kv, capacity, D)
        assert keys.is_contiguous() and values.is_contiguous() and keys.dtype == x.dtype
        keys_seen = cache.length + length
        x = x.contiguous().clone()  # the residual stream, updated in place by the kernel
        positions = positions.contiguous()
        if mask is not None:
            mask = mask.to(torch.uint8).contiguous()
            assert mask.shape == (batch, length, keys_seen), f"mask {tuple(mask.shape)}"
        rows, heads, dim = batch * length, shape.heads, shape.head_dim
        width = (heads + 2 * shape.kv_heads) * dim
        work = torch.empty(rows * (hidden + width + 2 * heads * dim + 3 * shape.intermediate), dtype=x.dtype)
        scores = torch.empty(rows * heads * keys_seen, dtype=torch.float32)
        out = torch.empty_like(x)
        slot_bytes = len(LAYER_SLOTS) * ctypes.sizeof(ctypes.c_void_p)
        captured, first = [], 0
        for last in [*capture, table.layers - 1]:  # layers first … last in one call
            if last < first:  # the last layer was captured: nothing left to run
                continue
            self._fn("forward", x.dtype)(
                ctypes.addressof(table.pointers) + first * slot_bytes, last + 1 - first, hidden, heads,
                shape.kv_heads, dim, shape.intermediate, shape.eps, dim ** -0.5, table.packed, x.data_ptr(),
                rope.data_ptr(), positions.data_ptr(), rope.shape[1], keys[first].data_ptr(),
                values[first].data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2), cache.length, _ptr(mask),
                batch, length, final_norm.data_ptr(), out.data_ptr(), work.data_ptr(), scores.data_ptr(),
                torch.get_num_threads())
            if last in capture:
                captured.append(x.clone())
            first = last + 1
        return out, captured

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   cache: KVCache | None, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`TorchKernels.rope_store` in one call, the same bits (IEEE products and sums, rounded alike)."""
        if cache is None:
            return TorchKernels.rope_store(qkv, cos, sin, heads, kv_heads, cache, layer)
        batch, length, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        assert cache.pending == length, "rope_store() must follow reserve() with the same token count"
        keys, values = cache.keys[layer], cache.values[layer]  # (B, H_kv, capacity, D), contiguous
        qkv = qkv.contiguous()
        q = torch.empty(batch, length, heads, dim, dtype=qkv.dtype)
        cos, sin = cos.reshape(batch * length, dim).contiguous(), sin.reshape(batch * length, dim).contiguous()
        self._fn("rope_store", qkv.dtype)(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                          keys.data_ptr(), values.data_ptr(), batch, length, heads, kv_heads, dim,
                                          cache.length, keys.stride(0), keys.stride(1))
        end = cache.length + length
        return q, keys[:, :, :end], values[:, :, :end]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, T, H, D) over k/v (B, H_kv, S, D) → (B, T, H, D); mask (B, T, S), None = causal."""
        batch, length, heads, dim = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        if k.stride(-1) != 1 or k.stride(-2) != dim or k.stride() != v.stride():  # a cache slice passes as is
            k, v = k.contiguous(), v.contiguous()
        assert dim <= 512, "head_dim above 512"
        q = q.contiguous()
        if mask is not None:
            mask = mask.to(torch.uint8).contiguous()
            assert mask.shape == (batch, length, keys), f"mask {tuple(mask.shape)}"
        out = torch.empty_like(q)
        threads = torch.get_num_threads()
        scratch = torch.empty(batch * length * heads * keys, dtype=torch.float32)
        self._fn("attention", q.dtype)(q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(mask), out.data_ptr(),
                                       batch, length, heads, kv_heads, keys, dim, k.stride(0), k.stride(1),
                                       dim ** -0.5, scratch.data_ptr(), threads)
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

    @staticmethod
    def _map(size: int) -> torch.Tensor:
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not hasattr(mmap, "MAP_ANONYMOUS"):
            return torch.empty(shape, dtype=dtype)
        size = math.prod(shape) * dtype.itemsize
        with self._lock:
            if size > self.CHUNK:
                block = self._map(size)
            else:
                if self._chunk is None or self._used + size > self.CHUNK:
                    self._chunk, self._used = self._map(self.CHUNK), 0
                block = self._chunk[self._used:self._used + size]
                self._used += -(-size // self.ALIGN) * self.ALIGN
        return block.view(dtype).view(shape)


@dataclass(frozen=True)
class DecoderShape:
    """The sizes `RowExactKernels.forward` needs besides the weights."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


# A layer's tensors in the order of the C forward's table (LAYER_SLOTS in rowexact.c); None where
# the architecture has no such tensor. The linear weights are the ones the kernel may repack.
LAYER_SLOTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm",
               "gate_up", "gate_up_bias", "down", "down_bias")
LINEAR_SLOTS = {LAYER_SLOTS.index(name) for name in ("qkv", "o", "gate_up", "down")}


class LayerTable:
    """The C forward's pointers to every layer's weights, with the packed copies they point to.

    Built once and reused while `current()` holds: the same tensors, unchanged in place (their
    version counters) and not moved (their data pointers).
    """

    def __init__(self, tensors: list[torch.Tensor], keep: list[torch.Tensor], pointers: list[int | None],
                 layers: int, packed: bool) -> None:
        self.tensors, self.keep, self.layers, self.packed = tensors, keep, layers, int(packed)
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        self.stamp = self._stamp()

    def _stamp(self) -> list[tuple[int, int]]:
        return [(t._version, t.data_ptr()) for t in self.tensors]

    def current(self) -> bool:
        return self._stamp() == self.stamp

    @classmethod
    def build(cls, kernels: "RowExactKernels", layers: list[tuple[torch.Tensor | None, ...]]) -> "LayerTable | None":
        """The table for these layers (one tuple of LAYER_SLOTS tensors each), or None where this
        build cannot run them in one call."""
        tensors, keep, pointers, packed_flags = [], [], [], set()
        for row in layers:
            assert len(row) == len(LAYER_SLOTS)
            for slot, tensor in enumerate(row):
                if tensor is None:
                    pointers.append(None)
                    continue
                if not tensor.is_contiguous():
                    return None
                tensors.append(tensor)
                if slot in LINEAR_SLOTS:
                    packed = kernels.packed(tensor)
                    packed_flags.add(packed is not None)
                    tensor = tensor if packed is None else packed
                keep.append(tensor)
                pointers.append(tensor.data_ptr())
        if len(packed_flags) > 1:  # a mixed layout (an odd bf16 width): per-op calls instead
            return None
        return cls(tensors, keep, pointers, len(layers), packed_flags == {True})


def _cache_dir() -> Path:
    return Path(os.environ.get("D3D_CACHE", Path.home() / ".cache" / "d3d")) / "kernels"


def cpu_flags_line() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C compiler found (set CC, or install gcc) to build the row-exact kernels")


def build(verbose: bool = False, profile: bool = False) -> Path:
    """Compile rowexact.c for this machine (once; cached by source, compiler and CPU flags).

    `profile` builds the variant whose fused forward times its stages (`stage_seconds`).
    """
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    flags = FLAGS + ["-DD3D_PROFILE"] * profile
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, cpu_flags_line(), " ".join(flags)]).encode())
    target = _cache_dir() / f"rowexact-{key.hexdigest()[:16]}{'-profile' * profile}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed to build the row-exact kernels:\n{result.stderr.strip()}")
        if verbose:
            print(f"d3d: built row-exact kernels {target}", file=sys.stderr)
        os.replace(built, target)  # atomic: a half-written library is never loaded
    return target


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
