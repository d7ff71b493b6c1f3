"""A GGUF's quantized weights as the row-exact kernels stream them: read, repacked once, checked.

A GGUF file stores most linear weights in blocks of 4–8 bits a weight; d3d's loader dequantizes
them (through transformers, i.e. gguf-py's reference dequantization) to the model dtype. Streaming
16-bit copies reads 2–3.5× the bytes the file holds, and a one-token step is bound by the bytes it
reads. So for a bf16 target the kernels read the blocks themselves, repacked at load into their
formats (d3d/kernels/formats.h):

    GGUF Q4_1, Q4_K      → u4 (per 32 weights: fp32 scale and offset, 4-bit codes)
    GGUF Q4_0            → s4 (per 32 weights: fp32 scale, 4-bit codes less 8)
    GGUF Q8_0            → i8 (per 32 weights: fp32 scale, 8-bit codes)
    GGUF Q6_K            → u6 (per 32 weights: two fp32 scales, 6-bit codes)

and decode them in registers to exactly the bf16 values the loader produced, so every logit is the
bits the dequantized weights give (`RowExactKernels.use_stream` checks every block before a
stream is used; a weight whose blocks would differ keeps its bf16 stream). Rows are reordered and
fused as the loader does (llama q/k un-permuted; q|k|v and gate|up concatenated). Where the
kernels' path reads a copy of its own made from the blocks (`RowExactKernels.grouped_bytes`; on
AVX2, 4-bit blocks as tables of their 16 values), the blocks are read once, to make it, and stay
out of the arena's huge pages.

This module reads and repacks; it runs nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from d3d.config import ModelConfig
from d3d.kernels import RowExactKernels, StreamPart, WeightStream

FORMAT_OF = {"Q4_0": "s4", "Q4_1": "u4", "Q4_K": "u4", "Q8_0": "i8", "Q6_K": "u6"}  # GGUF type → kernel format


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as fp32 (exact), shape (n, 1)."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _u4_blocks(scale: np.ndarray, offset: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """u4 blocks from per-32 scale/offset (n,) and codes (n, 32) in 0…15: 24 bytes each."""
    out = np.empty((codes.shape[0], 24), np.uint8)
    out[:, 0:4] = scale.astype(np.float32).reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = offset.astype(np.float32).reshape(-1, 1).view(np.uint8)
    out[:, 8:24] = (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)
    return out


def _repack_q4_0(blocks: np.ndarray) -> np.ndarray:
    out = np.empty((blocks.shape[0], 20), np.uint8)
    out[:, 0:4] = _fp16(blocks, 0).view(np.uint8)
    out[:, 4:20] = blocks[:, 2:18]  # the same nibble layout
    return out


def _repack_q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _fp16(blocks, 0)[:, 0], _fp16(blocks, 2)[:, 0]
    qs = blocks[:, 4:20]
    return _u4_blocks(d, m, np.concatenate([qs & 15, qs >> 4], axis=1))


def _repack_q8_0(blocks: np.ndarray) -> np.ndarray:
    out = np.empty((blocks.shape[0], 36), np.uint8)
    out[:, 0:4] = _fp16(blocks, 0).view(np.uint8)
    out[:, 4:36] = blocks[:, 2:34]
    return out


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K super-block (n, 12 bytes) → (n, 8) each."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _repack_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, mins = _q4_k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 15).reshape(n * 8, 32)  # sub-block 2g: group g's low nibbles, 2g + 1: its high ones
    return _u4_blocks((d * sc).reshape(-1), -(dmin * mins).reshape(-1), codes).reshape(n, 8 * 24)


def _repack_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _fp16(blocks, 208)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low.reshape(n, 256) | (high.reshape(n, 256) << 4)).reshape(n * 8, 32)  # q + 32, in 0…63
    out = np.empty((n * 8, 32), np.uint8)
    out[:, 0:8] = (d * scales).reshape(n * 8, 2).view(np.uint8)
    nibbles = codes & 15
    out[:, 8:24] = nibbles[:, :16] | (nibbles[:, 16:] << 4)
    pairs = (codes >> 4).reshape(-1, 4, 8)  # weight 8j + i's high bits → byte i, bits 2j
    out[:, 24:32] = (pairs[:, 0] | (pairs[:, 1] << 2) | (pairs[:, 2] << 4) | (pairs[:, 3] << 6)).astype(np.uint8)
    return out.reshape(n, 8 * 32)


REPACK = {"Q4_0": (_repack_q4_0, 32, 18), "Q4_1": (_repack_q4_1, 32, 20), "Q8_0": (_repack_q8_0, 32, 34),
          "Q4_K": (_repack_q4_k, 256, 144), "Q6_K": (_repack_q6_k, 256, 210)}  # → (repack, weights, bytes a block)


def repack(type_name: str, raw: np.ndarray) -> tuple[str, np.ndarray]:
    """A GGUF tensor's blocks (rows, bytes a row), as stored → (kernel format, (rows, bytes) uint8)."""
    function, _, size = REPACK[type_name]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    return FORMAT_OF[type_name], function(blocks).reshape(rows, -1)


def llama_row_order(rows: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader gives a llama q or k projection (it undoes the
    rotary interleaving llama.cpp's converter applied): row i of the loaded weight is row order[i]
    of the file's."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


@dataclass
class StreamPlan:
    """What a GGUF gives the kernels: a stream per native weight name, and what it could not."""

    streams: dict[str, WeightStream] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # native name → why it keeps its bf16 stream


def plan_streams(path: str | Path, config: ModelConfig) -> StreamPlan:
    """Every linear weight of the decoder `config` describes, as the GGUF at `path` stores it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    field_ = reader.fields.get("general.architecture")
    architecture = bytes(field_.parts[field_.data[0]]).decode() if field_ is not None else ""
    plan = StreamPlan()

    def part(name: str, order: np.ndarray | None = None) -> StreamPart | str:
        tensor = tensors.get(name)
        if tensor is None:
            return f"{name} is not in the file"
        type_name = tensor.tensor_type.name
        if type_name not in REPACK:
            return f"{name} is {type_name}, which the kernels do not stream (supported: {', '.join(REPACK)})"
        raw = np.asarray(tensor.data)
        if order is not None:
            raw = raw[order]
        format, packed = repack(type_name, raw)
        return StreamPart(format, torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1), raw.shape[0], type_name)

    def add(native: str, names: list[str], orders: list[np.ndarray | None]) -> None:
        parts = [part(name, order) for name, order in zip(names, orders)]
        reasons = [p for p in parts if isinstance(p, str)]
        if reasons:
            plan.skipped[native] = "; ".join(reasons)
            return
        merged: list[StreamPart] = []
        for p in parts:  # runs of one format become one part: rows are independent
            if merged and merged[-1].format == p.format and merged[-1].rows % 4 == 0:
                last = merged.pop()
                p = StreamPart(p.format, torch.cat([last.data, p.data]), last.rows + p.rows,
                               last.source if last.source == p.source else f"{last.source}+{p.source}")
            merged.append(p)
        if len(merged) > 3 or any(p.rows % 4 for p in merged[:-1]):
            plan.skipped[native] = "its parts' formats alternate in runs the kernels cannot split"
            return
        plan.streams[native] = WeightStream(tuple(merged))

    permute = architecture == "llama"  # transformers reorders llama's q and k rows only
    head_dim = config.head_dim
    for i in range(config.num_layers):
        prefix, native = f"blk.{i}.", f"layers.{i}."
        q_order = llama_row_order(config.num_heads * head_dim, config.num_heads) if permute else None
        k_order = llama_row_order(config.num_kv_heads * head_dim, config.num_kv_heads) if permute else None
        add(native + "self_attn.qkv_proj.weight", [prefix + "attn_q.weight", prefix + "attn_k.weight",
                                                    prefix + "attn_v.weight"], [q_order, k_order, None])
        add(native + "self_attn.o_proj.weight", [prefix + "attn_output.weight"], [None])
        add(native + "mlp.gate_up_proj.weight", [prefix + "ffn_gate.weight", prefix + "ffn_up.weight"], [None, None])
        add(native + "mlp.down_proj.weight", [prefix + "ffn_down.weight"], [None])
    head = "output.weight" if "output.weight" in tensors and not config.tie_word_embeddings else "token_embd.weight"
    add("lm_head.weight", [head], [None])
    return plan


STREAMS_FILE = "streams/v1.safetensors"  # the repacked blocks, in a GGUF's conversion cache


def cached_plan(path: str | Path, config: ModelConfig, folder: Path) -> StreamPlan:
    """`plan_streams`, read from `folder / STREAMS_FILE` when an earlier load wrote it (reading a
    GGUF's metadata with gguf-py takes seconds; the repacked blocks load in a fraction of one)."""
    from safetensors import SafetensorError, safe_open

    from d3d.files import save_tensors

    file = Path(folder) / STREAMS_FILE
    try:
        with safe_open(str(file), "pt") as handle:
            meta = json.loads(handle.metadata()["plan"])
            plan = StreamPlan(skipped=meta["skipped"])
            for name, parts in meta["streams"].items():
                plan.streams[name] = WeightStream(tuple(
                    StreamPart(format, handle.get_tensor(f"{name}/{i}"), rows, source)
                    for i, (format, rows, source) in enumerate(parts)))
            return plan
    except (OSError, SafetensorError, KeyError, ValueError, TypeError):
        pass
    plan = plan_streams(path, config)
    tensors = {f"{name}/{i}": part.data for name, stream in plan.streams.items() for i, part in enumerate(stream.parts)}
    meta = {"streams": {name: [(p.format, p.rows, p.source) for p in stream.parts] for name, stream in plan.streams.items()},
            "skipped": plan.skipped}
    staging = file.with_suffix(f".{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_tensors(tensors, staging, metadata={"plan": json.dumps(meta)})
        os.replace(staging, file)  # atomic: readers see all of it or none
    except OSError:  # a read-only cache: plan again next time
        staging.unlink(missing_ok=True)
    return plan


def cached_parts(file: Path) -> dict[str, list[tuple[str, int]]]:
    """The (format, rows) runs of each weight's stream in a `cached_plan` file (a folder's
    STREAMS_FILE), from its header alone (empty where it cannot be read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as handle:
            streams = json.loads(handle.metadata()["plan"])["streams"]
        return {name: [(format, rows) for format, rows, _ in parts] for name, parts in streams.items()}
    except (OSError, SafetensorError, KeyError, ValueError, TypeError):
        return {}


@dataclass
class StreamReport:
    """What a decoder streams after `use_gguf_streams`: per source type, the weights and bytes."""

    streamed: dict[str, str] = field(default_factory=dict)  # native name → source ("Q4_1", …)
    refused: dict[str, str] = field(default_factory=dict)  # native name → why not
    stream_bytes: int = 0  # bytes the streamed weights read per forward
    bf16_bytes: int = 0  # what the same weights read as bf16

    def summary(self) -> str:
        if not self.streamed:
            return "bf16"
        sources = sorted(set(self.streamed.values()))
        return f"GGUF {'/'.join(sources)}"


def use_gguf_streams(kernels: RowExactKernels, weights: dict[str, torch.Tensor], path: str | Path,
                     config: ModelConfig, folder: Path | None = None) -> StreamReport:
    """Give every weight of `weights` (native name → the decoder's bf16 tensor) the GGUF's stream
    of it, where the kernels decode it to exactly the tensor's values; report what streams.
    `folder`: where the repacked blocks are cached (None: not cached)."""
    plan = plan_streams(path, config) if folder is None else cached_plan(path, config, folder)
    report = StreamReport(refused=dict(plan.skipped))
    for name, stream in plan.streams.items():
        weight = weights.get(name)
        if weight is None:
            report.refused[name] = "the decoder has no such weight"
            continue
        stream = WeightStream(tuple(StreamPart(p.format, kernels.arena.copy(p.data), p.rows, p.source)
                                    if kernels.in_arena(p.format, p.rows, weight.shape[1]) else p for p in stream.parts))
        try:
            kernels.use_stream(weight, stream)
        except ValueError as error:
            report.refused[name] = str(error)
            continue
        report.streamed[name] = stream.source
        report.stream_bytes += stream.nbytes
        report.bf16_bytes += weight.numel() * 2
    return report


# --weights: how a target's linear weights are stored for the kernels
WEIGHTS = ("stored", "dequantized", "q8_0", "q4_1", "q4_0")
QUANTIZE_TO = {"q8_0": "Q8_0", "q4_1": "Q4_1", "q4_0": "Q4_0"}  # the GGUF types gguf-py can quantize to
# --drafter-weights: how a drafter's own weights are streamed (its drafts change, never the output)
DRAFTER_WEIGHTS = ("stored", *QUANTIZE_TO)


def quantize_weights(kernels: RowExactKernels, weights: dict[str, torch.Tensor], type_name: str) -> StreamReport:
    """Quantize every weight (native name → bf16 tensor, changed in place) to a GGUF type with
    gguf-py's quantizer, as llama.cpp would, and stream the blocks: a different model from the
    source's (each weight becomes its dequantized blocks), decoded exactly as a GGUF's would be."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    report = StreamReport()
    done: set[int] = set()
    for name, weight in weights.items():
        if id(weight) in done:  # a tied head is the embedding
            continue
        done.add(id(weight))
        if weight.shape[1] % 32:
            report.refused[name] = f"its width {weight.shape[1]} is not a multiple of {type_name}'s 32-weight blocks"
            continue
        raw = quantize(weight.detach().float().numpy(), qtype)
        with torch.no_grad():
            weight.copy_(torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).to(weight.dtype))
        format, packed = repack(type_name, raw)
        stream = WeightStream.whole(format, kernels.arena.copy(torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1)),
                                    weight.shape[0], type_name)
        kernels.use_stream(weight, stream)
        report.streamed[name] = type_name
        report.stream_bytes += stream.nbytes
        report.bf16_bytes += weight.numel() * 2
    return report
