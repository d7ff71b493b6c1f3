"""The D3D drafter: a token-only block-diffusion decoder and its checkpoint format.

D3D (Chen et al., "Decoupled Diffusion Drafting for Asynchronous Speculative Decoding", arXiv
2611.06425) drafts a block from token ids alone — never the target's hidden states — which is
what lets drafting run ahead of verification. Each round the drafter reads the committed tokens it
has not seen yet (clean, causal, kept in its own KV cache) and one block
`[anchor, MASK × (B-1)]` at positions p … p+B-1, and returns a distribution for every block
position. Labels are *shifted* by default: block row i predicts the token at p+i+1, like an AR
model, so row 0 is the ordinary next-token prediction and one block yields B drafts (rows 0 … B-2
are verified, row B-1 serves the async engine's bonus guesses). With *unshifted* labels (the masked
diffusion convention) row i predicts its own position p+i, so rows 1 … B-1 are the B-1 drafts and
the anchor's row predicts nothing. The block's KV is dropped afterwards.

The same class holds the AR-drafter baseline (`DrafterConfig.kind == "ar"`): classic speculative
decoding's small drafter, of the same depth and initialisation (target layers copied, embedding and
head shared), run causally over its own KV cache one token at a time (`next_logits`); it has no
blocks and no MASK embedding, and trains on the next-token loss alone (L_AR of the D3D drafter).
It also holds the DFlash-style baseline (kind "dflash"): D3D's blocks, but with the target's hidden
states in place of the committed tokens as context (`d3d.dflash`), so it drafts only after the
verification that computed them.

A checkpoint is a folder: `config.json` (DrafterConfig + format tag) and `model.safetensors`.
Weights shared with the target (embedding, LM head) are not stored; they come from the target.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from d3d import delta
from d3d.cache import KVCache
from d3d.config import BlockAttention, ConfigError, DrafterConfig, DrafterKind, LabelShift
from d3d.dflash import FeatureProjection, conditioned_hidden, default_feature_layers, inject, require_features
from d3d.files import save_tensors
from d3d.loading import LoadError, check_finite, check_state, read_safetensors
from d3d.masks import causal_mask, draft_mask, packed_mask
from d3d.models import PREFILL_CHUNK, Decoder, SequenceRows
from d3d.quantized import StreamReport, quantize_weights

FORMAT = "d3d-drafter"
FORMAT_VERSION = 1
DELTA_FORMAT_VERSION = 2  # some matrices stored as their difference from the target's (d3d.delta)
SHARED_PREFIXES = ("embed_tokens.", "lm_head.")

# One sequence's drafting request to `Drafter.draft_together`: its drafter cache, committed tokens
# and the drafts wanted (None: a whole block).
DraftRequest = tuple[KVCache, list[int], int | None]

LAYERS_HELP = ("'0,1,2,3', ranges ('0-3,8'), 'all' (every layer: a copy of the target) or 'every:K' "
               "(layers 0, K, 2K, …)")


def layer_selection(text: str, depth: int | None = None, option: str = "layers") -> list[int]:
    """The target layers a drafter starts from, as a command line names them (LAYERS_HELP). With
    `depth` None only the syntax is checked and "all" / "every:K" give []; otherwise every index must
    be one of the target's `depth` layers, each named once. ConfigError for anything else."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{option} takes {LAYERS_HELP}; {why}")

    text = text.strip()
    if text == "all" or text.startswith("every:"):
        try:
            step = int(text[len("every:"):]) if text != "all" else 1
        except ValueError:
            raise refuse(f"got {text!r}") from None
        if step < 1:
            raise refuse(f"K must be at least 1, got {step}")
        return [] if depth is None else list(range(0, depth, step))
    layers: list[int] = []
    for piece in text.split(","):
        first, dash, last = piece.strip().partition("-")
        try:
            layers += range(int(first), int(last) + 1) if dash else [int(first)]
        except ValueError:
            raise refuse(f"got {text!r}") from None
    if not layers:
        raise refuse(f"{text!r} names no layer")
    if len(set(layers)) != len(layers):
        raise refuse(f"{text!r} names a layer twice")
    if depth is not None and any(not 0 <= i < depth for i in layers):
        raise refuse(f"{text!r} is outside the target's layers 0-{depth - 1}")
    return layers


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, target: Decoder, *, loading: bool = False) -> None:
        """`loading`: every own weight is loaded next (`from_pretrained`), so none is drawn at random."""
        super().__init__()
        self.config = config
        self.decoder = Decoder.for_weights(config.model) if loading else Decoder(config.model)
        self.decoder.fixed_rows = 0  # a drafter's passes take their own shapes: drafts need no exactness (d3d.graphs)
        if config.shared_embeddings:
            # Shared modules, not copies: the target's embedding and head are stored once.
            self.decoder.embed_tokens = target.embed_tokens
            self.decoder.lm_head = target.lm_head
        # MASK inputs exist only in D3D blocks; an AR drafter reads committed tokens and its own drafts
        self.mask_embedding = (nn.Parameter(target.embed_tokens.weight.detach().float().mean(0).clone())
                               if config.kind != "ar" else None)
        # A DFlash-style drafter's context: the target's hidden states, projected (d3d.dflash)
        self.feature_projection = (FeatureProjection(len(config.feature_layers), config.model.hidden_size,
                                                     config.model.rms_norm_eps) if config.kind == "dflash" else None)
        # A reduced draft vocabulary: the head scores only these ids (the LM head's rows for them),
        # which cuts the head — ~20% of a 135M model's bytes — by the vocabulary ratio.
        size = config.draft_vocab_size
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        self.register_buffer("draft_head", self._gather_head(), persistent=False)  # derived, frozen
        self.to(device=target.device, dtype=target.dtype)

    def _gather_head(self) -> torch.Tensor:
        head = self.decoder.embed_tokens.weight if self.decoder.lm_head is None else self.decoder.lm_head.weight
        return head.detach()[self.draft_vocab].clone()

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict drafting to `token_ids` (length draft_vocab_size, distinct ids of the vocabulary)."""
        size, vocab = self.config.draft_vocab_size, self.config.model.vocab_size
        if token_ids.shape != (size,) or token_ids.unique().numel() != token_ids.numel():
            raise ConfigError(f"draft vocabulary must hold {size} distinct ids")
        if size and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < vocab:
            raise ConfigError(f"draft vocabulary ids must lie in [0, {vocab}), got {int(token_ids.min())} … "
                              f"{int(token_ids.max())}")
        self.draft_vocab.copy_(token_ids)
        self.draft_head = self._gather_head()

    def draft_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) → (..., Vd) logits over the draft vocabulary (the whole vocabulary when unset)."""
        if not self.config.draft_vocab_size:
            return self.decoder.logits(hidden)
        if not self.config.shared_embeddings:  # the head itself trains: gather it fresh
            return torch.nn.functional.linear(hidden, self._gather_head())
        # the decoder's kernels: packed and ~3x faster than F.linear for a few rows on CPU
        return self.decoder.kernels_for(hidden).linear(hidden, self.draft_head, None)

    def quantize(self, type_name: str) -> StreamReport:
        """Have the kernels stream this drafter's own linear weights and its draft head as GGUF
        `type_name` blocks (`d3d.quantized.quantize_weights`; the weights become their dequantized
        values). Fewer bytes a pass and somewhat other drafts: a different drafter, never a different
        output, since every draft is verified. The embedding and head it shares with the target are
        left as they are. For inference only: a weight changed afterwards goes back to bf16 streams."""
        kernels = self.decoder.row_exact
        if kernels is None or self.decoder.device.type != "cpu" or self.decoder.dtype != torch.bfloat16:
            raise ConfigError("quantized drafter weights need the row-exact kernels: a bf16 drafter on the CPU")
        weights = self.decoder.linear_weights()
        if self.config.shared_embeddings:
            weights.pop("lm_head.weight")  # the target's
            if self.config.draft_vocab_size:
                weights["draft_head"] = self.draft_head  # the drafter's own copy of the rows it drafts among
        return quantize_weights(kernels, weights, type_name)

    def pack_weights(self) -> float:
        """Prepare what its passes read (`Decoder.pack_weights`, and its draft head) now rather than on
        the first draft; seconds taken."""
        seconds = self.decoder.pack_weights()
        kernels = self.decoder.row_exact
        if self.config.draft_vocab_size and self.config.shared_embeddings and kernels is not None \
                and self.decoder.device.type == "cpu":
            started = time.perf_counter()
            kernels.prepare(self.draft_head)
            seconds += time.perf_counter() - started
        return seconds

    def to_draft_ids(self, tokens: torch.Tensor, missing: int = -100) -> torch.Tensor:
        """Vocabulary ids → indices into the draft vocabulary (`missing` where outside it)."""
        if not self.config.draft_vocab_size:
            return tokens
        table = torch.full((self.config.model.vocab_size,), missing, dtype=torch.long, device=tokens.device)
        table[self.draft_vocab] = torch.arange(self.config.draft_vocab_size, device=tokens.device)
        return torch.where(tokens >= 0, table[tokens.clamp_min(0)], tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) → (..., V) logits; tokens outside the draft vocabulary get -inf (never drafted)."""
        scores = self.draft_scores(hidden)
        if not self.config.draft_vocab_size:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.config.model.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, scores)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_rows(self) -> slice:
        """The block rows that predict positions p+1 … p+B-1 (the drafts), in order."""
        return slice(0, self.block_size - 1) if self.config.labels == "shifted" else slice(1, self.block_size)

    @classmethod
    def from_target(cls, target: Decoder, layers: list[int], block_size: int = 16,
                    block_attention: BlockAttention = "anchor_causal", tokenizer_fingerprint: str = "",
                    shared_embeddings: bool = True, draft_vocab: torch.Tensor | None = None,
                    labels: LabelShift = "shifted", kind: DrafterKind = "d3d",
                    feature_layers: list[int] | None = None) -> "Drafter":
        """A drafter whose layers are copies of the given target layers (final norm copied too).

        With kind "ar", the AR drafter: `block_attention` and `labels` do not apply (it is causal and
        predicts the next token); `block_size` - 1 bounds the drafts of one verification. With kind
        "dflash", a DFlash-style drafter reading the target's hidden states after `feature_layers`
        (default: as many as it has layers, spread through the target's; `d3d.dflash`)."""
        if kind == "ar":
            block_attention, labels = "causal", "shifted"
        if kind == "dflash" and not feature_layers:
            feature_layers = default_feature_layers(target.config.num_layers, len(layers))
        if not layers or any(not 0 <= i < target.config.num_layers for i in layers):
            raise ConfigError(f"drafter layers {layers} must be non-empty indices of the target's "
                              f"{target.config.num_layers} layers")
        model = dataclasses.replace(target.config, num_layers=len(layers))
        config = DrafterConfig(model=model, block_size=block_size, target_layers=list(layers),
                               target_vocab_size=target.config.vocab_size,
                               tokenizer_fingerprint=tokenizer_fingerprint,
                               shared_embeddings=shared_embeddings, block_attention=block_attention,
                               draft_vocab_size=0 if draft_vocab is None else int(draft_vocab.numel()),
                               labels=labels, kind=kind,
                               feature_layers=list(feature_layers or []) if kind == "dflash" else [])
        if any(not 0 <= i < target.config.num_layers for i in config.feature_layers):
            raise ConfigError(f"feature layers {config.feature_layers} must be indices of the target's "
                              f"{target.config.num_layers} layers")
        drafter = cls(config, target)
        for own, source in zip(drafter.decoder.layers, layers):
            own.load_state_dict(target.layers[source].state_dict())
        drafter.decoder.norm.load_state_dict(target.norm.state_dict())
        if not shared_embeddings:
            drafter.decoder.embed_tokens.load_state_dict(target.embed_tokens.state_dict())
            if target.lm_head is not None:
                drafter.decoder.lm_head.load_state_dict(target.lm_head.state_dict())
        if draft_vocab is not None:
            drafter.set_draft_vocab(draft_vocab.to(drafter.draft_vocab.device))
        return drafter

    # -- checkpoint -------------------------------------------------------------------------

    def own_state(self) -> dict[str, torch.Tensor]:
        """Parameters this drafter stores (shared target weights excluded)."""
        state = self.state_dict()
        if self.config.shared_embeddings:
            state = {k: v for k, v in state.items()
                     if not k.removeprefix("decoder.").startswith(SHARED_PREFIXES)}
        return state

    def save_pretrained(self, folder: str | Path, dtype: torch.dtype | None = None,
                        state: dict[str, torch.Tensor] | None = None, delta_from: Decoder | None = None) -> None:
        """Write config.json + model.safetensors (in `dtype`, default: as held). `state`: the tensors
        of `own_state()` as given (a sharded training run passes them gathered whole). `delta_from`:
        the target its layers were copied from — each copied matrix is then stored as its difference
        from the target's in 4-bit blocks (`d3d.delta`: ~1/4 of bf16's bytes, nearly the same drafts),
        and loading needs that target."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype).contiguous().cpu()
                 for k, v in (self.own_state() if state is None else state).items()}  # ids (the draft vocabulary) keep their integer type
        document = {"format": FORMAT, "format_version": FORMAT_VERSION}
        if delta_from is not None:
            target_state = delta_from.state_dict()
            state = delta.encode(state, target_state, self.config.target_layers)
            bases = delta.bases(state, target_state, self.config.target_layers)
            document.update(format_version=DELTA_FORMAT_VERSION, delta_base=delta.base_fingerprint(bases))
        save_tensors(state, folder / "model.safetensors", metadata={"format": FORMAT})
        document.update(self.config.to_dict())
        (folder / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True))

    @classmethod
    def from_pretrained(cls, folder: str | Path, target: Decoder, tokenizer_fingerprint: str = "") -> "Drafter":
        """Load a drafter for `target`; refuses one made for another vocabulary or tokenizer."""
        folder = Path(folder)
        config_file, weights_file = folder / "config.json", folder / "model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise LoadError(f"{folder} is not a d3d drafter (needs config.json and model.safetensors)")
        try:
            document = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise LoadError(f"{config_file} is not valid JSON ({error})") from None
        if not isinstance(document, dict) or document.pop("format", None) != FORMAT:
            raise LoadError(f"{config_file} is not a d3d drafter config")
        version = document.pop("format_version", None)
        delta_base = document.pop("delta_base", None)
        if version not in (FORMAT_VERSION, DELTA_FORMAT_VERSION):
            raise LoadError(f"{folder}: drafter format version {version} is not supported "
                            f"(this d3d reads versions {FORMAT_VERSION} and {DELTA_FORMAT_VERSION})")
        try:
            config = DrafterConfig.from_dict(document)
        except ConfigError as error:
            raise LoadError(f"{config_file}: {error}") from None
        check_compatible(config, target, tokenizer_fingerprint, str(folder))
        drafter = cls(config, target, loading=True)
        state = read_safetensors(weights_file)
        if version == DELTA_FORMAT_VERSION:
            bases = delta.bases(state, target.state_dict(), config.target_layers)
            if delta.base_fingerprint(bases) != delta_base:
                raise LoadError(f"{folder} stores its layers as differences from another target's weights "
                                "(the same shapes and tokenizer, other values): load it with the target it was made for")
            try:
                state = delta.decode(state, bases, config.target_layers, torch.bfloat16)
            except ValueError as error:
                raise LoadError(f"{weights_file}: {error}") from None
        check_state(drafter.own_state(), state, str(weights_file))
        check_finite(state, str(weights_file))
        drafter.load_state_dict(state, strict=False)
        if config.draft_vocab_size:
            try:
                drafter.set_draft_vocab(drafter.draft_vocab.clone())  # checks the stored ids
            except ConfigError as error:
                raise LoadError(f"{weights_file}: {error}") from None
        return drafter.eval()

    # -- drafting ---------------------------------------------------------------------------

    def new_cache(self, capacity: int) -> KVCache:
        """A cache for committed tokens plus one block; may reach B positions past the context."""
        c = self.config.model
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity + self.block_size,
                       1, self.decoder.dtype, self.decoder.device, split=self.decoder.splits_values,
                       tile_keys=self.decoder.tiles_keys)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids, MASK included → (B, T, hidden)."""
        if self.mask_embedding is None:  # an AR drafter: token ids only
            return self.decoder.embed(ids)
        is_mask = ids == self.config.mask_token_id
        embeds = self.decoder.embed(ids.masked_fill(is_mask, 0))
        return torch.where(is_mask[..., None], self.mask_embedding.to(embeds.dtype), embeds)

    def packed_hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states (B, T, hidden) of a packed training batch (`d3d.train.batch.collate`): its clean
        rows as tokens, or — for a DFlash-style drafter — as the target's hidden states (batch["features"])."""
        embeds = self.embed(batch["input_ids"])
        if self.feature_projection is None:
            return self.decoder.hidden_states(embeds, batch["positions"], None, batch["mask"])
        features, is_context = require_features(batch)
        context = self.feature_projection(features)
        return conditioned_hidden(self.decoder, embeds, context, is_context, batch["positions"], batch["mask"])

    @torch.no_grad()
    def read_features(self, cache: KVCache, features: torch.Tensor) -> None:
        """DFlash-style: append the next committed tokens' context to the cache from their target
        hidden states (T, F · hidden) (`d3d.dflash.inject`)."""
        self.require_kind(("dflash",), "reading target hidden states")
        inject(self.decoder, self.feature_projection, cache, features)

    def block_pass(self, cache: KVCache, clean: list[int], block: list[int]) -> torch.Tensor:
        """One forward over clean tokens + one block; keeps the clean KV; returns block logits (B, V)."""
        start = cache.length
        device = self.decoder.device
        ids = torch.tensor([clean + block], device=device)
        positions = torch.arange(start, start + ids.shape[1], device=device)[None]
        mask = draft_mask(len(clean), len(block), start, self.config.block_attention, device)[None]
        hidden = self.decoder.hidden_states(self.embed(ids), positions, cache, mask)
        cache.commit(len(clean))
        return self.logits(hidden[0, len(clean):])

    @torch.no_grad()
    def draft(self, cache: KVCache, tokens: list[int], num_drafts: int | None = None) -> torch.Tensor:
        """Block logits after the committed `tokens`, row i predicting position len(tokens)+i: (B, V)
        with shifted labels (the last row guesses the bonus after a full block), (B-1, V) unshifted.

        The cache holds a prefix of `tokens` (everything but the anchor at most); the missing
        clean tokens are fed in the same pass as the block. With more than one denoising step,
        each further pass re-feeds the most confident drafts in place of their masks.

        With `num_drafts` (one denoising step), the block holds only the rows those drafts need —
        the anchor and the first masks — so the pass costs about its rows, and the first
        `num_drafts` rows come back. In a causal block they are the full block's rows exactly; in an
        anchor-causal or bidirectional one the anchor's row is, the masks see fewer masks.
        """
        return self.draft_together([(cache, tokens, num_drafts)])[0]

    @torch.no_grad()
    def draft_together(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor]:
        """`draft` for several sequences, each (cache, tokens, num_drafts) with its own cache, in one
        forward over all their rows where the decoder fuses rows (`Decoder.batches_rows`: the
        row-exact kernels) — each sequence's logits bit for bit those of its `draft` alone —, else
        one `draft` pass after another. A sequence with more than a prefill chunk of clean tokens
        to read (its first draft after a long prompt) and drafters of several denoising steps draft
        alone. Subclasses that change what `draft` returns override this."""
        self.require_kind(("d3d", "dflash"), "block drafting")
        together = []
        if self.config.kind == "d3d" and self.config.denoising_steps == 1 and len(requests) > 1 \
                and self.decoder.batches_rows:
            together = [i for i, (cache, tokens, num_drafts) in enumerate(requests)
                        if len(tokens) - cache.length + self.block_size <= PREFILL_CHUNK]
        out: list[torch.Tensor | None] = [None] * len(requests)
        if len(together) > 1:
            for i, logits in zip(together, self._block_passes([self._first_block(*requests[i]) for i in together])):
                out[i] = logits if self.config.labels == "shifted" else logits[self.draft_rows]
        for i, request in enumerate(requests):
            if out[i] is None:
                out[i] = self._draft_alone(*request)
        return out

    def _first_block(self, cache: KVCache, tokens: list[int], num_drafts: int | None,
                     ) -> tuple[KVCache, list[int], list[int]]:
        """(cache, clean tokens it lacks, first block [anchor, MASK…]) of `draft`'s first pass."""
        if not cache.length < len(tokens):
            raise ValueError("the drafter cache must not hold the anchor (the last committed token)")
        if self.feature_projection is not None and cache.length != len(tokens) - 1:
            raise ValueError(f"a DFlash-style drafter drafts from the target's hidden states of every committed "
                             f"token but the anchor: it has {cache.length} of the {len(tokens) - 1} (read_features)")
        size = self.block_size
        if num_drafts is not None and self.config.denoising_steps == 1:
            size = max(1, min(size, num_drafts + self.draft_rows.start))  # shifted: row i drafts i+1
        return cache, tokens[cache.length:-1], [tokens[-1]] + [self.config.mask_token_id] * (size - 1)

    def _draft_alone(self, cache: KVCache, tokens: list[int], num_drafts: int | None) -> torch.Tensor:
        cache, clean, block = self._first_block(cache, tokens, num_drafts)
        logits = self.block_pass(cache, clean, block)
        anchor, size, steps = block[0], len(block), self.config.denoising_steps
        for step in range(1, steps):
            confidence, guess = logits[self.draft_rows].float().softmax(-1).max(-1)  # row j-1 fills block slot j
            num_fixed = (size - 1) * step // steps
            fixed = set(torch.topk(confidence, num_fixed).indices.tolist())
            block = [anchor] + [int(guess[j]) if j in fixed else self.config.mask_token_id for j in range(size - 1)]
            logits = self.block_pass(cache, [], block)
        return logits if self.config.labels == "shifted" else logits[self.draft_rows]

    def _block_passes(self, passes: list[tuple[KVCache, list[int], list[int]]]) -> list[torch.Tensor]:
        """`block_pass` for several caches in one fused forward: each one's block logits (B, V)."""
        device = self.decoder.device
        parts = [SequenceRows(torch.tensor(clean + block, device=device), cache,
                              draft_mask(len(clean), len(block), cache.length, self.config.block_attention, device))
                 for cache, clean, block in passes]
        ids = torch.cat([part.ids for part in parts])
        hidden, _ = self.decoder.hidden_rows(self.embed(ids[None])[0], parts)
        rows, begin = [], 0
        for cache, clean, block in passes:
            cache.commit(len(clean))
            rows.extend(range(begin + len(clean), begin + len(clean) + len(block)))
            begin += len(clean) + len(block)
        logits = self.logits(hidden[rows])
        return list(logits.split([len(block) for _, _, block in passes]))

    @torch.no_grad()
    def packed_draft(self, cache: KVCache, trunk: list[int], branches: list[tuple[int, int]], anchor_slot: int,
                     with_trunk: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One packed forward (the async engine's drafting pass) → (trunk logits (T', V) from the
        anchor's row on, when `with_trunk`; branch block logits (N, B, V)).

        `trunk`: clean tokens after the cache — e.g. committed tokens it lacks, the anchor a, then
        the drafts d_1..d_K under verification — causal. `anchor_slot`: a's slot (= position), in
        the cache or the trunk. Branch (k, b) is the block [b, MASK × (B-1)] at positions
        anchor_slot+k+1 … anchor_slot+k+B that `draft` would run after the outcome "k drafts
        accepted, bonus b": it sees slots 0 … anchor_slot+k (context, a, d_1..d_k) and itself, never
        other branches or later drafts. Everything stays pending in `cache`: the caller keeps the
        trunk KV (clean causal input, so valid for any accepted prefix) and drops the branches.
        """
        self.require_kind(("d3d",), "packed drafting")
        if self.config.denoising_steps != 1 or self.config.labels != "shifted":
            raise ValueError("packed drafting runs one denoising step with shifted labels; this drafter has "
                             f"{self.config.denoising_steps} steps and {self.config.labels} labels")
        size, start, device = self.block_size, cache.length, self.decoder.device
        end = start + len(trunk)
        if not 0 <= anchor_slot < end or any(not 0 <= k < end - anchor_slot for k, _ in branches):
            raise ValueError(f"branches {branches} after the anchor at slot {anchor_slot} must lie within "
                             f"the {end} slots of cache and trunk")
        masks = [self.config.mask_token_id] * (size - 1)
        ids = trunk + [token for _, bonus in branches for token in [bonus] + masks]
        offsets = torch.arange(size)
        positions = torch.cat([torch.arange(start, end)]
                              + [anchor_slot + k + 1 + offsets for k, _ in branches]).to(device)
        mask = packed_mask(len(trunk), [anchor_slot + k + 1 for k, _ in branches], size, start,
                           self.config.block_attention, device)
        hidden = self.decoder.hidden_states(self.embed(torch.tensor([ids], device=device)), positions[None],
                                            cache, mask[None])[0]
        trunk_logits = self.logits(hidden[max(0, anchor_slot - start):len(trunk)]) if with_trunk else None
        logits = self.logits(hidden[len(trunk):])  # (N·B, V)
        return trunk_logits, logits.view(len(branches), size, logits.shape[-1])

    @torch.no_grad()
    def next_logits(self, cache: KVCache, new_tokens: list[int]) -> torch.Tensor:
        """AR drafting: feed `new_tokens` causally after the cache and keep their KV; returns the
        logits (V,) of the token that follows them. k drafts are k of these passes."""
        self.require_kind(("ar",), "next-token drafting")
        if not new_tokens:
            raise ValueError("next_logits needs at least one new token to read the next one from")
        start, device = cache.length, self.decoder.device
        ids = torch.tensor([new_tokens], device=device)
        positions = torch.arange(start, start + len(new_tokens), device=device)[None]
        mask = causal_mask(len(new_tokens), start, device)[None]
        hidden = self.decoder.hidden_states(self.embed(ids), positions, cache, mask)
        cache.commit()
        return self.logits(hidden[0, -1])

    def require_kind(self, kinds: tuple[DrafterKind, ...], what: str) -> None:
        if self.config.kind not in kinds:
            raise ValueError(f"{what} needs a drafter of kind {' or '.join(map(repr, kinds))}; "
                             f"this one is {self.config.kind!r}")


def check_compatible(config: DrafterConfig, target: Decoder, tokenizer_fingerprint: str, source: str) -> None:
    """Refuse a drafter made for another vocabulary, tokenizer or width."""
    if config.target_vocab_size != target.config.vocab_size:
        raise LoadError(f"{source} was made for a vocabulary of {config.target_vocab_size} tokens; "
                        f"this target has {target.config.vocab_size}")
    if config.tokenizer_fingerprint and tokenizer_fingerprint and config.tokenizer_fingerprint != tokenizer_fingerprint:
        raise LoadError(f"{source} was made for another tokenizer (fingerprint "
                        f"{config.tokenizer_fingerprint}, target's is {tokenizer_fingerprint})")
    if config.feature_layers and config.model.hidden_size != target.config.hidden_size:
        raise LoadError(f"{source} projects the target's hidden states to width {config.model.hidden_size}; "
                        f"this target's are {target.config.hidden_size} wide")
    if any(i >= target.config.num_layers for i in config.feature_layers):
        raise LoadError(f"{source} reads the target's hidden states after layers {config.feature_layers}; "
                        f"this target has {target.config.num_layers} layers")
    if config.shared_embeddings and config.model.hidden_size != target.config.hidden_size:
        raise LoadError(f"{source} shares the target's embeddings but its width "
                        f"{config.model.hidden_size} differs from the target's {target.config.hidden_size}")
