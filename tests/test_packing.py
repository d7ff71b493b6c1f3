"""The kernels' arena: memory reserved ahead of the copies, faulted in on a thread of its own, never
written by that thread; and the kernels' count of the bytes those copies take."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import pytest
import torch

from d3d.kernels import row_exact_kernels
from d3d.kernels.packing import HugePageArena

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_ANONYMOUS"),
                                reason="the arena maps anonymous memory on Linux")


def populated(tensor: torch.Tensor) -> float:
    """The share of the tensor's pages resident in memory (mincore)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / pages


def wait_for_populating() -> None:
    for thread in threading.enumerate():
        if thread.name == "d3d-populate":
            thread.join(timeout=60)


def test_reserved_memory_is_faulted_in_and_holds_the_next_copies():
    arena = HugePageArena()
    arena.reserve(48 << 20)
    reserved = arena._chunk
    values = [torch.randn(1 << 20), torch.arange(3 << 20, dtype=torch.int32), torch.randn(5, 7).to(torch.bfloat16)]
    copies = [arena.copy(value) for value in values]  # written while the pages may still be faulting in
    wait_for_populating()
    assert populated(reserved) == 1.0
    first, last = reserved.data_ptr(), reserved.data_ptr() + reserved.numel()
    for value, copy in zip(values, copies):
        assert first <= copy.data_ptr() < last  # from the reserve, not a chunk of its own
        assert torch.equal(copy, value)  # faulting in wrote nothing over them
    beyond = arena.copy(torch.ones(48 << 18))  # past the reserve's end: a mapping of its own, as before
    assert not first <= beyond.data_ptr() < last and bool((beyond == 1).all())
    assert torch.equal(copies[0], values[0])


def test_without_a_reserve_pages_fault_in_as_written():
    arena = HugePageArena()
    fresh = arena.empty((4 << 20,), torch.uint8)
    assert populated(fresh) < 0.5
    fresh.fill_(7)
    assert populated(fresh) == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_copied_bytes_are_those_the_kernels_copy(dtype):
    kernels = row_exact_kernels()
    shapes = [(50, 64), (16, 32), (3, 48), (64, 576)]
    weights = [torch.randn(shape).to(dtype) for shape in shapes]
    made = 0
    for weight in weights:
        stream = kernels.stream(weight)
        if stream.parts[0].data is not weight:  # a copy, not the weight itself
            made += stream.parts[0].data.numel() * stream.parts[0].data.element_size()
    assert kernels.copied_bytes(shapes, dtype) == made
