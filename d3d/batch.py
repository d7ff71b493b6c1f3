"""Continuous batching: many generations advanced together, each exactly as it runs alone.

A `Batch` holds live `Run`s (`d3d.run`). Each `step` asks every run for its rows — a piece of
its prompt, or its anchor and the drafts its own sources propose, every run's D3D drafter pass
run together in one drafter forward (`d3d.sources.propose_together`) — scores them all in one target
forward (`d3d.target_step.score_rows`: every linear layer once over all the rows, attention per
sequence over its own KV cache), and settles each run with its own logits. Runs join (`add`) and
leave (finished, or `cancel`) between steps. The row-exact kernels make a row's bits independent of
the other rows in the call, and a run's choices (its gate, its random draws) depend on its own tokens
only, so every generation commits exactly what it commits alone: at T = 0 and, with its own seed,
at T > 0.

Each greedy run's gate weighs its drafts against the whole forward (`d3d.gate.Crowd`): a draft row
pays when it raises the batch's tokens per step, by the measured cost of a forward of n sequences
(`d3d.costs.batch_costs`); where the batch is already compute-bound, drafting stops. That counts a
run's extra tokens as the batch's throughput, which they are while generations wait to join (the
`backlog`: a finished run's place is taken at once). With nothing waiting, the batch lasts as long
as its run with the most tokens left, so only such runs draft: drafts of a run ahead would add rows
to every forward and shorten nothing the batch waits on. At batch 1, and for sampling runs (whose
draws must replay their solo run's), the gate decides as alone.

Prompts enter in pieces: a step carries at most `prefill_rows` prompt rows in all (oldest run
first), so a long prompt delays the other runs' next token by one piece's cost, never by the whole
prompt's. Where the target is not row-count invariant (PyTorch's kernels on an unverified device),
each prompt enters whole and each block is scored row by row, as alone.

`BatchedSteps` is one run's steps as an iterator — what `Pipeline.steps` returns with batching on:
asking it for a step that is not there yet advances the whole batch, so several consumers (the
server's requests) drive one batch with no loop of its own. It is thread-safe.

This module batches; it drafts, verifies and picks nothing itself (`Run` does) and knows no text.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from d3d.costs import batch_costs
from d3d.run import Run
from d3d.gate import Crowd
from d3d.exactness import verify_mode
from d3d.models import Decoder
from d3d.sequence import Step
from d3d.sources import DrafterCall, Proposal, propose_together
from d3d.target_step import score_rows

# Prompt rows per batched step, over all runs still reading their prompt: a step that carries them
# costs about as much as 128 one-token steps' worth of arithmetic spread over the batch's rows.
PREFILL_ROWS = 128

# `d3d serve`'s default --max-batch. Measured on an AMD EPYC Zen 5 (2 cores, SmolLM2-135M from its GGUF;
# docs/server.md): a forward of R one-token sequences costs 1.25 / 1.8 / 3.3 / 5.5 /
# 9.3 / 17 one-token steps at R = 2 / 4 / 8 / 16 / 32 / 64 — 16 is where doubling R stops adding
# 20% throughput, while each request still decodes at ~3× a human's reading speed.
MAX_BATCH = 16


@dataclass
class BatchStats:
    """What the batch's forwards held: the counts `/metrics` and the benchmark report."""

    forwards: int = 0
    rows: int = 0  # rows scored, over all forwards
    sequences: int = 0  # runs in each forward, summed
    seconds: float = 0.0  # in the forwards (and the runs' drafting and settling)

    @property
    def mean_rows(self) -> float:
        return self.rows / self.forwards if self.forwards else 0.0

    @property
    def mean_sequences(self) -> float:
        return self.sequences / self.forwards if self.forwards else 0.0


@dataclass
class Outcome:
    """What one batch step did for one run: its `step` (None after a prompt piece that was not the
    last), or the `error` that ended it — that run only."""

    key: int
    step: Step | None = None
    error: BaseException | None = None


class Batch:
    """Live runs of one target, advanced together one forward at a time."""

    def __init__(self, target: Decoder, prefill_rows: int = PREFILL_ROWS,
                 backlog: Callable[[], int] | None = None) -> None:
        if prefill_rows < 1:
            raise ValueError(f"prefill_rows must be at least 1, got {prefill_rows}")
        self.target = target
        self.prefill_rows = prefill_rows
        self.backlog = backlog  # generations waiting to join (the server's queue); None: none ever wait
        self.runs: dict[int, Run] = {}  # in arrival order
        self.stats = BatchStats()
        self._next_key = 0
        self._rows_cost: tuple[float, ...] | None = None  # measured batched-forward costs, once needed

    def __len__(self) -> int:
        return len(self.runs)

    def add(self, run: Run) -> int:
        """Admit `run` (not yet started); it joins the next step. Returns its key."""
        if run.target is not self.target:
            raise ValueError("a run joins the batch of its own target")
        key, self._next_key = self._next_key, self._next_key + 1
        self.runs[key] = run
        return key

    def cancel(self, key: int) -> None:
        """Drop a run (finished or not); its rows leave at the next step, its cache for the prefix cache."""
        run = self.runs.pop(key, None)
        if run is not None:
            run.release()

    @torch.no_grad()
    def step(self) -> list[Outcome]:
        """One target forward over every live run's rows; each run settled. Finished and failed runs
        leave the batch."""
        if not self.runs:
            return []
        started = time.perf_counter()
        whole = verify_mode(self.target) != "batched"  # a prompt piece must then be the whole prompt
        budget = self.prefill_rows
        outcomes: list[Outcome] = []
        # prompt pieces first, then the decoding runs, each drafting what pays for the forward so far
        order = sorted(self.runs.items(), key=lambda item: not item[1].prefilling)
        decoding = sum(not run.prefilling for run in self.runs.values())
        # with nothing waiting to join, the batch lasts as long as its runs with the most tokens left
        longest = -1 if self.backlog is not None and self.backlog() > 0 else max(
            (run.sequence.room for run in self.runs.values() if not run.prefilling), default=-1)
        rows = 0
        planned, calls = [], []  # (key, run) planned this step; (key, its drafter call)
        for key, run in order:
            if run.prefilling and not whole and budget == 0:
                continue  # its prompt waits for the next step's rows
            try:
                call = run.plan(None if whole else budget if run.prefilling else None,
                                self._crowd(run, rows, decoding, longest))
            except Exception as error:  # a source failing fails its run, not the batch
                outcomes.append(Outcome(key, error=error))
                continue
            if run.prefilling:
                pieces = run.piece_end - run.prefilled
                budget = max(0, budget - pieces)
                rows += pieces
            else:  # its drafts (its anchor is counted in `decoding`)
                rows += call.num_drafts if call is not None else len(run.drafts)
            planned.append((key, run))
            if call is not None:
                calls.append((key, call))
        proposals, drafted_in = self._propose(calls, outcomes)
        keys, parts = [], []
        for key, run in planned:
            if run.call is not None and key not in proposals:
                continue  # its drafter pass failed
            keys.append(key)
            parts.append(run.rows(proposals.get(key), drafted_in))
        layers = sorted({layer for key in keys for layer in self.runs[key].feature_layers})
        scored_at = time.perf_counter()
        try:
            scored = score_rows(self.target, parts, layers)
        except Exception as error:
            for key, part in zip(keys, parts):  # the forward wrote nothing it keeps: the caches are as before
                part.cache.pending = 0
                outcomes.append(Outcome(key, error=error))
            scored = []
        seconds = time.perf_counter() - scored_at
        for key, part, (logits, features) in zip(keys, parts, scored):
            run = self.runs.get(key)
            if run is None:  # cancelled during this step (a consumer closed its stream)
                continue
            if features is not None and run.feature_layers != layers:
                columns = [layers.index(layer) for layer in run.feature_layers]
                features = features.view(features.shape[0], len(layers), -1)[:, columns].flatten(1)
            try:
                outcomes.append(Outcome(key, step=run.settle(logits, features, seconds)))
            except Exception as error:
                outcomes.append(Outcome(key, error=error))
        for outcome in outcomes:
            run = self.runs.get(outcome.key)
            if run is not None and (outcome.error is not None or run.finished):
                self.cancel(outcome.key)
        self.stats.forwards += 1
        self.stats.rows += sum(len(part.ids) for part in parts)
        self.stats.sequences += len(parts)
        self.stats.seconds += time.perf_counter() - started
        return outcomes

    def _propose(self, calls: list[tuple[int, DrafterCall]], outcomes: list[Outcome],
                 ) -> tuple[dict[int, Proposal], float]:
        """Every run's drafter call in one pass per drafter (`propose_together`): the proposals by
        run key, and the seconds the pass took. A failing pass fails its runs, not the batch."""
        if not calls:
            return {}, 0.0
        started = time.perf_counter()
        try:
            proposals = propose_together([call for _, call in calls])
        except Exception as error:
            outcomes.extend(Outcome(key, error=error) for key, _ in calls)
            return {}, 0.0
        return {key: proposal for (key, _), proposal in zip(calls, proposals)}, time.perf_counter() - started

    def _crowd(self, run: Run, rows: int, decoding: int, longest: int) -> Crowd | None:
        """What the rest of this step's forward holds, for `run`'s gate: none at batch 1 (the solo
        decisions), for a sampling run (its draws must replay its solo run's), or without a gate.
        `longest`: the most tokens a decoding run has left when nothing waits to join, else -1."""
        if run.prefilling or run.gate is None or not run.config.sampling.greedy or rows + decoding <= 1:
            return None
        if self._rows_cost is None:
            self._rows_cost = batch_costs(self.target)
        return Crowd(rows + decoding, decoding - 1, self._rows_cost, waited_on=run.sequence.room >= longest)

    def run_all(self) -> dict[int, list[Step]]:
        """Step until every run has finished; each run's steps by key (a failed run raises)."""
        steps: dict[int, list[Step]] = {key: [] for key in self.runs}
        with self.target.holding_weights():
            while self.runs:
                for outcome in self.step():
                    if outcome.error is not None:
                        raise outcome.error
                    if outcome.step is not None:
                        steps.setdefault(outcome.key, []).append(outcome.step)
        return steps


@dataclass
class _Feed:
    steps: deque[Step] = field(default_factory=deque)
    error: BaseException | None = None
    done: bool = False


class SharedBatch:
    """A `Batch` behind a lock, with each run's finished steps kept until its consumer asks."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.lock = threading.RLock()  # re-entrant: a stream finalised while this thread steps closes itself
        self.feeds: dict[int, _Feed] = {}

    def submit(self, run: Run) -> "BatchedSteps":
        with self.lock:
            key = self.batch.add(run)
            self.feeds[key] = _Feed()
        return BatchedSteps(self, key)

    def next_step(self, key: int) -> Step:
        with self.lock:
            feed = self.feeds.get(key)
            if feed is None:  # ended, or closed
                raise StopIteration
            with self.batch.target.holding_weights():  # the layer table checked once a turn, not every forward
                self._step_until(feed)
            if feed.steps:
                step = feed.steps.popleft()
                if not feed.steps and (feed.done or feed.error is not None):
                    del self.feeds[key]
                return step
            del self.feeds[key]
            if feed.error is not None:
                raise feed.error
            raise StopIteration

    def _step_until(self, feed: _Feed) -> None:
        """Step the batch (the lock held) until `feed` has a step, an error or its end."""
        while not feed.steps and feed.error is None and not feed.done:
            for outcome in self.batch.step():
                other = self.feeds.get(outcome.key)
                if other is None:
                    continue
                if outcome.error is not None:
                    other.error = outcome.error
                elif outcome.step is not None:
                    other.steps.append(outcome.step)
                    other.done = outcome.step.finish_reason is not None

    def close(self, key: int) -> None:
        with self.lock:
            self.batch.cancel(key)
            self.feeds.pop(key, None)


class BatchedSteps(Iterator[Step]):
    """One run's steps from a shared batch; `close` takes it out of the batch."""

    def __init__(self, shared: SharedBatch, key: int) -> None:
        self.shared, self.key = shared, key
        self.closed = False

    def __next__(self) -> Step:
        if self.closed:
            raise StopIteration
        try:
            return self.shared.next_step(self.key)
        except StopIteration:
            self.closed = True
            raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.shared.close(self.key)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # the interpreter shutting down
            pass


@torch.no_grad()
def generate_batched(target: Decoder, runs: list[Run], prefill_rows: int = PREFILL_ROWS) -> list[list[Step]]:
    """Run every one of `runs` to the end in one batch; each run's steps, in order."""
    batch = Batch(target, prefill_rows)
    keys = [batch.add(run) for run in runs]
    steps = batch.run_all()
    return [steps.get(key, []) for key in keys]
