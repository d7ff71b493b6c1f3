"""The native Decoder: parity with transformers, cache consistency, row-invariance (its explicit masks: test_masks.py)."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.cache import CacheFullError, KVCache, joined_values
from d3d.config import ModelConfig
from d3d.loading import load_state
from d3d.masks import chunk_bounds, draft_mask
import d3d.models
from d3d.kernels import TorchKernels
from d3d.models import Decoder, SequenceRows

HF_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
               attn_implementation="eager")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}  # head_dim 8: one frequency in each band


def hf_model(family: str, seed: int = 0, **overrides):
    """A transformers CausalLM of the given family with seeded, non-trivial random weights (fp32)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    config = config_class(**{**HF_TINY, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():  # transformers' init (std 0.02) would make every logit ~0
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def native_from_hf(model) -> Decoder:
    decoder = Decoder(ModelConfig.from_hf(model.config))
    load_state(decoder, model.state_dict(), "test")
    return decoder.eval()


def random_ids(length: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


PARITY_CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-llama3-rope": ("llama", dict(tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING,
                                        rope_theta=10000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
}


@pytest.mark.parametrize("case", PARITY_CASES)
@torch.no_grad()
def test_logits_match_transformers(case):
    """Same weights → same logits as transformers (fp32, atol 1e-4), through both kernel sets.

    Under no_grad the row-exact kernels run; with gradients recorded, PyTorch's ops.
    """
    family, overrides = PARITY_CASES[case]
    model = hf_model(family, **overrides)
    decoder = native_from_hf(model)
    assert decoder.config.family == family
    assert decoder.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    for length in (20, 100):
        ids = random_ids(length)
        expected = model(ids).logits
        assert expected.abs().max() > 1.0  # the comparison is not between near-zero numbers
        torch.testing.assert_close(decoder(ids), expected, atol=1e-4, rtol=1e-4)
        with torch.enable_grad():
            torch.testing.assert_close(decoder(ids).detach(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_attention_bias_matches_transformers(family):
    """A Llama / Qwen3 config with attention_bias=True (biases on q, k, v *and* o_proj in transformers)."""
    model = hf_model(family, attention_bias=True)
    decoder = native_from_hf(model)
    ids = random_ids(20)
    torch.testing.assert_close(decoder(ids), model(ids).logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_llama3_scaling_changes_the_logits():
    """The llama3 case is a real check: without the scaling the logits differ."""
    model = hf_model("llama", tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING)
    decoder = native_from_hf(model)
    plain = Decoder(dataclasses.replace(decoder.config, rope_scaling=None))
    plain.load_state_dict(decoder.state_dict())
    ids = random_ids(100)
    assert not torch.allclose(plain(ids), decoder(ids), atol=1e-2)


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="rope scaling"):
        Decoder(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_cached_incremental_forward_equals_full_forward(family):
    """Prefill + chunks + single tokens through the KV cache give the full forward's logits."""
    decoder = make_decoder(tiny_config(family))
    ids = random_ids(30)
    full = decoder(ids)
    cache = decoder.new_cache()
    pieces = []
    for start, end in [(0, 10), (10, 15), (15, 16), (16, 17), (17, 30)]:
        pieces.append(decoder(ids[:, start:end], cache=cache))
        cache.commit()
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rejected_cache_slots_are_overwritten():
    """Forwarding a block, keeping 2 of its 5 slots, then continuing equals never having seen the rest."""
    decoder = make_decoder(tiny_config())
    ids = random_ids(12)
    cache = decoder.new_cache()
    decoder(ids[:, :6], cache=cache)
    cache.commit()
    decoder(torch.tensor([[7, 7, 7, 7, 7]]), cache=cache)  # 5 speculative slots
    cache.commit(0)
    out = decoder(ids[:, 6:], cache=cache)
    torch.testing.assert_close(out, decoder(ids)[:, 6:], atol=1e-5, rtol=1e-5)


def forward_block_and_steps(decoder: Decoder, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one `length`-token forward over a cached prefix, and of `length` one-token steps."""
    prefix, block = random_ids(7, seed=1), random_ids(length, seed=2)
    caches = [decoder.new_cache(), decoder.new_cache()]
    for cache in caches:
        decoder(prefix, cache=cache)
        cache.commit()
    together = decoder(block, cache=caches[0])[0]
    one_by_one = []
    for i in range(block.shape[1]):
        one_by_one.append(decoder(block[:, i:i + 1], cache=caches[1])[0, 0])
        caches[1].commit()
    return together, torch.stack(one_by_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_multi_token_forward_is_bit_identical_to_single_steps(dtype, family):
    """A T-token causal forward over the cache equals T one-token steps, bit for bit, in fp32 and bf16.

    This is what makes greedy speculative decoding reproduce plain decoding token for token. It
    holds by construction of the row-exact kernels, not by a BLAS library's luck: on AMD Zen 4,
    PyTorch's own fp32 GEMM rounds every row differently for 1 and 16 rows, so a decoder that
    bypassed the kernels fails here (see the control below).
    """
    decoder = make_decoder(tiny_config(family), dtype=dtype)
    together, one_by_one = forward_block_and_steps(decoder)
    assert together.dtype == dtype
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("threads", [1, 2])
@torch.no_grad()
def test_row_exact_forward_does_not_depend_on_the_thread_count(threads):
    """Threads split output columns, never one reduction: logits are the same bits with 1 or 2 threads."""
    decoder = make_decoder(tiny_config("qwen3"), dtype=torch.bfloat16)
    reference = forward_block_and_steps(decoder)[0]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together, one_by_one = forward_block_and_steps(decoder)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, reference) and torch.equal(one_by_one, reference)


def per_op_forward(decoder: Decoder, ids: torch.Tensor, cache, mask=None, kernels=None, positions=None) -> torch.Tensor:
    """Logits from one kernel call per operation (the layers' own forward), not the fused C forward:
    the row-exact kernels', or those given (`TorchKernels`: PyTorch's own ops)."""
    kernels = kernels or decoder.row_exact
    batch, length = ids.shape
    if positions is None:
        positions = torch.arange(cache.length, cache.length + length)[None].expand(batch, -1)
    cache.reserve(length)
    cos, sin = decoder.rope(positions, decoder.dtype)
    x = decoder.embed_tokens(ids)
    for index, layer in enumerate(decoder.layers):
        x = layer(x, cos, sin, mask, cache, index, kernels)
    return decoder.logits(decoder.norm(x, kernels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_fused_forward_is_the_per_op_forward(dtype, family):
    """A cached forward runs every layer in one C call (`d3d_forward`); it computes the same bits, keys
    and values as one kernel call per operation — causal or masked, one sequence or two."""
    config = tiny_config(family, attention_bias=family != "qwen3", mlp_bias=family == "llama")
    decoder = make_decoder(config, dtype=dtype)
    assert decoder.layer_table(decoder.row_exact) is not None  # this decoder runs fused
    prefix, block = random_ids(7, seed=1).repeat(2, 1), random_ids(5, seed=2).repeat(2, 1)
    block[1] = random_ids(5, seed=3)[0]
    fused_cache, per_op_cache = decoder.new_cache(batch_size=2), decoder.new_cache(batch_size=2)
    mask = torch.rand(2, 5, 12, generator=torch.Generator().manual_seed(4)) < 0.6
    mask[..., 7:] |= torch.eye(5, dtype=torch.bool)  # every query sees itself
    for ids, step_mask, kept in ((prefix, None, 7), (block, None, 0), (block, mask, 0)):
        fused = decoder(ids, cache=fused_cache, mask=step_mask)
        assert torch.equal(fused, per_op_forward(decoder, ids, per_op_cache, step_mask))
        assert torch.equal(fused_cache.keys, per_op_cache.keys) and torch.equal(fused_cache.values, per_op_cache.values)
        fused_cache.commit(kept)
        per_op_cache.commit(kept)


@torch.no_grad()
def test_positions_past_the_rotary_table_take_its_last_row():
    """Positions past the rotary table (async branches drafted beyond the length limit) reuse its last
    row: the fused forward, which clamps in the kernels, gives the bits of the position just below the
    limit and of the per-op forward, which clamps in PyTorch; negative control: one row earlier differs."""
    decoder = make_decoder(tiny_config(), dtype=torch.bfloat16)
    last = decoder.rope_table.shape[1] - 1
    ids = random_ids(1, seed=5)

    def at(position: int, fused: bool = True) -> torch.Tensor:
        cache = decoder.new_cache()
        decoder(random_ids(3, seed=6), cache=cache)
        cache.commit()
        positions = torch.tensor([[position]])
        if fused:
            return decoder.final_hidden(ids, positions=positions, cache=cache)[0]
        return per_op_forward(decoder, ids, cache, positions=positions)

    beyond = at(last + 5)
    assert torch.equal(beyond, at(last)) and not torch.equal(beyond, at(last - 1))
    assert torch.equal(decoder.logits(beyond), at(last + 5, fused=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_cache_layouts_change_no_bit(dtype):
    """A cache whose V is stored by slices of d (what `new_cache` gives the row-exact kernels when
    head_dim allows), and one whose K is stored by tiles of slots besides (where the build reads them:
    this machine's AVX2 build, bf16), give the bits of a plain cache on every path — fused (a
    one-token step's scores among them), one kernel per operation, PyTorch's ops, several sequences
    in one forward — and hold the same values."""
    config = tiny_config("qwen3", head_dim=64, num_heads=2, num_kv_heads=1)
    decoder = make_decoder(config, dtype=dtype)
    assert decoder.new_cache().split and decoder.new_cache().values.shape == (2, 1, 1, 2, 128, 32)
    tiles = decoder.row_exact.tiles_keys(dtype, 64)
    assert decoder.new_cache().tiled == tiles
    c = decoder.config

    def cache(layout: str) -> KVCache:
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 61, 1, dtype, split=layout != "plain",
                       tile_keys=layout == "tiled")

    layouts = ["plain", "split", "tiled"] if tiles else ["plain", "split"]
    prefix, block = random_ids(19, seed=1), random_ids(5, seed=2)
    mask = torch.rand(1, 3, 24, generator=torch.Generator().manual_seed(4)) < 0.6
    mask[..., 21:] |= torch.eye(3, dtype=torch.bool)  # after 19 + 2 kept: every query sees itself
    fused = lambda ids, kv, m: decoder(ids, cache=kv, mask=m)  # noqa: E731
    per_op = lambda ids, kv, m: per_op_forward(decoder, ids, kv, m)  # noqa: E731
    torch_ops = lambda ids, kv, m: per_op_forward(decoder, ids, kv, m, TorchKernels)  # noqa: E731
    steps = ((prefix, None, 19), (block, None, 2), (block[:, 2:], mask, 0), (block[:, :1], None, 1),
             (block[:, 1:2], None, 1))
    for forward in (fused, per_op, torch_ops):
        caches = [cache(layout) for layout in layouts]
        for ids, step_mask, kept in steps:
            logits = [forward(ids, kv, step_mask) for kv in caches]
            assert all(torch.equal(logits[0], other) for other in logits[1:])
            for kv in caches:
                kv.commit(kept)
            held = [kv.snapshot(kv.length) for kv in caches]
            assert all(torch.equal(held[0][0], keys) for keys, _ in held[1:])
            assert all(torch.equal(held[0][1], joined_values(values)) for _, values in held[1:])
    caches = [cache(layout) for layout in (layouts[-1], "plain")]
    for kv in caches:
        decoder(prefix, cache=kv)
        kv.commit()
    rows = decoder.forward_rows([SequenceRows(block[0], caches[0]), SequenceRows(block[0, :3], caches[1])])
    assert torch.equal(rows[0][0][:3], rows[1][0])


@torch.no_grad()
def test_one_token_steps_on_the_avx2_build_give_the_per_op_bits(avx2):
    """On the AVX2 build (any x86 CPU with AVX2), one-token steps of the fused forward — whose scores
    run over each thread's tiles across KV heads, read from rows or tiles — give the bits of one
    kernel per operation (scores in per-tile jobs), over plain, split and tiled caches, on 1–3 threads."""
    config = tiny_config("llama", head_dim=64, num_heads=9, num_kv_heads=3)
    decoder = make_decoder(config, dtype=torch.bfloat16)
    decoder.row_exact = avx2
    assert decoder.new_cache().tiled
    c = decoder.config
    prompt, steps = random_ids(40, seed=1), random_ids(12, seed=2)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            caches = [KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 61, 1, torch.bfloat16, split=layout != "plain",
                              tile_keys=layout == "tiled") for layout in ("plain", "split", "tiled")]
            reference = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 61, 1, torch.bfloat16, split=True)
            for kv in caches:
                decoder(prompt, cache=kv)
                kv.commit()
            per_op_forward(decoder, prompt, reference)
            reference.commit()
            for i in range(steps.shape[1]):  # after 40 … 51 tokens: across a tile's end
                want = per_op_forward(decoder, steps[:, i:i + 1], reference)
                reference.commit()
                for kv in caches:
                    assert torch.equal(decoder(steps[:, i:i + 1], cache=kv), want)
                    kv.commit()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (10, 2)])
@torch.no_grad()
def test_verifications_on_the_avx2_build_give_the_per_op_bits(avx2, heads, kv_heads):
    """On the AVX2 build, forwards of a few rows over a tiled cache — whose scores run over each
    thread's tiles, every chunk of up to 6 query heads straight from the tile into its rows, the
    tiles some row sees only in part by the per-tile jobs — give the bits of one kernel per operation
    over a cache of rows (scores from transposed tiles), on 1 and 2 threads, groups of 3 and 5."""
    config = tiny_config("llama", head_dim=64, num_heads=heads, num_kv_heads=kv_heads)
    decoder = make_decoder(config, dtype=torch.bfloat16)
    decoder.row_exact = avx2
    c = decoder.config
    prompt, block = random_ids(37, seed=1), random_ids(17, seed=2)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (2, 3, 5, 17):
                tiled = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 61, 1, torch.bfloat16, split=True, tile_keys=True)
                reference = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 61, 1, torch.bfloat16, split=True)
                decoder(prompt, cache=tiled)
                tiled.commit()
                per_op_forward(decoder, prompt, reference)
                reference.commit()
                want = per_op_forward(decoder, block[:, :rows], reference)
                assert torch.equal(decoder(block[:, :rows], cache=tiled), want)
    finally:
        torch.set_num_threads(previous)


def test_split_values_need_whole_slices():
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(1, 1, 48, 8, split=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 16, 40])
@torch.no_grad()
def test_a_long_forward_gives_the_same_bits_in_any_chunking(monkeypatch, dtype, chunk):
    """A long forward (a prompt's prefill) runs in chunks of `PREFILL_CHUNK` rows; logits, captured
    features and every K/V slot are the bits of the forward in one call, after a cached prefix or
    not, causal or under a drafter's block mask — whatever the chunk size."""
    decoder = make_decoder(tiny_config("qwen3"), dtype=dtype)
    prompt = random_ids(37, seed=4)

    def run(chunk_rows: int, mask: torch.Tensor | None = None, cached: int = 0):
        monkeypatch.setattr(d3d.models, "PREFILL_CHUNK", chunk_rows)
        cache = decoder.new_cache()
        if cached:
            decoder(prompt[:, :cached], cache=cache)
            cache.commit()
        logits, features = decoder.logits_and_features(prompt[:, cached:], [0, 1], cache=cache, mask=mask)
        return logits, features, cache.keys.clone(), cache.values.clone()

    block = draft_mask(29, 8, 0, "bidirectional")[None]  # 29 clean tokens, then a block of 8
    for mask, cached in ((None, 0), (None, 5), (block, 0)):
        whole, chunked = run(10_000, mask, cached), run(chunk, mask, cached)
        for a, b in zip(whole, chunked):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 16, 40])
@torch.no_grad()
def test_a_prefill_computes_past_its_keys_only_the_last_row_with_the_same_bits(monkeypatch, dtype, chunk, threads):
    """With `last_only` (a prompt's prefill) the fused forward's last layer goes past its keys and values
    only for the last row, and chunks before the last one store their keys and values only: the last
    row's logits and every K/V slot are the bits of the whole forward — whatever the chunking, after a
    cached prefix or not, causal or under a drafter's block mask."""
    decoder = make_decoder(tiny_config("qwen3"), dtype=dtype)
    prompt = random_ids(37, seed=4)
    monkeypatch.setattr(d3d.models, "PREFILL_CHUNK", chunk)

    def run(last_only: bool, mask: torch.Tensor | None = None, cached: int = 0):
        cache = decoder.new_cache()
        if cached:
            decoder(prompt[:, :cached], cache=cache)
            cache.commit()
        logits = decoder(prompt[:, cached:], cache=cache, mask=mask, last_only=last_only)
        return logits[:, -1], cache.keys.clone(), cache.values.clone()

    block = draft_mask(29, 8, 0, "bidirectional")[None]  # 29 clean tokens, then a block of 8
    for mask, cached in ((None, 0), (None, 5), (block, 0)):
        whole, last = run(False, mask, cached), run(True, mask, cached)
        assert last[0].shape == whole[0].shape
        for a, b in zip(whole, last):
            assert torch.equal(a, b)


def test_chunks_are_cut_only_where_no_row_sees_past_the_cut():
    assert chunk_bounds(10, 0, None, 4) == [4, 8, 10]
    assert chunk_bounds(3, 0, None, 4) == [3]
    # a bidirectional block at rows 6 … 9: no cut inside it, so the chunk before it grows or shrinks
    block = draft_mask(6, 4, 2, "bidirectional")[None]
    assert chunk_bounds(10, 2, block, 4) == [4, 6, 10]
    assert chunk_bounds(10, 2, block, 8) == [6, 10]
    causal = draft_mask(6, 4, 2, "causal")[None]
    assert chunk_bounds(10, 2, causal, 4) == [4, 8, 10]


@torch.no_grad()
def test_fused_forward_follows_weight_updates():
    """The fused forward's weight table is rebuilt after an in-place update (e.g. a training step)."""
    decoder = make_decoder(tiny_config("llama"))
    ids = random_ids(4)
    before = decoder(ids, cache=decoder.new_cache())
    decoder.layers[0].mlp.down_proj.weight.mul_(2.0)
    after = decoder(ids, cache=decoder.new_cache())
    assert not torch.equal(before, after)
    assert torch.equal(after, per_op_forward(decoder, ids, decoder.new_cache()))


@torch.no_grad()
def test_torch_kernels_control():
    """Control: the same check over PyTorch's own ops (kernels="torch") in fp32.

    Where the CPU's GEMM rounds rows differently by row count (AMD Zen 4 and Intel Xeon with MKL
    both did, on every row), the check above would fail without the row-exact kernels; the test
    says so by asserting the difference, and skips on a CPU whose GEMM happens to be invariant.
    """
    config = tiny_config("llama")
    decoder = make_decoder(config)
    naive = Decoder(config, kernels="torch")
    naive.load_state_dict(decoder.state_dict())
    together, one_by_one = forward_block_and_steps(naive.eval())
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=1e-5)  # same maths
    if torch.equal(together, one_by_one):
        pytest.skip("this CPU's fp32 GEMM happens to be row-count invariant for these shapes")
    assert not torch.equal(together, one_by_one)


@torch.no_grad()
def test_last_only_returns_the_last_row():
    decoder = make_decoder(tiny_config())
    ids = random_ids(9)
    out = decoder(ids, last_only=True)
    assert out.shape == (1, 1, 64)
    torch.testing.assert_close(out[:, 0], decoder(ids)[:, -1])


@torch.no_grad()
def test_batched_forward_matches_single_sequences():
    decoder = make_decoder(tiny_config())
    a, b = random_ids(10, seed=3), random_ids(10, seed=4)
    both = decoder(torch.cat([a, b]))
    torch.testing.assert_close(both[:1], decoder(a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[1:], decoder(b), atol=1e-5, rtol=1e-5)


def test_new_cache_respects_the_context():
    """The cache is capped at max_position_embeddings; forwards past its capacity raise CacheFullError."""
    decoder = make_decoder(tiny_config(max_position_embeddings=16))
    assert decoder.new_cache().capacity == 16
    with pytest.raises(ValueError, match="16"):
        decoder.new_cache(17)
    cache = decoder.new_cache(8)
    with torch.no_grad():
        decoder(random_ids(6), cache=cache)
        cache.commit()
        with pytest.raises(CacheFullError):
            decoder(random_ids(3), cache=cache)


def test_loading_a_target_has_the_kernels_built_beside_it(monkeypatch):
    """A target's load starts the kernels' build on a thread of its own and goes on reading the weights;
    a build that fails there raises nothing on that thread (the decoder reports it where it asks); a
    path where no target is found is refused without starting one."""
    import threading

    import d3d.loading

    started, release, built = threading.Event(), threading.Event(), []

    def slow_build():
        started.set()
        built.append(threading.current_thread().name)
        release.wait(5)
        raise d3d.loading.LoadError("no compiler here")  # swallowed on the build's thread

    monkeypatch.setattr(d3d.loading, "row_exact_kernels", slow_build)
    monkeypatch.setattr(d3d.loading, "_kernels_build", None)  # as in a fresh process
    d3d.loading.build_kernels_meanwhile()
    assert started.wait(5) and not release.is_set()  # the caller went on while the build ran
    d3d.loading.build_kernels_meanwhile()  # asked again (a GGUF's converted folder): no second build
    release.set()
    d3d.loading._kernels_build.join(5)
    assert built == ["d3d-kernels-build"]
    built.clear()
    monkeypatch.setattr(d3d.loading, "row_exact_kernels", lambda: built.append("build"))
    monkeypatch.setattr(d3d.loading, "_kernels_build", None)
    for source in ("/no/such/target", Path(__file__).parent):  # no target there: refused, nothing built
        with pytest.raises(d3d.loading.LoadError):
            d3d.loading.load_target(source)
    assert built == []


# -- the real default target -------------------------------------------------------------------

@pytest.mark.slow
@torch.no_grad()
def test_default_target_matches_transformers():
    """The embedded SmolLM2-135M, loaded natively in fp32, gives transformers' logits."""
    from transformers import AutoModelForCausalLM

    from d3d.loading import _gguf_cache_dir, embedded_gguf_path, load_target

    target = load_target(dtype=torch.float32)
    assert target.decoder.dtype == torch.float32 and target.eos_token_ids
    folder = _gguf_cache_dir(embedded_gguf_path())
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = "The capital of France is Paris. The capital of Italy is"
    short = target.tokenizer(text)["input_ids"]
    long = target.tokenizer(" ".join([text] * 7))["input_ids"]
    for ids in (torch.tensor([short]), torch.tensor([long])):
        expected = reference(ids).logits
        actual = target.decoder(ids)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_a_decoder_built_for_loaded_weights_computes_as_one_built_at_random(family):
    """`Decoder.for_weights` draws nothing at random; with the same weights loaded it has the same
    RoPE table, parameters and logits as a decoder built the usual way."""
    config = tiny_config(family)
    reference = make_decoder(config, seed=3)
    loaded = Decoder.for_weights(config)
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert torch.equal(loaded.rope_table, Decoder(config).rope_table)
    load_state(loaded, reference.state_dict(), "test")
    loaded.eval()
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    assert torch.equal(loaded(ids), reference(ids))
