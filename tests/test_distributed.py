"""Data-parallel training (`d3d.train.distributed`, the trainer's world): two `gloo` ranks on this CPU
train as one process does with the same global batch, read disjoint data, write once, and a run
resumes on another world size; `torchrun … -m d3d.cli train` works end to end.

Why "within a tolerance" and not bit for bit: with two ranks each gradient is the sum of two partial
gradients added by the all-reduce, with one process a single backward adds the same terms in another
order; float addition is not associative, so the weights differ in their last bits and Adam carries
that on. Everything else — data, anchors, masks, denominators, schedule, counters — is the same.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from d3d.config import ConfigError
from d3d.train.distributed import World
from d3d.train.trainer import Trainer
from test_trainer import config, data_dir, tiny_train_target  # noqa: F401  (data_dir is a fixture)

TOLERANCE = dict(rtol=1e-4, atol=1e-6)
SETTINGS = dict(steps=6, batch_size=4, save_every=3, eval_every=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_until(trainer: Trainer, steps_now: int) -> None:
    """All the steps (run()), or stop after `steps_now` with a checkpoint, as a killed run leaves it."""
    if steps_now >= SETTINGS["steps"]:
        trainer.run(progress=False)
        return
    while trainer.step < steps_now:
        trainer.log({"step": trainer.step + 1, **trainer.train_step()})
    trainer.save()


def _rank(rank: int, size: int, port: int, data: str, out: str, steps_now: int, fsdp: bool,
          overrides: dict) -> None:
    """One rank: join the world from the environment torchrun would set, train until `steps_now`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = World.from_environment()
    try:  # the trainer is gone when the world closes (World.close)
        train_until(Trainer(tiny_train_target(), data, out, config(**{**SETTINGS, **overrides}), world, fsdp=fsdp),
                    steps_now)
    finally:
        world.close()


def train_on_ranks(size: int, data, out, steps_now: int = SETTINGS["steps"], fsdp: bool = False,
                   **overrides) -> None:
    mp.spawn(_rank, args=(size, free_port(), str(data), str(out), steps_now, fsdp, overrides), nprocs=size,
             join=True)


def train_alone(data, out, steps_now: int = SETTINGS["steps"], **overrides) -> None:
    train_until(Trainer(tiny_train_target(), data, out, config(**{**SETTINGS, **overrides})), steps_now)


def losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoint" / "drafter" / "model.safetensors"))


def assert_same_run(a, b) -> None:
    steps_a, loss_a = zip(*losses(a))
    steps_b, loss_b = zip(*losses(b))
    assert steps_a == steps_b == tuple(range(1, SETTINGS["steps"] + 1))
    torch.testing.assert_close(torch.tensor(loss_a), torch.tensor(loss_b), **TOLERANCE)
    state_a, state_b = (json.loads((out / "checkpoint" / "state.json").read_text()) for out in (a, b))
    assert {k: state_a[k] for k in ("step", "epoch", "index", "tokens_seen")} == \
           {k: state_b[k] for k in ("step", "epoch", "index", "tokens_seen")}
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], **TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def alone(data_dir, tmp_path_factory):  # noqa: F811
    """The 1-process run every distributed run is compared with."""
    out = tmp_path_factory.mktemp("alone")
    train_alone(data_dir, out)
    return out


def test_share_is_disjoint_and_whole():
    items = list(range(12))
    shares = [World(rank, 3).share(items, 12) for rank in range(3)]
    assert sorted(sum(shares, [])) == items and all(len(s) == 4 for s in shares)
    with pytest.raises(ConfigError, match="must divide among 3 processes"):
        World(0, 3).share(items[:8], 8)
    with pytest.raises(ConfigError, match="does not exist"):
        World(2, 2)


def test_gradient_accumulation_sums_once_over_the_ranks(data_dir, tmp_path):  # noqa: F811
    """Global micro-batches of 2 (one sequence a rank), 2 accumulated per step: the ranks skip the
    gradient sum on the first micro-batch (DDP's no_sync, FSDP's requires_gradient_sync) and still
    train as one process does."""
    alone_out, ddp, fsdp = tmp_path / "alone", tmp_path / "ddp", tmp_path / "fsdp"
    train_alone(data_dir, alone_out, batch_size=2, grad_accum=2)
    train_on_ranks(2, data_dir, ddp, batch_size=2, grad_accum=2)
    train_on_ranks(2, data_dir, fsdp, fsdp=True, batch_size=2, grad_accum=2)
    assert_same_run(alone_out, ddp)
    assert_same_run(alone_out, fsdp)


def test_ranks_pack_disjoint_halves_of_the_same_micro_batch(data_dir, tmp_path):  # noqa: F811
    """Each rank's batch holds its half of the global micro-batch, packed exactly as one process packs
    those sequences (same anchors and masks), and the ranks' counters move as one process's do."""
    whole = Trainer(tiny_train_target(), data_dir, tmp_path / "a", config(**SETTINGS))
    halves = [Trainer(tiny_train_target(), data_dir, tmp_path / f"r{rank}", config(**SETTINGS)) for rank in range(2)]
    for rank, trainer in enumerate(halves):
        trainer.world = World(rank, 2)  # the slicing alone: no process group needed
    for _ in range(3):
        full = whole._next_batch()
        parts = [trainer._next_batch() for trainer in halves]
        assert [part["input_ids"].shape[0] for part in parts] == [2, 2]
        assert all(t.tokens_seen == whole.tokens_seen and t.index == whole.index for t in halves)
        # rows of the full batch: sequence 0, 1, 2, 3; rank 0 packed 0 and 2, rank 1 packed 1 and 3
        for rank, part in enumerate(parts):
            for row, source in enumerate(range(rank, 4, 2)):
                for key in ("input_ids", "labels", "weights"):
                    n = part[key].shape[1]
                    assert torch.equal(part[key][row], full[key][source][:n]), key


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_train_as_one_process(data_dir, alone, tmp_path, fsdp):  # noqa: F811
    """2 gloo ranks, global batch 4 (2 each) == 1 process, batch 4: losses, counters, weights, whether
    each rank holds a replica (DDP) or a shard (FSDP); rank 0 alone wrote the log, checkpoint, drafter
    and curves, and they hold whole tensors."""
    out = tmp_path / "two"
    train_on_ranks(2, data_dir, out, fsdp=fsdp)
    assert_same_run(alone, out)
    assert (out / "drafter" / "config.json").is_file() and (out / "curves.png").is_file()
    assert len((out / "log.jsonl").read_text().splitlines()) == SETTINGS["steps"] + 1  # step 0's τ, then each step once
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "curves.png", "drafter", "log.jsonl"]


def test_a_run_resumes_on_another_world_size(data_dir, alone, tmp_path):  # noqa: F811
    """Started on 2 sharded ranks and resumed on 1, or started on 1 and resumed on 2: the same run."""
    down, up = tmp_path / "down", tmp_path / "up"
    train_on_ranks(2, data_dir, down, steps_now=3, fsdp=True)
    assert json.loads((down / "checkpoint" / "state.json").read_text())["world_size"] == 2
    train_alone(data_dir, down)
    train_alone(data_dir, up, steps_now=3)
    train_on_ranks(2, data_dir, up)
    for out in (down, up):
        kept = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
        assert [r["step"] for r in kept] == list(range(1, SETTINGS["steps"] + 1))
        steps, loss = zip(*losses(alone))
        torch.testing.assert_close(torch.tensor([r["loss"] for r in kept]), torch.tensor(loss), **TOLERANCE)
        for name, value in weights(alone).items():
            torch.testing.assert_close(weights(out)[name], value, **TOLERANCE, msg=name)


def test_torchrun_trains_through_the_cli(data_dir, tmp_path):  # noqa: F811
    """`torchrun --nproc-per-node 2 -m d3d.cli train --target FOLDER …`: exit 0, one JSON result line
    (rank 0's), the drafter written; a global batch the ranks cannot share exits 2 with the reason."""
    from d3d.export import export_target
    from test_export import hf_target

    target = hf_target()
    folder = export_target(target, tmp_path / "target")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "d3d.cli", "train", "--data", str(data_dir), "--target",
            str(folder), "--out", str(tmp_path / "run"), "--layers", "0", "--block-size", "4", "--steps", "2",
            "--batch-size", "2", "--anchors", "2", "--max-length", "64", "--warmup", "1", "--eval-every", "0",
            "--save-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 2
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    sharded = subprocess.run(argv + ["--fsdp", "--out", str(tmp_path / "sharded")], capture_output=True, text=True,
                             env=env, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert (tmp_path / "sharded" / "drafter" / "model.safetensors").is_file()
    odd = subprocess.run(argv[:argv.index("--batch-size") + 1] + ["3"] + argv[argv.index("--batch-size") + 2:]
                         + ["--out", str(tmp_path / "odd")], capture_output=True, text=True, env=env, timeout=300)
    # each rank exits 2 with d3d's own message (torchrun then reports the failed ranks its own way)
    assert odd.returncode != 0 and "d3d: error: --batch-size 3" in odd.stderr and "must divide among 2" in odd.stderr
