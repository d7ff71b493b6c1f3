"""The block drafter: layers copied from the target, the draft contract, and its checkpoint format."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import make_decoder, perturb_drafter, tiny_config
from d3d.config import ConfigError, DrafterConfig
from d3d.drafter import Drafter, layer_selection
from d3d.loading import LoadError

TOKENS = [3, 17, 42, 5, 9, 33, 60, 1, 12]


@torch.no_grad()
def next_token_logits(target, tokens: list[int]) -> torch.Tensor:
    return target(torch.tensor([tokens]))[0, -1]


@pytest.mark.parametrize("mode", ["anchor_causal", "causal"])
def test_all_layer_drafter_row0_is_the_targets_next_token(target, mode):
    """With every layer copied, block row 0 is the target's next-token prediction — also on later
    calls, when the drafter cache already holds a prefix and only the new clean tokens are fed."""
    drafter = Drafter.from_target(target, [0, 1], block_size=4, block_attention=mode)
    cache = drafter.new_cache(64)
    for length in (5, 6, 9):
        tokens = TOKENS[:length]
        logits = drafter.draft(cache, tokens)
        assert logits.shape == (4, 64)
        assert cache.length == length - 1  # committed tokens but the anchor; the block's KV is dropped
        torch.testing.assert_close(logits[0], next_token_logits(target, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["causal", "anchor_causal"])
@torch.no_grad()
def test_drafting_only_the_rows_the_drafts_need(target, mode):
    """`num_drafts=k` runs the anchor and the first masks only and returns k rows: in a causal block
    the full block's first k rows bit for bit; anchor-causal, the anchor's row bit for bit (the
    masks see fewer masks). The cache ends as after a full pass."""
    drafter = Drafter.from_target(target, [0, 1], block_size=8, block_attention=mode)
    perturb_drafter(drafter, 0.1, seed=5)
    full = drafter.draft(drafter.new_cache(64), TOKENS)
    for k in (1, 3, 7):
        cache = drafter.new_cache(64)
        short = drafter.draft(cache, TOKENS, num_drafts=k)
        assert short.shape == (k, 64) and cache.length == len(TOKENS) - 1
        if mode == "causal":
            assert torch.equal(short, full[:k])
        else:
            assert torch.equal(short[0], full[0])


@pytest.mark.parametrize("mode", ["causal", "anchor_causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_drafting_together_is_drafting_alone_bit_for_bit(mode, dtype, monkeypatch):
    """Several sequences' drafter passes in one fused forward (`draft_together`, a continuous batch's
    drafting) give each sequence the logits its own `draft` gives, bit for bit, and leave each
    cache as its own pass does: caches at different lengths, clean tokens still to read, any number
    of drafts, a whole block."""
    target = make_decoder(tiny_config(), seed=1, dtype=dtype)
    drafter = Drafter.from_target(target, [0, 1], block_size=8, block_attention=mode)
    perturb_drafter(drafter, 0.1, seed=5)
    assert drafter.decoder.batches_rows  # the row-exact kernels: the passes do fuse
    streams = [TOKENS, TOKENS[::-1] + [7, 7], [4, 4, 4], TOKENS[:4]]
    asks = [(3, 1), (None, 5), (2, 7), (4, None)]  # (tokens already in the cache, drafts wanted)

    def caches():
        out = []
        for tokens, (known, _) in zip(streams, asks):
            cache = drafter.new_cache(64)
            if known:  # an earlier round read part of the context
                drafter.draft(cache, tokens[:known + 1])
            out.append(cache)
        return out

    alone_caches = caches()
    alone = [drafter.draft(cache, tokens, wanted) for cache, tokens, (_, wanted) in zip(alone_caches, streams, asks)]
    fused = []
    monkeypatch.setattr(drafter.decoder, "hidden_rows", lambda *a, f=drafter.decoder.hidden_rows: fused.append(1) or f(*a))
    together_caches = caches()
    together = drafter.draft_together([(cache, tokens, wanted) for cache, tokens, (_, wanted)
                                       in zip(together_caches, streams, asks)])
    assert fused == [1]  # one forward for all four
    for got, want, cache, cache_alone in zip(together, alone, together_caches, alone_caches):
        assert torch.equal(got, want)
        assert cache.length == cache_alone.length  # the context read, the block's KV dropped
        assert torch.equal(cache.keys, cache_alone.keys) and torch.equal(cache.values, cache_alone.values)


def test_bidirectional_anchor_sees_the_masks(target):
    """Contrast: with bidirectional block attention row 0 is no longer the plain next-token prediction."""
    drafter = Drafter.from_target(target, [0, 1], block_size=4, block_attention="bidirectional")
    logits = drafter.draft(drafter.new_cache(64), TOKENS)
    assert not torch.allclose(logits[0], next_token_logits(target, TOKENS), atol=1e-3)


def test_from_target_copies_the_chosen_layers(target):
    """Layer i of the drafter is a copy of target layer layers[i]; embeddings are shared, not copied."""
    drafter = Drafter.from_target(target, [1], block_size=3)
    assert drafter.config.model.num_layers == 1 and drafter.config.target_layers == [1]
    assert drafter.config.target_vocab_size == 64 and drafter.config.mask_token_id == 64
    assert drafter.block_size == 3
    for name, tensor in target.layers[1].state_dict().items():
        assert torch.equal(drafter.decoder.layers[0].state_dict()[name], tensor)
    assert torch.equal(drafter.decoder.norm.weight, target.norm.weight)
    assert drafter.decoder.embed_tokens is target.embed_tokens
    assert drafter.decoder.lm_head is target.lm_head


@pytest.mark.parametrize("layers", [[], [2], [-1]])
def test_from_target_refuses_bad_layers(target, layers):
    with pytest.raises(ConfigError, match="layers"):
        Drafter.from_target(target, layers)


@pytest.mark.parametrize("text,depth,layers", [
    ("0,1,2,3", 30, [0, 1, 2, 3]), (" 5 ", 30, [5]), ("0-3,8", 30, [0, 1, 2, 3, 8]), ("all", 4, [0, 1, 2, 3]),
    ("every:2", 5, [0, 2, 4]), ("every:1", 3, [0, 1, 2]), ("all", None, []), ("every:3", None, []),
    ("29", None, [29])])
def test_layer_selection_names_target_layers(text, depth, layers):
    """The command line's forms: indices, ranges, every layer (a copy of the target), every K-th."""
    assert layer_selection(text, depth) == layers


@pytest.mark.parametrize("text,depth,why", [
    ("0,x", None, "got '0,x'"), ("every:0", 30, "at least 1"), ("every:two", 30, "got"), ("", None, "got"),
    ("0,0", 30, "twice"), ("1-2,2", 30, "twice"), ("30", 30, "outside the target's layers 0-29"),
    ("-1", 30, "got"), ("copy", 30, "got 'copy'")])
def test_layer_selection_refuses_what_names_no_layers(text, depth, why):
    with pytest.raises(ConfigError, match=why):
        layer_selection(text, depth, option="--layers")


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_draft_returns_one_row_per_block_position(target, block_size):
    drafter = Drafter.from_target(target, [0], block_size=block_size)
    logits = drafter.draft(drafter.new_cache(64), TOKENS)
    assert logits.shape == (block_size, 64) and torch.isfinite(logits).all()


def test_draft_refuses_a_cache_holding_the_anchor(target):
    """The cache may hold every committed token but the last; asking again with fewer tokens fails."""
    drafter = Drafter.from_target(target, [0], block_size=4)
    cache = drafter.new_cache(64)
    drafter.draft(cache, TOKENS)
    with pytest.raises(ValueError, match="anchor"):
        drafter.draft(cache, TOKENS[:-1])


def test_drafter_cache_has_room_for_a_block_past_the_context(target):
    drafter = Drafter.from_target(target, [0], block_size=4)
    assert drafter.new_cache(128).capacity == 128 + 4


def test_denoising_steps_two(target):
    """A second denoising pass still returns (B, V) logits, keeps the anchor row and drops the block KV,
    but changes the later rows (they now see the guesses fed in place of some masks)."""
    one_step = Drafter.from_target(target, [0, 1], block_size=4)
    two_steps = Drafter.from_target(target, [0, 1], block_size=4)
    two_steps.config = dataclasses.replace(two_steps.config, denoising_steps=2)
    cache1, cache2 = one_step.new_cache(64), two_steps.new_cache(64)
    first, second = one_step.draft(cache1, TOKENS), two_steps.draft(cache2, TOKENS)
    assert second.shape == (4, 64)
    assert cache2.length == len(TOKENS) - 1
    torch.testing.assert_close(second[0], first[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(second[1:], first[1:], atol=1e-4)


# -- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_save_and_load_round_trip(tmp_path, tied):
    """from_pretrained(save_pretrained(d)) drafts exactly the same logits; shared weights are not stored."""
    target = make_decoder(tiny_config(tie_word_embeddings=tied), seed=1)
    drafter = Drafter.from_target(target, [1], block_size=4, block_attention="bidirectional",
                                  tokenizer_fingerprint="abc")
    perturb_drafter(drafter, 0.1, seed=5)
    drafter.save_pretrained(tmp_path)

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        keys = set(stored.keys())
        assert stored.metadata()["format"] == "d3d-drafter"
    assert "mask_embedding" in keys and "decoder.norm.weight" in keys
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    document = json.loads((tmp_path / "config.json").read_text())
    assert document["format"] == "d3d-drafter" and document["block_attention"] == "bidirectional"

    loaded = Drafter.from_pretrained(tmp_path, target, tokenizer_fingerprint="abc")
    assert loaded.config == drafter.config
    assert loaded.decoder.embed_tokens is target.embed_tokens
    expected = drafter.draft(drafter.new_cache(64), TOKENS)
    actual = loaded.draft(loaded.new_cache(64), TOKENS)
    assert torch.equal(actual, expected)


def test_loaded_drafter_is_not_the_untrained_copy(tmp_path, target):
    """The round trip really restores saved weights (a fresh copy of the target layers differs)."""
    drafter = Drafter.from_target(target, [0], block_size=4)
    perturb_drafter(drafter, 0.1, seed=5)
    drafter.save_pretrained(tmp_path)
    fresh = Drafter.from_target(target, [0], block_size=4)
    loaded = Drafter.from_pretrained(tmp_path, target)
    tokens_logits = loaded.draft(loaded.new_cache(64), TOKENS)
    assert not torch.allclose(tokens_logits, fresh.draft(fresh.new_cache(64), TOKENS), atol=1e-4)


def test_refuses_a_drafter_for_another_vocabulary(tmp_path, target):
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    other = make_decoder(tiny_config(vocab_size=80, tie_word_embeddings=False), seed=2)
    with pytest.raises(LoadError, match="vocabulary of 64 tokens; this target has 80"):
        Drafter.from_pretrained(tmp_path, other)


def test_refuses_a_drafter_for_another_tokenizer(tmp_path, target):
    Drafter.from_target(target, [0], block_size=4, tokenizer_fingerprint="aaa").save_pretrained(tmp_path)
    with pytest.raises(LoadError, match="another tokenizer") as error:
        Drafter.from_pretrained(tmp_path, target, tokenizer_fingerprint="bbb")
    assert "aaa" in str(error.value) and "bbb" in str(error.value)
    Drafter.from_pretrained(tmp_path, target, tokenizer_fingerprint="aaa")  # the right one loads


def test_refuses_a_drafter_of_another_width(tmp_path, target):
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    wide = make_decoder(tiny_config(hidden_size=48, tie_word_embeddings=False), seed=2)
    with pytest.raises(LoadError, match="width"):
        Drafter.from_pretrained(tmp_path, wide)


def test_truncated_weights_are_reported(tmp_path, target):
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(LoadError, match="truncated or corrupt"):
        Drafter.from_pretrained(tmp_path, target)


def test_not_a_drafter_folder(tmp_path, target):
    """Missing files, a foreign config and an unknown format version are refused with LoadError."""
    with pytest.raises(LoadError, match="not a d3d drafter"):
        Drafter.from_pretrained(tmp_path, target)
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    document = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**document, "format_version": 99}))
    with pytest.raises(LoadError, match="version 99"):
        Drafter.from_pretrained(tmp_path, target)
    config_file.write_text(json.dumps({**document, "format": "something-else"}))
    with pytest.raises(LoadError, match="not a d3d drafter config"):
        Drafter.from_pretrained(tmp_path, target)
    config_file.write_text("{not json")
    with pytest.raises(LoadError, match="not valid JSON"):
        Drafter.from_pretrained(tmp_path, target)
    config_file.write_text(json.dumps([document]))
    with pytest.raises(LoadError, match="not a d3d drafter config"):
        Drafter.from_pretrained(tmp_path, target)


def edit_config(folder, change) -> None:
    document = json.loads((folder / "config.json").read_text())
    change(document)
    (folder / "config.json").write_text(json.dumps(document))


def edit_weights(folder, change) -> None:
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("model"), "DrafterConfig: missing fields ['model']"),
    (lambda d: d.update(colour="red"), "DrafterConfig: unknown fields ['colour']"),
    (lambda d: d["model"].update(hiden_size=32), "ModelConfig: unknown fields ['hiden_size']"),
    (lambda d: d["model"].pop("num_heads"), "ModelConfig: missing fields ['num_heads']"),
    (lambda d: d.update(block_size="4"), 'DrafterConfig.block_size: expected int, got "4"'),
    (lambda d: d["model"].update(num_heads=4.0), "ModelConfig.num_heads: expected int, got 4.0"),
    (lambda d: d.update(model="llama"), 'DrafterConfig.model: expected ModelConfig, got "llama"'),
    (lambda d: d.update(draft_vocab_size=-1), "draft_vocab_size must be between"),
])
def test_malformed_config_is_a_load_error_naming_file_and_field(tmp_path, target, change, fragment):
    """A hand-edited config.json with a missing, mistyped, unknown or wrong-typed field: a LoadError
    naming the file and the field (a TypeError traceback before)."""
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    edit_config(tmp_path, change)
    with pytest.raises(LoadError) as error:
        Drafter.from_pretrained(tmp_path, target)
    assert str(tmp_path / "config.json") in str(error.value) and fragment in str(error.value)


@pytest.mark.parametrize("change, fragment", [
    (lambda s: s.pop("mask_embedding"), "missing ['mask_embedding']"),
    (lambda s: s.update(extra=torch.zeros(2)), "unexpected ['extra']"),
    (lambda s: s.update({"decoder.norm.weight": torch.ones(31)}), "decoder.norm.weight has shape (31,), expected (32,)"),
])
def test_weights_that_do_not_match_the_config_are_load_errors(tmp_path, target, change, fragment):
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    edit_weights(tmp_path, change)
    with pytest.raises(LoadError, match="model.safetensors") as error:
        Drafter.from_pretrained(tmp_path, target)
    assert fragment in str(error.value)


def test_a_file_that_is_not_safetensors_is_a_load_error(tmp_path, target):
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_text("<html>404: not found</html>")
    with pytest.raises(LoadError, match="not a readable safetensors file"):
        Drafter.from_pretrained(tmp_path, target)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, target, value):
    """NaN/inf weights would draft garbage (τ 1.00 at T = 0, a sampling error at T > 0): refused at load."""
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path)
    edit_weights(tmp_path, lambda s: s["decoder.layers.0.mlp.down_proj.weight"].__setitem__((3, 5), value))
    with pytest.raises(LoadError, match=r"decoder\.layers\.0\.mlp\.down_proj\.weight holds NaN or infinite"):
        Drafter.from_pretrained(tmp_path, target)


@pytest.mark.parametrize("ids, fragment", [([5, 1, 9, 64], "must lie in [0, 64), got 1 … 64"),
                                           ([5, -1, 9, 30], "must lie in [0, 64), got -1 … 30"),
                                           ([5, 5, 9, 30], "4 distinct ids")])
def test_stored_draft_vocabulary_out_of_range_is_refused(tmp_path, target, ids, fragment):
    """Draft-vocabulary ids outside the vocabulary (or repeated) are a LoadError at load, not an
    IndexError while drafting."""
    Drafter.from_target(target, [0], block_size=4, draft_vocab=torch.tensor([5, 1, 9, 30])).save_pretrained(tmp_path)
    edit_weights(tmp_path, lambda s: s.update(draft_vocab=torch.tensor(ids)))
    with pytest.raises(LoadError, match="model.safetensors") as error:
        Drafter.from_pretrained(tmp_path, target)
    assert fragment in str(error.value)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        Drafter.from_target(target, [0], block_size=4, draft_vocab=torch.tensor(ids))


def test_invalid_drafter_configs(target):
    """block_size < 2, denoising_steps < 1 and a mask id inside the vocabulary are ConfigErrors."""
    with pytest.raises(ConfigError, match="block_size"):
        Drafter.from_target(target, [0], block_size=1)
    model = target.config
    with pytest.raises(ConfigError, match="block_size"):
        DrafterConfig(model=model, block_size=1)
    with pytest.raises(ConfigError, match="denoising_steps"):
        DrafterConfig(model=model, denoising_steps=0)
    with pytest.raises(ConfigError, match="mask_token_id"):
        DrafterConfig(model=model, mask_token_id=10)
    with pytest.raises(ConfigError, match="block_attention"):
        DrafterConfig(model=model, block_attention="sideways")


def test_drafter_config_json_round_trip(target):
    config = DrafterConfig(model=target.config, block_size=8, target_layers=[0, 1], denoising_steps=3)
    again = DrafterConfig.from_json(config.to_json())
    assert again == config and again.model == target.config
    with pytest.raises(ConfigError, match="unknown fields"):
        DrafterConfig.from_dict({**config.to_dict(), "colour": "red"})


def test_unshared_drafter_round_trip(tmp_path, target):
    """shared_embeddings=False: the drafter owns (and stores) copies of the embedding and head."""
    drafter = Drafter.from_target(target, [0], block_size=4, shared_embeddings=False)
    assert drafter.decoder.embed_tokens is not target.embed_tokens
    assert torch.equal(drafter.decoder.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(drafter.decoder.lm_head.weight, target.lm_head.weight)
    perturb_drafter(drafter, 0.1, seed=5)
    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        keys = set(stored.keys())
    assert {"decoder.embed_tokens.weight", "decoder.lm_head.weight"} <= keys
    loaded = Drafter.from_pretrained(tmp_path, target)
    assert torch.equal(loaded.draft(loaded.new_cache(64), TOKENS), drafter.draft(drafter.new_cache(64), TOKENS))


@torch.no_grad()
def test_reduced_draft_vocabulary_round_trip_and_never_drafts_outside(tmp_path):
    """A drafter restricted to a draft vocabulary scores only those ids (-inf elsewhere), matches the
    full head on them, and keeps the vocabulary through save/load."""
    target = make_decoder(tiny_config(), seed=3)
    vocab = torch.tensor([5, 1, 9, 30, 2, 17])
    full = Drafter.from_target(target, [0, 1], block_size=4)
    reduced = Drafter.from_target(target, [0, 1], block_size=4, draft_vocab=vocab)
    tokens = [3, 4, 5, 6, 7]
    a = full.draft(full.new_cache(32), tokens)
    b = reduced.draft(reduced.new_cache(32), tokens)
    outside = torch.ones(a.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(b[:, outside]).all() and (b[:, outside] < 0).all()
    torch.testing.assert_close(b[:, vocab], a[:, vocab])
    reduced.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)  # ids must survive a bf16 save
    loaded = Drafter.from_pretrained(tmp_path / "d", target).float()
    assert torch.equal(loaded.draft_vocab, vocab)
    assert torch.equal(loaded.draft(loaded.new_cache(32), tokens).argmax(-1), b.argmax(-1))
    labels = torch.tensor([[9, 4, -100, 17]])
    assert reduced.to_draft_ids(labels).tolist() == [[2, -100, -100, 5]]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_a_drafter_quantized_at_load_streams_its_own_weights_and_leaves_the_output(type_name):
    """`Drafter.quantize`: the drafter's own linears and its draft head stream GGUF blocks (their
    values become the blocks' dequantized ones), the head it shares with the target is untouched,
    and greedy speculative decoding with it is still the target's own greedy output."""
    from d3d.config import GenerationConfig
    from d3d.engine import reference_generate, speculative_generate

    target = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1, dtype=torch.bfloat16)
    target.requires_grad_(False)
    drafter = Drafter.from_target(target, [0, 1], block_size=4, block_attention="causal",
                                  draft_vocab=torch.arange(8, 48)).eval()
    perturb_drafter(drafter, 0.3, seed=5)  # drafts that are sometimes wrong, so verification rejects some
    head, own = target.lm_head.weight.clone(), drafter.decoder.layers[0].mlp.down_proj.weight.clone()
    report = drafter.quantize(type_name)
    own_linears = {name for name in drafter.decoder.linear_weights() if name.startswith("layers.")}
    assert set(report.streamed) == own_linears | {"draft_head"} and set(report.streamed.values()) == {type_name}
    assert torch.equal(target.lm_head.weight, head)  # the shared head is the target's, as it was
    assert not torch.equal(drafter.decoder.layers[0].mlp.down_proj.weight, own)  # now its blocks' values
    streams = {drafter.decoder.row_exact.stream(w).source for w in drafter.decoder.linear_weights().values()}
    assert type_name in streams
    config = GenerationConfig(max_new_tokens=24, eos_token_ids=[])
    prompt = TOKENS[:6]
    expected = [t for step in reference_generate(target, prompt, config) for t in step.tokens]
    steps = list(speculative_generate(target, drafter, prompt, config))
    assert [t for step in steps for t in step.tokens] == expected
    assert len(steps) < len(expected)  # some drafts were accepted: the quantized drafter drafted


def test_a_packed_drafter_makes_nothing_on_its_first_draft():
    """`Drafter.pack_weights` (what loading a drafter ends with) makes every copy its passes read —
    the layers' table, and a quantized stream's dense and grouped copies, its draft head's too — so
    a first draft, timed by a user, makes none; without it the first draft made them."""
    def copies_made_by_first_draft(pack: bool) -> int:
        target = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1, dtype=torch.bfloat16)
        target.requires_grad_(False)
        drafter = Drafter.from_target(target, [0, 1], block_size=4, block_attention="causal",
                                      draft_vocab=torch.arange(8, 48)).eval()
        drafter.quantize("Q8_0")
        if pack:
            assert drafter.pack_weights() > 0
        kernels = drafter.decoder.row_exact
        before = set(kernels._dense) | set(kernels._grouped)
        drafter.draft(drafter.new_cache(32), TOKENS[:6])
        return len((set(kernels._dense) | set(kernels._grouped)) - before)

    kernels = make_decoder(tiny_config(), dtype=torch.bfloat16).row_exact
    if kernels is not None and (kernels.packs[torch.bfloat16] or kernels.lane_packs or kernels.grouped_rows):
        assert copies_made_by_first_draft(pack=False) > 0  # the lazy path it replaces
    assert copies_made_by_first_draft(pack=True) == 0


def test_only_a_bf16_drafter_on_the_kernels_is_quantized(target):
    """An fp32 drafter has no quantized streams: a clear ConfigError, nothing changed."""
    drafter = Drafter.from_target(target, [0], block_size=4)
    before = drafter.decoder.layers[0].mlp.down_proj.weight.clone()
    with pytest.raises(ConfigError, match="bf16 drafter"):
        drafter.quantize("Q8_0")
    assert torch.equal(drafter.decoder.layers[0].mlp.down_proj.weight, before)
