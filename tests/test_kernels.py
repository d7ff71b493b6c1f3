"""The row-exact kernels: a row's result never depends on the rows beside it; close to PyTorch's ops."""

from __future__ import annotations

import pytest
import torch

from attention_reference import pair_attention
from conftest import kernels_built_for

from d3d.cache import KEY_TILE, KVCache, key_rows, split_values, tiled_keys
from d3d.kernels import RowExactKernels, TorchKernels, row_exact_kernels

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def kernels():
    return row_exact_kernels()


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaNs included."""
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def cancelling_rows(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Inputs whose dot products cancel heavily (large terms of both signs, small sum): any change in
    the order of accumulation shows in the result."""
    x = randn(rows, width, seed=3, dtype=torch.float32)
    x[:, ::7] *= 300.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,outputs", [(1536, 576), (576, 3072), (100, 37)])  # tails: 100 % 32, 37 % 4
def test_linear_rows_do_not_depend_on_the_row_count(kernels, dtype, width, outputs):
    """Each row of an M-row call equals the same row computed alone, for every M up to 33."""
    weight = randn(outputs, width, seed=1, dtype=dtype)
    bias = randn(outputs, seed=2, dtype=dtype)
    x = cancelling_rows(33, width, dtype)
    alone = torch.cat([kernels.linear(x[i:i + 1], weight, bias) for i in range(33)])
    for rows in (2, 3, 4, 5, 16, 17, 33):
        assert torch.equal(kernels.linear(x[:rows], weight, bias), alone[:rows]), f"{rows} rows"
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    scale = x.double().abs() @ weight.double().abs().T  # error bound grows with the terms, not the sum
    error = (alone.double() - reference).abs() / (scale + 1)
    assert error.max() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 64])  # 64: lane-packed where the build lane-packs bf16
def test_linear_reads_strided_rows(kernels, dtype, width):
    """A row view (stride > width) gives the same bits as its contiguous copy."""
    weight = randn(24, width, seed=1, dtype=dtype)
    wide = randn(9, 80, seed=2, dtype=dtype)
    for rows in (1, 9):
        assert torch.equal(kernels.linear(wide[:rows, :width], weight, None),
                           kernels.linear(wide[:rows, :width].contiguous(), weight, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_rows_equal_single_queries(kernels, dtype):
    """Causal attention over a cache: query i of a T-query call equals a one-query call over its own keys."""
    q = randn(1, 16, 4, 8, seed=0, dtype=dtype)  # (B, T, H, D)
    k = randn(1, 2, 23, 8, seed=1, dtype=dtype, scale=3.0)  # (B, H_kv, S, D): 7 cached + 16 new
    v = randn(1, 2, 23, 8, seed=2, dtype=dtype)
    together = kernels.attention(q, k, v, None)
    alone = [kernels.attention(q[:, i:i + 1], k[:, :, :8 + i], v[:, :, :8 + i], None) for i in range(16)]
    assert torch.equal(together, torch.cat(alone, dim=1))
    expected = TorchKernels.attention(q.float(), k.float(), v.float(), None)
    torch.testing.assert_close(together.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,cached", [(9, 3, 64, 21), (4, 1, 80, 3), (6, 6, 128, 40), (16, 1, 64, 7),
                                                     (3, 1, 33, 9)])
def test_attention_rows_are_exact_at_model_shapes(kernels, dtype, heads, kv_heads, dim, cached):
    """SmolLM2's heads (9 over 3 KV heads, dim 64) and others: key tiles with tails, head dims not a
    multiple of 16 (or odd: no bf16 pairs), query groups that fill part of a chunk or exceed the heads
    whose weighted sums share V rows — every query of a 13-query call (several queries' heads summed
    together) equals that query alone (its key tiles scored without being stored), and all match SDPA."""
    q = randn(1, 13, heads, dim, seed=0, dtype=dtype)
    k = randn(1, kv_heads, cached + 13, dim, seed=1, dtype=dtype, scale=2.0)
    v = randn(1, kv_heads, cached + 13, dim, seed=2, dtype=dtype)
    together = kernels.attention(q, k, v, None)
    for i in (0, 5, 12):
        keys = cached + i + 1
        assert torch.equal(together[:, i:i + 1], kernels.attention(q[:, i:i + 1], k[:, :, :keys], v[:, :, :keys], None))
    expected = TorchKernels.attention(q.float(), k.float(), v.float(), None)
    torch.testing.assert_close(together.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_stops_at_a_querys_last_visible_key_with_the_same_bits(kernels, dtype):
    """Keys past a query's last visible one are never read (the kernel stops there, and skips key
    tiles no query of a chunk sees): a long causal call, and masks with holes, whole masked tiles,
    trailing masked keys and empty rows, give each row the bits of a call over its keys up to its
    last visible one only — with the keys past it set to NaN."""
    heads, kv_heads, dim, cached, length = 9, 3, 64, 5, 70
    q = randn(1, length, heads, dim, seed=0, dtype=dtype)
    k = randn(1, kv_heads, cached + length, dim, seed=1, dtype=dtype, scale=2.0)
    v = randn(1, kv_heads, cached + length, dim, seed=2, dtype=dtype)
    together = kernels.attention(q, k, v, None)
    for i in (0, 11, 30, 69):
        keys = cached + i + 1
        assert torch.equal(together[:, i:i + 1], kernels.attention(q[:, i:i + 1], k[:, :, :keys], v[:, :, :keys], None))
    mask = torch.rand(1, length, cached + length, generator=torch.Generator().manual_seed(6)) < 0.5
    ends = torch.randint(0, cached + length + 1, (length,), generator=torch.Generator().manual_seed(7))
    for row, end in enumerate(ends.tolist()):
        mask[0, row, end:] = False
    mask[0, 3, 16:48] = False  # two whole tiles masked inside a row
    mask[0, 4] = False  # an empty row
    poisoned_k, poisoned_v = k.clone(), v.clone()
    masked = kernels.attention(q, k, v, mask)
    for row, end in enumerate(ends.tolist()):
        visible = torch.nonzero(mask[0, row]).flatten()
        end = int(visible[-1]) + 1 if len(visible) else 0
        if end == 0:
            assert torch.equal(masked[:, row], torch.zeros_like(masked[:, row]))
            continue
        alone = kernels.attention(q[:, row:row + 1], k[:, :, :end], v[:, :, :end], mask[:, row:row + 1, :end])
        assert torch.equal(masked[:, row:row + 1], alone)
        poisoned_k[:, :, end:], poisoned_v[:, :, end:] = float("nan"), float("nan")
        assert torch.equal(masked[:, row:row + 1], kernels.attention(
            q[:, row:row + 1], poisoned_k, poisoned_v, mask[:, row:row + 1]))
        poisoned_k.copy_(k), poisoned_v.copy_(v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_long_context_attention_rows_are_exact_for_any_thread_count(kernels, dtype, split):
    """A verification over a long context (17 queries after 700 keys: the weighted sums go in spans
    of keys, every query's heads carried from span to span, the scaled queries kept across key
    tiles), causal and with a mask whose rows end anywhere, plain or split values: every row equals
    that query alone, with 1, 2, 3 or 8 threads (which split the queries' work differently), and
    all match SDPA."""
    heads, kv_heads, dim, cached, length = 9, 3, 64, 700, 17
    q = randn(1, length, heads, dim, seed=0, dtype=dtype)
    k = randn(1, kv_heads, cached + length, dim, seed=1, dtype=dtype, scale=2.0)
    v = randn(1, kv_heads, cached + length, dim, seed=2, dtype=dtype)
    values = split_values(v).contiguous() if split else v
    mask = torch.rand(1, length, cached + length, generator=torch.Generator().manual_seed(3)) < 0.9
    for row, end in enumerate(torch.randint(1, cached + length + 1, (length,),
                                            generator=torch.Generator().manual_seed(4)).tolist()):
        mask[0, row, end:] = False
    previous = torch.get_num_threads()
    try:
        for masked in (None, mask):
            outs = []
            for threads in (1, 2, 3, 8):
                torch.set_num_threads(threads)
                outs.append(kernels.attention(q, k, values, masked))
            assert all(torch.equal(out, outs[0]) for out in outs[1:])
            for i in (0, 7, 16):
                keys = cached + i + 1 if masked is None else int(torch.nonzero(mask[0, i]).max()) + 1
                alone_values = split_values(v[:, :, :keys]).contiguous() if split else v[:, :, :keys]
                alone = kernels.attention(q[:, i:i + 1], k[:, :, :keys].contiguous(), alone_values,
                                          None if masked is None else mask[:, i:i + 1, :keys])
                assert torch.equal(outs[0][:, i:i + 1], alone)
            expected = TorchKernels.attention(q.float(), k.float(), v.float(), masked)
            torch.testing.assert_close(outs[0].float(), expected, **TOLERANCE[dtype])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_attention_matches_sdpa_and_ignores_other_rows(kernels, dtype):
    """An arbitrary mask (B, T, S): SDPA's result, and each row equal to that row computed alone."""
    generator = torch.Generator().manual_seed(5)
    q = randn(2, 6, 4, 8, seed=0, dtype=dtype)
    k = randn(2, 2, 10, 8, seed=1, dtype=dtype)
    v = randn(2, 2, 10, 8, seed=2, dtype=dtype)
    mask = torch.rand(2, 6, 10, generator=generator) < 0.6
    mask[..., 0] = True  # no empty row
    together = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(together.float(), TorchKernels.attention(q.float(), k.float(), v.float(), mask),
                               **TOLERANCE[dtype])
    for row in range(6):
        alone = kernels.attention(q[:, row:row + 1], k, v, mask[:, row:row + 1])
        assert torch.equal(alone, together[:, row:row + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_swiglu_are_row_exact_and_match_torch(kernels, dtype):
    x = randn(17, 72, seed=0, dtype=dtype, scale=4.0)
    weight = randn(72, seed=1, dtype=dtype)
    normed = kernels.rms_norm(x, weight, 1e-6)
    assert torch.equal(normed[5:6], kernels.rms_norm(x[5:6], weight, 1e-6))
    torch.testing.assert_close(normed.float(), TorchKernels.rms_norm(x, weight, 1e-6).float(), **TOLERANCE[dtype])
    gate_up = randn(17, 2 * 40, seed=2, dtype=dtype, scale=3.0)
    mixed = kernels.silu_mul(gate_up)
    assert torch.equal(mixed[3:4], kernels.silu_mul(gate_up[3:4]))
    torch.testing.assert_close(mixed.float(), TorchKernels.silu_mul(gate_up).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 64])
def test_fused_residual_is_the_separate_add(kernels, dtype, width):
    """linear(…, residual) rounds like PyTorch's `residual + linear(…)`: the same bits."""
    weight, x = randn(48, width, seed=1, dtype=dtype), randn(5, width, seed=2, dtype=dtype)
    residual = randn(5, 48, seed=3, dtype=dtype, scale=10.0)
    assert torch.equal(kernels.linear(x, weight, None, residual), residual + kernels.linear(x, weight, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_stores_each_output_as_pytorch_rounds_it(kernels, dtype):
    """Exact dot products (one-hot rows pick one weight), so every output is `weight + bias` rounded
    once, then `+ residual` rounded again: ties to even, overflow to ±inf, for every row count and
    the columns past the last full group of 16 (37 outputs)."""
    outputs, width = 37, 64
    weight = torch.tensor([1.0, -2.5, 3.0e38, -3.0e38, 1.0 + 2 ** -8, 2 ** -130, 0.0, 7.0],
                          dtype=torch.float32).repeat(outputs * width // 8 + 1)[:outputs * width].reshape(outputs, width)
    weight = weight * randn(outputs, width, seed=1, dtype=torch.float32).sign()
    weight = weight.to(dtype)
    bias = torch.tensor([2 ** -8, 3.0e38, 3 * 2 ** -8, 1.0], dtype=torch.float32).repeat(10)[:outputs].to(dtype)
    residual = randn(17, outputs, seed=2, dtype=dtype, scale=4.0)
    for rows in (0, 1, 4, 7, 17):
        x = torch.eye(width, dtype=dtype)[:rows]
        picked = (weight.T[:rows].float() + bias.float()).to(dtype)
        assert same_bits(kernels.linear(x, weight, bias), picked), f"{rows} rows"
        assert same_bits(kernels.linear(x, weight, bias, residual[:rows]), residual[:rows] + picked), f"{rows} rows"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 64])
def test_rope_store_matches_pytorch_bit_for_bit(kernels, dtype, dim):
    """The fused RoPE + KV store gives PyTorch's q, k and v exactly, and fills the cache slots (a head
    of 8: the scalar loop; of 64: AVX-512's 16 lanes where the build has them)."""
    from d3d.cache import KVCache

    heads, kv_heads, length = 4, 2, 5
    qkv = randn(1, length, (heads + 2 * kv_heads) * dim, seed=0, dtype=dtype, scale=3.0)
    angles = randn(1, length, 1, dim, seed=1, dtype=torch.float32, scale=3.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    results = []
    for implementation in (kernels, TorchKernels):
        cache = KVCache(2, kv_heads, dim, 16, dtype=dtype)
        cache.reserve(3)
        cache.commit()  # 3 slots already cached
        cache.reserve(length)
        slots = (cache.keys[1], cache.values[1], cache.length)
        results.append((*implementation.rope_store(qkv, cos, sin, heads, kv_heads, slots), cache.keys[1].clone()))
    for ours, reference in zip(*results):
        assert ours.shape == reference.shape and torch.equal(ours, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_lanes_kernel_gives_the_reference_lanes_bits(kernels, dtype):
    """Where this build reads a weight by the lanes (no column packing for its dtype), its vector
    kernels — AVX2 or compiler-vectorised — give the portable reference's bits, for every row count."""
    if kernels.packs[dtype]:
        pytest.skip(f"this build column-packs {dtype} weights: another reduction, tested above")
    weight = randn(101, 576, seed=1, dtype=dtype)  # an odd column count: the last pair is one column
    x = cancelling_rows(100, 576, dtype)
    # AVX2: the fused tiles up to 4 rows; from 5 rows the pair tiles of 3 rows with each remainder
    # (4 left go as 2 + 2), in blocks of 48 rows (49: a block of one; 100: 48 + 48 + 4)
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 17, 24, 25, 48, 49, 100):
        assert torch.equal(kernels.linear(x[:rows], weight, None), kernels.linear_reference(x[:rows], weight)), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lanes_order_shows_in_the_bits(kernels, dtype):
    """Per output, four terms of +2^24 and four of −2^24 among 56 of ±1/4 … 1: the exact sum is the
    small terms', and fp32 keeps a small term only where no big partial sum swallows it — so any
    other order of a lane's FMAs or of the lanes' fold gives other bits. A kernel that kept the
    values but not the order differs from the reference lanes here (smooth data rounds most such
    slips away in the outputs)."""
    if kernels.packs[dtype]:
        pytest.skip(f"this build column-packs {dtype} weights: another reduction, tested above")
    generator = torch.Generator().manual_seed(3)
    columns, width = 40, 64
    small = torch.tensor([1.0, 0.5, 0.25])[torch.randint(0, 3, (columns, width), generator=generator)]
    weight = small * (torch.randint(0, 2, (columns, width), generator=generator) * 2 - 1)
    big = torch.rand(columns, width // 2, generator=generator).argsort(dim=1)[:, :8] * 2  # 8 even places per output
    weight.scatter_(1, big, torch.tensor([2.0 ** 24, -(2.0 ** 24)]).repeat(4).expand(columns, 8))
    x = torch.tensor([1.0, 0.5])[torch.randint(0, 2, (13, width), generator=generator)]
    x[:, ::2] = 1.0  # the big terms cancel in every row
    weight, x = weight.to(dtype), x.to(dtype)
    for rows in (1, 2, 3, 5, 7, 13):
        assert torch.equal(kernels.linear(x[:rows], weight, None), kernels.linear_reference(x[:rows], weight)), rows
    moved = torch.arange(width) ^ (torch.arange(width) % 16 < 2).long()  # lanes 0 and 1 swapped
    assert not torch.equal(kernels.linear_reference(x[:, moved], weight[:, moved]), kernels.linear_reference(x, weight))


def test_an_avx2_build_reads_bf16_weights_lane_packed(kernels):
    """Where the build's bf16 lanes read lane-packed copies (AVX2), a bf16 weight of a width that is
    a multiple of 16 streams as one — the copy is the layout formats.h describes, made once — and
    every other weight as stored; elsewhere no weight is lane-packed."""
    from d3d.kernels.packing import LANE_ORDER

    weight = randn(40, 64, seed=1, dtype=torch.bfloat16)
    stream = kernels.stream(weight)
    if not kernels.lane_packs:
        assert stream.format != "lane_packed"
        pytest.skip("this build does not lane-pack bf16 weights")
    assert stream.format == "lane_packed" and kernels.stream(weight) is stream  # made once
    packed = stream.parts[0].data  # (blocks, lanes, steps, 16 columns in LANE_ORDER)
    assert packed.shape == (3, 16, 4, 16)  # 40 columns padded to 48
    block, lane, step, place = 1, 5, 2, 9
    column = block * 16 + LANE_ORDER[place]
    assert packed[block, lane, step, place] == weight[column, 16 * step + lane]
    assert not packed[2, :, :, [LANE_ORDER.index(c) for c in range(8, 16)]].any()  # the padding
    assert kernels.stream(randn(40, 40, seed=2, dtype=torch.bfloat16)).format == "plain"  # 40 % 16
    assert kernels.stream(weight.float()).format != "lane_packed"


def test_a_head_wider_than_the_kernels_hold_is_refused():
    from d3d.config import MAX_HEAD_DIM, ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig(vocab_size=8, hidden_size=2 * (MAX_HEAD_DIM + 64), intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=MAX_HEAD_DIM + 64)


@pytest.fixture(scope="module")
def portable():
    """The kernels built as portable C (no AVX2), beside this machine's own build."""
    return kernels_built_for("x86-64-v2", why="the portable build is compared on x86-64")


def tiled_cache_tensors(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k (B, H_kv, S, D) and v as a tiled cache holds them: keys tiled, values split, both over whole
    tiles of slots (the slots past S hold noise: no score of theirs may matter), values viewed up to S."""
    keys = k.shape[2]
    slots = keys + -keys % KEY_TILE
    noise = randn(*k.shape[:2], slots - keys, k.shape[3], seed=9, dtype=k.dtype, scale=1e3)
    tiled = tiled_keys(torch.cat([k, noise], 2))
    values = split_values(torch.cat([v, noise], 2)).contiguous()[..., :keys, :]
    return tiled, values


@pytest.fixture(scope="module", params=["avx2", "pairs"])
def tiling(request) -> RowExactKernels:
    """A build that reads tiled keys: the AVX2 build, and this machine's where its bf16 attention
    is the pair chains' (AVX-512 BF16 without the AMX tiles: a tile's pairs are their operands)."""
    if request.param == "avx2":
        return request.getfixturevalue("avx2")
    own = row_exact_kernels()
    if not (own.pair_scores(torch.bfloat16, 64) and own.tiles_keys(torch.bfloat16, 64)):
        pytest.skip(f"this build reads no tiled keys for its pair chains ({own.path_name})")
    return own


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (10, 2)])
@pytest.mark.parametrize("length,mask_on", [(1, False), (2, False), (17, False), (17, True), (40, False), (40, True), (50, False)])
def test_tiled_keys_give_the_bits_of_rows(tiling, length, mask_on, heads, kv_heads):
    """Attention over a tiled cache's keys — a one-token step's scores, a few queries', a
    verification's and a long call's (past QUERY_BLOCK), causal and masked, on 1 and 2 threads, in
    chunks of every size the tiles are read in (AVX2: groups of 3 and 5 query heads, 1-6) — gives the
    bits it gives over the same keys as rows (transposed a tile at a time); its KV store writes them
    alike."""
    avx2 = tiling
    assert avx2.tiles_keys(torch.bfloat16, 64) and not avx2.tiles_keys(torch.float32, 64)
    if not avx2.pair_scores(torch.bfloat16, 64):
        assert not avx2.tiles_keys(torch.bfloat16, 24)  # AVX2: whole pairs of 8 keys' 16 values of d only
    keys, dim = 530, 64
    q = randn(1, length, heads, dim, seed=0, dtype=torch.bfloat16)
    k = randn(1, kv_heads, keys, dim, seed=1, dtype=torch.bfloat16, scale=3.0)
    v = randn(1, kv_heads, keys, dim, seed=2, dtype=torch.bfloat16)
    mask = torch.rand(1, length, keys, generator=torch.Generator().manual_seed(3)) > 0.3 if mask_on else None
    tiled, values = tiled_cache_tensors(k, v)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(avx2.attention(q, tiled, values, mask), avx2.attention(q, k, split_values(v).contiguous(), mask))
    finally:
        torch.set_num_threads(previous)
    qkv = randn(1, length, (heads + 2 * kv_heads) * dim, seed=4, dtype=torch.bfloat16, scale=3.0)
    angles = randn(1, length, 1, dim, seed=5, dtype=torch.float32, scale=3.0)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    caches = [KVCache(1, kv_heads, dim, 61, dtype=torch.bfloat16, split=True, tile_keys=t) for t in (False, True)]
    out = []
    for cache in caches:
        cache.reserve(11)
        cache.commit()  # 11 slots cached: the new ones cross a tile's end
        cache.reserve(length)
        out.append(avx2.rope_store(qkv, cos, sin, heads, kv_heads, (cache.keys[0], cache.values[0], cache.length))[0])
        cache.commit()
    assert torch.equal(out[0], out[1])  # q, and the keys below: every slot, those past the new ones untouched
    assert torch.equal(key_rows(caches[1].keys)[..., :61, :], caches[0].keys) and caches[1].length == 11 + length


def test_a_build_that_reads_rows_refuses_tiled_keys(portable):
    k, v = tiled_cache_tensors(randn(1, 1, 20, 64, seed=1, dtype=torch.bfloat16),
                               randn(1, 1, 20, 64, seed=2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not read"):
        portable.attention(randn(1, 1, 3, 64, seed=0, dtype=torch.bfloat16), k, v, None)


def reference_attention(kernels: RowExactKernels, portable: RowExactKernels, dtype: torch.dtype):
    """What this build's attention of dtype must equal bit for bit: the pair contract where it
    scores so, else the portable C's."""
    if kernels.pair_scores(dtype, 64):
        return lambda q, k, v, mask: pair_attention(kernels, q, k, v, mask)
    return portable.attention


def test_pair_scores_are_a_contract_of_their_own(kernels, portable):
    """Where bf16 attention scores and sums as pair dot products (AVX-512 BF16), its bits are
    `pair_attention`'s, step for step, causal and masked, plain and split values, over an odd and an
    even number of keys, and not the portable C's (the negative control)."""
    if not kernels.pair_scores(torch.bfloat16, 64):
        pytest.skip(f"this build scores bf16 as fp32 chains ({kernels.path_name})")
    assert not portable.pair_scores(torch.bfloat16, 64) and not kernels.pair_scores(torch.float32, 64)
    for length, keys, dim in ((17, 131, 64), (1, 300, 64), (4, 64, 64), (6, 45, 80)):  # 80: a scale not a power of 2
        q = randn(1, length, 9, dim, seed=0, dtype=torch.bfloat16)
        k = randn(1, 3, keys, dim, seed=1, dtype=torch.bfloat16, scale=3.0)
        v = randn(1, 3, keys, dim, seed=2, dtype=torch.bfloat16)
        mask = torch.rand(1, length, keys, generator=torch.Generator().manual_seed(3)) > 0.3
        for m in (None, mask):
            expected = pair_attention(kernels, q, k, v, m)
            for values in (v, split_values(v).contiguous()) if dim % 32 == 0 else (v,):
                assert torch.equal(kernels.attention(q, k, values, m), expected), (length, keys, m is None)
            if dim % 32 == 0 and kernels.tiles_keys(torch.bfloat16, dim):  # a tiled cache's keys: the tiles' pairs as stored
                assert torch.equal(kernels.attention(q, *tiled_cache_tensors(k, v), m), expected), (length, keys)
    assert not torch.equal(kernels.attention(q, k, v, None), portable.attention(q, k, v, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length,heads,kv_heads,keys", [(1, 9, 3, 600), (2, 9, 3, 300), (17, 9, 3, 530), (3, 8, 2, 300)])
def test_attention_gives_the_portable_bits_at_decoding_shapes(kernels, portable, dtype, length, heads, kv_heads, keys):
    """A one-token step (its key tiles read without storing them, where the build does), a few
    queries and a verification over a context longer than a span of weighted sums (each head's
    chains carried from span to span, several heads together), and a group of 4 query heads per KV
    head: the portable C's bits (where bf16 scores as pairs, the pair contract's), causal and masked,
    plain and split values, on 1 and 2 threads."""
    if kernels.amx and dtype == torch.bfloat16:
        pytest.skip("bf16 attention on AMX tiles is a contract of its own: tests/test_amx.py")
    q = randn(1, length, heads, 64, seed=0, dtype=dtype)
    k = randn(1, kv_heads, keys, 64, seed=1, dtype=dtype, scale=3.0)
    v = randn(1, kv_heads, keys, 64, seed=2, dtype=dtype)
    mask = torch.rand(1, length, keys, generator=torch.Generator().manual_seed(3)) > 0.3
    reference = reference_attention(kernels, portable, dtype)
    expected = {m is None: reference(q, k, v, m) for m in (None, mask)}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for values in (v, split_values(v).contiguous()):
                for m in (None, mask):
                    assert torch.equal(kernels.attention(q, k, values, m), expected[m is None])
    finally:
        torch.set_num_threads(previous)


def test_the_softmax_exp_gives_the_scalar_bits_for_every_x_at_most_zero(kernels):
    """The vector softmax takes exp(x − top) by a formula for x ≤ 0 only (rowexact.c's exp_below16: no
    upper clamp, 2^k by vscalefps): every 4,099th float from −0 to −inf, every float of the lower
    clamp's neighbourhood and of [−2⁻¹⁰, 0], ±0, −inf and NaN give exp_fixed's bits (NaN for NaN);
    above 88 it is not exp_fixed (the negative control: the domain matters)."""
    negative = torch.arange(0x80000000, 0xFF800001, 4099, dtype=torch.int64)
    near_clamp = torch.arange(-90.0, -84.0, 2.0 ** -17)  # every float there (spacing 2^-17 from 64 to 128)
    tiny = torch.arange(0x80000000, 0xBA800000, 0x1000, dtype=torch.int64)  # −0 … −2⁻¹⁰
    bits = torch.cat([negative, tiny]).to(torch.int32).view(torch.float32)
    x = torch.cat([bits, near_clamp, torch.tensor([0.0, -0.0, float("-inf"), -87.0, -86.99, -1e-45])])
    x = x[~torch.isnan(x)]
    got, expected = kernels.exp_below(x), kernels.exp_fixed(x)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.isnan(kernels.exp_below(torch.full((16,), float("nan")))).all()
    if kernels.path_name.startswith(("avx512", "amx")):  # elsewhere exp_below is exp_fixed itself
        above = torch.linspace(89.0, 200.0, 32)
        assert not torch.equal(kernels.exp_below(above), kernels.exp_fixed(above))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_vector_paths_give_the_portable_bits(kernels, portable, dtype):
    """Attention, norms, SwiGLU and RoPE give the portable C's bits on this machine's vector path
    (AVX2 or AVX-512), and so does the linear wherever this build reads the weight by the lanes.
    (bf16 attention on AMX tiles is a contract of its own: tests/test_amx.py.)"""
    q = randn(2, 5, 6, 64, seed=0, dtype=dtype)
    k = randn(2, 2, 37, 64, seed=1, dtype=dtype, scale=3.0)
    v = randn(2, 2, 37, 64, seed=2, dtype=dtype)
    mask = torch.rand(2, 5, 37, generator=torch.Generator().manual_seed(3)) > 0.3
    for m in (None, mask):
        if not (kernels.amx and dtype == torch.bfloat16):
            assert torch.equal(kernels.attention(q, k, v, m), reference_attention(kernels, portable, dtype)(q, k, v, m))
    x = randn(7, 576, seed=4, dtype=dtype, scale=5.0)
    weight = randn(576, seed=5, dtype=dtype)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5), portable.rms_norm(x, weight, 1e-5))
    gate_up = randn(7, 2 * 384, seed=6, dtype=dtype, scale=4.0)
    assert torch.equal(kernels.silu_mul(gate_up), portable.silu_mul(gate_up))
    # SwiGLU's edges: a width that leaves a scalar tail, ±0, ±inf, NaN, huge gates, rounding ties
    gate_up = randn(3, 2 * 203, seed=8, dtype=dtype, scale=30.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 88.5])
    gate_up[1, ::5] = torch.tensor(1.0 + 2.0 ** -8).to(dtype)  # bf16 ties after the product
    assert same_bits(kernels.silu_mul(gate_up), portable.silu_mul(gate_up))
    if not kernels.packs[dtype]:
        w = randn(100, 576, seed=7, dtype=dtype)
        assert torch.equal(kernels.linear(x, w, None), portable.linear(x, w, None))


def test_the_profile_build_times_the_attention_passes():
    """Built with `profile`, the vector attention adds each pass's time to `attention_pass_seconds`
    (what scripts/profile_step.py reports), reset on request, with the plain build's bits; the plain
    build's timers stay at zero. (AMX tiles: tests/test_amx.py.)"""
    import ctypes

    from d3d.kernels import RowExactKernels, build

    kernels = row_exact_kernels()
    path = build(profile=True)
    profiled = RowExactKernels(ctypes.CDLL(str(path)), path)
    q = randn(1, 3, 9, 64, seed=0, dtype=torch.float32)
    k = randn(1, 3, 300, 64, seed=1, dtype=torch.float32)
    v = randn(1, 3, 300, 64, seed=2, dtype=torch.float32)
    profiled.attention_pass_seconds(reset=True)
    out = profiled.attention(q, k, v, None)
    spent = profiled.attention_pass_seconds(reset=True)
    assert all(spent[name] > 0 for name in ("scores", "softmax", "sums")) and not spent["softmax_and_sums"], spent
    assert not any(profiled.attention_pass_seconds().values())
    assert torch.equal(out, kernels.attention(q, k, v, None))
    assert not any(kernels.attention_pass_seconds().values())


def test_a_forwards_scratch_is_kept_per_thread_up_to_a_size(kernels):
    """A forward's scratch (`RowExactKernels._scratch_for`): the same buffer again for the same role and
    thread while it is large enough, a larger one when not, its own for each thread, and a fresh one
    each call past KEPT_SCRATCH bytes (never held)."""
    import threading

    from d3d.kernels.binding import KEPT_SCRATCH

    first = kernels._scratch_for("test", 100, torch.float32)
    assert kernels._scratch_for("test", 50, torch.float32) is first
    grown = kernels._scratch_for("test", 1000, torch.float32)
    assert grown is not first and grown.numel() >= 1000 and kernels._scratch_for("test", 1000, torch.float32) is grown
    assert kernels._scratch_for("test", 10, torch.bfloat16).dtype == torch.bfloat16  # another dtype: its own
    elsewhere = []
    worker = threading.Thread(target=lambda: elsewhere.append(kernels._scratch_for("test", 10, torch.bfloat16)))
    worker.start(), worker.join()
    assert elsewhere[0] is not kernels._scratch_for("test", 10, torch.bfloat16)
    huge = KEPT_SCRATCH // 4 + 1
    assert kernels._scratch_for("test", huge, torch.float32) is not kernels._scratch_for("test", huge, torch.float32)
