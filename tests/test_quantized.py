"""GGUF blocks streamed by the kernels: every block decodes to the loader's bf16 value, and every
linear over a quantized stream gives the bits of the same linear over the dequantized weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from d3d.kernels import StreamPart, WeightStream, row_exact_kernels
from d3d.kernels.packing import BLOCK_BYTES, column_packed
from d3d.quantized import REPACK, STREAMS_FILE, cached_parts, llama_row_order, repack

TYPES = list(REPACK)
SCALE_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}  # fp16 fields of a block


@pytest.fixture(scope="module")
def kernels():
    return row_exact_kernels()


def random_blocks(type_name: str, rows: int, width: int, seed: int, scales: list[float] | None = None) -> np.ndarray:
    """GGUF rows (rows, bytes a row) of random codes, with fp16 scale fields drawn from `scales`
    (default: typical weight scales of both signs)."""
    _, per_block, size = REPACK[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * width // per_block, size), dtype=np.uint8)
    choices = np.array(scales if scales is not None else [1e-3, -2e-3, 5e-4, 3e-2, -1e-2], np.float32)
    for at in SCALE_AT[type_name]:
        values = choices[rng.integers(0, len(choices), blocks.shape[0])].astype(np.float16)
        blocks[:, at:at + 2] = values.reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


def loader_values(type_name: str, raw: np.ndarray) -> torch.Tensor:
    """What d3d's loader makes of these blocks: gguf-py's reference dequantization, rounded to bf16."""
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)).to(torch.bfloat16)


def stream_of(kernels, type_name: str, raw: np.ndarray) -> WeightStream:
    format, packed = repack(type_name, raw)
    data = kernels.arena.copy(torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1))
    return WeightStream.whole(format, data, raw.shape[0], type_name)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("scales", [None, [65504.0, -65504.0, 1.0], [2.0 ** -24, -(2.0 ** -24), 0.0, 6.1e-5]],
                         ids=["typical", "largest", "smallest"])
def test_every_block_decodes_to_the_loaders_value(kernels, type_name, scales):
    """The kernels' decoders — vector and scalar reference — give gguf-py's dequantization rounded
    to bf16 on every block, at typical and at extreme scales (fp16's largest and subnormal)."""
    raw = random_blocks(type_name, 64, 512, seed=1, scales=scales)
    expected = loader_values(type_name, raw)
    format, packed = repack(type_name, raw)
    data = torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1)
    assert torch.equal(kernels.dequantize(data, format, 64, 512), expected)
    assert torch.equal(kernels.dequantize(data, format, 64, 512, reference=True), expected)


def test_a_wrong_decoding_is_refused(kernels):
    """A stream whose blocks decode to other values than the weight's is refused (negative control:
    one flipped code)."""
    raw = random_blocks("Q4_1", 8, 64, seed=2)
    weight = loader_values("Q4_1", raw)
    raw = raw.copy()
    raw[3, 10] ^= 0x11
    with pytest.raises(ValueError, match="decodes to"):
        kernels.use_stream(weight, stream_of(kernels, "Q4_1", raw))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("width", [256, 1536])
def test_a_quantized_linear_is_the_dequantized_linear_bit_for_bit(kernels, type_name, width):
    """linear over the stream == linear over the bf16 weight it decodes to (this build's own bf16
    path), for every row count, with bias and residual; and each row equals the row alone."""
    outputs = 100  # not a multiple of 16 or 64: the last column blocks are partial
    raw = random_blocks(type_name, outputs, width, seed=3)
    weight = loader_values(type_name, raw)
    plain = weight.clone()  # the same values, without a stream of its own
    kernels.use_stream(weight, stream_of(kernels, type_name, raw))
    assert kernels.stream(weight).quantized and not kernels.stream(plain).quantized
    x = (torch.randn(25, width, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    bias = torch.randn(outputs, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    residual = torch.randn(25, outputs, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    grouped = kernels.grouped_rows
    if grouped:  # a few rows read the grouped blocks where this path has a form for them
        made = kernels._grouped_stream(weight, kernels.stream(weight))
        forms = {"u4": {"t4"}, "s4": {"t4"}} if kernels.lane_packs else {"u4": {"g4", "a4", "ql"}, "s4": {"qs", None}, "i8": {"g8"}}
        assert (made and made.format) in forms.get(kernels.stream(weight).format, {None}), made
    try:
        # several rows from the bf16 values, one from the grouped blocks (AVX-512 BF16), or decoding the blocks;
        # quads (QL) through their own chains at every row count
        for dense_rows, kernels.grouped_rows in ((True, grouped), (True, False), (False, False)):
            kernels.dense_rows = dense_rows
            streams = kernels._weight(weight)[1]
            form = streams[2].format if len(streams) == 3 and streams[2] is not None else None
            same = chains_of(kernels, form)
            alone = torch.cat([kernels.linear(x[i:i + 1], weight, bias) for i in range(25)])
            for rows in (1, 2, 3, 4, 5, 6, 16, 17, 24, 25):  # AVX2: pair tiles over the bf16 values from 3 rows;
                # decoding the blocks, fused tiles to 24 rows and the strip beyond
                assert torch.equal(kernels.linear(x[:rows], weight, bias), same(x[:rows], plain, bias)), rows
                assert torch.equal(kernels.linear(x[:rows], weight, bias), alone[:rows]), rows
                assert torch.equal(kernels.linear(x[:rows], weight, None, residual[:rows]),
                                   same(x[:rows], plain, None, residual[:rows])), rows
    finally:
        kernels.dense_rows, kernels.grouped_rows = True, grouped


def chains_of(kernels, form: str | None):
    """The linear whose bits a weight read in this grouped form has, over its dequantized values: the
    quads' chains (QL, QS), else the path's own for a bf16 weight."""
    return {"ql": quad_reference, "qs": quad_reference}.get(form, kernels.linear)


def quad_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """The quads' chains (linear.h's QL), step by step in fp32: per row, column and pair slot s, one
    vdpbf16ps chain over the steps i of 8 (k = 8i + 2s and 8i + 2s + 1: the odd product added first,
    each product of two bf16 exact in fp32), the slots folded as (s0 + s1) + (s2 + s3); then the bias,
    rounding to bf16, the residual, rounding again (store16_bf16)."""
    xf, wf = x.float(), weight.float()
    chains = torch.zeros(xf.shape[0], wf.shape[0], 4)
    for i in range(xf.shape[1] // 8):
        for s in range(4):
            k = 8 * i + 2 * s
            chains[..., s] = (chains[..., s] + xf[:, k + 1, None] * wf[None, :, k + 1]) + xf[:, k, None] * wf[None, :, k]
    out = (chains[..., 0] + chains[..., 1]) + (chains[..., 2] + chains[..., 3])
    out = (out + bias.float() if bias is not None else out).to(torch.bfloat16)
    return out if residual is None else (residual.float() + out.float()).to(torch.bfloat16)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_0"])
def test_4bit_blocks_looked_up_in_quads_are_their_values_through_the_quads_chains(kernels, type_name):
    """Where the build has the quads (AVX-512 BF16 with VBMI) and they are on, a Q4_1 weight's grouped
    copy is QL (a Q4_0 weight's QS: its offsets -0, its codes q - 8) — one row 8 quads at a time, 2-4 rows decoding each vector once, more rows its bf16
    values in quads (QUAD_PACKED) in tiles of up to 6 — with the bits of `quad_reference`, bias and
    residual included, each row the row alone's; widths whose last run of 32 columns is partial. Switched
    off, the grouped blocks (G4; Q4_0 has none: its blocks and bf16 values) again, with the packed layout's
    bits — which differ from the quads' on 2 of Q4_1's 1,900 outputs (the negative control: the reference
    tells the chains apart)."""
    was = kernels.quads
    if not kernels.set_quads(True):
        pytest.skip("no 4-bit quads in this build (AVX-512 BF16 with VBMI only)")
    weights = []
    try:
        for outputs, width in ((100, 256), (200, 96), (48, 1536)):
            raw = random_blocks(type_name, outputs, width, seed=11)
            weight = loader_values(type_name, raw)
            plain = weight.clone()
            kernels.use_stream(weight, stream_of(kernels, type_name, raw))
            weights.append((weight, plain))
            assert kernels.one_row_stream(weight).format == {"Q4_1": "ql", "Q4_0": "qs"}[type_name] and "quads" in kernels.path_name
            x = (torch.randn(19, width, generator=torch.Generator().manual_seed(12)) * 3).to(torch.bfloat16)
            bias = torch.randn(outputs, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
            residual = torch.randn(19, outputs, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
            alone = torch.cat([kernels.linear(x[i:i + 1], weight, bias) for i in range(19)])
            for rows in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 19):
                out = kernels.linear(x[:rows], weight, bias)
                assert torch.equal(out, quad_reference(x[:rows], plain, bias)), (outputs, width, rows)
                assert torch.equal(out, alone[:rows]), (outputs, width, rows)
                assert torch.equal(kernels.linear(x[:rows], weight, None, residual[:rows]),
                                   quad_reference(x[:rows], plain, None, residual[:rows])), (outputs, width, rows)
        kernels.set_quads(False)
        for weight, plain in weights:
            assert kernels.one_row_stream(weight).format == {"Q4_1": "g4", "Q4_0": "s4"}[type_name]
            x = (torch.randn(19, weight.shape[1], generator=torch.Generator().manual_seed(12)) * 3).to(torch.bfloat16)
            for rows in (1, 19):
                assert torch.equal(kernels.linear(x[:rows], weight, None), kernels.linear(x[:rows], plain, None))
        weight, plain = weights[0]
        x = (torch.randn(19, 256, generator=torch.Generator().manual_seed(12)) * 3).to(torch.bfloat16)
        if type_name == "Q4_1":
            assert not torch.equal(kernels.linear(x, weight, None), quad_reference(x, plain))
    finally:
        kernels.set_quads(was)


@pytest.mark.parametrize("parts", [[("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)], [("Q4_K", 64), ("Q4_0", 30)]],
                         ids=["q4_k-q6_k", "q4_k-q4_0"])
def test_a_fused_weight_of_mixed_types_streams_as_runs(kernels, parts):
    """q | k | v quantized differently (as in Q4_K_M files: Q4_K, Q4_K, Q6_K) stream as runs of
    rows in their own formats, with the bits of the dequantized fused weight; where the AVX2 lanes
    read tables, the runs of 4-bit blocks (of two formats, the last of 30 rows: a padded block of 4)
    as one T4 copy beside the other runs' blocks."""
    raws = [random_blocks(type_name, rows, 256, seed=7 + i) for i, (type_name, rows) in enumerate(parts)]
    weight = torch.cat([loader_values(type_name, raw) for (type_name, _), raw in zip(parts, raws)])
    plain = weight.clone()
    runs = []
    for (type_name, rows), raw in zip(parts, raws):
        format, packed = repack(type_name, raw)
        runs.append(StreamPart(format, kernels.arena.copy(torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1)),
                               rows, type_name))
    kernels.use_stream(weight, WeightStream(tuple(runs)))
    assert kernels.stream(weight).source == "+".join(dict.fromkeys(type_name for type_name, _ in parts))
    if kernels.lane_packs and kernels.grouped_rows:
        tables = kernels._grouped_stream(weight, kernels.stream(weight))
        assert tables is not None and tables.format == "t4"
        assert tables.nbytes == sum(-(-rows // 4) * 4 * 8 * 48 for type_name, rows in parts if type_name != "Q6_K")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    try:
        for dense_rows in (True, False):
            kernels.dense_rows = dense_rows
            for rows in (1, 2, 4, 5):
                assert torch.equal(kernels.linear(x[:rows], weight, None), kernels.linear(x[:rows], plain, None))
    finally:
        kernels.dense_rows = True


def test_the_arena_holds_a_streams_grouped_copy_or_its_blocks(kernels):
    """What a load reserves for a stream: its grouped copy where this path makes one of its runs —
    those runs' blocks are then read once and stay out of the arena — and the other runs' blocks."""
    width = 256
    for format, rows in (("u4", 8), ("s4", 8), ("i8", 8), ("u6", 6)):
        grouped, blocks = kernels.grouped_bytes([(format, rows)], width), rows * width // 32 * BLOCK_BYTES[format]
        assert kernels.in_arena(format, rows, width) == (grouped == 0)
        assert kernels.arena_bytes([(format, rows)], width) == grouped + (blocks if grouped == 0 else 0)
    if kernels.lane_packs and kernels.grouped_rows:  # T4: 48 bytes a block, each run padded to 4 rows
        assert kernels.grouped_bytes([("u4", 8), ("u6", 4), ("s4", 6)], width) == (8 + 8) * 8 * 48
        assert kernels.arena_bytes([("u4", 8), ("u6", 4)], width) == 8 * 8 * 48 + 4 * 8 * BLOCK_BYTES["u6"]
    assert kernels.grouped_bytes([("u4", 8)], width + 16) == 0  # no whole blocks: no copy


def test_a_weight_changed_in_place_drops_its_stream(kernels):
    """Healing or training a weight in place makes its quantized stream stale: the kernels read
    the new values, never the old blocks."""
    raw = random_blocks("Q8_0", 8, 64, seed=9)
    weight = loader_values("Q8_0", raw)
    kernels.use_stream(weight, stream_of(kernels, "Q8_0", raw))
    weight.mul_(2)
    assert not kernels.stream(weight).quantized
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert torch.equal(kernels.linear(x, weight, None), kernels.linear(x, weight.clone(), None))


@pytest.mark.skipif(not hasattr(row_exact_kernels().library, "d3d_decode_panel"), reason="no AVX2 in this build")
def test_the_avx512_panel_is_the_packed_layout(kernels):
    """Where AVX-512 BF16 runs quantized weights through the packed tiles, each panel the decoder
    writes must be the packed layout of the dequantized weight (checked here on any AVX2 CPU)."""
    import ctypes

    from d3d.kernels.binding import Weight

    raw = random_blocks("Q4_1", 70, 96, seed=10)  # 70 rows: the last group is partly padding
    weight = loader_values("Q4_1", raw)
    stream = stream_of(kernels, "Q4_1", raw)
    packed = column_packed(weight, kernels.arena)  # (groups, K/2, 16, 2), zero rows up to 128
    lib = kernels.library
    lib.d3d_decode_panel.argtypes = [ctypes.POINTER(Weight), ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p]
    panel = torch.empty(3, 48, 16, 2, dtype=torch.bfloat16)
    lib.d3d_decode_panel(ctypes.byref(Weight.of(stream)), 2, 3, 70, 96, panel.data_ptr())
    assert torch.equal(panel, packed[2:5])


def test_llama_row_order_is_transformers_reverse_permutation():
    """The row order matches transformers' _reverse_permute_weights on the file's rows."""
    heads, rows = 3, 24
    w = np.arange(rows)
    dim = rows // heads // 2
    expected = w.reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)
    assert np.array_equal(llama_row_order(rows, heads), expected)
    assert sorted(llama_row_order(rows, heads)) == list(range(rows))


@pytest.mark.slow
def test_the_embedded_gguf_streams_its_own_blocks_with_the_dequantized_logits():
    """The embedded SmolLM2 (Q4_1 layers, Q8_0 head) in bf16: every linear weight streams the file's
    blocks, and the logits — a prefill, then a 17-token verification and its 17 one-token steps —
    are bit-identical to those of the dequantized bf16 weights."""
    from d3d.loading import load_target

    stored, dequantized = load_target(weights="stored"), load_target(weights="dequantized")
    assert stored.weights == "GGUF Q4_1/Q8_0" and dequantized.weights == "bfloat16"
    weights = stored.decoder.linear_weights()
    assert all(stored.decoder.row_exact.stream(w).quantized for w in weights.values()), "a weight kept bf16"
    assert stored.decoder.streamed_weights() == "Q4_1/Q8_0"
    kernels = stored.decoder.row_exact
    # the cached plan's header (what the load reserves the arena by) names the runs the streams hold
    header = cached_parts(Path(stored.folder) / STREAMS_FILE)
    assert header == {name: [(p.format, p.rows) for p in kernels.stream(w).parts] for name, w in weights.items()}
    if kernels.lane_packs and kernels.grouped_rows:  # AVX2: a one-token step reads the layers' tables
        assert {kernels.one_row_stream(w).format for name, w in weights.items() if name != "lm_head.weight"} == {"t4"}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (1, 40), generator=generator)
    block = torch.randint(0, 49152, (1, 17), generator=generator)
    results = []
    with torch.no_grad():
        for target in (stored, dequantized):
            decoder = target.decoder
            cache = decoder.new_cache(64)
            first = decoder(prompt, cache=cache)
            cache.commit()
            together = decoder(block, cache=cache)[0]
            cache.commit(0)
            steps = []
            for i in range(17):
                steps.append(decoder(block[:, i:i + 1], cache=cache)[0, 0])
                cache.commit()
            results.append((first, together, torch.stack(steps)))
    (first, together, steps), (first_bf16, together_bf16, steps_bf16) = results
    assert torch.equal(together, steps), "a 17-row forward differs from its one-token steps"
    looked_up = {name for name, w in weights.items() if kernels.one_row_stream(w).format in ("ql", "qs")}
    if not looked_up:
        assert torch.equal(first, first_bf16) and torch.equal(together, together_bf16) and torch.equal(steps, steps_bf16)
        return
    # AVX-512 BF16 with the quads: the 4-bit weights' chains are the quads', the bf16 weights'
    # the packed layout's — so weight by weight, the stream's linear is its dequantized values' linear
    # through the chains it takes, at one row and at 17
    assert "lm_head.weight" not in looked_up and all("layers." in name for name in looked_up)
    bf16_weights = dequantized.decoder.linear_weights()
    x = (torch.randn(17, 1536, generator=generator) * 2).to(torch.bfloat16)
    for name, w in weights.items():
        rows = x[:, :w.shape[1]]
        same = chains_of(kernels, kernels.one_row_stream(w).format)
        for count in (1, 17):
            assert torch.equal(kernels.linear(rows[:count], w, None), same(rows[:count], bf16_weights[name], None)), name
