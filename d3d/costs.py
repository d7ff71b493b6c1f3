"""What verifying and drafting cost on this machine, measured once: the speculation gate's cost model.

The gate (`d3d.gate`) weighs the tokens a draft is expected to commit against what it costs: a
verification of k drafts is one (k + 1)-row target forward, a drafter proposal one block pass.
Both are measured here in one-token target steps, for every k, by timing the real forwards the
engines run (`target_step.score_rows`, `Drafter.draft` over the rows k drafts need, or for an AR
drafter k sequential `Drafter.next_logits` passes, as `sources.ARDrafterSource` runs them) after a
context of a typical mid-generation length (`CONTEXT`; at 128 tokens a 6-row verification
measured 1.30 steps, at 300 1.40, on the project's AMD EPYC): each round times every row count back
to back, and each cost is the median over rounds of its ratio to that round's one-token step, then
made non-decreasing in k and rounded to 0.01.
The result is stored per machine, kernel build, thread count, dtype and model shapes under
`$D3D_CACHE/costs`, so the gate's choices — and with them the random draws at T > 0 — are a
function of the tokens alone once a machine is measured: the same seed gives the same output. A
fixed formula could not do that job: every kernel change moves the ratio of a 16-token
verification to a one-token step (docs/performance.md: 2.2 steps before the one-call forward,
2.1–2.7 after, on the same machine).

Costs are measured after each of `CONTEXTS` tokens (within the model's limit) and read by the gate
at the request's current length (`d3d.gate.ByContext`): the relative cost of more rows grows with
the context (AMD EPYC Zen 5: verifying 8 drafts 1.28 steps after 256 tokens, 2.13 after 4,096).
After the first context, fewer rounds and a subset of row counts are timed (the rest interpolated
linearly in k), and the longer contexts repeat the first `PREFILLED` tokens' keys and values
rather than run a long prefill, to keep the measurement to seconds. `catch_up` is what the drafter's first pass over
the context costs per token (a D3D drafter reads the prompt on its first draft of a request).

A measurement taken while other work held the cores is wrong, not just slow: with the threads
oversubscribed, a one-token step took 97 ms instead of 11 and verifying 2–6 rows looked free
(1.0 step each, against 1.13–1.40 on the idle machine), so the gate drafted where it lost time.
Stored costs are therefore checked against a quick timing of the one-token step when first read
in a process (`probe_step_ms`), and measured again when their step was `BUSY` times slower.

`batch_costs` is the continuous batch's table (`d3d.batch`, `d3d.gate.Crowd`): a forward of n
one-row sequences, each after its own cache, in one-token steps, stored beside the others.

This module times forwards; it decides nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from weakref import WeakKeyDictionary

import torch
from tqdm import tqdm

from d3d.cache import KVCache
from d3d.devices import synchronize
from d3d.drafter import Drafter
from d3d.exactness import machine_key
from d3d.files import write_text
from d3d.gate import ByContext
from d3d.loading import cache_root
from d3d.models import Decoder, SequenceRows
from d3d.target_step import score_rows

CONTEXT = 256  # tokens before the timed forwards: about a benchmark generation's middle
CONTEXTS = (CONTEXT, 1024, 4096)  # … and longer ones, for long prompts
PREFILLED = CONTEXT  # tokens a measurement runs through the target; longer contexts repeat their K/V
MEASUREMENT = 5  # bump when what is timed changes (e.g. the drafter's head kernel), to measure afresh
ROUNDS, REPEATS = 7, 3  # rounds over every row count; forwards per timing (their mean)
LONG_ROUNDS = 3  # rounds after the longer contexts …
LONG_DRAFTS = (1, 2, 3, 4, 6, 8, 11, 15)  # … over these draft counts (others interpolated)
PROBE_ROUNDS = 1  # timings of the one-token step that check stored costs (their median): a busy moment only
# makes it slower, which keeps the stored costs, so one does (0.10 s of each process, 0.18 with 3; Zen 3)
PROBE_CONTEXT = 32  # tokens before them: a short prefill (0.2 s, once a process; 0.45 s after 256 tokens)
BUSY = 1.5  # stored costs whose one-token step was this many times slower than now are measured again


@dataclass(frozen=True)
class ForwardCosts:
    """Costs in one-token target steps, as the gate reads them."""

    verify: tuple[float, ...]  # verify[k]: verifying k drafts (a (k+1)-row forward); verify[0] = 1; () when drafter_only
    drafter: tuple[float, ...]  # drafter[k]: drafting k drafts (a pass over their rows); all 0.0 without a drafter
    step_ms: float  # the one-token step they are measured in, when measured
    seconds: float = 0.0  # how long the measurement took
    # the same after each of `contexts` (verify and drafter above are the first), and the drafter's
    # catching up on a context, per token
    contexts: tuple[int, ...] = ()
    verify_by_context: tuple[tuple[float, ...], ...] = ()
    drafter_by_context: tuple[tuple[float, ...], ...] = ()
    catch_up: tuple[float, ...] = ()

    def by_context(self, kind: str) -> ByContext:
        """"verify", "drafter" or "catch_up" ([0] per token) as the gate reads them at any context."""
        if not self.contexts:  # stored by a d3d before costs followed the context
            return ByContext((CONTEXT,), ((self.verify if kind == "verify" else self.drafter if kind == "drafter"
                                          else (0.0,)),))
        rows = {"verify": self.verify_by_context, "drafter": self.drafter_by_context,
                "catch_up": tuple((per_token,) for per_token in self.catch_up)}[kind]
        return ByContext(self.contexts, rows)


@torch.no_grad()
def measure(target: Decoder, drafter: Drafter | None, max_drafts: int, seed: int = 0,
            drafter_only: bool = False, progress: bool = False) -> ForwardCosts:
    """Time verifications of 0 … max_drafts drafts and drafter passes for 1 … max_drafts drafts,
    against a one-token step, after each of `CONTEXTS` tokens. `drafter_only`: time of the
    verifications only the one-token step the passes are counted in (the verify tables stay empty):
    what a drafting source reads, its verifications being the target's alone (`forward_costs(target,
    None, …)`) — the shipped drafter's 11.2 → 5.3 s on 2 Zen 3 cores. `progress`: a bar over the
    rounds (a real model's first measurement takes ~20 s)."""
    started = time.perf_counter()
    limit = target.config.max_position_embeddings
    max_drafts = min(max_drafts, limit - 2)
    contexts = sorted({max(1, min(c, limit - max_drafts - 1)) for c in CONTEXTS})
    verify, drafting, catch_up, steps_ms = [], [], [], []
    bar = tqdm(total=ROUNDS + LONG_ROUNDS * (len(contexts) - 1), desc="gate costs", unit="round",
               disable=not progress, leave=False)
    for i, context in enumerate(contexts):
        drafts = range(max_drafts + 1) if i == 0 else sorted({0, *(k for k in LONG_DRAFTS if k < max_drafts), max_drafts})
        row = _measure_after(target, drafter, context, max_drafts, ROUNDS if i == 0 else LONG_ROUNDS, list(drafts), seed,
                             drafter_only, bar)
        verify.append(row[0])
        drafting.append(row[1])
        catch_up.append(row[2])
        steps_ms.append(row[3])
    bar.close()
    return ForwardCosts(verify[0], drafting[0], steps_ms[0], round(time.perf_counter() - started, 2),
                        tuple(contexts), tuple(verify), tuple(drafting), tuple(catch_up))


def _measure_after(target: Decoder, drafter: Drafter | None, context: int, max_drafts: int, rounds: int,
                   drafts: list[int], seed: int, drafter_only: bool, bar: tqdm
                   ) -> tuple[tuple[float, ...], tuple[float, ...], float, float]:
    """(verify[k], drafter[k], the drafter's catching up per token, the step in ms) after `context`
    tokens, timing the draft counts `drafts` (0 and max_drafts among them) and interpolating the rest."""
    tokens, cache = _after_context(target, context, max_drafts + 1, seed)
    blocks = {k: tokens[None, context:context + k + 1].to(target.device) for k in drafts}

    draft: Callable[[int], Callable[[], None]] | None = None  # drafting k drafts, after a round
    catching_up = 0.0
    if drafter is not None:
        drafter_cache = drafter.new_cache(context + 1)
        history = tokens[:context + 1].tolist()
        kind = drafter.config.kind
        features = (torch.zeros(len(history), len(drafter.config.feature_layers) * target.config.hidden_size,
                                dtype=target.dtype, device=target.device)  # DFlash-style: stand-in hidden states
                    if kind == "dflash" else None)
        began = time.perf_counter()
        if kind == "ar":
            drafter.next_logits(drafter_cache, history[:-2])
        elif kind == "dflash":
            drafter.read_features(drafter_cache, features[:-2])
        else:
            drafter.draft(drafter_cache, history[:-1])  # the cache then holds all but the last two tokens
        synchronize(target.device)
        catching_up = (time.perf_counter() - began) * 1000 / max(context - 1, 1)  # ms per token, for now

        def drafting(num_drafts: int) -> Callable[[], None]:
            def run():  # as after a round: one newly committed token to feed, then the block
                drafter_cache.crop(len(history) - 2)
                if kind == "dflash":  # its hidden states, from the verification just done
                    drafter.read_features(drafter_cache, features[-2:-1])
                drafter.draft(drafter_cache, history, num_drafts)

            def run_ar():  # as after a round: the newly committed token and the anchor, then a pass per draft
                drafter_cache.crop(len(history) - 2)
                logits = drafter.next_logits(drafter_cache, history[-2:])
                for _ in range(num_drafts - 1):
                    logits = drafter.next_logits(drafter_cache, [int(logits.argmax())])
            return run_ar if kind == "ar" else run
        draft = drafting

    # Each round times every row count (and the drafter) back to back and divides by its own
    # one-token step; the median over rounds of those ratios shrugs off a busy moment on a shared
    # machine, which would shift absolute times of different row counts by different amounts.
    ratios: dict[int, list[float]] = {k: [] for k in drafts}
    drafter_ratios: dict[int, list[float]] = {k: [] for k in drafts}
    steps_ms = []
    verified = {0: blocks[0]} if drafter_only else blocks
    for _ in range(rounds):
        times = {k: _timed(_verification(target, cache, block), target.device) for k, block in verified.items()}
        steps_ms.append(times[0])
        for k in drafts:
            if k in times:
                ratios[k].append(times[k] / times[0])
            if draft is not None and k:
                drafter_ratios[k].append(_timed(draft(k), target.device) / times[0])
        bar.update(1)
    step = median(steps_ms)
    return (() if drafter_only else fill_in(non_decreasing([ratios[k] for k in drafts], first=1.0), drafts, max_drafts),
            fill_in(non_decreasing([drafter_ratios[k] for k in drafts], first=0.0), drafts, max_drafts),
            round(catching_up / step, 4), round(step, 3))


def fill_in(measured: tuple[float, ...], drafts: list[int], max_drafts: int) -> tuple[float, ...]:
    """Costs for every k ≤ max_drafts from those measured at `drafts` (ascending, 0 and max_drafts
    included): linear between neighbours, rounded to 0.01."""
    by_k = dict(zip(drafts, measured))
    full = []
    for k in range(max_drafts + 1):
        if k in by_k:
            full.append(by_k[k])
            continue
        low = max(d for d in drafts if d < k)
        high = min(d for d in drafts if d > k)
        full.append(round(by_k[low] + (k - low) / (high - low) * (by_k[high] - by_k[low]), 2))
    return tuple(full)


def _after_context(target: Decoder, context: int, extra: int, seed: int) -> tuple[torch.Tensor, KVCache]:
    """Random tokens (context + extra,) and a target cache of `context` positions: the first
    `PREFILLED` of them run through the target, their keys and values repeated to fill the rest.
    What a forward after the cache costs follows the cache's length, not what it holds (the kernels
    read every slot the same way), and a 4,096-token prefill took 15 s of a first measurement on an
    AMD EPYC Zen 3 (twice: the target's table and the drafter's)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (context + extra,), generator=generator)
    cache = target.new_cache(context + extra)
    prefilled = min(context, PREFILLED)
    target(tokens[None, :prefilled].to(target.device), cache=cache)
    cache.commit()
    if context > prefilled:
        keys, values = cache.snapshot(prefilled)
        copies = -(-context // prefilled)
        # the slot is the second-to-last dimension of keys and values, plain or split (KVCache.snapshot)
        cache.restore(torch.cat([keys] * copies, dim=-2), torch.cat([values] * copies, dim=-2), context)
    return tokens, cache


def _verification(target: Decoder, cache: KVCache, block: torch.Tensor) -> Callable[[], None]:
    """A verification of `block` (1, rows) after the cache, leaving the cache as it was: the forward
    and the head over the rows it computes at once (`target_step.head_rows`; a verification reads
    more only past accepted drafts)."""
    def run():
        score_rows(target, [SequenceRows(block[0], cache)])
        cache.commit(0)
    return run


def _timed(function: Callable[[], None], device: torch.device) -> float:
    """Milliseconds per call: the mean of `REPEATS` calls after one to warm up."""
    function()
    synchronize(device)
    began = time.perf_counter()
    for _ in range(REPEATS):
        function()
    synchronize(device)
    return (time.perf_counter() - began) / REPEATS * 1000


@torch.no_grad()
def probe_step_ms(target: Decoder) -> float:
    """The one-token step now, timed as `measure` times it (median of `PROBE_ROUNDS`) after a
    shorter context: a few forwards, to tell whether stored costs were measured on a busy machine."""
    context = max(1, min(PROBE_CONTEXT, target.config.max_position_embeddings - 2))
    tokens, cache = _after_context(target, context, 1, seed=0)
    step = _verification(target, cache, tokens[None, context:].to(target.device))
    return median(_timed(step, target.device) for _ in range(PROBE_ROUNDS))


def non_decreasing(ratios: list[list[float]], first: float) -> tuple[float, ...]:
    """Median of each k's ratios, rounded to 0.01, never below the one before (more rows never cost
    less); [0] = `first`. All zeros when nothing was measured (no drafter)."""
    costs, highest = [first], first
    for measured in ratios[1:]:
        highest = max(highest, round(median(measured), 2)) if measured else 0.0
        costs.append(highest)
    return tuple(costs)


_machine_keys: WeakKeyDictionary[Decoder, tuple[int, int, list]] = WeakKeyDictionary()


def _machine_key(target: Decoder) -> list:
    """`machine_key(target)`, kept per decoder, thread count and kernels (it walks every weight's
    stream, ~0.5 ms, and each new generation asks for its costs several times)."""
    threads, kernels, held = torch.get_num_threads(), id(target.row_exact), _machine_keys.get(target)
    if held is None or held[:2] != (threads, kernels):
        held = _machine_keys[target] = (threads, kernels, machine_key(target))
    return held[2]


def _cache_file(target: Decoder, drafter: Drafter | None, max_drafts: int, drafter_only: bool = False) -> Path:
    drafter_shape = None
    if drafter is not None:
        drafter_shape = [drafter.config.model.to_dict(), drafter.block_size, drafter.config.draft_vocab_size,
                         drafter.config.block_attention, drafter.config.denoising_steps, str(drafter.decoder.dtype)]
        if drafter.config.kind != "d3d":  # appended only for other kinds: D3D drafters keep their stored costs
            drafter_shape.append(drafter.config.kind)
    key = json.dumps([_machine_key(target), drafter_shape, max_drafts, CONTEXTS, MEASUREMENT]
                     + (["drafter only"] if drafter_only else []), sort_keys=True)
    return cache_root() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


_measured: dict[Path, ForwardCosts] = {}
_probed: dict[str, float] = {}  # machine_key → the one-token step timed by this process


def forward_costs(target: Decoder, drafter: Drafter | None = None, max_drafts: int = 15,
                  remeasure: bool = False, drafter_only: bool = False) -> ForwardCosts:
    """The costs for this machine and these models: from memory, from disk, or measured and stored.
    `drafter_only`: the drafter's costs without verify tables (`measure`), as drafting sources read them."""
    path = _cache_file(target, drafter, max_drafts, drafter_only)
    if not remeasure:
        if path in _measured:
            return _measured[path]
        try:
            data = json.loads(path.read_text())
            costs = ForwardCosts(tuple(data["verify"]), tuple(data["drafter"]), data["step_ms"], data["seconds"],
                                 tuple(data["contexts"]), tuple(map(tuple, data["verify_by_context"])),
                                 tuple(map(tuple, data["drafter_by_context"])), tuple(data["catch_up"]))
        except (OSError, ValueError, TypeError, KeyError):
            costs = None
        if costs is not None:
            key = json.dumps(_machine_key(target))  # the target alone's and the drafter's costs share a probe
            now = _probed[key] = _probed.get(key) or probe_step_ms(target)
            if costs.step_ms <= BUSY * now:
                _measured[path] = costs
                return costs
            print(f"d3d: the stored verification costs were measured while the machine was busy (a one-token "
                  f"step took {costs.step_ms:.1f} ms, {now:.1f} ms now): measuring again", file=sys.stderr)
    real = target.config.num_layers > 4  # a real model: seconds, worth a word and a bar
    if real:
        what = ("the drafter's passes" if drafter_only else "verifications" if drafter is None
                else "verifications and the drafter's passes")
        print(f"d3d: measuring what {what} cost on this machine, for the speculation gate "
              "(once; stored under $D3D_CACHE/costs)", file=sys.stderr)
    costs = measure(target, drafter, max_drafts, drafter_only=drafter_only, progress=real)
    write_text(path, json.dumps(asdict(costs), indent=2))
    _measured[path] = costs
    return costs


# -- batched forwards -----------------------------------------------------------------------------

BATCH_SEQUENCES = (1, 2, 4, 8, 16, 32)  # one-row sequences per timed forward (others interpolated)
BATCH_CONTEXT = 128  # tokens in each sequence's cache before it
BATCH_MEASUREMENT = 2  # bump when the batched forward changes (2: short segments' attention together)


@torch.no_grad()
def measure_batch(target: Decoder, rounds: int = LONG_ROUNDS) -> tuple[float, ...]:
    """[n]: a forward of n one-row sequences, each after its own cache of `BATCH_CONTEXT` tokens
    (`Decoder.forward_rows`, as `d3d.batch` runs them), in one-token steps; [0] = 0. The median over
    rounds of each n's ratio to that round's one-row forward, non-decreasing, 0.01-rounded."""
    from d3d.models import SequenceRows  # the batched forward's part

    context = max(1, min(BATCH_CONTEXT, target.config.max_position_embeddings - 2))
    tokens, first = _after_context(target, context, 1, seed=0)
    caches = [first]
    for _ in range(BATCH_SEQUENCES[-1] - 1):  # distinct caches, as distinct requests' are
        cache = target.new_cache(context + 1)
        cache.keys.copy_(first.keys)
        cache.values.copy_(first.values)
        cache.length = first.length
        caches.append(cache)
    anchor = tokens[context:].to(target.device)

    def forward(n: int) -> Callable[[], None]:
        def run():
            target.forward_rows([SequenceRows(anchor, cache) for cache in caches[:n]])
            for cache in caches[:n]:
                cache.commit(0)
        return run

    ratios: dict[int, list[float]] = {n: [] for n in BATCH_SEQUENCES}
    for _ in range(rounds):
        one = _timed(forward(1), target.device)
        for n in BATCH_SEQUENCES:
            ratios[n].append(_timed(forward(n), target.device) / one)
    measured = non_decreasing([[]] + [ratios[n] for n in BATCH_SEQUENCES], 0.0)
    return fill_in(measured, [0, *BATCH_SEQUENCES], BATCH_SEQUENCES[-1])


_batch_measured: dict[Path, tuple[float, ...]] = {}


def batch_costs(target: Decoder) -> tuple[float, ...]:
    """`measure_batch` for this machine and target: from memory, from disk, or measured and stored
    beside the verification costs. Unlike them it is not re-measured when the machine was busy: its
    entries are medians of per-round ratios to a one-row forward timed in the same round."""
    key = json.dumps([_machine_key(target), "batch", BATCH_SEQUENCES, BATCH_CONTEXT, MEASUREMENT, BATCH_MEASUREMENT],
                     sort_keys=True)
    path = cache_root() / "costs" / f"batch-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if path in _batch_measured:
        return _batch_measured[path]
    try:
        costs = tuple(json.loads(path.read_text())["rows_cost"])
    except (OSError, ValueError, TypeError, KeyError):
        if target.config.num_layers > 4:
            print("d3d: measuring what batched forwards cost on this machine (once; stored under "
                  "$D3D_CACHE/costs)", file=sys.stderr)
        costs = measure_batch(target)
        write_text(path, json.dumps({"rows_cost": costs}, indent=2))
    _batch_measured[path] = costs
    return costs
