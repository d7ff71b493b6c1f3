"""The AR drafter as a Hugging Face CausalLM folder, so transformers (e.g. `assistant_model`) runs it.

An AR drafter (`Drafter` of kind "ar") is an ordinary causal decoder of the target's family: its
own layers and final norm, the target's embedding and head. `export_hf` writes it as
`config.json` + `model.safetensors` in transformers' names (LlamaForCausalLM, Qwen2ForCausalLM or
Qwen3ForCausalLM), shared weights included, so the folder stands alone. A D3D drafter has no such
form (its blocks and MASK input are not a causal LM), nor does a drafter with a reduced draft
vocabulary (its head scores a subset; a full head would draft other tokens): both are refused.

This module writes files; it loads nothing and runs no model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from d3d.config import ConfigError, ModelConfig
from d3d.drafter import Drafter
from d3d.loading import native_to_hf

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


def hf_state(drafter: Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The AR drafter's weights in transformers' names (shared embedding and head included), in `dtype`
    (default: as held); refuses a drafter that is no causal LM over the whole vocabulary."""
    if drafter.config.kind != "ar":
        raise ConfigError(f"only an AR drafter exports as a causal LM; this one is of kind {drafter.config.kind!r}")
    if drafter.config.draft_vocab_size:
        raise ConfigError(f"this AR drafter drafts among {drafter.config.draft_vocab_size} tokens; a causal LM's "
                          "head scores the whole vocabulary, so it would draft others: train it without "
                          "--draft-vocab-size to export it")
    dtype = dtype or drafter.decoder.dtype
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"export dtype must be one of {', '.join(DTYPE_NAMES.values())}, got {dtype}")
    state = {k: v for k, v in drafter.decoder.state_dict().items() if k != "rope_table"}  # a derived buffer
    return {k: v.detach().to(dtype).contiguous() for k, v in native_to_hf(state, drafter.config.model).items()}


def export_hf(drafter: Drafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the AR drafter as a transformers CausalLM folder (in `dtype`, default: as held)."""
    state = {k: v.cpu() for k, v in hf_state(drafter, dtype).items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(drafter.config.model, dtype or drafter.decoder.dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder
