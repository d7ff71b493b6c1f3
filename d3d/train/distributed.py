"""Data-parallel training under `torchrun`: which process this is, and the few collectives training needs.

`torchrun --nproc-per-node N -m d3d.cli train …` starts N processes with RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous address in their environment; `World.from_environment` joins them
into PyTorch's own process group (`gloo` on the CPU, `nccl` on CUDA). A plain `d3d train` is a
world of one, with no process group and no collective ever called.

How the trainer stays world-size independent (`d3d.train.trainer`): every rank walks the same
global order of sequences and keeps the same counters, and takes its own slice of each global
micro-batch (`World.share`); losses are normalised by denominators summed over the ranks, so the
summed gradient is the one a single process computes over the whole micro-batch. A checkpoint
therefore means the same thing for any world size, and a run resumes on any other.

`wrap` gives the objective to PyTorch's DistributedDataParallel (each rank a whole replica, the
default) or, for drafters too large to replicate, to FSDP2's `fully_shard` (`d3d train --fsdp`:
parameters, gradients and Adam's moments sharded over the ranks); checkpoints hold whole tensors
either way (`whole`, `laid_out_like`), so a sharded run resumes unsharded and back.

What it is not: a launcher (torchrun is) or a sharding strategy of its own (DDP and FSDP are
PyTorch's).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from d3d.config import ConfigError


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0  # 0 … size − 1; rank 0 writes checkpoints, logs and curves, and evaluates
    size: int = 1  # processes training together
    local_rank: int = 0  # index on this node (the CUDA device it drives)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} of a world of {self.size} processes does not exist")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_environment(cls, device: torch.device | None = None) -> "World":
        """The world torchrun describes in the environment, its process group joined; a world of
        one (nothing joined) when WORLD_SIZE is absent or 1."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return cls()
        world = cls(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        return world

    def share(self, items: list, total: int) -> list:
        """This rank's slice of a global micro-batch of `total` items: items rank, rank + size, …
        (disjoint across ranks, together the whole)."""
        self.check_divides(total)
        return items[self.rank::self.size]

    def check_divides(self, total: int) -> None:
        """Refuse a global micro-batch of `total` sequences that the processes cannot share evenly."""
        if total % self.size:
            raise ConfigError(f"--batch-size {total} (the global micro-batch) must divide among "
                              f"{self.size} processes")

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over the ranks (in place, and returned); the values themselves alone."""
        if self.distributed:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group, once nothing refers to the trainer any more (its locals gone).
        The collection first frees a trainer that only reference cycles keep alive, so DDP's reducer
        lets go of the group and destroying it tears down gloo's worker threads now, while the
        interpreter is whole — not during interpreter shutdown, where a worker thread releasing a
        tensor asks a dying interpreter for the GIL and the process aborts ("terminate called without
        an active exception", seen once in CI)."""
        if self.distributed and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def wrap(objective: torch.nn.Module, world: World, fsdp: bool, frozen: list[torch.nn.Parameter]) -> torch.nn.Module:
    """The training objective as the world trains it: itself alone; DistributedDataParallel (each rank
    a whole replica); or with `fsdp`, FSDP2 (`fully_shard`): each decoder layer its own group, the
    rest of the drafter's own parameters in the root's, the `frozen` shared target weights left whole.
    Build the optimizer after this: FSDP replaces the parameters it shards."""
    if not world.distributed:
        return objective
    device = next(p.device for p in objective.parameters())
    if not fsdp:
        return torch.nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False)  # buffers (RoPE tables) are the same everywhere: synced once, at start
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    for layer in objective.drafter.decoder.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(objective, mesh=mesh, ignored_params=set(frozen))


def gradient_sync(module: torch.nn.Module, on: bool) -> contextlib.AbstractContextManager:
    """Within it, backward passes sum gradients over the ranks only when `on` (the last micro-batch)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if on else module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(on)
    return contextlib.nullcontext()


def is_sharded(module: torch.nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync")


def _dtensor() -> type | None:
    """DTensor, where this torch build has torch.distributed (not every platform's does)."""
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole on every rank (FSDP's shards gathered: collective, same order on every rank)."""
    dtensor = _dtensor()
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def laid_out_like(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """A whole tensor (a checkpoint's optimizer moment) in the layout of `parameter`: this rank's shard
    of it under FSDP; as it is otherwise, and for values of another shape (Adam's step)."""
    dtensor = _dtensor()
    if dtensor is not None and isinstance(parameter, dtensor) and value.shape == parameter.shape:
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements)
    return value.to(parameter.device)
