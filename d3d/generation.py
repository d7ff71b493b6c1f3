"""Text in, text out: the user-facing pipeline over the token engines.

`Pipeline` holds a loaded target, its tokenizer and (optionally) a drafter; `generate()` applies the
chat template, runs an engine, and yields `Chunk`s of newly decoded text with the engine's `Step`
(and so the running `SpecStats`). It handles what needs a tokenizer — incremental detokenisation
that never emits half a UTF-8 character, and stop strings that never leak into the output — so
that the engines stay token-only. CLI, server and benchmark all consume this generator.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from d3d.async_engine import AsyncConfig, async_generate
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.drafter import Drafter, layer_selection
from d3d.batch import SharedBatch
from d3d.engine import generate_from_sources, reference_generate
from d3d.run import OnCommit, Run
from d3d.exactness import machine_key
from d3d.export import exported_from
from d3d.loading import Target, load_target
from d3d.lookup import LookupConfig
from d3d.prefix_cache import PREFIX_DISK_MB, PrefixCache
from d3d.quantized import QUANTIZE_TO
from d3d.sequence import Step
from d3d.sources import ARDrafterSource, DraftSource, default_sources

# "speculative": lookup where the context matches, the drafter elsewhere; "drafter" / "lookup":
# one source alone; "async": the drafter, drafting the next block during verification
# (d3d.async_engine); "ar": the plain autoregressive reference; "ar_drafter": classic speculative
# decoding with the AR drafter (`ar_drafter`, one pass per draft), k chosen by the gate.
Method = Literal["speculative", "drafter", "lookup", "async", "ar", "ar_drafter"]
METHODS: tuple[str, ...] = ("speculative", "drafter", "lookup", "async", "ar", "ar_drafter")
DEFAULT_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"


@dataclass
class Chunk:
    text: str  # newly decoded text (may be empty while a character or stop string is pending)
    step: Step  # the engine step that produced it
    finish_reason: str | None = None  # "eos", "length" or "stop" on the last chunk
    num_tokens: int = 0  # generated tokens the text so far stands for (a stop string's: up to the one completing it)
    # `text` split by the token that completed each part: (that token's index among the generated
    # tokens, its text); what a view colouring tokens by where they came from shows.
    pieces: list[tuple[int, str]] = field(default_factory=list)

    @classmethod
    def of(cls, pieces: list[tuple[int, str]], step: Step, finish_reason: str | None, num_tokens: int) -> "Chunk":
        return cls("".join(text for _, text in pieces), step, finish_reason, num_tokens, pieces)


class Pipeline:
    def __init__(self, target: Target, drafter: Drafter | None = None, drafter_source: str = "",
                 lookup: LookupConfig | None = None, async_config: AsyncConfig | None = None,
                 ar_drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.ar_drafter = ar_drafter  # method "ar_drafter" only: the AR-drafter baseline
        self.lookup = lookup or LookupConfig()
        self.adaptive = True  # gate speculation by its measured rate (see d3d.gate)
        self.async_config = async_config or AsyncConfig()  # method "async" only
        self.timeline: list | None = None  # set to a list to record async spans (d3d.timeline)
        self.drafter_source = drafter_source or ("none" if drafter is None else "given")  # for messages
        # prompt prefixes of ended generations, reused by later prompts (d3d.prefix_cache); None: off
        self.prefixes: PrefixCache | None = None

    @classmethod
    def load(cls, target: str | None = None, drafter: str | Path | None = "default",
             dtype: torch.dtype = torch.bfloat16, drafter_layers: list[int] | str | None = None,
             ar_drafter: str | Path | None = None, async_config: AsyncConfig | None = None,
             weights: str = "stored", drafter_weights: str = "stored") -> "Pipeline":
        """Load a target and a drafter.

        `drafter`: a checkpoint folder; "default" for the shipped drafter when the target is the
        embedded default (context lookup alone when none is shipped); "untrained" for a drafter
        copied from `drafter_layers` of the target (indices or "all" / "every:K" / ranges; all layers when
        None); None for no drafter.
        `ar_drafter`: an AR drafter checkpoint folder, for method "ar_drafter" (None: none).
        `async_config`: how method "async" drafts ahead (None: the defaults).
        `weights`: how the kernels read the target's weights (`d3d.loading.load_target`);
        `drafter_weights`: the drafter's (`resolve_drafter`).
        """
        loaded = load_target(target, dtype, weights)
        return cls(loaded, *resolve_drafter(loaded, drafter, target, drafter_layers, drafter_weights),
                   ar_drafter=load_ar_drafter(loaded, ar_drafter), async_config=async_config)

    def keep_prefixes(self, max_mb: int, folder: str | Path | None = None, disk_mb: int = PREFIX_DISK_MB) -> None:
        """Start later prompts from ended generations' keys and values (`d3d.prefix_cache`): `max_mb`
        MiB of them in memory, and with `folder` also on disk for later processes, in its subfolder
        for this target's weights, machine and kernels (`prefix_key`). Off with neither."""
        if folder is not None:
            folder = Path(folder) / prefix_key(self.target)
        self.prefixes = PrefixCache(max_mb << 20, folder, disk_mb << 20) if max_mb or folder is not None else None

    def encode(self, prompt: str | list[dict[str, str]], chat: bool = True) -> list[int]:
        tokenizer = self.target.tokenizer
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if tokenizer.chat_template is None:
                raise ConfigError("this target's tokenizer has no chat template: use a raw prompt")
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            return list(ids)
        return tokenizer.encode(prompt, add_special_tokens=False)

    def generation_config(self, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                          top_p: float = 1.0, seed: int | None = None) -> GenerationConfig:
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=list(self.target.eos_token_ids),
                                sampling=sampling)

    def steps(self, prompt_ids: list[int], config: GenerationConfig, method: Method = "speculative",
              batch: SharedBatch | None = None, on_commit: OnCommit | None = None) -> Iterator[Step]:
        """The token engine for `method` (see `Method`); with `batch`, a run in that continuous batch
        (`d3d.batch`: the same steps as alone, decoded together with the batch's other runs) unless
        the method is "async". `on_commit` gets the target's logits of every committed token
        (`d3d.run.OnCommit`; what the server's logprobs report): every method but "async", whose
        verification happens beside its drafting thread, gives them."""
        decoder = self.target.decoder
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
        if method == "async" and on_commit is not None:
            raise ConfigError("method 'async' does not report the target's logits: use another method")
        if method == "ar_drafter" and self.ar_drafter is None:
            raise ConfigError("method 'ar_drafter' needs an AR drafter: pass --ar-drafter PATH "
                              "(trained by `d3d train --drafter-kind ar`)")
        if method in ("drafter", "async") and self.drafter is None:
            raise ConfigError(f"method {method!r} needs a drafter: pass --drafter PATH or --drafter untrained")
        if method == "async":  # never batched: its drafter runs beside the target, one sequence at a time
            return async_generate(decoder, self.drafter, prompt_ids, config, self.async_config,
                                  timeline=self.timeline)
        sources, adaptive = self.sources(method)
        if batch is not None:
            return batch.submit(Run(decoder, sources, prompt_ids, config, adaptive, on_commit, self.prefixes))
        if method == "ar" and on_commit is None and self.prefixes is None:
            return reference_generate(decoder, prompt_ids, config)
        # otherwise plain decoding is a run with no drafting source: the same tokens (the batch's "ar")
        return generate_from_sources(decoder, sources, prompt_ids, config, adaptive, on_commit, self.prefixes)

    def sources(self, method: Method) -> tuple[list[DraftSource], bool]:
        """A synchronous `method`'s drafting sources, fresh for one generation (none for "ar"), and
        whether it is gated: the product default (never knowingly slower than plain decoding) and
        the AR-drafter baseline (its k chosen by the same gate as D3D's) are; the single-source
        methods are not, so that benchmarks measure the source itself."""
        adaptive = self.adaptive and method in ("speculative", "ar_drafter")
        if method == "ar_drafter":
            return [ARDrafterSource(self.ar_drafter)], adaptive
        drafter = None if method in ("lookup", "ar") else self.drafter
        lookup = None if method in ("drafter", "ar") else self.lookup
        return default_sources(drafter, lookup), adaptive

    def generate(self, prompt: str | list[dict[str, str]], *, chat: bool = True, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: list[str] | None = None, method: Method = "speculative") -> Iterator[Chunk]:
        config = self.generation_config(max_new_tokens, temperature, top_k, top_p, seed)
        prompt_ids = self.encode(prompt, chat)
        yield from self.stream_text(self.steps(prompt_ids, config, method), stop or [])

    def stream_text(self, steps: Iterator[Step], stop: list[str]) -> Iterator[Chunk]:
        """Decode steps into text chunks, ending at the first stop string (not included).

        Token by token, so a stop string ends the text where one-token decoding would (at the first
        token whose text holds it) whatever a step's size; each token decodes only a short window
        (`TextDecoder`), so a step costs the same at the end of a long answer as at its start.
        """
        decoder = TextDecoder(self.target.tokenizer)
        stop = [s for s in stop if s]  # an empty stop string would match everywhere
        hold = max((len(s) for s in stop), default=1) - 1  # a stop string may still be forming
        held = HeldText()  # decoded, not yet yielded: at least the last `hold` characters
        used = 0  # generated tokens so far
        try:
            for step in steps:
                for i, token in enumerate(step.tokens):
                    piece = decoder.add(token)
                    if step.finish_reason is not None and i == len(step.tokens) - 1:
                        piece += decoder.flush()  # the end: an incomplete character too, as U+FFFD
                    held.add(used, piece)
                    used += 1
                    start = max(0, len(held.text) - len(piece) - hold)
                    if piece and (cut := first_stop(held.text, stop, start)) is not None:
                        yield Chunk.of(held.take(cut), step, "stop", used)
                        return
                if step.finish_reason is not None:
                    yield Chunk.of(held.take(len(held.text)), step, step.finish_reason, used)
                    return
                yield Chunk.of(held.take(max(0, len(held.text) - hold)), step, None, used)
        finally:  # ended, stopped or closed: the engine's generation ends with it (a batch frees its rows)
            close = getattr(steps, "close", None)
            if close is not None:
                close()


class TextDecoder:
    """Incremental detokenisation: the text each new token completes.

    Decoding the whole answer again for every token costs O(length) per token, O(length²) per
    answer. Here a token decodes only the window of tokens since the last text was emitted (its
    first token starts on a character boundary) and emits what that window's text gained — the
    scheme of vLLM's incremental detokenizer. Byte-level tokenizers split rare characters over
    several tokens; the window then decodes to text ending in U+FFFD, held until a later token
    completes the character, or until `flush` at the end.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.start = 0  # first token of the decoding window
        self.read = 0  # tokens whose text has been emitted
        self.emitted = ""  # the text of tokens[start:read]

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self.advance(final=False)

    def flush(self) -> str:
        """What is still held (an incomplete character decodes to U+FFFD)."""
        return self.advance(final=True)

    def advance(self, final: bool) -> str:
        text = self.tokenizer.decode(self.tokens[self.start:], skip_special_tokens=True)
        if len(text) <= len(self.emitted) or (text.endswith("\ufffd") and not final):
            return ""
        new = text[len(self.emitted):]
        # Decoded again, not taken from `new`: some tokenizers drop a window's leading space.
        self.start, self.read = self.read, len(self.tokens)
        self.emitted = self.tokenizer.decode(self.tokens[self.start:], skip_special_tokens=True)
        return new


class HeldText:
    """Decoded text not yet yielded, each piece tagged with the index of the token that completed it."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, str]] = []
        self.text = ""

    def add(self, index: int, piece: str) -> None:
        if piece:
            self.pieces.append((index, piece))
            self.text += piece

    def take(self, length: int) -> list[tuple[int, str]]:
        """The first `length` characters as pieces (a piece split at the boundary stays in part)."""
        taken, size = [], 0
        while self.pieces and size < length:
            index, piece = self.pieces.pop(0)
            if size + len(piece) > length:
                piece, rest = piece[:length - size], piece[length - size:]
                self.pieces.insert(0, (index, rest))
            taken.append((index, piece))
            size += len(piece)
        self.text = self.text[length:]
        return taken


def prefix_key(target: Target) -> str:
    """What a stored prefix's bits depend on: the CPU, kernel build, dtype and shapes
    (`d3d.exactness.machine_key`), and the target's weight files as they are now (paths, sizes,
    modification times: a file rewritten in place keys a new folder)."""
    stamps = []
    for place in {target.name, target.folder} - {""}:
        path = Path(place)
        for file in sorted(path.rglob("*") if path.is_dir() else [path] if path.is_file() else []):
            if file.suffix in (".gguf", ".safetensors", ".json") and file.is_file():
                stat = file.stat()
                stamps.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    key = json.dumps([machine_key(target.decoder), target.name, stamps], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def first_stop(text: str, stop: list[str], start: int) -> int | None:
    """Where the earliest stop string in `text[start:]` begins (None: none there)."""
    return min((i for i in (text.find(s, start) for s in stop) if i >= 0), default=None)


def load_ar_drafter(target: Target, folder: str | Path | None) -> Drafter | None:
    """The AR drafter checkpoint at `folder` for `target` (None when no folder is given)."""
    if not folder:
        return None
    drafter = Drafter.from_pretrained(folder, target.decoder, target.fingerprint)
    if drafter.config.kind != "ar":
        raise ConfigError(f"{folder} holds a drafter of kind {drafter.config.kind!r}, not an AR drafter "
                          "(pass it as --drafter)")
    return drafter


def resolve_drafter(target: Target, drafter: str | Path | None, target_source: str | None,
                    drafter_layers: list[int] | str | None, weights: str = "stored") -> tuple[Drafter | None, str]:
    """The drafter and a description of where it came from; an untrained one copies `drafter_layers`
    (indices, or their command-line form: `d3d.drafter.layer_selection`; None: every layer).
    `weights`: "stored" (as its file holds them) or a GGUF type to quantize its own weights to at
    load (`QUANTIZE_TO`: fewer bytes a draft, other drafts, the same output)."""
    if weights != "stored" and weights not in QUANTIZE_TO:
        raise ConfigError(f"drafter weights are 'stored' or one of {', '.join(QUANTIZE_TO)}, not {weights!r}")
    loaded, where = _load_drafter(target, drafter, target_source, drafter_layers)
    if loaded is not None and weights != "stored":
        report = loaded.quantize(QUANTIZE_TO[weights])
        where += f"; {report.summary().removeprefix('GGUF ')} weights quantized at load"
    if loaded is not None:
        loaded.pack_weights()  # at load, as the target's: the first draft is timed as every later one
    return loaded, where


def _load_drafter(target: Target, drafter: str | Path | None, target_source: str | None,
                  drafter_layers: list[int] | str | None) -> tuple[Drafter | None, str]:
    if drafter is None:
        return None, "none"
    fingerprint = target.fingerprint
    decoder = target.decoder
    if str(drafter) == "default":
        # The shipped drafter was trained for the embedded target; a folder `d3d export` wrote from
        # that target (the same weights and tokenizer) is the same target.
        embedded = target_source in (None, "default")
        exported = not embedded and target.folder and exported_from(target) == "default"
        if (embedded or exported) and (DEFAULT_DRAFTER / "config.json").is_file():
            where = "shipped default" + (" (this folder was exported from the embedded target)" if exported else "")
            return Drafter.from_pretrained(DEFAULT_DRAFTER, decoder, fingerprint), where
        # An untrained drafter only costs time (measured: 1.05x vs 1.13x for lookup alone on the
        # README prompt), so without a trained one the default drafts by context lookup only.
        return None, ("none trained for this target yet: context lookup only (--drafter PATH for a trained one, "
                      "--drafter untrained to try one)")
    if str(drafter) == "untrained":
        depth = decoder.config.num_layers
        layers = (layer_selection(drafter_layers, depth, "--drafter-layers") if isinstance(drafter_layers, str)
                  else drafter_layers or list(range(depth)))
        untrained = Drafter.from_target(decoder, layers, tokenizer_fingerprint=fingerprint).eval()
        return untrained, "UNTRAINED (copied from the target's layers; no trained drafter for this target)"
    return Drafter.from_pretrained(drafter, decoder, fingerprint), str(drafter)
