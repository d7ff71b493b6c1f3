"""Native Llama / Qwen2 / Qwen3-family decoder over a preallocated KV cache.

RMSNorm, RoPE (default, linear and llama3 scaling), grouped-query attention, SwiGLU, Qwen3 q/k
norm and Qwen2 q/k/v bias, tied or untied embeddings — the same arithmetic as transformers'
modelling code, so logits match it for the same weights. Attention takes an arbitrary boolean
mask over (cached + new) positions, which block drafting, packed async branches and training use.

The arithmetic comes from `d3d.kernels`: on a CPU the row-exact kernels (a token's logits are
bit-identical whether it is decoded alone or verified among 16 others, by construction) for every
forward that records no gradients, and PyTorch's differentiable ops for training or on another
device. `Decoder(config, kernels=...)` chooses; see `KernelChoice` and `Decoder.kernels_for`.

This module is the model only: it never samples, never tokenizes and owns no generation loop.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from d3d.cache import V_PART, KVCache
from d3d.config import ConfigError, ModelConfig
from d3d.graphs import fixed_rows_hidden, fixed_rows_linear, fixed_rows_of, pooled_cache
from d3d.kernels import (DecoderShape, KernelBuildError, LayerTable, RowExactKernels, Segment, TorchKernels,
                         row_exact_kernels)
from d3d.kernels.plan import MAX_ROWS as PLANNED_ROWS, ForwardPlan
from d3d.lazy_rows import LazyRows
from d3d.masks import chunk_bounds
from d3d.rope import rope_table
from d3d.sampling import greedy_ids

# "auto": row-exact kernels where they build (CPU inference), else PyTorch's; "row-exact": required
# (fails loudly where they cannot build); "torch": PyTorch's ops everywhere.
KernelChoice = Literal["auto", "row-exact", "torch"]
Kernels = RowExactKernels | type[TorchKernels]

# Rows per fused kernel call of a long forward (a prompt's prefill, a drafter's first pass over
# it): the forward runs in chunks of at most this many rows, each after the KV the chunks before it
# stored. The row-exact kernels make a row's bits independent of the rows beside it, so chunking
# changes no output bit (tested for every chunk size); it bounds the attention scratch
# (rows × heads × keys floats) and keeps a chunk's activations in cache.
PREFILL_CHUNK = 512


@dataclass
class SequenceRows:
    """One sequence's share of a batched forward (`Decoder.forward_rows`): new token ids (T,) after
    its own `cache` (batch size 1), seen causally or through `mask` (T, cache.length + T); with
    `last_only`, only the last row's logits are wanted (a prompt's prefill); with `greedy`, only each
    row's argmax is (greedy decoding whose logits nobody reads: a plain step, or a verification at
    T = 0): the head computes no row with the forward; the argmaxes of its first `head_rows` rows
    come with it, every greedy part's from one `Decoder.greedy_ids` call, later ones as read
    (`LazyRows.argmaxes`)."""

    ids: torch.Tensor
    cache: KVCache
    mask: torch.Tensor | None = None
    last_only: bool = False
    greedy: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels = TorchKernels) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        # q, k and v in one matmul (transformers' q_proj/k_proj/v_proj, concatenated at load time):
        # a decoding step is ~200 small matmuls, and each call costs overhead on top of its bytes.
        self.widths = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                       self.num_kv_heads * self.head_dim]
        self.qkv_proj = nn.Linear(hidden, sum(self.widths), bias=bias)
        # Qwen2 biases q/k/v only; Llama and Qwen3 with attention_bias bias o_proj too.
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden,
                                bias=bias and config.family != "qwen2")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                layer_index: int, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, H, D) of normed inputs x (B, T, hidden), and the keys and values seen so far (B, H_kv, S, D):
        x's own, rotated, after the cache's (and stored in its reserved slots)."""
        batch, length, _ = x.shape
        qkv = kernels.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # (B, T, (H + 2 H_kv) D)
        if self.q_norm is not None:
            q, k, v = qkv.split(self.widths, dim=-1)
            q = self.q_norm(q.reshape(batch, length, self.num_heads, self.head_dim), kernels)
            k = self.k_norm(k.reshape(batch, length, self.num_kv_heads, self.head_dim), kernels)
            qkv = torch.cat((q.flatten(2), k.flatten(2), v), dim=-1)
        slots = None if cache is None else (cache.keys[layer_index], cache.values[layer_index], cache.length)
        return kernels.rope_store(qkv, cos, sin, self.num_heads, self.num_kv_heads, slots)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None, layer_index: int, kernels: Kernels) -> torch.Tensor:
        """residual + attention(x): the residual add rides on the output projection."""
        batch, length, _ = x.shape
        q, k, v = self.project(x, cos, sin, cache, layer_index, kernels)
        out = kernels.attention(q, k, v, mask)  # (B, T, H, D)
        return kernels.linear(out.reshape(batch, length, -1), self.o_proj.weight, self.o_proj.bias, residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)  # fused
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """residual + MLP(x)."""
        gate_up = kernels.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return kernels.linear(kernels.silu_mul(gate_up), self.down_proj.weight, self.down_proj.bias, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache, layer_index, kernels):
        x = self.self_attn(self.input_layernorm(x, kernels), x, cos, sin, mask, cache, layer_index, kernels)
        return self.mlp(self.post_attention_layernorm(x, kernels), x, kernels)


class Decoder(nn.Module):
    """A causal decoder: token ids (or embeddings) + positions + cache + mask → logits."""

    def __init__(self, config: ModelConfig, kernels: KernelChoice = "auto", *, draw: bool = True) -> None:
        """`draw`: draw the embedding at random as nn.Embedding does, and compute the RoPE table (False:
        `for_weights`, which builds on the meta device, where both would import torch._dynamo: ~1.5 s)."""
        super().__init__()
        if kernels not in ("auto", "row-exact", "torch"):
            raise ConfigError(f"unknown kernels {kernels!r} (auto, row-exact or torch)")
        self.config = config
        self.kernel_choice = kernels
        self.row_exact = self._load_row_exact(kernels)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=None if draw else torch.empty(
            config.vocab_size, config.hidden_size))  # a given weight is not drawn
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        # cos/sin of every position, computed once: a position's rotation is then one table row,
        # the same bits in any forward (a fresh cos() call may round lanes differently).
        self.register_buffer("rope_table", rope_table(config) if draw else torch.empty(0), persistent=False)
        self._rope_tables: dict[tuple, torch.Tensor] = {}  # the table in other dtypes
        self._layer_table: tuple[tuple[nn.Module, ...], LayerTable | None] | None = None
        self._holds, self._held = 0, False  # `holding_weights`: open holds, and whether the table was checked in them
        self._plans = threading.local()  # each thread's `ForwardPlan` (`planned_hidden`)
        self.fixed_rows: int | None = None  # rows of every decoding forward on PyTorch's ops (d3d.graphs; None: GPUs')

    @classmethod
    def for_weights(cls, config: ModelConfig, kernels: KernelChoice = "auto") -> Decoder:
        """A decoder whose every weight is loaded next: built on the meta device and given
        uninitialised memory, so that nothing is drawn at random only to be overwritten (the embedded
        target's load 0.1–0.3 s shorter on 2 cores: the draws took ~1 s, but most of it was touching
        fresh pages, which the load now does). The caller loads every parameter
        (`loading.load_state` refuses weights that miss one)."""
        cls._load_row_exact(kernels)  # built or found outside the meta device (cached: the call below reuses it)
        with torch.device("meta"):
            decoder = cls(config, kernels, draw=False)
        # Module.to_empty would run PyTorch's Python reference of empty_like, which imports sympy (~0.9 s)
        for module in decoder.modules():
            for name, weight in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype),
                                                             requires_grad=weight.requires_grad))
        decoder.rope_table = rope_table(config)  # computed, never loaded
        return decoder

    def __getstate__(self) -> dict:
        # copies (deepcopy, pickling) rebuild their own caches: the table points at this decoder's weights
        return {**self.__dict__, "_rope_tables": {}, "_layer_table": None, "_plans": None, "_holds": 0, "_held": False}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._plans = threading.local()

    @staticmethod
    def _load_row_exact(choice: KernelChoice) -> RowExactKernels | None:
        if choice == "torch":
            return None
        try:
            return row_exact_kernels()
        except KernelBuildError as error:
            if choice == "row-exact":
                raise
            warn_once(f"d3d: row-exact kernels unavailable ({str(error).splitlines()[0]}); using PyTorch's "
                      "ops, with exactness checked on this machine (see `d3d doctor`)")
            return None

    def kernels_for(self, x: torch.Tensor) -> Kernels:
        """The kernels a forward over `x` runs: row-exact for CPU inference, PyTorch's otherwise.

        A forward that can record gradients (grad mode on, and the input or a weight requiring
        them: training, healing) needs PyTorch's differentiable ops; every other CPU forward — all
        decoding, in any thread — runs the row-exact kernels, so all paths share one arithmetic.
        """
        if self.row_exact is None or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
            return TorchKernels
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return TorchKernels
        return self.row_exact

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`embed_tokens(ids)`'s values; by `torch.embedding` itself where it is a plain lookup — half the
        module call's time right after a forward (~60 against ~115 µs on an AMD EPYC Zen 3)."""
        weight = self._plain_embedding()
        return torch.embedding(weight, ids) if weight is not None else self.embed_tokens(ids)

    def _plain_embedding(self) -> torch.Tensor | None:
        """The embedding's weight where it is a plain lookup of rows (no padding index or norm), else None."""
        table = self.embed_tokens
        plain = type(table) is nn.Embedding and table.padding_idx is None and table.max_norm is None
        return table.weight if plain else None

    @property
    def head_weight(self) -> torch.Tensor:
        """The output projection's weight (V, hidden): the embedding itself when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def linear_weights(self) -> dict[str, torch.Tensor]:
        """Every weight a linear kernel reads, by its state-dict name (the head by its own)."""
        weights = {f"{name}.weight": module.weight for name, module in self.named_modules()
                   if isinstance(module, nn.Linear)}
        weights.setdefault("lm_head.weight", self.head_weight)
        return weights

    def streamed_weights(self) -> str:
        """How the kernels read the linear weights: the dtype, or the GGUF types whose blocks they
        stream ("Q4_1/Q8_0") — part of what a measurement on this decoder depends on."""
        if self.row_exact is None or self.device.type != "cpu":
            return str(self.dtype).removeprefix("torch.")
        sources = sorted({stream.source for stream in map(self.row_exact.stream, self.linear_weights().values())
                          if stream.quantized})
        return "/".join(sources) if sources else str(self.dtype).removeprefix("torch.")

    def pack_weights(self) -> float:
        """Prepare what the row-exact forward reads now rather than on its first use: every weight's
        stream and the layers' table (with a quantized stream's dense and grouped copies: seconds for
        a 30-layer drafter quantized at load, which its first draft paid before); seconds taken."""
        if self.row_exact is None or self.device.type != "cpu":
            return 0.0
        started = time.perf_counter()
        for weight in self.linear_weights().values():
            self.row_exact.prepare(weight)
        if self.layers:
            self.layer_table(self.row_exact)
        return time.perf_counter() - started

    def prepare_greedy_head(self) -> None:
        """The certified greedy head of this (target's) vocabulary head (`greedy_ids`), prepared now —
        checked and timed on this machine, ~0.4 s for SmolLM2-135M — rather than at the first greedy token."""
        if self.row_exact is not None and self.device.type == "cpu":
            self.row_exact.greedy.head(self.head_weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, capacity: int | None = None, batch_size: int = 1) -> KVCache:
        capacity = capacity or self.config.max_position_embeddings
        if capacity > self.config.max_position_embeddings:
            raise ValueError(f"cache of {capacity} exceeds the model's context of "
                             f"{self.config.max_position_embeddings} positions")
        if batch_size == 1 and self.device.type == "cuda" and fixed_rows_of(self):
            return pooled_cache(self, capacity)  # storage whose graph an ended request captured (d3d.graphs)
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, batch_size, self.dtype, self.device,
                       split=self.splits_values, tile_keys=self.tiles_keys)

    @property
    def splits_values(self) -> bool:
        """Whether this model's caches store V by slices of d (d3d.cache): where the row-exact kernels
        read them, whose weighted sums stream that layout faster (docs/performance.md)."""
        return (self.row_exact is not None and self.device.type == "cpu" and self.config.head_dim % V_PART == 0
                and self.dtype in (torch.bfloat16, torch.float32))

    @property
    def tiles_keys(self) -> bool:
        """Whether this model's caches also store K by tiles of slots (d3d.cache): where the row-exact
        kernels' build reads them so (`RowExactKernels.tiles_keys`), its scores' fastest layout."""
        return self.splits_values and self.row_exact.tiles_keys(self.dtype, self.config.head_dim)

    def rope_table_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The cos/sin table (2, positions, D) in `dtype`, converted once."""
        table = self.rope_table
        key = (dtype, table.device, table.data_ptr())
        cached = self._rope_tables.get(key)
        if cached is None:
            cached = self._rope_tables[key] = table.to(dtype)
        return cached

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, 1, D) for positions (B, T)."""
        table = self.rope_table_as(dtype)
        positions = self.clamp_positions(positions)
        return table[0][positions][:, :, None], table[1][positions][:, :, None]

    def clamp_positions(self, positions: torch.Tensor) -> torch.Tensor:
        # Positions past the context reuse the last rotation: only async branches drafted beyond the
        # length limit reach them, and those drafts are never verified.
        return positions.clamp(max=self.rope_table.shape[1] - 1)

    @contextmanager
    def holding_weights(self) -> Iterator[None]:
        """Within it, forwards read the weights as they were when it began: the layer table is
        checked against them once (`LayerTable.current`: ~270 tensors' versions and addresses, ~0.14 ms
        of a 5.8 ms one-token step on an AMD EPYC Zen 4, the weights' stream having evicted their Python
        objects), not at every forward. A generation holds them (`d3d.engine`); a weight changed in
        place during one is read from the next on. Holds nest, and each one checks once."""
        self._holds += 1
        self._held = False
        try:
            yield
        finally:
            self._holds -= 1

    def layer_table(self, kernels: RowExactKernels) -> LayerTable | None:
        """The row-exact kernels' table of this decoder's weights, rebuilt when a weight changed
        (checked at every call, or once while `holding_weights`)."""
        layers = tuple(self.layers)
        if self._held and self._holds and self._layer_table is not None and self._layer_table[0] == layers:
            return self._layer_table[1]
        if self._layer_table is None or self._layer_table[0] != layers or not (
                self._layer_table[1] is None or self._layer_table[1].current()):
            rows = []
            for layer in layers:
                attention, mlp = layer.self_attn, layer.mlp
                rows.append(dict(
                    input_norm=layer.input_layernorm.weight, qkv=attention.qkv_proj.weight,
                    qkv_bias=attention.qkv_proj.bias,
                    q_norm=attention.q_norm.weight if attention.q_norm is not None else None,
                    k_norm=attention.k_norm.weight if attention.k_norm is not None else None,
                    o=attention.o_proj.weight, o_bias=attention.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight, gate_up=mlp.gate_up_proj.weight,
                    gate_up_bias=mlp.gate_up_proj.bias, down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias))
            self._layer_table = (layers, LayerTable(kernels, rows) if all(
                tensor is None or tensor.is_contiguous() for row in rows for tensor in row.values()) else None)
        self._held = self._holds > 0
        return self._layer_table[1]

    def hidden_states(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layers and final norm over embeddings (B, T, hidden) at positions (B, T)."""
        return self.hidden_and_features(embeds, positions, cache, mask)[0]

    def hidden_and_features(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                            mask: torch.Tensor | None = None, feature_layers: Sequence[int] = (),
                            last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`hidden_states`, and the residual stream after each of `feature_layers` (ascending),
        concatenated (B, T, len · hidden) — None without feature layers. Reading them changes no bit
        of the hidden states. With `last_only`, the hidden states are (B, 1, hidden), the last
        position's: where the kernels' fused forward runs, the last layer goes past its keys and values
        for that row only (a prompt's prefill), the same bits."""
        batch, length, _ = embeds.shape
        assert positions.shape == (batch, length), f"positions {tuple(positions.shape)} != {(batch, length)}"
        assert list(feature_layers) == sorted(set(feature_layers)) and all(
            0 <= i < len(self.layers) for i in feature_layers), f"feature layers {feature_layers}"
        if cache is not None:
            cache.reserve(length)
        if mask is not None:
            expected = (batch, length, length + (cache.length if cache is not None else 0))
            assert tuple(mask.shape) == expected, f"mask {tuple(mask.shape)} != {expected}"
        kernels = self.kernels_for(embeds)
        features: list[torch.Tensor] = []
        if cache is not None and kernels is self.row_exact and self.layers:
            table = self.layer_table(kernels)
            if table is not None:  # every layer in one C call: the same kernels, no per-op overhead
                c = self.config
                shape = DecoderShape(c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
                assert cache.pending == length, "the forward must follow reserve() with the same token count"
                rope = self.rope_table_as(embeds.dtype)  # positions past it: its last row, in the kernels
                # with last_only and one sequence, a chunk's outputs are computed only where read: the
                # last chunk's last row; the chunks before it store their keys and values only
                keeps = last_only and batch == 1 and not feature_layers
                hiddens, chunks, begin = [], [], 0
                for end in chunk_bounds(length, cache.length, mask, PREFILL_CHUNK):
                    whole = begin == 0 and end == length  # one chunk: the tensors themselves, not views
                    hidden, features = kernels.forward(
                        table, shape, embeds if whole else embeds[:, begin:end], rope,
                        positions if whole else positions[:, begin:end], cache.keys, cache.values, cache.length + begin,
                        mask if mask is None or whole else mask[:, begin:end, :cache.length + end],
                        self.norm.weight, feature_layers, keep=int(end == length) if keeps else None)
                    hiddens.append(hidden)
                    chunks.append(torch.cat(features, -1) if features else None)
                    begin = end
                if last_only:
                    return hiddens[-1][:, -1:], torch.cat(chunks, 1) if feature_layers else None
                if len(hiddens) == 1:
                    return hiddens[0], chunks[0]
                return torch.cat(hiddens, 1), torch.cat(chunks, 1) if feature_layers else None
        cos, sin = self.rope(positions, embeds.dtype)
        x = embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, index, kernels)
            if index in feature_layers:
                features.append(x)
        hidden = self.norm(x, kernels)
        return hidden[:, -1:] if last_only else hidden, torch.cat(features, -1) if features else None

    def forward_rows(self, parts: Sequence[SequenceRows], feature_layers: Sequence[int] = (),
                     head_rows: int | None = None) -> list[tuple[torch.Tensor | LazyRows, torch.Tensor | None]]:
        """Several sequences' new rows, each after its own cache, in one forward: per part, its
        logits (T, V) — (1, V) with `last_only` — and its residual stream after `feature_layers`
        (T, len · hidden; None without). With the row-exact kernels every linear layer runs once over
        all parts' rows and attention per part, and each row's bits are those of its sequence's
        forward alone; elsewhere the parts run one after another — the same bits by definition.
        With `head_rows` (row-exact kernels), a part's logits past its first `head_rows` rows — past
        none for a `greedy` part — are computed when read (`LazyRows`; one head call over every
        part's first rows now): the same bits, the head being row-exact."""
        if not parts:
            return []
        table = self._fused_table()
        if table is None or len(parts) == 1 and len(parts[0].ids) > PREFILL_CHUNK:
            return [self._part_alone(part, feature_layers) for part in parts]
        planned = (self.planned_hidden(table, parts[0].ids, parts[0].cache)
                   if len(parts) == 1 and parts[0].mask is None and not feature_layers else None)
        hidden, features = (planned, None) if planned is not None else self._hidden_rows(
            table, self.embed(torch.cat([part.ids for part in parts])), parts, feature_layers)
        ends = torch.tensor([len(part.ids) for part in parts]).cumsum(0).tolist()
        wanted = [range(end - 1, end) if part.last_only else range(end - len(part.ids), end)
                  for part, end in zip(parts, ends)]
        greedy = [part.greedy and head_rows is not None and not part.last_only for part in parts]
        now = [rows[:0] if argmax_only else rows if head_rows is None else rows[:head_rows]
               for argmax_only, rows in zip(greedy, wanted)]
        picked = [row for rows in now for row in rows]
        logits = self.logits(hidden[picked]) if picked else hidden.new_empty(0, self.head_weight.shape[0])
        # greedy parts: their first rows' argmaxes now, every part's in one call (each call of the
        # certified head reads all of it; past the counts it is faster for, the full head's argmax)
        argmax_now = [rows[:head_rows] if argmax_only else rows[:0] for argmax_only, rows in zip(greedy, wanted)]
        argmax_picked = [row for rows in argmax_now for row in rows]
        argmaxes = self.greedy_ids(hidden[argmax_picked]) if argmax_picked else None
        out, begin, argmax_begin = [], 0, 0
        for part, argmax_only, rows, first, first_ids, end in zip(parts, greedy, wanted, now, argmax_now, ends):
            computed = logits[begin:begin + len(first)]
            if len(first) < len(rows):
                computed = LazyRows(len(rows), lambda b, e, rows=rows: self.logits(hidden[rows[b]:rows[b] + e - b]),
                                    computed, argmax=(lambda b, e, rows=rows: self.greedy_ids(hidden[rows[b]:rows[b] + e - b]))
                                    if argmax_only else None,
                                    argmaxes=argmaxes[argmax_begin:argmax_begin + len(first_ids)] if argmax_only else None)
            out.append((computed, None if features is None else features[end - len(part.ids):end]))
            begin += len(first)
            argmax_begin += len(first_ids)
        return out

    def planned_hidden(self, table: LayerTable | None, ids: torch.Tensor, cache: KVCache,
                       last_only: bool = False) -> torch.Tensor | None:
        """The final-normed hidden states (T, hidden) — (1, hidden) with `last_only` — of ids (T,) after
        `cache` (batch size one; T slots reserved here), causal, through this thread's `ForwardPlan` over
        `table` — `hidden_rows`' bits without rebuilding its arguments each step — or None where no plan
        applies."""
        if table is None or len(ids) > PLANNED_ROWS or cache.batch_size != 1 or cache.keys.dtype != self.dtype:
            return None
        rope, norm = self.rope_table_as(cache.keys.dtype), self.norm.weight
        plan = self._plans.__dict__.get("plan")
        if plan is None or not plan.fits(self.row_exact, table, cache.keys, cache.values, rope, norm):
            c = self.config
            shape = DecoderShape(c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
            plan = self._plans.plan = ForwardPlan(self.row_exact, table, shape, cache.keys, cache.values, rope, norm)
        rows, weight = len(ids), self._plain_embedding()
        if weight is not None:
            torch.index_select(weight, 0, ids, out=plan.x[:rows])  # `embed`'s values, in place
        else:
            plan.x[:rows].copy_(self.embed(ids))
        if last_only:
            return plan.run(rows, cache.reserve(rows), keep=1)[-1:]
        return plan.run(rows, cache.reserve(rows))

    def _fused_table(self) -> LayerTable | None:
        """The row-exact kernels' table where several sequences can share one fused forward, else None."""
        kernels = self.kernels_for(self.embed_tokens.weight)
        return self.layer_table(kernels) if kernels is self.row_exact and self.layers else None

    @property
    def batches_rows(self) -> bool:
        """Whether `hidden_rows` can run several sequences in one fused forward (the row-exact kernels)."""
        return self._fused_table() is not None

    def hidden_rows(self, embeds: torch.Tensor, parts: Sequence[SequenceRows], feature_layers: Sequence[int] = (),
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-normed hidden states (N, hidden) of every part's rows, in order, from their
        embeddings (N, hidden) — one fused forward (needs `batches_rows`), each part after its own
        cache (reserved here, committed by the caller) — and the residual stream after
        `feature_layers` (N, len · hidden; None without)."""
        table = self._fused_table()
        assert table is not None, "hidden_rows runs on the row-exact kernels"
        return self._hidden_rows(table, embeds, parts, feature_layers)

    def _hidden_rows(self, table: LayerTable, embeds: torch.Tensor, parts: Sequence[SequenceRows],
                     feature_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert list(feature_layers) == sorted(set(feature_layers)), f"feature layers {feature_layers}"
        assert embeds.shape[0] == sum(len(part.ids) for part in parts), "one embedding per row"
        segments, positions = [], []
        for part in parts:
            cache, length = part.cache, len(part.ids)
            assert cache.batch_size == 1, "forward_rows takes one sequence per cache"
            start = cache.reserve(length)
            segments.append(Segment(length, cache.keys[:, 0], cache.values[:, 0], start, part.mask))
            positions.append(torch.arange(start, start + length, device=self.device))
        c = self.config
        shape = DecoderShape(c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
        hidden, captured = self.row_exact.forward_segments(
            table, shape, embeds, self.rope_table_as(embeds.dtype),
            torch.cat(positions), segments, self.norm.weight, feature_layers)
        return hidden, torch.cat(captured, -1) if captured else None

    def _part_alone(self, part: SequenceRows, feature_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, features = self.logits_and_features(part.ids[None], feature_layers, cache=part.cache,
                                                    mask=None if part.mask is None else part.mask[None],
                                                    last_only=part.last_only)
        return logits[0], None if features is None else features[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels_for(hidden)
        rows = fixed_rows_of(self) if kernels is TorchKernels and not torch.is_grad_enabled() else 0
        if rows and hidden.numel():  # the head in the fixed rows of the forwards (d3d.graphs)
            return fixed_rows_linear(hidden, self.head_weight, rows)
        return kernels.linear(hidden, self.head_weight, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, mask: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T); with `last_only`, logits (B, 1, V) of the last position."""
        return self.logits_and_features(input_ids, (), positions, cache, mask, last_only)[0]

    def logits_and_features(self, input_ids: torch.Tensor, feature_layers: Sequence[int],
                            positions: torch.Tensor | None = None, cache: KVCache | None = None,
                            mask: torch.Tensor | None = None, last_only: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the residual stream after each of `feature_layers` at every position
        (B, T, len · hidden; `hidden_and_features`) — what a DFlash-style drafter reads."""
        hidden, features = self.final_hidden(input_ids, feature_layers, positions, cache, mask, last_only)
        return self.logits(hidden), features

    def final_hidden(self, input_ids: torch.Tensor, feature_layers: Sequence[int] = (),
                     positions: torch.Tensor | None = None, cache: KVCache | None = None,
                     mask: torch.Tensor | None = None, last_only: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-normed hidden states (B, T, hidden) — (B, 1, hidden) with `last_only` — that
        `logits_and_features` takes its logits from, and its features."""
        if cache is not None and positions is None and mask is None and len(input_ids) == 1:
            table = self._fused_table()  # a decoding step's plan on the CPU kernels, fixed rows on a GPU's
            if table is None:
                found = fixed_rows_hidden(self, input_ids[0], cache, last_only, feature_layers)
                if found is not None:
                    return found[0][None], None if found[1] is None else found[1][None]
            elif not feature_layers:
                hidden = self.planned_hidden(table, input_ids[0], cache, last_only)
                if hidden is not None:
                    return hidden[None], None
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        return self.hidden_and_features(self.embed(input_ids), positions, cache, mask, feature_layers, last_only)

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of its logits (M,) from final hidden states (M, hidden): the first of the
        largest, as `d3d.sampling.greedy_ids` takes it from `logits` — computing the exact logits of
        only the vocabulary rows that can hold it where the row-exact kernels have a certified greedy
        head for this head (`d3d.kernels.greedy`), else from the full logits. The same ids either way."""
        kernels = self.kernels_for(hidden)
        if kernels is self.row_exact and kernels is not None:
            ids = kernels.greedy.ids(hidden, self.head_weight)
            return ids if ids is not None else kernels.argmax(self.logits(hidden))
        return greedy_ids(self.logits(hidden))
