"""DFlash-style conditioning: a block drafter that reads the target's hidden states.

DFlash (the D3D paper's main baseline) drafts a block like D3D — `[anchor, MASK × (B-1)]` in one
pass, shifted labels — but its context is not the committed tokens: it is the target's own hidden
states. The residual streams after a few target layers (`feature_layers`, spread from shallow to
deep) are concatenated per committed token, projected to the drafter's width and normed
(`FeatureProjection`), and every drafter layer turns that one context vector into the token's keys
and values (its input norm, then its own k and v projections and RoPE at the token's position).
The block's rows then attend to those keys and values and to the block, as in D3D.

So each round the drafter must wait for the verification that produced the newest hidden states:
it cannot draft ahead of the target, which is the coupling D3D removes. It never runs without them:
the source (`d3d.sources.DFlashSource`) refuses to draft past the hidden states it was given, and
the asynchronous engine refuses this kind of drafter.

Training computes the hidden states on the fly with the target (`attach_features`), never from
dumps; a training row of context takes the projected features as its input at every layer
(`conditioned_hidden`), which gives its keys and values exactly as `inject` writes them at decoding
time. This module holds that mechanism; `d3d.drafter.Drafter` holds the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from d3d.cache import KVCache
from d3d.config import ConfigError
from d3d.models import Decoder, RMSNorm


def default_feature_layers(num_target_layers: int, count: int) -> list[int]:
    """At most `count` target layers (fewer where they coincide), spread evenly from the second to the
    fourth-last (DFlash's spread):
    shallow layers carry the tokens, deep ones the target's plan for the next ones."""
    if num_target_layers < 2:
        return [0]
    low, high = 1, max(1, num_target_layers - 3)
    if count <= 1:
        return [high]
    return sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)})


class FeatureProjection(nn.Module):
    """Concatenated target hidden states (…, F · hidden) → one context vector (…, hidden).

    It starts as the identity on the shallowest layer's hidden state (zeros on the others): the
    drafter's layers are copies of the target's first ones, so their keys and values start from
    inputs like those they were made for, and training mixes in the deeper layers."""

    def __init__(self, num_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(num_features * hidden_size, hidden_size, bias=False)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden_size] = torch.eye(hidden_size)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(features.to(self.proj.weight.dtype)))


def inject(decoder: Decoder, projection: FeatureProjection, cache: KVCache, features: torch.Tensor) -> None:
    """Write the keys and values of the next committed tokens, at positions cache.length …, from
    their target hidden states `features` (T, F · hidden): every layer reads the projected context."""
    length = features.shape[0]
    if not length:
        return
    context = projection(features[None].to(decoder.dtype))  # (1, T, hidden)
    kernels = decoder.kernels_for(context)
    positions = torch.arange(cache.length, cache.length + length, device=context.device)[None]
    cos, sin = decoder.rope(positions, context.dtype)
    cache.reserve(length)
    for index, layer in enumerate(decoder.layers):
        layer.self_attn.project(layer.input_layernorm(context, kernels), cos, sin, cache, index, kernels)
    cache.commit(length)


def conditioned_hidden(decoder: Decoder, embeds: torch.Tensor, context: torch.Tensor, is_context: torch.Tensor,
                       positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The layers over a packed training batch (B, T, hidden) whose `is_context` rows (B, T) read the
    projected `context` (B, T, hidden) as their input at every layer — their keys and values are
    `inject`'s — while block rows run as usual. Context rows' outputs mean nothing."""
    kernels = decoder.kernels_for(embeds)
    cos, sin = decoder.rope(positions, embeds.dtype)
    fixed = is_context[..., None]
    x = embeds
    for index, layer in enumerate(decoder.layers):
        x = layer(torch.where(fixed, context.to(x.dtype), x), cos, sin, mask, None, index, kernels)
    return decoder.norm(x, kernels)


@torch.no_grad()
def target_features(target: Decoder, sequences: list[list[int]], feature_layers: list[int]) -> torch.Tensor:
    """The target's hidden states at `feature_layers` for every token of each sequence, padded:
    (N, longest, F · hidden) in the target's dtype (rows past a sequence's end are zero)."""
    longest = max(len(tokens) for tokens in sequences)
    width = len(feature_layers) * target.config.hidden_size
    out = torch.zeros(len(sequences), longest, width, dtype=target.dtype, device=target.device)
    for row, tokens in enumerate(sequences):  # one causal forward each, as decoding runs it (same bits)
        ids = torch.tensor([tokens], device=target.device)
        _, features = target.logits_and_features(ids, feature_layers, cache=target.new_cache(len(tokens)),
                                                 last_only=True)
        out[row, :len(tokens)] = features[0]
    return out


def attach_features(batch: dict[str, torch.Tensor], sequences: list[list[int]], target: Decoder,
                    feature_layers: list[int]) -> dict[str, torch.Tensor]:
    """A collated batch (`d3d.train.batch.collate`) whose examples pack `sequences` as their clean
    rows, with the target's hidden states of those rows: batch["features"] (B, T, F · hidden) and
    batch["is_context"] (B, T)."""
    device = batch["input_ids"].device
    assert len(sequences) == batch["input_ids"].shape[0], f"{len(sequences)} sequences for a batch of {batch['input_ids'].shape[0]}"
    assert all(batch["input_ids"][row, :len(tokens)].tolist() == tokens for row, tokens in enumerate(sequences)), \
        "each sequence must be its example's clean rows"
    features = target_features(target, sequences, feature_layers).to(device)
    rows, width = batch["input_ids"].shape[1], features.shape[-1]
    batch["features"] = torch.zeros(len(sequences), rows, width, dtype=features.dtype, device=device)
    batch["is_context"] = torch.zeros(len(sequences), rows, dtype=torch.bool, device=device)
    for row, tokens in enumerate(sequences):
        batch["features"][row, :len(tokens)] = features[row, :len(tokens)]
        batch["is_context"][row, :len(tokens)] = True
    return batch


def require_features(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's target hidden states and context rows (`attach_features`), or a clear error."""
    if "features" not in batch:
        raise ConfigError("a DFlash-style drafter reads the target's hidden states, and this batch has none "
                          "(d3d.dflash.attach_features)")
    return batch["features"], batch["is_context"]
