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

import copy
import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from d3d.async_engine import async_generate
from d3d.config import ConfigError, GenerationConfig
from d3d.drafter import Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.estimate import teacher_forced_tau
from d3d.loading import Target
from d3d.models import Decoder
from d3d.stats import SpecStats


@dataclass
class PruneConfig:
    min_layers: int = 1  # never prune below this depth
    min_retention: float = 0.0  # stop when τ would fall below this share of the input's τ (0 = off)
    anchors: int = 8  # calibration blocks per sequence
    seed: int = 0  # calibration anchors
    heal_steps: int = 0  # fine-tune steps after each removal (needs training data; 0 = off)
    heal_sequences: int = 0  # healing trains on the data's first N sequences (0 = all; keep calibration out)
    # healing's recipe where it departs from `d3d train`'s defaults (None: the trainer's own)
    heal_lr: float | None = None  # peak learning rate (cosine over the heal steps)
    heal_distill: float | None = None  # KL weight to the target's distributions (needs `d3d data --distill-top-k`)
    heal_ce_weight: float | None = None  # cross-entropy weight (PARD-2's recipe: distill 1, CE 0.1)

    def __post_init__(self) -> None:
        if self.min_layers < 1:
            raise ConfigError("min_layers must be at least 1")
        if not 0 <= self.min_retention <= 1:
            raise ConfigError("min_retention must be in [0, 1]")
        if any(v is not None and v < 0 for v in (self.heal_distill, self.heal_ce_weight)) or (
                self.heal_lr is not None and self.heal_lr <= 0):
            raise ConfigError("heal_lr must be > 0, heal_distill and heal_ce_weight >= 0")


@dataclass
class PruneRound:
    layers: list[int]  # target layers the drafter still holds (its config.target_layers)
    removed: int | None  # position (in the previous round's drafter) of the layer removed; None for the input
    tau: float  # teacher-forced τ, bonus included
    retention: float  # tau ÷ the input's tau
    candidates: dict[int, float] = field(default_factory=dict)  # position → τ after removing that layer
    tokens_per_second: float | None = None  # end-to-end sync decoding (drafter only), when measured
    async_tokens_per_second: float | None = None  # end-to-end async decoding, when measured
    decoded_tau: float | None = None  # τ of that sync decoding: the estimator's check


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


def time_rounds(target: Decoder, rounds: list[PruneRound], drafters: list[Drafter], prompts: list[list[int]],
                max_new_tokens: int, with_async: bool = False) -> float:
    """Decode `prompts` greedily with AR and with every round's drafter alone (sync, and async with
    `with_async`), prompt by prompt in rotating order — so that a slow minute on a shared machine
    falls on every depth alike, not on the one measured then —, after one short warm-up decode of
    each. Fills each round's tokens/s and decoded τ; returns AR's tokens/s."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    runs: list[tuple[str, Any]] = [("ar", lambda prompt, c: reference_generate(target, prompt, c))]
    for i, drafter in enumerate(drafters):
        runs.append((f"sync{i}", lambda prompt, c, d=drafter: speculative_generate(target, d, prompt, c)))
        if with_async:
            runs.append((f"async{i}", lambda prompt, c, d=drafter: async_generate(target, d, prompt, c)))
    warm = GenerationConfig(max_new_tokens=4)
    for _, generate in runs:
        for _ in generate(prompts[0], warm):
            pass
    seconds = {name: 0.0 for name, _ in runs}
    stats = {name: SpecStats() for name, _ in runs}
    for index, prompt in enumerate(prompts):
        order = runs[index % len(runs):] + runs[:index % len(runs)]
        for name, generate in order:
            started = time.perf_counter()
            for step in generate(prompt, config):
                pass
            seconds[name] += time.perf_counter() - started
            stats[name] = stats[name].merge(step.stats)
    rate = {name: stats[name].new_tokens / seconds[name] for name in seconds}
    for i, r in enumerate(rounds):
        r.tokens_per_second, r.decoded_tau = rate[f"sync{i}"], stats[f"sync{i}"].tau
        r.async_tokens_per_second = rate.get(f"async{i}")
    return rate["ar"]


def heal(drafter: Drafter, target: Target, data_dir: str, config: PruneConfig) -> Drafter:
    """A short fine-tune of `drafter` through the trainer (train/ stays independent of pruning):
    `config.heal_steps` steps at `heal_lr` (with `heal_distill` / `heal_ce_weight`) on the data's
    first `heal_sequences` sequences (0 = all: keep calibration sequences out)."""
    from d3d.train.trainer import TrainConfig, Trainer

    # The trainer keeps fp32 master weights, and the drafter shares the target's embedding and
    # head: train against an fp32 copy, so the target that decodes (bf16, say) is never touched.
    master = dataclasses.replace(target, decoder=copy.deepcopy(target.decoder).float())
    with tempfile.TemporaryDirectory() as folder:
        drafter.save_pretrained(Path(folder) / "input")
        steps = config.heal_steps
        asked = {name: value for name, value in (("lr", config.heal_lr), ("distill", config.heal_distill),
                                                 ("ce_weight", config.heal_ce_weight)) if value is not None}
        recipe = TrainConfig(layers=[], init_from=str(Path(folder) / "input"), steps=steps,
                             drafter_kind=drafter.config.kind, block_size=drafter.block_size,
                             block_attention=drafter.config.block_attention, **asked,
                             warmup=max(1, steps // 10), eval_every=0, save_every=steps, seed=config.seed,
                             draft_vocab_size=drafter.config.draft_vocab_size, max_sequences=config.heal_sequences)
        trainer = Trainer(master, data_dir, Path(folder) / "run", recipe)
        trainer.run(progress=False)
        return Drafter.from_pretrained(Path(folder) / "run" / "drafter", target.decoder, target.fingerprint)


@torch.no_grad()
def prune(drafter: Drafter, target: Target, sequences: list[tuple[list[int], int]], config: PruneConfig,
          data_dir: str | None = None, progress: bool = True) -> tuple[list[PruneRound], list[Drafter]]:
    """Greedy progressive pruning; returns every round and the drafter after each (round 0 = input).
    `time_rounds` then decodes every kept depth end to end, for its tokens/s and decoded τ."""
    decoder = target.decoder

    def tau(candidate: Drafter) -> float:
        return teacher_forced_tau(candidate, sequences, config.anchors, config.seed, target=decoder).tau

    base = tau(drafter)
    rounds = [PruneRound(list(drafter.config.target_layers), None, base, 1.0)]
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
                pruned = heal(pruned, target, data_dir, config)
        value = tau(pruned)
        if config.min_retention and value / base < config.min_retention:
            break
        rounds.append(PruneRound(list(pruned.config.target_layers), position, value, value / base, candidates))
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


def correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's r (None for fewer than 3 points or no spread)."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def report(rounds: list[PruneRound], ar_tokens_per_second: float | None = None) -> dict[str, Any]:
    decoded = [r for r in rounds if r.decoded_tau is not None]
    r = correlation([x.tau for x in decoded], [x.decoded_tau for x in decoded])
    return {"rounds": [dataclasses.asdict(r) for r in rounds], "chosen": best_round(rounds),
            "ar_tokens_per_second": ar_tokens_per_second,
            "estimator_correlation": None if r is None else round(r, 4),
            "definitions": {"tau": "teacher-forced tokens per verification, bonus included",
                            "decoded_tau": "tokens per verification in real greedy decoding of the speed prompts",
                            "estimator_correlation": "Pearson r of tau and decoded_tau over the depths",
                            "retention": "tau / tau of the input drafter"}}


def save_report(rounds: list[PruneRound], folder: str | Path, ar_tokens_per_second: float | None = None) -> list[str]:
    """prune.json, and prune.png (depth → τ and tokens/s) when matplotlib is installed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prune.json").write_text(json.dumps(report(rounds, ar_tokens_per_second), indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [str(folder / "prune.json")]
    depths = [len(r.layers) for r in rounds]
    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    axis.plot(depths, [r.tau for r in rounds], marker="o", label="τ teacher-forced")
    if all(r.decoded_tau is not None for r in rounds):
        axis.plot(depths, [r.decoded_tau for r in rounds], marker="o", linestyle="--", label="τ decoded")
    axis.set_xlabel("drafter layers")
    axis.set_ylabel("τ (bonus included)")
    axis.invert_xaxis()
    lines, labels = axis.get_legend_handles_labels()
    if all(r.tokens_per_second is not None for r in rounds):
        speed_axis = axis.twinx()
        speed_axis.plot(depths, [r.tokens_per_second for r in rounds], marker="s", color="tab:red",
                        label="tokens/s sync")
        if all(r.async_tokens_per_second is not None for r in rounds):
            speed_axis.plot(depths, [r.async_tokens_per_second for r in rounds], marker="s", color="tab:purple",
                            label="tokens/s async")
        if ar_tokens_per_second:
            speed_axis.axhline(ar_tokens_per_second, color="gray", linestyle=":", label="tokens/s AR")
        speed_axis.set_ylabel("tokens/s (drafter only)")
        more_lines, more_labels = speed_axis.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    axis.legend(lines, labels, fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(folder / "prune.png", dpi=110)
    plt.close(figure)
    return [str(folder / "prune.json"), str(folder / "prune.png")]
