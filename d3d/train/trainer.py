"""`d3d train`: the D3D drafter's training loop, with exact resume.

Loss per batch = L_diff + λ·L_AR (see `d3d.train.batch`): cross-entropy of the noisy blocks'
shifted labels (optionally decayed by draft position) plus next-token cross-entropy on the clean
tokens. With `distill`, each term also carries a KL to the target's own distribution of that token
(`d3d.train.distill`), and `ce_weight` scales the cross-entropy. With `drafter_kind="ar"` the
same loop trains the AR-drafter baseline: no noisy blocks, so the loss is L_AR alone (with its KL
term under `distill`), on the same data and schedule. AdamW, linear warm-up then cosine decay, gradient clipping and accumulation, bf16 autocast
on CPU. Weights shared with the target (embedding, LM head) stay frozen.

Checkpoints hold everything needed to continue bit-for-bit — drafter weights, AdamW moments,
step, data position and RNG states — in safetensors + JSON (nothing is pickled), written to a
staging folder and renamed into place. Re-running the same command resumes. Every `eval_every`
steps a teacher-forced τ on held-out sequences goes to `log.jsonl` and `curves.png`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from d3d.config import BlockAttention, ConfigError, DrafterKind, LabelShift, _JsonMixin
from d3d.dflash import attach_features
from d3d.drafter import Drafter
from d3d.estimate import teacher_forced_tau
from d3d.files import save_tensors
from d3d.loading import Target
from d3d.train.batch import IGNORE, MaskRatio, collate, pack_example, sample_anchors
from d3d.train.distributed import World, gradient_sync, is_sharded, laid_out_like, whole, wrap
from d3d.train import distill
from d3d.train.distill import TopK
from d3d.train.shards import DataFolders, read_shards


@dataclass
class TrainConfig(_JsonMixin):
    """One drafter training run. The defaults are the shipped drafter's recipe (docs/training.md:
    λ = 1 and random mask ratios won the ablations)."""

    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # target layers the drafter starts from
    # "ar": the AR-drafter baseline (next-token loss only); block_attention, labels, lambda_ar, gamma,
    # mask_ratio and anchors shape D3D's noisy blocks and do not apply to it. "dflash": the DFlash-style
    # baseline (d3d.dflash), D3D's blocks over the target's hidden states computed on the fly; it has
    # no clean-token rows to predict, so no L_AR (lambda_ar does not apply)
    drafter_kind: DrafterKind = "d3d"
    feature_layers: list[int] = field(default_factory=list)  # dflash: target layers it reads ([] = spread evenly)
    init_from: str = ""  # a drafter checkpoint to start from instead (healing a pruned drafter)
    block_size: int = 16  # B
    block_attention: BlockAttention = "anchor_causal"  # attention inside a block
    labels: LabelShift = "shifted"  # block row i predicts x_{a+i+1} (shifted) or x_{a+i} (unshifted)
    steps: int = 2000  # optimizer steps
    batch_size: int = 8  # sequences per micro-batch, all ranks together (the global micro-batch)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 5e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine floor as a share of lr
    warmup: int = 60  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    clip: float = 1.0  # gradient norm clip (0 = off)
    lambda_ar: float = 1.0  # weight of the auxiliary AR loss
    distill: float = 0.0  # weight of KL to the target's distributions (0 = off; needs `d3d data --distill-top-k`)
    ce_weight: float = 1.0  # weight of cross-entropy to the target's tokens (PARD-2 distils with 1.0 KL + 0.1 CE)
    gamma: float = 0.0  # position decay exp(-(k-1)/γ) of L_diff (0 = uniform)
    mask_ratio: MaskRatio = "random"  # all-mask blocks, or a random share revealed
    anchors: int = 8  # noisy blocks per sequence
    max_length: int = 512  # clean tokens per sequence (prompt is cut from the left)
    held_out: int = 64  # sequences kept out of training for the τ estimate
    eval_every: int = 100  # steps between τ estimates (0 = only at the end)
    save_every: int = 100  # steps between checkpoints
    draft_vocab_size: int = 0  # draft among the most frequent response tokens only (0 = whole vocabulary)
    max_sequences: int = 0  # use the first N sequences of the data (0 = all; fix it while `d3d data` still runs)
    seed: int = 0  # data order, anchors, masks
    autocast: bool = True  # bf16 autocast (CPU and CUDA)
    compile: bool = False  # each drafter layer through torch.compile (one graph serves them all): faster, other roundings
    # micro-batches of sequences of similar length: each window of this many micro-batches of the
    # shuffled order is sorted by length, cut into micro-batches, and those are shuffled (0 = off).
    # A micro-batch is padded to its longest sequence; at random, 28% of its rows and 45% of its
    # attention were padding on data/smollm2-* (docs/training.md)
    length_groups: int = 64

    def __post_init__(self) -> None:
        if self.held_out < 0 or self.eval_every < 0:
            raise ConfigError("held_out and eval_every must be >= 0")
        for name in ("steps", "batch_size", "grad_accum", "anchors", "max_length", "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.length_groups < 0:
            raise ConfigError("length_groups must be >= 0 (0 = no grouping by length)")
        if not self.layers and not self.init_from:
            raise ConfigError("give the target layers to start from, or init_from")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.distill < 0 or self.ce_weight < 0 or self.distill + self.ce_weight == 0:
            raise ConfigError("distill and ce_weight must be >= 0, and not both 0")
        if self.drafter_kind not in ("d3d", "ar", "dflash"):
            raise ConfigError(f"unknown drafter kind {self.drafter_kind!r} (d3d, ar or dflash)")
        if self.feature_layers and self.drafter_kind != "dflash":
            raise ConfigError("feature_layers are the target layers a dflash drafter reads; this run trains "
                              f"a {self.drafter_kind} drafter")


# What a field meant in runs saved before it existed, where that differs from today's default.
BEFORE_FIELD = {"length_groups": 0}


def length_grouped(order: list[int], lengths: list[int], batch_size: int, groups: int,
                   rng: random.Random) -> list[int]:
    """`order` rearranged so that each run of `batch_size` places holds sequences of similar length:
    each window of `groups` micro-batches is sorted by length (ties keep their order), cut into
    micro-batches, and all micro-batches are shuffled by `rng`. The same sequences, once each."""
    window = batch_size * groups
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [i for batch in batches for i in batch]


def load_sequences(data_dir: DataFolders, max_length: int, teachers: list[TopK] | None = None,
                   origins: list[tuple[str, int]] | None = None) -> list[tuple[list[int], int]]:
    """(tokens, response_start) per record of the data folder(s) (`d3d.train.shards.data_folders`:
    several are read in turn), the prompt cut from the left to fit `max_length`. Given a
    list as `teachers`, fills it with each kept record's distributions (`d3d.train.distill`), cut alike;
    as `origins`, with each kept record's (prompt id, sample): 0 for the greedy response, j for the
    j-th sampled one (`d3d data --samples`)."""
    sequences = []
    distributions = distill.read_all(data_dir) if teachers is not None else None
    for number, record in enumerate(read_shards(data_dir)):
        teacher = next(distributions) if distributions is not None else None
        prompt, response = record["prompt_ids"], record["response_ids"]
        if len(response) < 2:
            continue
        response = response[:max_length - 1]
        prompt = prompt[-(max_length - len(response)):]
        sequences.append((prompt + response, len(prompt)))
        if origins is not None:
            origins.append((str(record.get("id", f"record {number}")), int(record.get("sample", 0))))
        if teachers is not None:
            teachers.append(teacher[:len(response)])
    if not sequences:
        raise ConfigError(f"{data_dir} holds no finished shards: run `d3d data` first")
    if teachers and len({teacher.ids.shape[-1] for teacher in teachers}) > 1:
        raise ConfigError(f"the data folders {data_dir} hold distributions of different widths "
                          "(`d3d data --distill-top-k`): give them all the same")
    return sequences


def frequent_tokens(sequences: list[tuple[list[int], int]], count: int, vocab_size: int) -> torch.Tensor:
    """The `count` most frequent response tokens (ties by lower id), for a reduced draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens, response_start in sequences:
        counts += torch.bincount(torch.tensor(tokens[response_start:], dtype=torch.long), minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep id order
    return order[:count].clone()


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def distill_kl(drafter: Drafter, log_q: torch.Tensor, teacher_ids: torch.Tensor,
               teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row over the target's top-k tokens plus one bucket for all other tokens.

    log_q: (n, V_draft) the drafter's log-probabilities; teacher_ids / teacher_logprobs: (n, k)
    the target's top-k (target vocabulary). Top-k tokens outside the draft vocabulary join the
    bucket; p's bucket is 1 − Σ p over the rest, q's likewise, so the sum is a true KL ≥ 0.
    """
    draft_ids = drafter.to_draft_ids(teacher_ids, missing=-1)  # (n, k)
    known = draft_ids >= 0
    p = teacher_logprobs.exp() * known
    log_q_top = log_q.gather(-1, draft_ids.clamp_min(0))
    q_rest = (1 - (log_q_top.exp() * known).sum(-1)).clamp_min(1e-6)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    top = torch.where(known, p * (teacher_logprobs - log_q_top), 0.0).sum(-1)
    return top + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()


def _selection(drafter: Drafter, batch: dict[str, torch.Tensor], lambda_ar: float, distill: float) -> dict[str, Any]:
    """Which rows carry a loss term, and with what weight: everything of the loss but the model."""
    labels = drafter.to_draft_ids(batch["labels"], missing=IGNORE)  # outside the draft vocabulary: no CE
    teacher_rows = batch.get("teacher_rows") if distill > 0 else None
    if distill > 0 and teacher_rows is None:
        raise ConfigError("distillation needs the target's distributions in the batch (d3d data --distill-top-k)")
    has_label = labels != IGNORE
    rows = has_label if teacher_rows is None else has_label | (teacher_rows >= 0)
    if lambda_ar == 0:  # the clean rows' terms weigh nothing: leave them out of the head
        rows = rows & batch["is_block"]
    return {"rows": rows, "labels": labels[rows], "labelled": has_label[rows], "weights": batch["weights"][rows],
            "in_block": batch["is_block"][rows],
            "taught": teacher_rows[rows] >= 0 if teacher_rows is not None else None,
            "teacher_rows": teacher_rows[rows] if teacher_rows is not None else None}


def weight_sums(drafter: Drafter, batch: dict[str, torch.Tensor], lambda_ar: float,
                distill: float = 0.0) -> torch.Tensor:
    """(4,) float64: what each of the loss's weighted means divides by — CE over block rows, CE over
    clean rows, KL over block rows, KL over clean rows. Summed over the ranks of a data-parallel run,
    they make each rank's loss its share of the whole micro-batch's (`d3d.train.distributed`)."""
    return _sums(_selection(drafter, batch, lambda_ar, distill))


def _sums(chosen: dict[str, Any]) -> torch.Tensor:
    w, in_block = chosen["weights"].double(), chosen["in_block"]
    sums = [(w * chosen["labelled"])[in_block].sum(), (w * chosen["labelled"])[~in_block].sum()]
    taught = chosen["taught"]
    sums += [(w * taught)[in_block].sum(), (w * taught)[~in_block].sum()] if taught is not None else [w.new_zeros(())] * 2
    return torch.stack(sums).cpu()


def drafter_loss(drafter: Drafter, batch: dict[str, torch.Tensor], lambda_ar: float, distill: float = 0.0,
                 ce_weight: float = 1.0, sums: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """ce_weight·CE + distill·KL, each over the blocks (L_diff) plus λ times over clean rows (L_AR).

    Each term is a weighted mean; `sums` (from `weight_sums`, default this batch's own) is what the
    means divide by, so a rank holding part of a micro-batch returns its share of the whole's loss."""
    chosen = _selection(drafter, batch, lambda_ar, distill)
    sums = (_sums(chosen) if sums is None else sums).float().clamp_min(1e-9).tolist()
    hidden = drafter.packed_hidden(batch)
    log_q = torch.log_softmax(drafter.draft_scores(hidden[chosen["rows"]]).float(), dim=-1)  # only rows with a target
    weights, in_block = chosen["weights"], chosen["in_block"]

    def split(per_row: torch.Tensor, used: torch.Tensor, block_sum: float, clean_sum: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted sums over the block rows and over the clean rows where `used`, over the given totals."""
        w = weights * used
        return (per_row * w)[in_block].sum() / block_sum, (per_row * w)[~in_block].sum() / clean_sum

    labelled, labels = chosen["labelled"], chosen["labels"]
    ce = -log_q.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
    diff, ar = split(torch.where(labelled, ce, 0.0), labelled, sums[0], sums[1])
    loss = ce_weight * (diff + lambda_ar * ar)
    parts = {"diff": diff.item(), "ar": ar.item()}
    if chosen["taught"] is not None:
        taught, source = chosen["taught"], chosen["teacher_rows"].clamp_min(0)
        kl = distill_kl(drafter, log_q, batch["teacher_ids"][source], batch["teacher_logprobs"][source])
        kl_diff, kl_ar = split(torch.where(taught, kl, 0.0), taught, sums[2], sums[3])
        loss = loss + distill * (kl_diff + lambda_ar * kl_ar)
        parts.update(kl_diff=kl_diff.item(), kl_ar=kl_ar.item())
    return loss, parts


class DrafterObjective(torch.nn.Module):
    """The drafter's loss as a module's forward: DistributedDataParallel hooks `forward`, and the
    loss calls the drafter's own passes (`packed_hidden`, `draft_scores`), not its forward."""

    def __init__(self, drafter: Drafter, lambda_ar: float, distill: float, ce_weight: float) -> None:
        super().__init__()
        self.drafter, self.lambda_ar, self.distill, self.ce_weight = drafter, lambda_ar, distill, ce_weight

    def forward(self, batch: dict[str, torch.Tensor] | None = None, sums: torch.Tensor | None = None,
                run: Callable[[], Any] | None = None) -> Any:
        """The loss of `batch` over the `sums`, or with `run`, that pass's result instead: FSDP gathers
        the drafter's top-level parameters around forward, so evaluation runs in here when sharded."""
        if run is not None:
            with torch.no_grad():
                return run()
        return drafter_loss(self.drafter, batch, self.lambda_ar, self.distill, self.ce_weight, sums)


class Trainer:
    """One training run, in this process or as one rank of a data-parallel world (`world`): every
    rank keeps the same counters over the same global order, and rank 0 alone evaluates and writes."""

    def __init__(self, target: Target, data_dir: DataFolders, out_dir: str | Path, config: TrainConfig,
                 world: World = World(), fsdp: bool = False, release_target: bool = False) -> None:
        """`release_target`: the caller hands the target over, and the layers the training does not
        read are freed once the drafter is built (a D3D or AR drafter reads only the target's
        embedding and head; a DFlash-style one its hidden states, from the layers or their bf16 copy):
        for Qwen3-8B, 27.8 GB of fp32 weights on every rank."""
        self.config, self.target, self.world = config, target, world
        if fsdp and not world.distributed:
            raise ConfigError("--fsdp shards the drafter over the processes of a torchrun world; this is one process")
        world.check_divides(config.batch_size)  # refused now, before any loading
        self.out = Path(out_dir)
        if world.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        # the target's distributions: for the loss with `distill`, and for τ at T = 1 whenever the data has them
        has_teachers = config.distill > 0 or distill.available(data_dir)
        teachers: list[TopK] | None = [] if has_teachers else None
        origins: list[tuple[str, int]] = []
        sequences = load_sequences(data_dir, config.max_length, teachers, origins)
        if config.max_sequences:
            sequences = sequences[:config.max_sequences]
        self.num_sequences = len(sequences)
        order = list(range(len(sequences)))
        random.Random(config.seed).shuffle(order)  # the same order as shuffling the list itself
        # held out: greedy responses only (τ at T = 0 is read on them), and none of their prompts'
        # sampled responses trains; with greedy data alone, the first `held` of the shuffled order
        greedy = [i for i in order if origins[i][1] == 0]
        held_ids = {origins[i][0] for i in greedy[:min(config.held_out, len(greedy) // 10)]}
        held_order = [i for i in greedy if origins[i][0] in held_ids]
        train_order = [i for i in order if origins[i][0] not in held_ids]
        self.held_out = [sequences[i] for i in held_order]
        self.train_set = [sequences[i] for i in train_order]
        self.held_teachers = [teachers[i] for i in held_order] if teachers is not None else None
        self.train_teachers = [teachers[i] for i in train_order] if teachers is not None and config.distill > 0 else None
        torch.manual_seed(config.seed)
        if config.init_from:
            self.drafter = Drafter.from_pretrained(config.init_from, target.decoder, target.fingerprint)
            if self.drafter.config.kind != config.drafter_kind:
                raise ConfigError(f"{config.init_from} holds a drafter of kind {self.drafter.config.kind!r}; "
                                  f"this run trains one of kind {config.drafter_kind!r}")
        else:
            vocab = (frequent_tokens(self.train_set, config.draft_vocab_size, target.decoder.config.vocab_size)
                     if config.draft_vocab_size else None)
            self.drafter = Drafter.from_target(target.decoder, config.layers, config.block_size,
                                               config.block_attention, target.fingerprint, draft_vocab=vocab,
                                               labels=config.labels, kind=config.drafter_kind,
                                               feature_layers=config.feature_layers or None)
        self.drafter.float().train()
        if config.compile:  # regional: the layers share one compiled graph, so compiling costs one layer's time
            for layer in self.drafter.decoder.layers:
                layer.compile()
        # DFlash-style: the target's hidden states as decoding computes them (bf16 under autocast)
        self.feature_target = None
        if self.drafter.feature_projection is not None:
            wanted = torch.bfloat16 if config.autocast else target.decoder.dtype
            self.feature_target = (target.decoder if target.decoder.dtype == wanted
                                   else copy.deepcopy(target.decoder).to(wanted))
        shared = {id(p) for p in target.decoder.parameters()}
        for p in target.decoder.parameters():
            p.requires_grad_(False)
        self.step, self.epoch, self.index = 0, 0, 0
        self.extended_from: int | None = None  # the run's former --steps, where resuming changed them
        self.tokens_seen = 0  # response tokens of the sequences trained on so far (the τ scaling axis)
        self.order = self._order()
        resumed = (self.out / "checkpoint" / "state.json").is_file()
        moments = self._resume() if resumed else {}
        if release_target and self.feature_target is not target.decoder:
            target.decoder.layers = torch.nn.ModuleList()  # the drafter holds copies of the layers it uses
        lambda_ar = {"ar": 1.0, "dflash": 0.0}.get(config.drafter_kind, config.lambda_ar)
        # an AR drafter has no blocks: its loss is the clean rows' term alone, at weight 1; a
        # DFlash-style drafter's clean rows are the target's hidden states, with nothing to predict
        objective = DrafterObjective(self.drafter, lambda_ar, config.distill, config.ce_weight)
        # after resume, every rank holds the same whole weights; FSDP then keeps each rank's shard
        self.objective = wrap(objective, world, fsdp, [p for p in self.drafter.parameters() if id(p) in shared])
        self.parameters = {n: p for n, p in self.drafter.named_parameters() if id(p) not in shared}
        # fused: one kernel over all the weights (the per-tensor loop cost a 30-layer drafter's step ~2 s on CPU)
        self.optimizer = torch.optim.AdamW(self.parameters.values(), lr=config.lr,
                                           weight_decay=config.weight_decay, fused=True)
        for name, p in self.parameters.items():
            if name in moments:
                self.optimizer.state[p] = {key: laid_out_like(value, p) for key, value in moments[name].items()}

    # -- data --------------------------------------------------------------------------------

    def _order(self, epoch: int | None = None) -> list[int]:
        order = list(range(len(self.train_set)))
        rng = random.Random(self.config.seed * 1000 + (self.epoch if epoch is None else epoch))
        rng.shuffle(order)
        if self.config.length_groups:
            lengths = [len(tokens) for tokens, _ in self.train_set]
            order = length_grouped(order, lengths, self.config.batch_size, self.config.length_groups, rng)
        return order

    def _next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's share of the next global micro-batch of `batch_size` sequences. Each sequence's
        anchors and masks come from its own generator, seeded by its place in the global order, so
        they do not depend on which rank packs it."""
        c = self.config
        places = []  # (epoch, index) of each sequence of the global micro-batch
        while len(places) < c.batch_size:
            if self.index >= len(self.order):
                self.epoch, self.index = self.epoch + 1, 0
                self.order = self._order()
            places.append((self.epoch, self.index))
            tokens, response_start = self.train_set[self.order[self.index]]
            self.tokens_seen += len(tokens) - response_start
            self.index += 1
        examples, clean = [], []
        for epoch, place in self.world.share(places, c.batch_size):
            index = self.order[place] if epoch == self.epoch else self._order(epoch)[place]
            tokens, response_start = self.train_set[index]
            teacher = self.train_teachers[index] if self.train_teachers is not None else None
            rng = random.Random(((c.seed * 65_537 + epoch) << 32) + place)
            anchors = [] if c.drafter_kind == "ar" else sample_anchors(len(tokens), response_start, c.anchors, rng)
            examples.append(pack_example(tokens, response_start, anchors, c.block_size,
                                         self.drafter.config.mask_token_id, c.block_attention, c.gamma,
                                         c.mask_ratio, rng, self.drafter.config.labels, teacher))
            clean.append(tokens)
        batch = collate(examples)
        if self.drafter.feature_projection is not None:  # DFlash-style: the target's hidden states, computed now
            batch = attach_features(batch, clean, self.feature_target, self.drafter.config.feature_layers)
        return batch

    # -- checkpoints -------------------------------------------------------------------------

    def _own_state(self) -> dict[str, torch.Tensor]:
        """The drafter's own tensors, whole (gathered from the ranks' shards under FSDP: every rank calls it)."""
        return {name: whole(value.detach()) for name, value in self.drafter.own_state().items()}

    def save(self) -> None:
        """Rank 0 writes the checkpoint: whole tensors (every rank holds the same counters), so any
        world size, sharded or not, resumes it."""
        weights = self._own_state()
        tensors = {"torch_rng": torch.get_rng_state()}
        for name, p in self.parameters.items():
            for key, value in self.optimizer.state.get(p, {}).items():
                tensors[f"{name}/{key}"] = whole(value.detach()).cpu().clone().contiguous()
        if not self.world.is_main:
            return
        staging = self.out / "checkpoint.staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        self.drafter.save_pretrained(staging / "drafter", state=weights)  # fp32: resume must be exact
        save_tensors(tensors, staging / "optimizer.safetensors")
        state = {"step": self.step, "epoch": self.epoch, "index": self.index, "tokens_seen": self.tokens_seen,
                 "config": self.config.to_dict(), "num_sequences": self.num_sequences,
                 "world_size": self.world.size}  # for the record: any world size resumes it
        (staging / "state.json").write_text(json.dumps(state))
        final = self.out / "checkpoint"
        previous = self.out / "checkpoint.previous"
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            os.replace(final, previous)
        os.replace(staging, final)
        shutil.rmtree(previous, ignore_errors=True)

    def _resume(self) -> dict[str, dict[str, torch.Tensor]]:
        """Weights, counters and generator from the checkpoint; returns Adam's moments by parameter
        name, whole (the optimizer is built, and sharded, after)."""
        folder = self.out / "checkpoint"
        state = json.loads((folder / "state.json").read_text())
        defaults = TrainConfig(layers=self.config.layers, init_from=self.config.init_from).to_dict()
        # fields added since: what they meant before they existed, else their defaults
        saved, wanted = {**defaults, **BEFORE_FIELD, **state["config"]}, self.config.to_dict()
        differing = [name for name in wanted if name != "steps" and saved.get(name) != wanted[name]]
        if differing:
            raise ConfigError(f"{self.out} holds a run with another config ("
                              + ", ".join(f"{name}: {saved.get(name)!r} there, {wanted[name]!r} now" for name in differing)
                              + "); use a new --out or the run's options")
        if wanted["steps"] < state["step"]:
            raise ConfigError(f"{self.out} is already at step {state['step']}: --steps {wanted['steps']} would "
                              "end it before where it stands; give at least that many")
        # more --steps than the run was started with extends it: the cosine decay stretches over the
        # new length from here on (the learning rate rises again), the steps done stay as they were
        self.extended_from = saved["steps"] if saved["steps"] != wanted["steps"] else None
        if state.get("num_sequences", self.num_sequences) != self.num_sequences:
            raise ConfigError(f"the data changed since this run started ({state['num_sequences']} → "
                              f"{self.num_sequences} sequences): resume needs the same data — pass "
                              "--max-sequences to fix it, or use a new --out")
        loaded = Drafter.from_pretrained(folder / "drafter", self.target.decoder, self.target.fingerprint)
        self.drafter.load_state_dict(loaded.float().state_dict())
        tensors = load_file(str(folder / "optimizer.safetensors"))
        torch.set_rng_state(tensors.pop("torch_rng"))
        moments: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            name, moment = key.split("/", 1)
            moments.setdefault(name, {})[moment] = value
        self.step, self.epoch, self.index = state["step"], state["epoch"], state["index"]
        self.tokens_seen = state.get("tokens_seen", 0)
        self.order = self._order()
        log = self.out / "log.jsonl"
        self.world.barrier()  # every rank has read the checkpoint before rank 0 may rewrite the log
        if self.world.is_main and log.is_file():  # drop lines past the checkpoint: those steps are about to be redone
            kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= self.step]
            log.write_text("".join(line + "\n" for line in kept))
        return moments

    # -- loop --------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        c = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(c, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        objective = getattr(self.objective, "module", self.objective)  # DDP holds it; FSDP is it
        totals: dict[str, float] = {}
        for micro in range(c.grad_accum):
            batch = self._next_batch()
            # the whole micro-batch's denominators, so each rank's loss is its share of the whole's
            sums = self.world.sum(weight_sums(self.drafter, batch, objective.lambda_ar, c.distill))
            last = micro == c.grad_accum - 1
            # gradients are summed over the ranks once, after the last micro-batch
            with gradient_sync(self.objective, last):
                with torch.autocast(self.drafter.decoder.device.type, dtype=torch.bfloat16, enabled=c.autocast):
                    loss, parts = self.objective(batch, sums)
                # DDP averages the ranks' gradients; the shares are meant to be summed
                (loss * self.world.size / c.grad_accum).backward()
            names = ["loss", *parts]
            shares = self.world.sum(torch.tensor([loss.item(), *parts.values()], dtype=torch.float64))
            for name, value in zip(names, shares.tolist()):
                totals[name] = totals.get(name, 0.0) + value / c.grad_accum
        if c.clip > 0:
            torch.nn.utils.clip_grad_norm_(list(self.parameters.values()), c.clip)
        self.optimizer.step()
        # the fused step writes the weights in place without counting a new version, and the row-exact
        # kernels' packed copies (the held-out τ, `d3d prune`'s decoding) are keyed on it
        torch.autograd.graph.increment_version(list(self.parameters.values()))
        self.step += 1
        return {**totals, "lr": learning_rate(c, self.step - 1)}

    def evaluate(self) -> dict[str, Any]:
        """The held-out τ estimate, on rank 0 only (the others have nothing to add to it: {})."""
        sharded = is_sharded(self.objective)  # then every rank runs it: its passes gather the shards
        if not self.world.is_main and not sharded:
            return {}
        self.drafter.eval()

        def held_out_tau():
            # eager: τ is read with the kernels decoding uses (the row-exact ones call C, which a compiled layer cannot trace)
            with torch.autocast(self.drafter.decoder.device.type, dtype=torch.bfloat16, enabled=self.config.autocast), \
                    torch.compiler.set_stance("force_eager"):
                return teacher_forced_tau(self.drafter, self.held_out, seed=12345, teachers=self.held_teachers,
                                          target=self.feature_target)

        estimate = self.objective(run=held_out_tau) if sharded else held_out_tau()
        self.drafter.train()
        if not self.world.is_main:
            return {}
        result = {"tau": round(estimate.tau, 4), "acceptance_rate": [round(r, 4) for r in estimate.acceptance_rate]}
        if estimate.tau_t1 is not None:
            result["tau_t1"] = round(estimate.tau_t1, 4)
        return result

    def log(self, record: dict[str, Any]) -> None:
        if not self.world.is_main:
            return
        with open(self.out / "log.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def run(self, progress: bool = True) -> dict[str, Any]:
        c = self.config
        if self.step == 0:
            self.log({"step": 0, **self.evaluate()})
        bar = tqdm(total=c.steps, initial=self.step, desc="train drafter", unit="step",
                   disable=not progress or not self.world.is_main)
        started = time.perf_counter()
        while self.step < c.steps:
            metrics = self.train_step()
            record = {"step": self.step, **{k: round(v, 5) for k, v in metrics.items()},
                      "tokens_seen": self.tokens_seen, "seconds": round(time.perf_counter() - started, 1)}
            if c.eval_every and self.step % c.eval_every == 0 or self.step == c.steps:
                record.update(self.evaluate())
            self.log(record)
            if self.step % c.save_every == 0 or self.step == c.steps:
                self.save()
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", **({"tau": record["tau"]} if "tau" in record else {}))
            bar.update(1)
        bar.close()
        result = {"step": self.step, **self.evaluate()}
        weights = self._own_state()
        if self.world.is_main:
            self.drafter.save_pretrained(self.out / "drafter", dtype=torch.bfloat16, state=weights)
            from d3d.train.curves import plot_curves
            plot_curves(self.out / "log.jsonl", self.out / "curves.png")
        self.world.barrier()  # no rank leaves (and closes the group) before the drafter is written
        return result
