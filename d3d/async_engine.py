"""Asynchronous speculative decoding: successor blocks drafted while the target verifies.

D3D's drafter reads token ids only, so it can work ahead (SPEC §2, "Asynchronous packed
drafting"). While the target verifies the block [a, d_1..d_K] after anchor a at position p, a
drafting worker runs `Drafter.packed_draft` over
- the *trunk* a, d_1..d_K as clean causal tokens, whose KV for a, d_1..d_k is valid whenever the
  target accepts k drafts, and
- one *branch* per anticipated outcome (k accepted, bonus guess b): the draft block
  [b, MASK × (B-1)] at p+k+1 … p+k+B that the next round would draft after that outcome.
The verdict (k, bonus) then picks its branch (a *hit*: the next block is drafted already and the
next verification starts at once) or finds none (a *miss*: `miss_policy` decides). Round time is
≈ T_verify + (1 − hit rate) · T_draft instead of T_verify + T_draft.

Where the bonus guesses come from (`AsyncConfig.guess_source`):
- "block": the drafter's rows of the block under verification (row k predicts the token at
  p+k+1, seeing only the anchor and masks in between); trunk and branches share one forward.
- "trunk": the trunk is forwarded first, and its causal outputs — the drafter's AR prediction
  after a, d_1..d_k, the very context the target judges — give both P(accept) and the guesses;
  the branches follow in a second forward. Two forwards, both off the critical path. Measured
  (greedy, 2 branches): SmolLM2-135M with an untrained full-copy drafter hits 3% of outcomes with
  "block" and 93-97% with "trunk"; tiny random drafters 1-52% vs 69-100%. Mask rows are weak
  guessers; causal rows are what a drafter (and its L_AR loss) is good at. Hence the default.

On this project's 2-core CPU the worker competes with verification for the same cores (a verify
took ~2× as long while the worker ran), so concurrency only pays with spare compute: a second
device, a CUDA stream with idle SMs, or many cores.

Lossless in every case: the target verifies every draft, and at T > 0 each draft is drawn from a
distribution fixed before its verification, which is all rejection sampling needs. The engine
reuses the sync engine's pieces — `d3d.sequence.Sequence`, `d3d.target_step`'s `prefill` and
`verify_block` — and drafts through a `d3d.sources.DrafterSource` (its block logits, vocabulary
check and name); only the drafting schedule differs from `speculative_generate`. It is not a batch engine and uses no context lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from d3d.cache import KVCache
from d3d.config import ConfigError, GenerationConfig, SamplingConfig, _JsonMixin
from d3d.drafter import Drafter
from d3d.exactness import verify_mode
from d3d.models import Decoder
from d3d.sampling import make_generator, probabilities
from d3d.sequence import Sequence, Step
from d3d.sources import DrafterSource, check_vocabulary, drafts_from_logits
from d3d.stats import SpecStats
from d3d.target_step import prefill, verify_block
from d3d.timeline import Span

Branch = tuple[int, int]  # (num_accepted k, bonus guess b)
# A planner maps (committed tokens, draft_tokens, guess_logits (≥ K+1, V), largest useful k) to
# the branches to draft, most probable first; guess_logits row i predicts the token after the
# anchor's i-th successor (see `plan_branches`). Tests inject planners that know the outcome.
Planner = Callable[[list[int], list[int], torch.Tensor, int], list[Branch]]
MissPolicy = Literal["redraft", "reanchor"]
Selection = Literal["joint", "per_k"]
GuessSource = Literal["block", "trunk"]


@dataclass
class AsyncConfig(_JsonMixin):
    """How many outcomes the packed pass drafts ahead, which ones, and what a miss costs."""

    max_branches: int = 4  # branches per packed pass: the drafting budget (0 = draft nothing ahead)
    guesses_per_k: int = 2  # bonus guesses per accepted-prefix length k, at most
    # "joint": the most probable (k, b) pairs overall; "per_k": the most probable k values, each
    # with guesses_per_k guesses (so max_branches // guesses_per_k values of k).
    selection: Selection = "joint"
    # After a miss — "redraft": draft [bonus, MASK × (B-1)] synchronously (the trunk KV makes this
    # exactly the k-branch re-run with the true bonus as anchor); "reanchor": reuse the drafts of a
    # same-k branch (drafted for a wrong bonus guess) behind the true bonus, with no drafting pass
    # on the critical path (redraft when no branch has that k).
    miss_policy: MissPolicy = "redraft"
    # "trunk": plan from the drafter's causal outputs over the drafts (a second forward in the
    # worker); "block": plan from the block logits that drafted them (one packed forward).
    guess_source: GuessSource = "trunk"
    concurrent: bool = True  # run packed passes in a worker thread; False = the same schedule, serially
    drafter_threads: int = 1  # torch CPU threads of the worker (0 = torch's default); thread-local

    def __post_init__(self) -> None:
        if self.max_branches < 0:
            raise ConfigError(f"max_branches must be >= 0, got {self.max_branches}")
        if self.guesses_per_k < 1:
            raise ConfigError(f"guesses_per_k must be >= 1, got {self.guesses_per_k}")
        if self.selection not in ("joint", "per_k"):
            raise ConfigError(f"unknown selection {self.selection!r}: use joint or per_k")
        if self.miss_policy not in ("redraft", "reanchor"):
            raise ConfigError(f"unknown miss_policy {self.miss_policy!r}: use redraft or reanchor")
        if self.guess_source not in ("block", "trunk"):
            raise ConfigError(f"unknown guess_source {self.guess_source!r}: use block or trunk")
        if self.drafter_threads < 0:
            raise ConfigError(f"drafter_threads must be >= 0, got {self.drafter_threads}")


# -- branch plan ---------------------------------------------------------------------------------

def plan_branches(guess_logits: torch.Tensor, draft_tokens: list[int], max_k: int, config: AsyncConfig,
                  sampling: SamplingConfig) -> list[Branch]:
    """The outcomes (k, b) worth drafting ahead, most probable first, judged by the drafter alone.

    guess_logits (≥ K+1, V), row i predicting the token after d_i (row 0: after the anchor): the
    block logits that drafted d_1..d_K (row K is then the extra row when K = B-1), or the trunk's
    causal outputs at a, d_1..d_K. Row K predicts the bonus after a full accept. With q_i row i's
    distribution and c_i = q_i(d_{i+1}) the drafter's confidence in its own draft,
    P(k accepted, bonus b) ≈ c_0 ⋯ c_{k-1} · q_k(b), b ≠ d_{k+1} (the target rejected it) for k < K.
    Only k ≤ max_k are planned (a larger k leaves no room to draft another block).
    """
    num_drafts = len(draft_tokens)
    assert guess_logits.dim() == 2 and guess_logits.shape[0] > num_drafts, \
        f"guess_logits {tuple(guess_logits.shape)} needs a row per draft and one after them"
    max_k = min(max_k, num_drafts)
    if config.max_branches == 0 or max_k < 0:
        return []
    rows = guess_logits[:max_k + 1].float().cpu()  # a few rows: planning is bookkeeping, not compute
    row_probs = rows.softmax(-1) if sampling.greedy else probabilities(rows, sampling)  # (max_k+1, V)
    num_judged = min(max_k + 1, num_drafts)  # rows k whose draft d_{k+1} is under verification
    judged = torch.arange(num_judged)
    drafts = torch.tensor(draft_tokens[:num_judged], dtype=torch.long)
    confidence = row_probs[judged, drafts]  # (num_judged,)
    reach = torch.cat([torch.ones(1), torch.cumprod(confidence, 0)])[:max_k + 1]  # P(d_1..d_k accepted)
    guesses = row_probs.clone()
    guesses[judged, drafts] = 0.0  # a rejected draft is never the bonus
    guess_probs, guess_tokens = torch.topk(guesses, min(config.guesses_per_k, guesses.shape[-1]), dim=-1)
    scores = reach[:, None] * guess_probs  # (max_k+1, F): P(k, b) estimates
    candidates = [(float(scores[k, j]), k, int(guess_tokens[k, j]))
                  for k in range(max_k + 1) for j in range(scores.shape[1]) if guess_probs[k, j] > 0]
    if config.selection == "per_k":
        stop = torch.cat([1 - confidence, torch.ones(max_k + 1 - num_judged)])
        exact = reach * stop  # P(exactly k accepted)
        num_k = max(1, config.max_branches // config.guesses_per_k)
        chosen = set(torch.argsort(exact, descending=True)[:num_k].tolist())
        candidates = [c for c in candidates if c[1] in chosen]
    candidates.sort(key=lambda c: -c[0])
    return [(k, b) for _, k, b in candidates[:config.max_branches]]


# -- drafting worker -------------------------------------------------------------------------------

@dataclass
class PackedResult:
    branches: list[Branch]  # the outcomes drafted ahead, in plan order
    logits: torch.Tensor  # (N, B, V) block logits, one block per branch
    seconds: float  # the worker's time on this job
    started: float = 0.0  # time.perf_counter() when the job began


class DraftWorker:
    """Runs drafting jobs in one dedicated thread (concurrent) or inline (serial).

    A thread suffices on CPU: torch kernels release the GIL, and `torch.set_num_threads` is
    thread-local under OpenMP (measured: setting it in the worker leaves the main thread's count
    unchanged), so the worker sets its own thread count once when it starts, and the main thread
    keeps what the worker does not take until `close` gives it back (two OpenMP teams
    oversubscribing 2 cores run many times slower than one thread each). On CUDA the worker drafts
    on its own stream and synchronises it before handing results back.
    """

    def __init__(self, drafter: Drafter, concurrent: bool, threads: int) -> None:
        self.threads = threads
        self.stream = None
        self.executor: ThreadPoolExecutor | None = None
        self.main_threads: int | None = None  # the main thread's count before the worker took its share
        if concurrent:
            if drafter.decoder.device.type == "cuda":
                self.stream = torch.cuda.Stream(drafter.decoder.device)
            elif threads:
                self.main_threads = torch.get_num_threads()
                torch.set_num_threads(max(1, self.main_threads - threads))
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="d3d-drafter", initializer=self._init_thread)

    def _init_thread(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def _run(self, job: Callable[[], tuple[list[Branch], torch.Tensor]]) -> PackedResult:
        started = time.perf_counter()
        if self.stream is not None:
            # Work queued on the main stream (an earlier synchronous draft into this cache) first.
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        # no_grad is per thread: the worker needs its own, or drafting would record gradients.
        with torch.no_grad(), torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            branches, logits = job()
        if self.stream is not None:
            self.stream.synchronize()
        return PackedResult(branches, logits, time.perf_counter() - started, started)

    def submit(self, job: Callable[[], tuple[list[Branch], torch.Tensor]]) -> Future[PackedResult]:
        if self.executor is not None:
            return self.executor.submit(self._run, job)
        future: Future[PackedResult] = Future()
        try:
            future.set_result(self._run(job))
        except Exception as error:  # delivered by result(), as from the thread
            future.set_exception(error)
        return future

    def close(self) -> None:
        """Wait for a running job (a torch kernel cannot be interrupted), end the thread and give
        the main thread its cores back."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None
        if self.main_threads is not None:
            torch.set_num_threads(self.main_threads)
            self.main_threads = None


def drafting_job(drafter: Drafter, cache: KVCache, clean: list[int], draft_tokens: list[int],
                 plan: Callable[[torch.Tensor], list[Branch]], guess_logits: torch.Tensor | None,
                 ) -> Callable[[], tuple[list[Branch], torch.Tensor]]:
    """The worker's job for one verification: trunk + branches → (branches, logits (N, B, V)).

    With `guess_logits` (guess source "block") the plan is made from them and one packed forward
    runs; without, the trunk runs first and the plan is made from its causal outputs. Either way
    the cache ends holding the whole trunk and no branch; the caller crops it to the verdict.
    """
    trunk = clean + draft_tokens
    anchor_slot = cache.length + len(clean) - 1

    def job() -> tuple[list[Branch], torch.Tensor]:
        if guess_logits is not None:
            branches = plan(guess_logits)
            _, logits = drafter.packed_draft(cache, trunk, branches, anchor_slot)
            cache.commit(len(trunk))
            return branches, logits
        trunk_logits, _ = drafter.packed_draft(cache, trunk, [], anchor_slot, with_trunk=True)
        cache.commit(len(trunk))
        branches = plan(trunk_logits)
        _, logits = drafter.packed_draft(cache, [], branches, anchor_slot) if branches else (None, None)
        cache.commit(0)
        if logits is None:
            logits = trunk_logits.new_zeros(0, drafter.block_size, trunk_logits.shape[-1])
        return branches, logits
    return job


# -- engine --------------------------------------------------------------------------------------

def next_block(result: PackedResult, num_accepted: int, bonus_token: int,
               miss_policy: MissPolicy) -> tuple[torch.Tensor | None, bool]:
    """(block logits (B, V) for the block after the verdict, or None to redraft; whether it was a hit)."""
    for (k, guess), logits in zip(result.branches, result.logits):
        if (k, guess) == (num_accepted, bonus_token):
            return logits, True
    if miss_policy == "reanchor":
        for (k, _), logits in zip(result.branches, result.logits):
            if k == num_accepted:  # plan order: the most probable same-k branch
                return logits, False
    return None, False


def round_spans(started: float, drafted: float, verified: float, waited: float, result: PackedResult | None,
                concurrent: bool) -> list[Span]:
    """One round on the timeline: a synchronous draft (if any), the verification, the packed pass
    (on the drafter's lane when it ran concurrently) and the wait for it (if any)."""
    spans = [Span("target", "draft", started, drafted)] if drafted - started > 1e-4 else []
    spans.append(Span("target", "verify", drafted, verified))
    if result is not None:
        spans.append(Span("drafter" if concurrent else "target", "packed draft",
                          result.started, result.started + result.seconds))
    if waited - verified > 1e-4:
        spans.append(Span("target", "wait", verified, waited))
    return spans


def check_drafter(drafter: Drafter | None) -> Drafter:
    """Refuse a drafter that cannot draft a block ahead of verification in one packed pass."""
    if drafter is None:
        raise ConfigError("asynchronous drafting needs a drafter")
    if drafter.config.kind == "dflash":
        raise ConfigError("asynchronous drafting needs a D3D drafter: a DFlash-style drafter reads the target's "
                          "hidden states of the tokens before its block, so it cannot draft ahead of verification")
    if drafter.config.kind != "d3d":
        raise ConfigError("asynchronous drafting needs a D3D drafter: an AR drafter's drafts each wait for the one "
                          "before, so it cannot draft a block ahead in one pass")
    if drafter.config.denoising_steps != 1:
        raise ConfigError("asynchronous drafting runs one denoising step per block; "
                          f"this drafter is configured for {drafter.config.denoising_steps}")
    if drafter.config.labels != "shifted":
        raise ConfigError("asynchronous drafting needs a drafter with shifted labels: its branch plan "
                          "guesses the bonus token from the row after the last draft")
    return drafter


def bounded_plan(planner: Planner, tokens: list[int], draft_tokens: list[int], max_k: int, budget: int,
                 guess_logits: torch.Tensor) -> list[Branch]:
    """The planner's branches for one verification: distinct, k within 0 … max_k, at most `budget`."""
    branches = planner(tokens, draft_tokens, guess_logits, max_k)
    return list(dict.fromkeys(b for b in branches if 0 <= b[0] <= max_k))[:budget]


def account(stats: SpecStats, started: float, drafted: float, verified: float, waited: float,
            result: PackedResult | None, concurrent: bool) -> None:
    """Charge one round's times: drafting on the critical path, verification, the worker's pass and
    the wait for it (serially, the pass ran before verification, inside the drafting time)."""
    stats.draft_seconds += (drafted - started) + (waited - verified)
    stats.verify_seconds += verified - drafted
    if result is not None:
        stats.packed_seconds += result.seconds
        stats.wait_seconds += waited - verified if concurrent else result.seconds


@torch.no_grad()
def async_generate(target: Decoder, drafter: Drafter, prompt_ids: list[int], config: GenerationConfig,
                   async_config: AsyncConfig | None = None, planner: Planner | None = None,
                   timeline: list[Span] | None = None) -> Iterator[Step]:
    """Speculative decoding with successor blocks drafted during verification (see module docstring).

    `timeline`, when given, receives a `Span` for every verification, synchronous draft, packed
    drafting job and wait (see `d3d.timeline`).

    Same contract as `d3d.engine.speculative_generate`: one `Step` per target forward with running
    `SpecStats` (which here also count branch hits, drafting-job time and waiting). The worker
    thread ends when the generator is exhausted, closed or interrupted by an exception.
    """
    async_config = async_config or AsyncConfig()
    source = DrafterSource(check_drafter(drafter))
    check_vocabulary([source], target)
    sampling = config.sampling
    if planner is None:
        def planner(tokens: list[int], drafts: list[int], guess_logits: torch.Tensor, max_k: int) -> list[Branch]:
            return plan_branches(guess_logits, drafts, max_k, async_config, sampling)
    block_size, budget = drafter.block_size, async_config.max_branches
    sequence = Sequence(prompt_ids, target.config.max_position_embeddings, config)
    generator = make_generator(sampling, target.device)
    step, target_cache = prefill(target, sequence, sampling, generator)
    verify_mode(target)  # the exactness check (on a GPU, its graph's capture) before the drafter's worker shares the device
    yield step
    if sequence.finish_reason is not None:
        return
    # Room for the committed tokens, a trunk and every branch block of one packed forward.
    source.start(sequence.max_length + budget * block_size, target.device)
    drafter_cache = source.cache
    worker = DraftWorker(drafter, async_config.concurrent, async_config.drafter_threads)
    no_drafts = torch.empty(0, dtype=torch.long, device=target.device)
    try:
        with target.holding_weights():
            block_logits: torch.Tensor | None = None  # (B, V) drafted for the block after tokens[-1]
            while sequence.finish_reason is None:
                # 1. this round's drafts: drafted ahead last round (a hit), else now, on the critical path
                num_drafts = min(block_size - 1, sequence.room - 1)  # the bonus token always needs a slot
                started = time.perf_counter()
                if num_drafts > 0 and block_logits is None:
                    block_logits = source.block_logits(sequence.tokens)
                draft_tokens, draft_probs = (drafts_from_logits(block_logits[:num_drafts], sampling, generator)
                                             if num_drafts > 0 else (no_drafts, None))
                # 2. the worker drafts the next round's block for the likely verdicts; k accepted commits
                # k+1 tokens, and a branch is useful only if two slots remain to draft into
                max_k = min(num_drafts, sequence.room - 3)
                packed, anchor_slot = None, len(sequence.tokens) - 1
                if max_k >= 0 and budget > 0:
                    drafts = draft_tokens.tolist()
                    plan = partial(bounded_plan, planner, list(sequence.tokens), drafts, max_k, budget)
                    guesses = block_logits if async_config.guess_source == "block" else None
                    clean = sequence.tokens[drafter_cache.length:]  # ends with the anchor
                    packed = worker.submit(drafting_job(drafter, drafter_cache, clean, drafts, plan, guesses))
                # 3. verification, meanwhile
                drafted = time.perf_counter()
                verdict = verify_block(target, target_cache, sequence.tokens[-1], draft_tokens, draft_probs,
                                       sampling, generator)
                verified = time.perf_counter()
                result = packed.result() if packed is not None else None
                waited = time.perf_counter()
                account(sequence.stats, started, drafted, verified, waited, result, async_config.concurrent)
                if timeline is not None:
                    timeline += round_spans(started, drafted, verified, waited, result, async_config.concurrent)
                # 4. the verdict picks the next block among the branches (a hit), or none
                block_logits, hit = None, False
                if result is not None:
                    drafter_cache.crop(anchor_slot + verdict.num_accepted + 1)  # a, d_1..d_k are committed now
                    block_logits, hit = next_block(result, verdict.num_accepted, verdict.bonus_token,
                                                   async_config.miss_policy)
                new_tokens = draft_tokens[:verdict.num_accepted].tolist() + [verdict.bonus_token]
                step = sequence.commit(new_tokens, len(draft_tokens), verdict.num_accepted,
                                       source.name if num_drafts > 0 else "none")
                if num_drafts > 0 and sequence.finish_reason is None and sequence.room >= 2:
                    # a next block is needed: was it ready, or at least drafted for this k?
                    planned = result is not None and any(k == verdict.num_accepted for k, _ in result.branches)
                    sequence.stats.record_branch(verdict.num_accepted, hit, planned)
                yield step
    finally:
        worker.close()
