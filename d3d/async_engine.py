"""Asynchronous speculative decoding: packed successor drafting overlapped with verification.

D3D's drafter reads token ids only, so it can work ahead (SPEC §2, "Asynchronous packed
drafting"). While the target verifies the block [a, d_1..d_K] after anchor a at position p, a
drafting worker runs one packed forward (`Drafter.packed_draft`) over
- the *trunk* a, d_1..d_K as clean causal tokens, whose KV for a, d_1..d_k is valid whenever the
  target accepts k drafts, and
- one *branch* per anticipated outcome (k accepted, bonus guess b): the draft block
  [b, MASK × (B-1)] at p+k+1 … p+k+B that the next round would draft after that outcome.
The verdict (k, bonus) then picks its branch (a *hit*: the next block is drafted already and the
next verification starts at once) or finds none (a *miss*: `miss_policy` decides). Round time is
≈ T_verify + (1 − hit rate) · T_draft instead of T_verify + T_draft.

Lossless in every case: the target verifies every draft, and at T > 0 each draft is drawn from a
distribution fixed before its verification, which is all rejection sampling needs. The engine
reuses `d3d.engine`'s `Sequence`, `prefill`, `propose` and `verify_block`; only the drafting
schedule differs from `speculative_generate`. It is not a batch engine and uses no context lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from d3d.cache import KVCache
from d3d.config import ConfigError, GenerationConfig, SamplingConfig, _JsonMixin
from d3d.drafter import Drafter
from d3d.engine import Sequence, Step, prefill, propose, verify_block
from d3d.models import Decoder
from d3d.sampling import make_generator, probabilities

Branch = tuple[int, int]  # (num_accepted k, bonus guess b)
# A planner maps (committed tokens, draft_tokens, block_logits (B, V), largest useful k) to the
# branches to draft, most probable first. Tests inject planners that know the true outcome.
Planner = Callable[[list[int], list[int], torch.Tensor, int], list[Branch]]
MissPolicy = Literal["redraft", "reanchor"]
Selection = Literal["joint", "per_k"]


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
        if self.drafter_threads < 0:
            raise ConfigError(f"drafter_threads must be >= 0, got {self.drafter_threads}")


# -- branch plan ---------------------------------------------------------------------------------

def plan_branches(block_logits: torch.Tensor, draft_tokens: list[int], max_k: int, config: AsyncConfig,
                  sampling: SamplingConfig) -> list[Branch]:
    """The outcomes (k, b) worth drafting ahead, most probable first, judged by the drafter alone.

    block_logits (B, V): the pass that drafted d_1..d_K; row i predicts the token after d_i (row 0:
    after the anchor), so row K — the extra row when K = B-1 — predicts the bonus after a full
    accept. With c_i = q_i(d_{i+1}) the drafter's confidence in its own draft,
    P(k accepted, bonus b) ≈ c_0 ⋯ c_{k-1} · q_k(b), b ≠ d_{k+1} (the target rejected it) for k < K.
    Only k ≤ max_k are planned (a larger k leaves no room to draft another block).
    """
    num_drafts = len(draft_tokens)
    assert block_logits.dim() == 2 and block_logits.shape[0] > num_drafts, \
        f"block_logits {tuple(block_logits.shape)} needs a row per draft and one after them"
    max_k = min(max_k, num_drafts)
    if config.max_branches == 0 or max_k < 0:
        return []
    rows = block_logits[:max_k + 1].float()
    draft_probs = rows.softmax(-1) if sampling.greedy else probabilities(rows, sampling)  # (max_k+1, V)
    num_judged = min(max_k + 1, num_drafts)  # rows k whose draft d_{k+1} is under verification
    judged = torch.arange(num_judged)
    drafts = torch.tensor(draft_tokens[:num_judged], dtype=torch.long)
    confidence = draft_probs[judged, drafts]  # (num_judged,)
    reach = torch.cat([torch.ones(1), torch.cumprod(confidence, 0)])[:max_k + 1]  # P(d_1..d_k accepted)
    guesses = draft_probs.clone()
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
    seconds: float  # the packed pass's own duration


class DraftWorker:
    """Runs packed drafting passes in one dedicated thread (concurrent) or inline (serial).

    A thread suffices on CPU: torch kernels release the GIL, and `torch.set_num_threads` is
    thread-local under OpenMP (measured: setting it in the worker leaves the main thread's count
    unchanged), so the worker gets its own thread budget. On CUDA the worker drafts on its own
    stream and synchronises it before handing results back.
    """

    def __init__(self, drafter: Drafter, concurrent: bool, threads: int) -> None:
        self.drafter = drafter
        self.threads = threads
        self.stream = None
        self.executor: ThreadPoolExecutor | None = None
        if concurrent:
            if drafter.decoder.device.type == "cuda":
                self.stream = torch.cuda.Stream(drafter.decoder.device)
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="d3d-drafter", initializer=self._init_thread)

    def _init_thread(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def _run(self, cache: KVCache, clean: list[int], draft_tokens: list[int], branches: list[Branch]) -> PackedResult:
        started = time.perf_counter()
        if self.stream is not None:
            # Work queued on the main stream (an earlier synchronous draft into this cache) first.
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            logits = self.drafter.packed_draft(cache, clean, draft_tokens, branches)
        if self.stream is not None:
            self.stream.synchronize()
        return PackedResult(branches, logits, time.perf_counter() - started)

    def submit(self, cache: KVCache, clean: list[int], draft_tokens: list[int],
               branches: list[Branch]) -> Future[PackedResult]:
        if self.executor is not None:
            return self.executor.submit(self._run, cache, clean, draft_tokens, branches)
        future: Future[PackedResult] = Future()
        try:
            future.set_result(self._run(cache, clean, draft_tokens, branches))
        except Exception as error:  # delivered by result(), as from the thread
            future.set_exception(error)
        return future

    def close(self) -> None:
        """Wait for a running pass (a torch kernel cannot be interrupted) and end the thread."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None


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


@torch.no_grad()
def async_generate(target: Decoder, drafter: Drafter, prompt_ids: list[int], config: GenerationConfig,
                   async_config: AsyncConfig | None = None, planner: Planner | None = None) -> Iterator[Step]:
    """Speculative decoding with successor blocks drafted during verification (see module docstring).

    Same contract as `d3d.engine.speculative_generate`: one `Step` per target forward with running
    `SpecStats` (which here also count branch hits, packed-pass time and waiting). The worker thread
    ends when the generator is exhausted, closed or interrupted by an exception.
    """
    async_config = async_config or AsyncConfig()
    if drafter is None:
        raise ConfigError("asynchronous drafting needs a drafter")
    if drafter.config.target_vocab_size != target.config.vocab_size:
        raise ValueError("the drafter was made for another vocabulary")
    if drafter.config.denoising_steps != 1:
        raise ConfigError("asynchronous drafting runs one denoising step per block; "
                          f"this drafter is configured for {drafter.config.denoising_steps}")
    sampling = config.sampling
    if planner is None:
        def planner(tokens: list[int], draft_tokens: list[int], block_logits: torch.Tensor, max_k: int) -> list[Branch]:
            return plan_branches(block_logits, draft_tokens, max_k, async_config, sampling)

    block_size = drafter.block_size
    sequence = Sequence(prompt_ids, target.config.max_position_embeddings, config)
    generator = make_generator(sampling)
    step, target_cache = prefill(target, sequence, sampling, generator)
    yield step
    if sequence.finish_reason is not None:
        return
    stats = sequence.stats
    # Room for the committed tokens plus one packed pass: the trunk and every branch block.
    drafter_cache = drafter.new_cache(sequence.max_length + async_config.max_branches * block_size)
    worker = DraftWorker(drafter, async_config.concurrent, async_config.drafter_threads)
    try:
        block_logits: torch.Tensor | None = None  # (B, V) drafted for the block after tokens[-1]
        while sequence.finish_reason is None:
            num_drafts = min(block_size - 1, sequence.room - 1)  # the bonus token always needs a slot
            started = time.perf_counter()
            if num_drafts > 0 and block_logits is None:
                block_logits = drafter.draft(drafter_cache, sequence.tokens)
            draft_tokens, draft_probs = (propose(block_logits[:num_drafts], sampling, generator)
                                         if num_drafts > 0 else (torch.empty(0, dtype=torch.long), None))
            # k accepted commits k+1 tokens; a branch is useful only if two slots remain to draft into.
            max_k = min(num_drafts, sequence.room - 3)
            branches = planner(sequence.tokens, draft_tokens.tolist(), block_logits, max_k) if max_k >= 0 else []
            branches = list(dict.fromkeys(b for b in branches if 0 <= b[0] <= max_k))[:async_config.max_branches]
            clean = sequence.tokens[drafter_cache.length:]  # ends with the anchor
            packed = worker.submit(drafter_cache, clean, draft_tokens.tolist(), branches) if branches else None
            drafted = time.perf_counter()
            verdict = verify_block(target, target_cache, sequence.tokens[-1], draft_tokens, draft_probs,
                                   sampling, generator)
            verified = time.perf_counter()
            result = packed.result() if packed is not None else None
            waited = time.perf_counter()
            stats.draft_seconds += (drafted - started) + (waited - verified)
            stats.verify_seconds += verified - drafted
            if result is not None:
                stats.packed_seconds += result.seconds
                # Serially the pass ran before verification, inside `drafted - started`.
                stats.wait_seconds += waited - verified if async_config.concurrent else result.seconds
                drafter_cache.commit(len(clean) + verdict.num_accepted)  # a, d_1..d_k are committed now
            new_tokens = draft_tokens[:verdict.num_accepted].tolist() + [verdict.bonus_token]
            step = sequence.commit(new_tokens, len(draft_tokens), verdict.num_accepted,
                                   "drafter" if num_drafts > 0 else "none")
            block_logits, hit = None, False
            if result is not None:
                block_logits, hit = next_block(result, verdict.num_accepted, verdict.bonus_token,
                                               async_config.miss_policy)
            if num_drafts > 0 and sequence.finish_reason is None:
                stats.record_branch(verdict.num_accepted, hit)
            yield step
    finally:
        worker.close()
