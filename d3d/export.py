"""Exports to other engines: the target as a plain Hugging Face folder, a drafter as a causal LM
(an AR drafter) or as a vLLM parallel draft model (a D3D drafter with causal blocks).

- `export_target` writes config.json, generation_config.json, the tokenizer and model.safetensors
  holding the weights d3d runs — for the embedded GGUF, dequantized and cast to the dtype d3d
  decodes in — so another engine serves the same target d3d verifies with.
- `export_drafter` writes a drafter as a transformers CausalLM of the target's family, its layers
  renumbered 0 … n-1 (pruned drafters included), with its own copy of the target's embedding and
  head. An AR drafter is such a model already (vLLM `draft_model`, transformers `assistant_model`).
  A D3D drafter becomes one that vLLM runs with `"method": "draft_model", "parallel_drafting":
  true` (the PARD path): vLLM feeds it the verified tokens, the bonus token and K-1 mask tokens at
  consecutive positions, attends causally, and reads draft i from the bonus slot's i-th successor —
  which is d3d's block [anchor, MASK × (B-1)] with causal block attention and shifted labels.

vLLM feeds a mask *token id*; the D3D drafter has a learned mask *embedding*. The export writes that
embedding into one row of the exported drafter's own embedding, at an id the target never uses
(`mask_candidates`), and names it in config.json (`pard_token`, which vLLM reads). The head keeps
the target's row for that id, so the exported drafter's embedding and head are untied. A drafter
this path cannot reproduce is refused: block attention other than causal, unshifted labels, more
than one denoising step, a mask id the target can emit, another vocabulary; a reduced draft
vocabulary only with `widen_draft_vocab`, and then the export says what changes (`widened`
gives d3d the widened drafter, to measure the change).

This module writes folders and compares their logits with d3d's (`check_logits`); it owns no
decoding loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from d3d.config import ConfigError, ModelConfig
from d3d.drafter import Drafter
from d3d.files import save_tensors
from d3d.loading import Target, native_to_hf
from d3d.masks import causal_mask
from d3d.models import Decoder

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
MASK_CONFIG_KEY = "pard_token"  # the draft config entry vLLM's parallel drafting reads the mask id from
EXPORT_CONFIG_KEY = "d3d_export"  # where an exported folder's config.json records what it came from
DraftMethod = Literal["draft_model", "parallel_draft"]


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The transformers config.json of a decoder (`ModelConfig.from_hf` reads it back)."""
    document = {
        "architectures": [ARCHITECTURES[config.family]], "model_type": config.family,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": DTYPE_NAMES[dtype],
    }
    if config.family == "llama":  # Qwen2 always has q/k/v biases; Qwen3 none, with q/k norms instead
        document.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    return document


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"export dtype must be one of {', '.join(DTYPE_NAMES.values())}, got {dtype}")


def decoder_state(decoder: Decoder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A decoder's weights in transformers' names, in `dtype` (a tied head is not stored)."""
    check_dtype(dtype)
    state = {k: v for k, v in decoder.state_dict().items() if k != "rope_table"}  # a derived buffer
    return {k: v.detach().to(dtype).contiguous() for k, v in native_to_hf(state, decoder.config).items()}


def hf_state(drafter: Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The AR drafter's weights in transformers' names (shared embedding and head included), in `dtype`
    (default: as held); refuses a drafter that is no causal LM over the whole vocabulary."""
    if drafter.config.kind != "ar":
        raise ConfigError(f"only an AR drafter exports as a causal LM; this one is of kind {drafter.config.kind!r}")
    if drafter.config.draft_vocab_size:
        raise ConfigError(f"this AR drafter drafts among {drafter.config.draft_vocab_size} tokens; a causal LM's "
                          "head scores the whole vocabulary, so it would draft others: train it without "
                          "--draft-vocab-size to export it")
    return decoder_state(drafter.decoder, dtype or drafter.decoder.dtype)


def write_folder(folder: str | Path, state: dict[str, torch.Tensor], config: dict[str, Any],
                 tokenizer: Any = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.cpu() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):  # the folder then stands alone
        tokenizer.save_pretrained(folder)
    return folder


def export_hf(drafter: Drafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the AR drafter alone as a transformers CausalLM folder (in `dtype`, default: as held)."""
    state = hf_state(drafter, dtype)
    return write_folder(folder, state, hf_config(drafter.config.model, dtype or drafter.decoder.dtype))


# -- the target ------------------------------------------------------------------------------------

def special_ids(tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> dict[str, int | list[int]]:
    """The bos / eos / pad / unk ids generation uses (config.json and generation_config.json entries)."""
    ids: dict[str, int | list[int]] = {}
    for name in ("bos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            ids[name] = int(value)
    eos = list(dict.fromkeys([*eos_token_ids] + ([] if getattr(tokenizer, "eos_token_id", None) is None
                                                 else [int(tokenizer.eos_token_id)])))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def export_target(target: Target, folder: str | Path, dtype: torch.dtype | None = None,
                  source: str | None = None) -> Path:
    """Write the target as a Hugging Face folder: its weights as d3d runs them (in `dtype`, default: the
    dtype it was loaded in), config, generation config and tokenizer. config.json records what it was
    exported from (`source`, as given to `load_target`: "default" for the embedded target) and its
    tokenizer's fingerprint, so that d3d finds the drafter shipped for that target (`exported_from`)."""
    dtype = dtype or target.decoder.dtype
    ids = special_ids(target.tokenizer, target.eos_token_ids)
    record = {"target": target.name, "source": source, "tokenizer_fingerprint": target.fingerprint}
    config = {**hf_config(target.decoder.config, dtype), **ids, EXPORT_CONFIG_KEY: record}
    folder = write_folder(folder, decoder_state(target.decoder, dtype), config, target.tokenizer)
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True))
    return folder


def exported_from(target: Target) -> str | None:
    """The source a target folder was exported from by `export_target` ("default": the embedded
    target), when its config.json says so and its tokenizer is still the one exported; else None."""
    try:
        record = json.loads((Path(target.folder) / "config.json").read_text()).get(EXPORT_CONFIG_KEY)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    if not isinstance(record, dict) or record.get("tokenizer_fingerprint") != target.fingerprint:
        return None
    return record.get("source")


# -- the mask token --------------------------------------------------------------------------------

def tokenizer_size(tokenizer: Any) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return len(tokenizer.get_vocab())


def reserved_ids(tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> set[int]:
    """Ids generation uses whatever the text: bos / eos / pad / unk and the chat template's special tokens."""
    reserved = {int(i) for i in eos_token_ids}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) is not None:
            reserved.add(int(getattr(tokenizer, name)))
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    for messages in ([{"role": "system", "content": "s"}, *turns], turns) if getattr(tokenizer, "chat_template", None) else ():
        try:  # some templates refuse a system turn: then the conversation without it
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:
            continue
        return reserved | (set(tokenizer.encode(text, add_special_tokens=False)) & set(special_tokens(tokenizer)))
    return reserved


def special_tokens(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's special added tokens (text never encodes to them as ordinary pieces)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted(int(i) for i, token in decoder.items() if getattr(token, "special", False))


def mask_candidates(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> list[int]:
    """Vocabulary ids the target never uses, best first: rows past the tokenizer's last token (no text
    encodes to them; Qwen's vocabularies have hundreds), then special tokens generation does not use
    (highest id first: the least common special tokens come last in the vocabularies seen so far)."""
    reserved = reserved_ids(tokenizer, eos_token_ids)
    beyond = list(range(tokenizer_size(tokenizer), vocab_size))
    unused = [i for i in reversed(special_tokens(tokenizer)) if i not in reserved and i < vocab_size]
    return beyond + unused


def choose_mask_token_id(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int] = (),
                         wanted: int | None = None) -> int:
    """`wanted` if the target never uses it (else a ConfigError saying why), or the best candidate."""
    candidates = mask_candidates(tokenizer, vocab_size, eos_token_ids)
    if wanted is None:
        if not candidates:
            raise ConfigError("the target's vocabulary has no id it never uses (no rows past the tokenizer, no "
                              "unused special token), so vLLM's mask token would be a token the target emits")
        return candidates[0]
    if not 0 <= wanted < vocab_size:
        raise ConfigError(f"mask token id {wanted} lies outside the vocabulary [0, {vocab_size}): vLLM requires the "
                          "draft and target vocabularies to be the same size, so the mask must be one of its rows")
    if wanted in reserved_ids(tokenizer, eos_token_ids):
        raise ConfigError(f"mask token id {wanted} is a token the target emits or every prompt holds (bos / eos / "
                          f"pad / unk or the chat template); candidates: {candidates[:8]}")
    if wanted not in candidates:
        raise ConfigError(f"mask token id {wanted} is an ordinary token the target can emit, so the drafter would "
                          f"read it as MASK wherever it appears; candidates: {candidates[:8]}")
    return wanted


# -- drafters --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterExport:
    """What `export_drafter` wrote and how vLLM runs it."""

    folder: Path
    method: DraftMethod  # "parallel_draft": a D3D block (PARD); "draft_model": an AR drafter, one pass per draft
    num_speculative_tokens: int  # K: the block's B-1 verified drafts (an AR drafter's bound on drafts)
    mask_token_id: int | None  # the id vLLM feeds for MASK (parallel drafting only)
    exact: bool  # True when the exported model computes d3d's drafts exactly (checked by `check_logits`)
    changes: list[str] = field(default_factory=list)  # what differs from the d3d drafter when not exact

    def speculative_config(self) -> dict[str, Any]:
        """vLLM's --speculative-config for this drafter."""
        config: dict[str, Any] = {"model": str(self.folder), "method": "draft_model",
                                  "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "parallel_draft":
            config["parallel_drafting"] = True
        return config


def check_parallel_draftable(drafter: Drafter) -> None:
    """Refuse a drafter vLLM's parallel drafting cannot reproduce, saying why and what would do."""
    c = drafter.config
    if c.kind not in ("d3d", "ar"):
        raise ConfigError(f"a drafter of kind {c.kind!r} does not export: vLLM's draft_model path feeds token ids "
                          "only; kinds 'd3d' (causal blocks) and 'ar' export")
    if c.kind == "ar":
        return
    if c.block_attention != "causal":
        raise ConfigError(f"this drafter attends {c.block_attention!r} inside its block, but vLLM's parallel drafting "
                          "attends causally, so from the second draft on vLLM would run a drafter it was not trained "
                          "as; train one with `d3d train --block-attention causal` (same τ at this scale, "
                          "docs/training.md)")
    if c.labels != "shifted":
        raise ConfigError("this drafter has unshifted labels (a mask predicts its own position), but vLLM reads the "
                          "first draft from the bonus token's slot, which predicts nothing here; train it with "
                          "--labels shifted")
    if c.denoising_steps != 1:
        raise ConfigError(f"this drafter denoises in {c.denoising_steps} passes; vLLM drafts a block in one")


def widened(drafter: Drafter, target: Decoder) -> Drafter:
    """A new drafter with `drafter`'s weights drafting among the whole vocabulary: what a widened export
    computes, so d3d can measure what widening changes (e.g. `d3d.estimate.teacher_forced_tau` of both)."""
    wide = Drafter(replace(drafter.config, draft_vocab_size=0), target)
    state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"}
    wide.load_state_dict(state, strict=False)  # the shared embedding and head are the target's already
    return wide.eval()


def parallel_draft_state(drafter: Drafter, mask_token_id: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The D3D drafter's weights in transformers' names: its layers and norm, the target's head, and the
    target's embedding with row `mask_token_id` replaced by the learned mask embedding (so untied)."""
    state = decoder_state(drafter.decoder, dtype)
    embedding = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = state.get("lm_head.weight", embedding).clone()
    embedding = embedding.clone()
    embedding[mask_token_id] = drafter.mask_embedding.detach().to(dtype)
    state["model.embed_tokens.weight"] = embedding
    return state


def export_drafter(drafter: Drafter, target: Target, folder: str | Path, dtype: torch.dtype | None = None,
                   mask_token_id: int | None = None, widen_draft_vocab: bool = False) -> DrafterExport:
    """Write `drafter` (made for `target`) for vLLM: an AR drafter as a causal LM (`draft_model`), a D3D
    drafter with causal blocks as a parallel draft model. Refuses what vLLM would run differently; a
    reduced draft vocabulary only with `widen_draft_vocab` (the result then drafts among all tokens)."""
    c = drafter.config
    dtype = dtype or drafter.decoder.dtype
    check_dtype(dtype)
    if c.target_vocab_size != target.decoder.config.vocab_size or c.model.vocab_size != target.decoder.config.vocab_size:
        raise ConfigError(f"the drafter was made for a vocabulary of {c.target_vocab_size} tokens; this target has "
                          f"{target.decoder.config.vocab_size} (vLLM requires the same vocabulary)")
    check_parallel_draftable(drafter)
    changes = []
    if c.draft_vocab_size:
        if not widen_draft_vocab:
            raise ConfigError(f"this drafter drafts among {c.draft_vocab_size} of the {c.model.vocab_size} tokens; "
                              "an exported model's head scores all of them, which no row of weights can restrict. "
                              "Pass --widen-draft-vocab to export it drafting among all tokens (its logits for the "
                              f"{c.draft_vocab_size} stay exact; drafts change where another token scores higher), "
                              "or train it without --draft-vocab-size")
        changes.append(f"drafts among all {c.model.vocab_size} tokens instead of its {c.draft_vocab_size}: the "
                       "logits of those stay exact, and a draft changes wherever another token outscores them all")
    model = c.model
    document: dict[str, Any] = {"kind": c.kind, "block_size": c.block_size, "target_layers": c.target_layers,
                                "draft_vocab_size": c.draft_vocab_size, "widened_draft_vocab": bool(c.draft_vocab_size),
                                "tokenizer_fingerprint": c.tokenizer_fingerprint}
    if c.kind == "ar":
        state, method, mask = decoder_state(drafter.decoder, dtype), "draft_model", None
    else:
        mask = choose_mask_token_id(target.tokenizer, model.vocab_size, target.eos_token_ids, mask_token_id)
        state, method = parallel_draft_state(drafter, mask, dtype), "parallel_draft"
        model = replace(model, tie_word_embeddings=False)
        document.update(block_attention=c.block_attention, labels=c.labels, mask_token_id=mask)
    config = {**hf_config(model, dtype), **special_ids(target.tokenizer, target.eos_token_ids),
              EXPORT_CONFIG_KEY: document}
    if mask is not None:
        config[MASK_CONFIG_KEY] = mask
    folder = write_folder(folder, state, config, target.tokenizer)
    return DrafterExport(folder, method, c.block_size - 1, mask, not changes, changes)


# -- checks ----------------------------------------------------------------------------------------

def float32_copy(reference: Decoder | Drafter) -> Decoder | Drafter:
    """The same weights in a freshly built float32 model: a cast copy would keep the RoPE table rounded to
    the dtype it ran in (a buffer), which alone moves a 30-layer model's logits by ~0.05."""
    state = {k: v.float() if v.is_floating_point() else v for k, v in reference.state_dict().items()}
    if isinstance(reference, Drafter):  # a stand-in target lends the embedding and head the state then fills
        copy = Drafter(reference.config, Decoder(reference.config.model).float())
        copy.load_state_dict(state)
        if reference.config.draft_vocab_size:
            copy.set_draft_vocab(copy.draft_vocab.clone())  # refreshes the derived head rows
    else:
        copy = Decoder(reference.config)
        copy.load_state_dict(state)
    return copy.float().eval()


@torch.no_grad()
def check_logits(folder: str | Path, reference: Decoder | Drafter, context: list[int], num_masks: int = 0,
                 mask_token_id: int | None = None) -> float:
    """Largest |logit| difference between an exported folder (run by transformers) and d3d's model, both in
    float32 from the same weights, over `context` then `num_masks` mask slots (a drafter's causal block; the
    export feeds `mask_token_id` there); over a reduced draft vocabulary's columns only. Raises a ConfigError
    where the argmax differs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = float32_copy(reference)
    exported_ids = torch.tensor([context])
    if isinstance(reference, Drafter):
        if num_masks and mask_token_id is None:
            raise ValueError("a drafter's mask slots need the exported mask_token_id")
        ids = torch.tensor([context + [reference.config.mask_token_id] * num_masks])
        exported_ids = torch.tensor([context + [mask_token_id] * num_masks])
        hidden = reference.decoder.hidden_states(reference.embed(ids), torch.arange(ids.shape[1])[None], None,
                                                 causal_mask(ids.shape[1], 0)[None])
        expected = reference.draft_scores(hidden[0])
        columns = reference.draft_vocab if reference.config.draft_vocab_size else slice(None)
    else:
        expected, columns = reference(exported_ids)[0], slice(None)
    actual = model(exported_ids).logits[0][:, columns]
    if not torch.equal(actual.argmax(-1), expected.argmax(-1)):
        raise ConfigError(f"{folder}: transformers' argmax differs from d3d's on the check sequence")
    return float((actual - expected).abs().max())
