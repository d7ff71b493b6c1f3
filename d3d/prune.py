"""Acceptance-driven progressive layer pruning of a D3D drafter.

D3D removes drafter layers one at a time, each round dropping the layer whose removal costs the
least acceptance length (the paper: 5 of 36 layers removed, over 99% of mean τ kept). τ comes from
the teacher-forced estimator (`d3d.estimate`) on target-generated calibration sequences — one
batched pass per candidate, no decoding loop. Optionally each round is healed with a short
fine-tune through the trainer, and each depth's end-to-end speed is measured, because the depth
to ship is where tokens/s peaks, not where τ does. Pruning returns new modules; the input drafter
and its checkpoint are never modified.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from d3d.config import ConfigError, GenerationConfig
from d3d.drafter import Drafter
from d3d.engine import speculative_generate
from d3d.estimate import teacher_forced_tau
from d3d.loading import Target
from d3d.models import Decoder


@dataclass
class PruneConfig:
    min_layers: int = 1  # never prune below this depth
    min_retention: float = 0.0  # stop when τ would fall below this share of the input's τ (0 = off)
    anchors: int = 8  # calibration blocks per sequence
    seed: int = 0  # calibration anchors
    heal_steps: int = 0  # fine-tune steps after each removal (needs training data; 0 = off)

    def __post_init__(self) -> None:
        if self.min_layers < 1:
            raise ConfigError("min_layers must be at least 1")
        if not 0 <= self.min_retention <= 1:
            raise ConfigError("min_retention must be in [0, 1]")


@dataclass
class PruneRound:
    layers: list[int]  # target layers the drafter still holds (its config.target_layers)
    removed: int | None  # position (in the previous round's drafter) of the layer removed; None for the input
    tau: float  # teacher-forced τ, bonus included
    retention: float  # tau ÷ the input's tau
    candidates: dict[int, float] = field(default_factory=dict)  # position → τ after removing that layer
    tokens_per_second: float | None = None  # end-to-end sync decoding, when measured


def remove_layer(drafter: Drafter, position: int, target: Decoder) -> Drafter:
    """A new drafter without its `position`-th layer (the input is untouched)."""
    layers = drafter.config.target_layers or list(range(drafter.config.model.num_layers))
    if not 0 <= position < len(drafter.decoder.layers) or len(drafter.decoder.layers) == 1:
        raise ConfigError(f"cannot remove layer {position} of a {len(drafter.decoder.layers)}-layer drafter")
    model = dataclasses.replace(drafter.config.model, num_layers=drafter.config.model.num_layers - 1)
    config = dataclasses.replace(drafter.config, model=model,
                                 target_layers=[l for i, l in enumerate(layers) if i != position])
    pruned = Drafter(config, target)
    state = drafter.own_state()
    kept = [i for i in range(len(drafter.decoder.layers)) if i != position]
    renamed = {}
    for key, value in state.items():
        if key.startswith("decoder.layers."):
            index = int(key.split(".")[2])
            if index == position:
                continue
            key = key.replace(f"decoder.layers.{index}.", f"decoder.layers.{kept.index(index)}.", 1)
        renamed[key] = value.detach().clone()
    pruned.load_state_dict(renamed, strict=False)
    if config.draft_vocab_size:
        pruned.set_draft_vocab(pruned.draft_vocab.clone())
    return pruned.eval()


def measure_speed(target: Decoder, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Tokens/s of synchronous speculative decoding (drafter only) over `prompts`, greedy."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    tokens, started = 0, time.perf_counter()
    for prompt in prompts:
        tokens += sum(len(step.tokens) for step in speculative_generate(target, drafter, prompt, config))
    return tokens / (time.perf_counter() - started)


def heal(drafter: Drafter, target: Target, data_dir: str, steps: int, seed: int) -> Drafter:
    """A short fine-tune of `drafter` through the trainer (train/ stays independent of pruning)."""
    from d3d.train.trainer import TrainConfig, Trainer

    with tempfile.TemporaryDirectory() as folder:
        drafter.save_pretrained(Path(folder) / "input")
        config = TrainConfig(layers=[], init_from=str(Path(folder) / "input"), steps=steps,
                             block_size=drafter.block_size, block_attention=drafter.config.block_attention,
                             warmup=max(1, steps // 10), eval_every=0, save_every=steps, seed=seed,
                             draft_vocab_size=drafter.config.draft_vocab_size)
        trainer = Trainer(target, data_dir, Path(folder) / "run", config)
        trainer.run(progress=False)
        return Drafter.from_pretrained(Path(folder) / "run" / "drafter", target.decoder, target.fingerprint)


@torch.no_grad()
def prune(drafter: Drafter, target: Target, sequences: list[tuple[list[int], int]], config: PruneConfig,
          data_dir: str | None = None, speed_prompts: list[list[int]] | None = None,
          max_new_tokens: int = 64, progress: bool = True) -> tuple[list[PruneRound], list[Drafter]]:
    """Greedy progressive pruning; returns every round and the drafter after each (round 0 = input)."""
    decoder = target.decoder

    def tau(candidate: Drafter) -> float:
        return teacher_forced_tau(candidate, sequences, config.anchors, config.seed).tau

    def speed(candidate: Drafter) -> float | None:
        return measure_speed(decoder, candidate, speed_prompts, max_new_tokens) if speed_prompts else None

    base = tau(drafter)
    rounds = [PruneRound(list(drafter.config.target_layers), None, base, 1.0, tokens_per_second=speed(drafter))]
    drafters = [drafter]
    depth = len(drafter.decoder.layers)
    bar = tqdm(total=max(0, depth - config.min_layers), desc="prune", unit="layer", disable=not progress)
    current = drafter
    while len(current.decoder.layers) > config.min_layers:
        candidates = {}
        for position in range(len(current.decoder.layers)):
            candidates[position] = tau(remove_layer(current, position, decoder))
        position = max(candidates, key=lambda p: (candidates[p], -p))
        pruned = remove_layer(current, position, decoder)
        if config.heal_steps and data_dir:
            with torch.enable_grad():
                pruned = heal(pruned, target, data_dir, config.heal_steps, config.seed)
        value = tau(pruned)
        if config.min_retention and value / base < config.min_retention:
            break
        rounds.append(PruneRound(list(pruned.config.target_layers), position, value, value / base,
                                 candidates, speed(pruned)))
        drafters.append(pruned)
        current = pruned
        bar.update(1)
        bar.set_postfix(layers=len(current.decoder.layers), tau=f"{value:.3f}")
    bar.close()
    return rounds, drafters


def best_round(rounds: list[PruneRound]) -> int:
    """The round to ship: fastest end-to-end when measured, else the shallowest one kept."""
    if all(r.tokens_per_second is not None for r in rounds):
        return max(range(len(rounds)), key=lambda i: rounds[i].tokens_per_second)
    return len(rounds) - 1


def report(rounds: list[PruneRound]) -> dict[str, Any]:
    return {"rounds": [dataclasses.asdict(r) for r in rounds], "chosen": best_round(rounds),
            "definitions": {"tau": "teacher-forced tokens per verification, bonus included",
                            "retention": "tau / tau of the input drafter"}}


def save_report(rounds: list[PruneRound], folder: str | Path) -> list[str]:
    """prune.json, and prune.png (depth → τ and tokens/s) when matplotlib is installed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prune.json").write_text(json.dumps(report(rounds), indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [str(folder / "prune.json")]
    depths = [len(r.layers) for r in rounds]
    figure, axis = plt.subplots(figsize=(6, 3.6))
    axis.plot(depths, [r.tau for r in rounds], marker="o", label="teacher-forced τ")
    axis.set_xlabel("drafter layers")
    axis.set_ylabel("τ (bonus included)")
    axis.invert_xaxis()
    if all(r.tokens_per_second is not None for r in rounds):
        speed_axis = axis.twinx()
        speed_axis.plot(depths, [r.tokens_per_second for r in rounds], marker="s", color="tab:red")
        speed_axis.set_ylabel("tokens/s (sync, drafter only)", color="tab:red")
    figure.tight_layout()
    figure.savefig(folder / "prune.png", dpi=110)
    plt.close(figure)
    return [str(folder / "prune.json"), str(folder / "prune.png")]
