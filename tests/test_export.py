"""d3d.export: the target and drafters as Hugging Face / vLLM folders, proven without vLLM.

Three kinds of proof, on tiny random models with a tiny word-level tokenizer built here:
- transformers loads each exported folder and computes d3d's logits (target, AR drafter, D3D drafter
  with its mask slots; every family, tied or not, pruned layers);
- `ParallelDraftEmulator` feeds the exported drafter vLLM's parallel-drafting layout step by step
  inside a greedy speculative loop, and drafts the same tokens as d3d's causal-block drafting;
- every refusal (block attention, labels, steps, vocabulary, mask ids) names its reason.
"""

from __future__ import annotations

import inspect
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

import d3d.loading
from conftest import greedy_continuation, make_decoder, tiny_config
from d3d.cli import main
from d3d.config import ConfigError
from d3d.drafter import Drafter
from d3d.export import (EXPORT_CONFIG_KEY, MASK_CONFIG_KEY, check_logits, choose_mask_token_id, export_drafter,
                        export_target, mask_candidates, widened)
from d3d.loading import Target

transformers = pytest.importorskip("transformers")

SPECIALS = ["<unk>", "<bos>", "<eos>", "<spare_a>", "<spare_b>"]  # ids 0 … 4; the spares are never used
UNK, BOS, EOS, SPARE_A, SPARE_B = range(5)


def hf_tokenizer(num_tokens: int = 64):
    """A word-level transformers tokenizer: the specials above, then words w5 … w{num_tokens-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + [f"w{i}" for i in range(len(SPECIALS), num_tokens)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<eos>",
        extra_special_tokens=["<spare_a>", "<spare_b>"])
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }} {{ eos_token }}{% endfor %}"
    return tokenizer


def hf_target(family: str = "llama", tied: bool = False, num_tokens: int = 64, seed: int = 1) -> Target:
    decoder = make_decoder(tiny_config(family, tie_word_embeddings=tied), seed=seed)
    return Target(decoder, hf_tokenizer(num_tokens), "tiny-random", [EOS])


def causal_drafter(target: Target, layers=(0, 1), block_size: int = 8, **kwargs) -> Drafter:
    """A D3D drafter with causal blocks, its mask embedding and final norm moved off their copies."""
    drafter = Drafter.from_target(target.decoder, list(layers), block_size=block_size, block_attention="causal",
                                  **kwargs)
    with torch.no_grad():
        drafter.mask_embedding.copy_(torch.randn(drafter.mask_embedding.shape, generator=torch.Generator().manual_seed(3)))
        drafter.decoder.norm.weight.mul_(1.1)
    return drafter


def load(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


class ParallelDraftEmulator:
    """vLLM's parallel drafting (`"method": "draft_model", "parallel_drafting": true`) for one request,
    over a transformers model, as vLLM's proposer lays its input out.

    After each verification vLLM feeds the draft model, at consecutive positions continuing its own
    KV cache: the target's input tokens this step that were accepted ("verified": the previous bonus
    token and the accepted drafts; after the prefill, the prompt), the new bonus token, then K-1 mask
    tokens. The draft model attends causally; draft i is the argmax at the i-th slot from the bonus
    token on. The verified tokens' KV stays; the bonus and mask slots' KV is overwritten by the next
    step's input, which starts again at that bonus token — here the cache is cropped to the same length.
    """

    def __init__(self, model, mask_token_id: int, num_speculative_tokens: int) -> None:
        self.model, self.mask_token_id, self.num_speculative_tokens = model, mask_token_id, num_speculative_tokens
        self.cache = transformers.DynamicCache()
        self.seen = 0  # tokens whose KV the draft model keeps

    @torch.no_grad()
    def propose(self, tokens: list[int]) -> list[int]:
        """K drafts after the committed `tokens` (the last one being the bonus token)."""
        verified, bonus = tokens[self.seen:-1], tokens[-1]
        ids = verified + [bonus] + [self.mask_token_id] * (self.num_speculative_tokens - 1)
        positions = torch.arange(self.seen, self.seen + len(ids))[None]
        # transformers 5.24 renamed past_key_values to cache
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        logits = self.model(torch.tensor([ids]), position_ids=positions, use_cache=True,
                            **{name: self.cache}).logits[0]
        self.seen += len(verified)
        self.cache.crop(self.seen - self.cache.get_seq_length())  # a negative count: tokens to drop
        return logits[len(verified):].argmax(-1).tolist()


def speculative_drafts(target: Target, drafter: Drafter, emulator: ParallelDraftEmulator, prompt: list[int],
                       max_new_tokens: int) -> tuple[list[int], int]:
    """Greedy speculative decoding with d3d's drafts, asserting at every step that the emulated vLLM
    drafter proposes the same K tokens; returns the output and the number of drafts accepted."""
    tokens, cache, accepted = list(prompt), drafter.new_cache(128), 0
    tokens.append(greedy_continuation(target.decoder, tokens, 1)[0])  # the prefill's token: the first bonus
    k = emulator.num_speculative_tokens
    while len(tokens) < len(prompt) + max_new_tokens:
        drafts = drafter.draft(cache, tokens)[:k].argmax(-1).tolist()
        assert emulator.propose(tokens) == drafts, f"step at {len(tokens)} tokens"
        truth = greedy_continuation(target.decoder, tokens, k + 1)
        num = next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), min(k, len(truth) - 1))
        accepted += num
        tokens += truth[:num + 1]
    return tokens[len(prompt):], accepted


# -- the target ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
@torch.no_grad()
def test_target_export_is_a_hugging_face_folder_with_d3d_logits(tmp_path, family, tied):
    target = hf_target(family, tied)
    folder = export_target(target, tmp_path / "target")
    model = load(folder)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, target.decoder(ids), atol=1e-4, rtol=1e-4)
    assert check_logits(folder, target.decoder, ids[0].tolist()) < 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.get_vocab() == target.tokenizer.get_vocab()
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS and generation["bos_token_id"] == BOS
    assert ("lm_head.weight" in load_file(folder / "model.safetensors")) != tied


def test_target_export_keeps_the_dtype_d3d_runs(tmp_path):
    target = hf_target()
    target.decoder.to(torch.bfloat16)
    folder = export_target(target, tmp_path / "target")
    state = load_file(folder / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], target.decoder.layers[0].mlp.down_proj.weight)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"


# -- D3D drafters as vLLM parallel draft models ----------------------------------------------------

@pytest.mark.parametrize("family,tied,layers", [("llama", False, (0, 1)), ("llama", True, (1,)),
                                                ("qwen2", False, (1, 0)), ("qwen3", True, (0,))])
@torch.no_grad()
def test_parallel_drafter_export_gives_d3d_logits_in_transformers(tmp_path, family, tied, layers):
    target = hf_target(family, tied, num_tokens=60)  # rows 60 … 63: no token, the mask goes there
    drafter = causal_drafter(target, layers)
    exported = export_drafter(drafter, target, tmp_path / "drafter")
    assert exported.method == "parallel_draft" and exported.exact and exported.mask_token_id == 60
    assert exported.speculative_config() == {"model": str(tmp_path / "drafter"), "method": "draft_model",
                                             "num_speculative_tokens": 7, "parallel_drafting": True}
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config[MASK_CONFIG_KEY] == 60 and config["tie_word_embeddings"] is False
    assert config["num_hidden_layers"] == len(layers) and config[EXPORT_CONFIG_KEY]["target_layers"] == list(layers)
    model = load(exported.folder)
    assert model.config.num_hidden_layers == len(layers)
    # d3d: a context, the anchor and 7 masks in one causal pass; transformers: the same with the mask id
    context = torch.randint(0, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([context, torch.full((1, 7), drafter.config.mask_token_id)], 1)
    hidden = drafter.decoder.hidden_states(drafter.embed(ids), torch.arange(19)[None], None,
                                           torch.ones(19, 19, dtype=torch.bool).tril()[None])
    exported_ids = torch.cat([context, torch.full((1, 7), 60)], 1)
    torch.testing.assert_close(model(exported_ids).logits[0], drafter.logits(hidden[0]), atol=1e-4, rtol=1e-4)
    # the head is the target's, whole: the mask row scores what the target's row scores
    head = target.decoder.embed_tokens.weight if tied else target.decoder.lm_head.weight
    assert torch.equal(model.lm_head.weight, head) and torch.equal(model.model.embed_tokens.weight[60],
                                                                    drafter.mask_embedding)
    assert check_logits(exported.folder, drafter, context[0].tolist(), 7, 60) < 1e-4


@pytest.mark.parametrize("block_size,num_drafts,layers", [(8, 7, (0, 1)), (8, 3, (0, 1)), (6, 5, (1,))])
def test_emulated_vllm_parallel_drafting_drafts_what_d3d_drafts(tmp_path, block_size, num_drafts, layers):
    """vLLM's layout (verified tokens, bonus, K-1 masks; draft i from the bonus slot's i-th successor) over
    the exported model drafts d3d's causal-block drafts token for token, through accepts and rejects."""
    target = hf_target(num_tokens=60)
    drafter = causal_drafter(target, layers, block_size=block_size)
    exported = export_drafter(drafter, target, tmp_path / "drafter")
    total = 0
    for seed in range(3):
        prompt = torch.randint(5, 60, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        emulator = ParallelDraftEmulator(load(exported.folder), exported.mask_token_id, num_drafts)
        output, accepted = speculative_drafts(target, drafter, emulator, prompt, 40)
        assert output[:40] == greedy_continuation(target.decoder, prompt, 40)  # the loop itself is lossless
        total += accepted
    assert 0 < total < 3 * 40  # drafts were accepted and rejected (a full copy's first draft: always accepted)


def test_mask_in_the_context_is_read_as_mask_by_the_export_only(tmp_path):
    """The one place the export differs: a context holding the mask id (the target never emits it)."""
    target = hf_target(num_tokens=60)
    drafter = causal_drafter(target)
    exported = export_drafter(drafter, target, tmp_path / "drafter", mask_token_id=62)
    model = load(exported.folder)
    with torch.no_grad():
        d3d_logits = drafter.decoder(torch.tensor([[7, 62, 9]]))[0, -1]  # d3d embeds 62 as the target does
        assert not torch.allclose(model(torch.tensor([[7, 62, 9]])).logits[0, -1], d3d_logits, atol=1e-3)


# -- AR drafters as vLLM draft models ----------------------------------------------------------------

@torch.no_grad()
def test_ar_drafter_exports_as_a_draft_model(tmp_path):
    target = hf_target(tied=True)
    drafter = Drafter.from_target(target.decoder, [1], block_size=5, kind="ar")
    exported = export_drafter(drafter, target, tmp_path / "ar")
    assert exported.method == "draft_model" and exported.mask_token_id is None and exported.exact
    assert exported.speculative_config() == {"model": str(tmp_path / "ar"), "method": "draft_model",
                                             "num_speculative_tokens": 4}
    config = json.loads((tmp_path / "ar" / "config.json").read_text())
    assert MASK_CONFIG_KEY not in config and config["tie_word_embeddings"] is True
    assert check_logits(exported.folder, drafter, list(range(5, 25))) < 1e-4


# -- reduced draft vocabularies ----------------------------------------------------------------------

@torch.no_grad()
def test_reduced_draft_vocabulary_is_refused_or_widened_with_its_change_said(tmp_path):
    target = hf_target(num_tokens=60)
    drafter = causal_drafter(target, draft_vocab=torch.arange(10, 42))
    with pytest.raises(ConfigError, match="drafts among 32 of the 64 tokens.*--widen-draft-vocab"):
        export_drafter(drafter, target, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    exported = export_drafter(drafter, target, tmp_path / "wide", widen_draft_vocab=True)
    assert not exported.exact and "instead of its 32" in exported.changes[0]
    assert json.loads((tmp_path / "wide" / "config.json").read_text())[EXPORT_CONFIG_KEY]["widened_draft_vocab"]
    # exact on the draft vocabulary's columns (check_logits compares those and their argmax)
    assert check_logits(exported.folder, drafter, list(range(5, 20)), 7, exported.mask_token_id) < 1e-4


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    (dict(block_attention="anchor_causal"), "attends 'anchor_causal' inside its block.*--block-attention causal"),
    (dict(block_attention="bidirectional"), "attends 'bidirectional' inside its block"),
    (dict(block_attention="causal", labels="unshifted"), "unshifted labels"),
])
def test_drafters_vllm_cannot_run_are_refused(tmp_path, options, message):
    target = hf_target(num_tokens=60)
    drafter = Drafter.from_target(target.decoder, [0], block_size=4, **options)
    with pytest.raises(ConfigError, match=message):
        export_drafter(drafter, target, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_several_denoising_steps_and_another_vocabulary_are_refused(tmp_path):
    target = hf_target(num_tokens=60)
    drafter = causal_drafter(target)
    drafter.config.denoising_steps = 2
    with pytest.raises(ConfigError, match="denoises in 2 passes"):
        export_drafter(drafter, target, tmp_path / "d")
    other = Target(make_decoder(tiny_config("llama", vocab_size=80), seed=1), hf_tokenizer(80), "other", [EOS])
    with pytest.raises(ConfigError, match="vocabulary of 64 tokens; this target has 80"):
        export_drafter(causal_drafter(target), other, tmp_path / "d")


@pytest.mark.parametrize("wanted,message", [
    (EOS, "the target emits or every prompt holds"), (BOS, "the target emits or every prompt holds"),
    (UNK, "the target emits or every prompt holds"), (20, "ordinary token the target can emit"),
    (64, "outside the vocabulary"), (-1, "outside the vocabulary"),
])
def test_mask_ids_the_target_can_emit_are_refused(tmp_path, wanted, message):
    target = hf_target(num_tokens=64)
    with pytest.raises(ConfigError, match=message):
        export_drafter(causal_drafter(target), target, tmp_path / "d", mask_token_id=wanted)


def test_mask_candidates_rows_past_the_tokenizer_then_unused_specials():
    assert mask_candidates(hf_tokenizer(60), 64, [EOS]) == [60, 61, 62, 63, SPARE_B, SPARE_A]
    assert mask_candidates(hf_tokenizer(64), 64, [EOS]) == [SPARE_B, SPARE_A]  # SmolLM2's case
    assert choose_mask_token_id(hf_tokenizer(64), 64, [EOS]) == SPARE_B
    assert choose_mask_token_id(hf_tokenizer(64), 64, [EOS], wanted=SPARE_A) == SPARE_A
    # an EOS id the generation config adds is reserved too
    assert mask_candidates(hf_tokenizer(64), 64, [EOS, SPARE_B]) == [SPARE_A]
    with pytest.raises(ConfigError, match="no id it never uses"):
        choose_mask_token_id(hf_tokenizer(64), 64, [EOS, SPARE_A, SPARE_B])


# -- the command -----------------------------------------------------------------------------------

@pytest.fixture
def hf_default(monkeypatch):
    """'default' → the tiny target with the word-level tokenizer (mask candidates: rows 60 … 63)."""
    target = hf_target(num_tokens=60)
    monkeypatch.setattr(d3d.loading, "load_target", lambda source=None, dtype=torch.bfloat16: target)
    return target


def test_cli_export_writes_target_and_drafter_and_prints_the_vllm_config(tmp_path, capsys, hf_default):
    causal_drafter(hf_default).save_pretrained(tmp_path / "ckpt")
    assert main(["export", "--out", str(tmp_path / "out"), "--drafter", str(tmp_path / "ckpt"), "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["target"] == str(tmp_path / "out" / "target") and summary["exact"] is True
    assert summary["speculative_config"]["parallel_drafting"] is True and summary["mask_token_id"] == 60
    assert summary["target_max_logit_difference"] < 1e-4 and summary["drafter_max_logit_difference"] < 1e-4
    assert summary["vllm"].startswith(f"vllm serve {tmp_path / 'out' / 'target'} --speculative-config '{{")
    assert (tmp_path / "out" / "drafter" / "tokenizer.json").is_file()


def test_cli_export_writes_files_every_user_can_read(tmp_path, capsys, hf_default):
    """The weights get a normal file's mode (0644 under umask 022) like config.json beside them;
    safetensors itself writes 0600."""
    causal_drafter(hf_default).save_pretrained(tmp_path / "ckpt")
    previous = os.umask(0o022)
    try:
        assert main(["export", "--out", str(tmp_path / "out"), "--drafter", str(tmp_path / "ckpt"), "--no-check"]) == 0
    finally:
        os.umask(previous)
    for part in ("target", "drafter"):
        for name in ("model.safetensors", "config.json"):
            assert stat.S_IMODE((tmp_path / "out" / part / name).stat().st_mode) == 0o644, (part, name)


def test_a_target_exported_from_the_embedded_default_finds_the_shipped_drafter(tmp_path, capsys, hf_default,
                                                                                monkeypatch):
    """config.json records what the target was exported from: the folder of the embedded target,
    loaded as --target, gets the drafter shipped for it (`--drafter default`, as the embedded target
    does); a folder exported from another source, or whose tokenizer changed since, drafts by lookup
    alone and says how to point at a drafter."""
    import d3d.generation
    from d3d.export import exported_from
    from d3d.generation import resolve_drafter

    causal_drafter(hf_default, tokenizer_fingerprint=hf_default.fingerprint).save_pretrained(tmp_path / "shipped")
    monkeypatch.setattr(d3d.generation, "DEFAULT_DRAFTER", tmp_path / "shipped")  # the shipped drafter's stand-in
    assert main(["export", "--out", str(tmp_path / "out"), "--dtype", "float32", "--no-check"]) == 0
    folder = tmp_path / "out" / "target"
    record = json.loads((folder / "config.json").read_text())[EXPORT_CONFIG_KEY]
    assert record == {"target": "tiny-random", "source": "default", "tokenizer_fingerprint": hf_default.fingerprint}
    exported = d3d.loading.load_hf_folder(folder, torch.float32)
    assert exported_from(exported) == "default"
    drafter, where = resolve_drafter(exported, "default", str(folder), None)
    assert drafter is not None and drafter.block_size == 8 and "exported from the embedded target" in where

    other = export_target(hf_default, tmp_path / "other", source=str(tmp_path / "some-folder"))
    drafter, where = resolve_drafter(d3d.loading.load_hf_folder(other, torch.float32), "default", str(other), None)
    assert drafter is None and "--drafter PATH" in where
    record["tokenizer_fingerprint"] = "another"
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    EXPORT_CONFIG_KEY: record}))
    assert exported_from(d3d.loading.load_hf_folder(folder, torch.float32)) is None


def test_cli_export_refusals_write_nothing(tmp_path, capsys, hf_default):
    Drafter.from_target(hf_default.decoder, [0], block_size=4).save_pretrained(tmp_path / "anchor")
    assert main(["export", "--out", str(tmp_path / "out"), "--drafter", str(tmp_path / "anchor")]) == 2
    assert "attends 'anchor_causal'" in capsys.readouterr().err and not (tmp_path / "out").exists()
    reduced = causal_drafter(hf_default, draft_vocab=torch.arange(5, 37))
    reduced.save_pretrained(tmp_path / "reduced")
    argv = ["export", "--out", str(tmp_path / "out"), "--drafter", str(tmp_path / "reduced"), "--dtype", "float32"]
    assert main(argv) == 2 and "--widen-draft-vocab" in capsys.readouterr().err
    assert main(argv + ["--widen-draft-vocab", "--no-check"]) == 0
    captured = capsys.readouterr()
    assert "note: the exported drafter drafts among all 64 tokens" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["exact"] is False


def test_cli_export_hf_alias_writes_the_drafter_alone(tmp_path, capsys, hf_default):
    Drafter.from_target(hf_default.decoder, [0], block_size=4, kind="ar").save_pretrained(tmp_path / "ar")
    assert main(["export-hf", "--drafter", str(tmp_path / "ar"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["method"] == "draft_model" and "target" not in summary
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf" / "target").exists()


@torch.no_grad()
def test_widened_is_the_drafter_a_widened_export_runs(tmp_path):
    """d3d's own copy of a widened export, to measure the change: the exported logits on every column."""
    target = hf_target(num_tokens=60)
    drafter = causal_drafter(target, draft_vocab=torch.arange(10, 42))
    exported = export_drafter(drafter, target, tmp_path / "wide", widen_draft_vocab=True)
    wide = widened(drafter, target.decoder)
    assert wide.config.draft_vocab_size == 0 and drafter.config.draft_vocab_size == 32  # a new module
    assert check_logits(exported.folder, wide, list(range(5, 20)), 7, exported.mask_token_id) < 1e-4
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(wide.logits(hidden)[:, drafter.draft_vocab], drafter.draft_scores(hidden))


def test_chat_template_tokens_are_reserved_even_when_it_refuses_a_system_turn():
    tokenizer = hf_tokenizer(64)
    tokenizer.chat_template = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system turn') }}{% endif %}"
                               "{% for m in messages %}<spare_a>{{ m.content }} {% endfor %}")
    assert mask_candidates(tokenizer, 64, [EOS]) == [SPARE_B]
