"""The decoding methods a benchmark compares, behind one call shape.

Each method takes prompt ids and a GenerationConfig and returns a `MethodRun`: the generated ids,
the wall time, the time to the first token (the prefill) and — for speculative methods — the
engine's SpecStats. d3d's own methods run through `Pipeline.steps`; the transformers baselines
(plain `generate`, prompt lookup) run on a transformers model holding the very same weights, so
they are what users of transformers get; the llama.cpp baselines (plain, lookup) run llama.cpp's
server on the BF16 GGUF of the embedded target, and `llamacpp_gguf` on the very GGUF file d3d
loads the target from (`d3d.bench.llamacpp`; opt-in, built by scripts/llamacpp.sh).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch

from d3d.async_engine import async_generate
from d3d.bench import llamacpp
from d3d.bench.runs import Method, MethodRun
from d3d.config import ConfigError, GenerationConfig
from d3d.generation import Pipeline
from d3d.sequence import Step
from d3d.stats import SpecStats

OURS = ("ar", "lookup", "drafter", "speculative", "async", "async_reanchor", "ar_drafter")
NEED_DRAFTER = ("drafter", "speculative", "async", "async_reanchor")
TRANSFORMERS = ("hf", "hf_lookup", "hf_ar_drafter")
LLAMACPP = ("llamacpp", "llamacpp_lookup", "llamacpp_gguf")
ALL_METHODS = OURS + TRANSFORMERS + LLAMACPP
DESCRIPTIONS = {
    "ar": "d3d plain AR decoding (the reference)",
    "lookup": "d3d speculative, context lookup drafts only",
    "drafter": "d3d speculative, D3D drafter only (sync)",
    "speculative": "d3d speculative, lookup where it matches + D3D drafter elsewhere (sync, gated)",
    "async": "d3d asynchronous: the drafter drafts successor blocks in a worker during verification",
    "async_reanchor": "d3d asynchronous, a miss reuses the same-k branch re-anchored on the true bonus "
                      "instead of redrafting",
    "ar_drafter": "d3d speculative, the AR-drafter baseline (classic SD: k one-token drafter passes, gated)",
    "hf": "transformers generate (AR)",
    "hf_lookup": "transformers prompt lookup decoding (prompt_lookup_num_tokens=10)",
    "hf_ar_drafter": "transformers assisted generation, the AR drafter as assistant_model (d3d.export)",
    # "llamacpp", "llamacpp_lookup", "llamacpp_gguf": `d3d.bench.llamacpp.describe` (names the build and threads)
}


def timed(steps: Callable[[], Iterator[Step]]) -> MethodRun:
    """Run an engine to the end: its tokens, wall time, prefill time and final stats."""
    started = time.perf_counter()
    prefill = None
    tokens: list[int] = []
    stats = SpecStats()
    for step in steps():
        if prefill is None:  # the first step is the prefill's token
            prefill = time.perf_counter() - started
        tokens.extend(step.tokens)
        stats = step.stats
    return MethodRun(tokens, time.perf_counter() - started, stats, prefill)


def ours(pipeline: Pipeline, name: str) -> Method:
    if name == "async_reanchor":
        async_config = dataclasses.replace(pipeline.async_config, miss_policy="reanchor")
        return lambda prompt_ids, config: timed(lambda: async_generate(
            pipeline.target.decoder, pipeline.drafter, prompt_ids, config, async_config))
    return lambda prompt_ids, config: timed(lambda: pipeline.steps(prompt_ids, config, name))  # type: ignore[arg-type]


def transformers_model(pipeline: Pipeline):
    """A transformers LlamaForCausalLM-family model sharing the target's weights (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from d3d.loading import native_to_hf

    if not pipeline.target.folder:
        raise ValueError("transformers baselines need a target loaded from a Hugging Face folder or GGUF")
    config = AutoConfig.from_pretrained(pipeline.target.folder)
    model = AutoModelForCausalLM.from_config(config, dtype=pipeline.target.decoder.dtype)
    state = native_to_hf(pipeline.target.decoder.state_dict(), pipeline.target.decoder.config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def transformers_assistant(pipeline: Pipeline):
    """The pipeline's AR drafter as a transformers CausalLM (`d3d.export`), for `assistant_model`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from d3d.export import hf_config, hf_state

    drafter = pipeline.ar_drafter
    values = hf_config(drafter.config.model, drafter.decoder.dtype)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, dtype=drafter.decoder.dtype)
    model.load_state_dict(hf_state(drafter), strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def transformers_method(model, lookup: bool, pad_token_id: int, assistant=None) -> Method:
    def run(prompt_ids: list[int], config: GenerationConfig) -> MethodRun:
        ids = torch.tensor([prompt_ids])
        sampling = config.sampling
        kwargs = dict(max_new_tokens=config.max_new_tokens, eos_token_id=config.eos_token_ids or None,
                      pad_token_id=pad_token_id, do_sample=not sampling.greedy)
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - started
        return MethodRun(out[0, ids.shape[1]:].tolist(), seconds)
    return run


def base_method(name: str) -> str:
    """"speculative@pruned" → "speculative": a method run with another drafter (see `build_methods`)."""
    return name.split("@", 1)[0]


def describe(name: str, drafters: dict[str, str]) -> str:
    base, _, label = name.partition("@")
    if base in LLAMACPP:
        return llamacpp.describe(lookup=base == "llamacpp_lookup", own_gguf=base == "llamacpp_gguf")
    return DESCRIPTIONS[base] + (f"; drafter {drafters[label]}" if label else "")


def check_methods(names: list[str]) -> None:
    """Refuse unknown method names, and llama.cpp methods when llama.cpp is not built — before
    anything is loaded."""
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown:
        raise ConfigError(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    if any(n in ("llamacpp", "llamacpp_lookup") for n in names):
        llamacpp.find_install()  # the server and the embedded target's BF16 conversion
    elif "llamacpp_gguf" in names:
        llamacpp.find_server()  # it serves the target's own GGUF file


def close_methods(methods: dict[str, Method]) -> None:
    """Stop what methods hold outside this process (the llama.cpp servers)."""
    for method in methods.values():
        close = getattr(method, "close", None)
        if close is not None:
            close()


def build_methods(pipeline: Pipeline, names: list[str],
                  challengers: dict[str, Pipeline] | None = None) -> dict[str, Method]:
    """The methods `names`, plus `method@label` for each method that needs a drafter, run with
    each challenger pipeline's drafter (same target), so drafters compare in one interleaved run."""
    check_methods(names)
    if pipeline.drafter is None and any(n in NEED_DRAFTER for n in names):
        raise ConfigError(f"methods {', '.join(NEED_DRAFTER)} need a drafter")
    if pipeline.ar_drafter is None and {"ar_drafter", "hf_ar_drafter"} & set(names):
        raise ConfigError("methods ar_drafter and hf_ar_drafter need an AR drafter: pass --ar-drafter PATH")
    methods: dict[str, Method] = {}
    try:
        add_methods(methods, pipeline, names, challengers or {})
    except BaseException:
        close_methods(methods)  # a llama.cpp server already started must not outlive the error
        raise
    return methods


def add_methods(methods: dict[str, Method], pipeline: Pipeline, names: list[str],
                challengers: dict[str, Pipeline]) -> None:
    """Fill `methods` in place, so that what was started before a failure can be stopped."""
    model = None
    for name in names:
        if name in OURS:
            methods[name] = ours(pipeline, name)
        elif name == "llamacpp_gguf":
            methods[name] = llamacpp.llamacpp_gguf_method(pipeline.target)
        elif name in LLAMACPP:
            methods[name] = llamacpp.llamacpp_method(pipeline.target, lookup=name == "llamacpp_lookup")
        else:
            model = model or transformers_model(pipeline)
            pad = pipeline.target.tokenizer.pad_token_id
            assistant = transformers_assistant(pipeline) if name == "hf_ar_drafter" else None
            methods[name] = transformers_method(model, name == "hf_lookup",
                                                pad if pad is not None else (pipeline.target.eos_token_ids or [0])[0],
                                                assistant)
    for label, challenger in challengers.items():
        if challenger.drafter is None:
            raise ConfigError(f"the challenger {label!r} has no drafter")
        if not any(n in NEED_DRAFTER for n in names):
            raise ConfigError(f"a challenger drafter needs a method that drafts: {', '.join(NEED_DRAFTER)}")
        for name in names:
            # only a D3D drafter drafts ahead of verification: a DFlash-style one reads the hidden states
            # the verification computes (the comparison the paper makes), so it has no async run
            if name in NEED_DRAFTER and (not name.startswith("async") or challenger.drafter.config.kind == "d3d"):
                methods[f"{name}@{label}"] = ours(challenger, name)
