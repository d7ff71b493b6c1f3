"""The AMX path (amx.h): every bf16 linear on Intel's tiles, each row's bits the row alone's.

Run twice where possible: on this CPU's AMX units when it has them (skipped, with the reason, where
it has not), and on the emulated tiles — the same C with its tile operations in plain C — on any
CPU with AVX-512 BF16, so the path's packing, tails and threading are tested on every such machine."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.kernels import RowExactKernels, build, row_exact_kernels
from test_models import forward_block_and_steps
from test_quantized import loader_values, random_blocks, stream_of


def amx_state() -> str:
    """Why this CPU's own kernels run on AMX tiles or not, in words."""
    kernels = row_exact_kernels()
    if kernels.amx:
        return "on"
    if kernels.amx_refused:
        return f"refused by the load-time check: {kernels.amx_refused}"
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    return "off: this CPU has no AMX-BF16 (no amx_bf16 in /proc/cpuinfo)" if "amx_bf16" not in flags else \
        "off: Linux did not grant the tile state, or D3D_AMX=0"


@pytest.fixture(scope="module", params=["hardware", "emulated"])
def tiles(request) -> RowExactKernels:
    """Kernels whose bf16 linears take the AMX path: this CPU's, or the emulated build's."""
    if request.param == "hardware":
        state = amx_state()
        if state != "on":
            pytest.skip(f"AMX tiles {state}")
        return row_exact_kernels()
    if platform.machine() not in ("x86_64", "AMD64") or not row_exact_kernels().packs[torch.bfloat16]:
        pytest.skip("the emulated AMX path builds where AVX-512 BF16 runs (every AMX CPU has it)")
    path = build(emulate_amx=True)
    kernels = RowExactKernels(ctypes.CDLL(str(path)), path)
    assert kernels.amx and kernels.path_name.startswith("amx (emulated)"), kernels.amx_refused
    return kernels


def small(tiles: RowExactKernels) -> bool:
    """The emulated tiles are scalar C: they get smaller shapes than the hardware."""
    return "emulated" in tiles.path_name


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)


def test_every_row_of_a_call_is_the_row_alone_on_tiles(tiles):
    """Rows 1…33 and 64 (full and partial row tiles, one or two of them per pass), an odd number of
    16-column groups and a partial last group, with bias and residual: each row the row alone's bits,
    and within bf16 rounding of float64."""
    width, outputs = (96, 72) if small(tiles) else (1536, 584)
    weight, bias = randn(outputs, width, seed=1), randn(outputs, seed=2)
    x = randn(64, width, seed=3, scale=3.0)
    residual = randn(64, outputs, seed=4)
    alone = torch.cat([tiles.linear(x[i:i + 1], weight, bias) for i in range(64)])
    alone_residual = torch.cat([tiles.linear(x[i:i + 1], weight, None, residual[i:i + 1]) for i in range(64)])
    for rows in (*range(2, 34), 64):
        assert torch.equal(tiles.linear(x[:rows], weight, bias), alone[:rows]), f"{rows} rows"
        assert torch.equal(tiles.linear(x[:rows], weight, None, residual[:rows]), alone_residual[:rows]), f"{rows} rows"
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    scale = x.double().abs() @ weight.double().abs().T
    assert ((alone.double() - reference).abs() / (scale + 1)).max() < 2e-2


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K"])
def test_quantized_weights_on_tiles_give_their_bf16_values_bits(tiles, type_name):
    """A GGUF stream on the tiles — up to 64 rows (Q4_1, as the tiles' first operand, one to four
    row tiles) or 32 (Q8_0, the second) decode its grouped blocks, Q4_K its blocks into a panel, more
    rows read its bf16 values — gives the bits of the dequantized weight's tiles (the second
    operand), at every row count."""
    width, outputs = (256, 40) if small(tiles) else (1536, 100)
    raw = random_blocks(type_name, outputs, width, seed=5)
    weight = loader_values(type_name, raw)
    plain = weight.clone()
    tiles.use_stream(weight, stream_of(tiles, type_name, raw))
    x = randn(65, width, seed=6, scale=3.0)
    bias = randn(outputs, seed=7)
    if type_name == "Q4_1" and " avx512vbmi" in open("/proc/cpuinfo").read():  # every AMX CPU has VBMI
        # 4-bit blocks as the tiles' first operand (A4), looked up in their tables (vpmultishiftqb)
        assert tiles._grouped_stream(weight, tiles.stream(weight)).format == "a4"
    try:
        for tiles.dense_rows in (True, False):  # False: every row count decodes the blocks
            for rows in (1, 2, 3, 4, 5, 16, 17, 32, 33, 47, 48, 64, 65):
                assert torch.equal(tiles.linear(x[:rows], weight, bias), tiles.linear(x[:rows], plain, bias)), rows
    finally:
        tiles.dense_rows = True


def test_each_path_reads_its_own_grouped_copy(tiles):
    """`set_amx` switches the process's path (what scripts/amx_check.py alternates); a Q4_1 weight's
    grouped copy follows it — the tiles' first-operand form (A4) on; off, the quads (QL) where the build
    has them and they are on, else the pair vectors (G4) — and on each path a call's rows are the rows
    alone."""
    if not small(tiles):
        pytest.skip("switching the process's own kernels off would change every other test's path")
    raw = random_blocks("Q4_1", 40, 256, seed=8)
    weight = loader_values("Q4_1", raw)
    tiles.use_stream(weight, stream_of(tiles, "Q4_1", raw))
    x = randn(5, 256, seed=9, scale=3.0)
    on = tiles.linear(x, weight, None)
    vbmi = " avx512vbmi" in open("/proc/cpuinfo").read()
    assert tiles._grouped_stream(weight, tiles.stream(weight)).format == ("a4" if vbmi else "g4")
    try:
        assert not tiles.set_amx(False) and not tiles.path_name.startswith("amx")
        assert tiles._grouped_stream(weight, tiles.stream(weight)).format == ("ql" if tiles.quads else "g4")
        off = tiles.linear(x, weight, None)
        assert torch.equal(off, torch.cat([tiles.linear(x[i:i + 1], weight, None) for i in range(5)]))
    finally:
        assert tiles.set_amx(True) and tiles.path_name.startswith("amx (emulated)")
    assert torch.equal(tiles.linear(x, weight, None), on)
    assert torch.equal(on, torch.cat([tiles.linear(x[i:i + 1], weight, None) for i in range(5)]))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_a_k_row_forward_is_k_steps_on_tiles(tiles, family):
    """The whole bf16 model on the tiles: a T-token forward equals T one-token steps, bit for bit, and
    stays within bf16 rounding of the AVX-512 path's logits."""
    decoder = make_decoder(tiny_config(family), dtype=torch.bfloat16)
    avx512 = forward_block_and_steps(decoder)[0]
    decoder = make_decoder(tiny_config(family), dtype=torch.bfloat16)
    decoder.row_exact = tiles
    together, one_by_one = forward_block_and_steps(decoder)
    assert torch.equal(together, one_by_one)
    if tiles is not row_exact_kernels():
        assert torch.allclose(together.float(), avx512.float(), rtol=5e-2, atol=5e-2)


def pair_chain(x: torch.Tensor, weight: torch.Tensor, first: int) -> torch.Tensor:
    """x @ weightᵀ as one fp32 FMA chain per output over the k pairs in order, element `first` of each
    pair (0: even, 1: odd) before the other — simulated in float64, where a bf16 product is exact."""
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    xs, ws = x.double(), weight.double()
    for k in range(0, x.shape[1], 2):
        for e in (first, 1 - first):
            out = (xs[:, k + e, None] * ws[None, :, k + e] + out.double()).float()
    return out


def test_each_output_is_one_chain_over_k_pairs(tiles):
    """The emulated tiles compute what the SDM says TDPBF16PS does: per output one FMA chain over the k
    pairs in order, the even element of a pair before the odd one. (vdpbf16ps, the AVX-512 path, takes
    the odd one first, as the SDM says of it — measured on AMD Zen 4 and an Intel Xeon —, so the two
    paths round differently and a process keeps to one.) On AMX hardware, which rule it follows is
    reported: "neither" on the Intel Xeon of docs/amx.md (row-exactness does not depend on it)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 576, generator=generator).to(torch.bfloat16)
    weight = torch.randn(16384, 576, generator=generator).to(torch.bfloat16)
    tiles_out = tiles.linear(x, weight, None)
    even, odd = (pair_chain(x, weight, first).to(torch.bfloat16) for first in (0, 1))
    assert int((even != odd).sum()) == 4  # the order shows in 4 of these 65,536 sums after rounding to bf16
    if small(tiles):
        assert torch.equal(tiles_out, even)
    else:
        rule = "even first" if torch.equal(tiles_out, even) else "odd first" if torch.equal(tiles_out, odd) else "neither"
        print(f"AMX tiles here: {rule}")
    tiles.library.d3d_amx(0)
    try:
        avx512 = tiles.linear(x, weight, None)
    finally:
        assert tiles.library.d3d_amx(1) == 1
    if "AuthenticAMD" in open("/proc/cpuinfo").read():
        assert torch.equal(avx512, odd)


def test_amx_is_one_choice_for_the_process_and_named(tiles, monkeypatch):
    """Off (D3D_AMX=0, or d3d_amx(0)), the path's name says the AVX-512 path runs; on, AMX."""
    if not small(tiles):
        pytest.skip("switching the process's own kernels off would change every other test's path")
    tiles.library.d3d_amx(0)
    try:
        assert not tiles.library.d3d_kernel_path().decode().startswith("amx")
    finally:
        assert tiles.library.d3d_amx(1) == 1
    assert tiles.library.d3d_kernel_path().decode().startswith("amx (emulated)")
    monkeypatch.setenv("D3D_AMX", "0")
    other = RowExactKernels(tiles.library, tiles.path)  # the same library: its switch turned off
    try:
        assert not other.amx and other.amx_refused is None and not other.path_name.startswith("amx")
    finally:
        tiles.library.d3d_amx(1)


def test_the_load_time_check_refuses_tiles_whose_rows_differ(tiles, monkeypatch):
    """The check that keeps the AMX path (`_amx_refusal`) refuses a linear whose rows change with
    the call (negative control: a linear that adds the row count to every output)."""
    if not small(tiles):
        pytest.skip("exercised on the emulated tiles")
    assert tiles._amx_refusal() is None
    honest = RowExactKernels.linear
    monkeypatch.setattr(RowExactKernels, "linear", lambda self, x, *rest: honest(self, x, *rest) + len(x))
    assert "changed with the rows beside it" in tiles._amx_refusal()


def test_the_amx_state_is_reported():
    """Which path this CPU's kernels take is said, with the reason when it is not AMX."""
    state = amx_state()
    print(f"AMX tiles on this machine: {state}")
    assert state == "on" or state.startswith(("off:", "refused"))
    assert row_exact_kernels().path_name.startswith("amx") == (state == "on")


def attention_inputs(queries: int, cached: int, heads: int = 9, kv_heads: int = 3, dim: int = 64, seed: int = 0):
    q = randn(1, queries, heads, dim, seed=seed)
    k = randn(1, kv_heads, cached + queries, dim, seed=seed + 1, scale=2.0)
    v = randn(1, kv_heads, cached + queries, dim, seed=seed + 2)
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (16, 1, 32), (4, 4, 128)])
def test_attention_on_tiles_gives_each_query_its_own_bits(tiles, heads, kv_heads, dim):
    """bf16 attention on tiles (attention_amx.h): every query of a causal call — one-token steps (the
    keys-as-rows form), verifications and prefill blocks (the query-rows form), full and partial 16-key
    and 16-head tiles — equals that query alone over its own keys, plain or split values, and all are
    within bf16 rounding of SDPA."""
    from d3d.cache import split_values
    from d3d.kernels import TorchKernels

    queries, cached = (20, 37) if small(tiles) else (70, 300)
    q, k, v = attention_inputs(queries, cached, heads, kv_heads, dim)
    for values in (v, split_values(v).contiguous()):
        together = tiles.attention(q, k, values, None)
        for i in (0, 1, 6, queries - 1):
            keys = cached + i + 1
            part = values[..., :keys, :] if values.dim() == 5 else values[:, :, :keys]
            alone = tiles.attention(q[:, i:i + 1], k[:, :, :keys].contiguous(), part.contiguous(), None)
            assert torch.equal(together[:, i:i + 1], alone), f"query {i}"
        first_two = tiles.attention(q[:, :2], k[:, :, :cached + 2].contiguous(),
                                    (values[..., :cached + 2, :] if values.dim() == 5 else values[:, :, :cached + 2]).contiguous(), None)
        assert torch.equal(together[:, :2], first_two)
    expected = TorchKernels.attention(q.float(), k.float(), v.float(), None)
    torch.testing.assert_close(together.float(), expected, rtol=3e-2, atol=3e-2)


def test_masked_attention_on_tiles_reads_no_key_past_a_querys_last(tiles):
    """A mask with holes, whole masked tiles, trailing masked keys and an empty row: each row equals
    that row alone over its keys up to its last visible one, and keys past it set to NaN change
    nothing; a query whose row is empty gets zeros."""
    queries, cached = (12, 40) if small(tiles) else (24, 200)
    q, k, v = attention_inputs(queries, cached)
    keys = cached + queries
    mask = torch.rand(1, queries, keys, generator=torch.Generator().manual_seed(6)) < 0.5
    ends = torch.randint(1, keys + 1, (queries,), generator=torch.Generator().manual_seed(7))
    for row, end in enumerate(ends.tolist()):
        mask[0, row, end:] = False
        mask[0, row, end - 1] = True
    mask[0, 2, 16:48] = False
    mask[0, 3] = False
    together = tiles.attention(q, k, v, mask)
    assert torch.equal(together[:, 3], torch.zeros_like(together[:, 3]))
    for row in (0, 2, 5, queries - 1):
        end = int(torch.nonzero(mask[0, row]).max()) + 1
        poisoned_k, poisoned_v = k.clone(), v.clone()
        poisoned_k[:, :, end:], poisoned_v[:, :, end:] = float("nan"), float("nan")
        alone = tiles.attention(q[:, row:row + 1], poisoned_k, poisoned_v, mask[:, row:row + 1])
        assert torch.equal(together[:, row:row + 1], alone), f"row {row}"


@pytest.mark.parametrize("queries,fused", [(3, False), (24, True)])
def test_the_profile_build_times_attention_passes_on_tiles(tiles, queries, fused):
    """Built with `profile`, attention on tiles adds each pass's time to `attention_pass_seconds` (what
    scripts/profile_step.py reports), reset on request, and the bits are the plain build's; a plain
    build's passes stay at zero. A few query heads take the softmax and the sums as two passes; 24
    queries' 72 query heads (5 groups of 16 for each of the 3 KV heads) take them as one."""
    path = build(profile=True, emulate_amx=small(tiles))
    profiled = RowExactKernels(ctypes.CDLL(str(path)), path)
    assert profiled.amx, profiled.amx_refused
    q, k, v = attention_inputs(queries, 40)
    profiled.attention_pass_seconds(reset=True)
    out = profiled.attention(q, k, v, None)
    spent = profiled.attention_pass_seconds(reset=True)
    assert list(spent) == ["scores", "softmax", "sums", "softmax_and_sums"]
    ran = {name for name, seconds in spent.items() if seconds > 0}
    assert ran == ({"scores", "softmax_and_sums"} if fused else {"scores", "softmax", "sums"}), spent
    assert not any(profiled.attention_pass_seconds().values())
    assert torch.equal(out, tiles.attention(q, k, v, None))
    assert not any(tiles.attention_pass_seconds().values())


def test_attention_on_tiles_is_one_choice_at_every_thread_count(tiles):
    """1, 2 and 3 threads split the keys, query heads and value slices differently: the same bits."""
    q, k, v = attention_inputs(17, 120 if small(tiles) else 700)
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(tiles.attention(q, k, v, None))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
