"""The AR-drafter baseline: a `Drafter` of kind "ar" drafting one token per causal pass over its own
cache (`ARDrafterSource`), its checkpoint, and the engine's losslessness with it.

Greedy output equals `reference_generate` token for token (fp32 and bf16, gated and not); at T > 0
the output law over whole continuations is the target's exact law, checked with test_lossless's
chi-square on the same vocab-8 setup (and the same check rejects a source that reports the
unfiltered q). Then: its teacher-forced τ, training through the same trainer, the bench methods
(ar_drafter identity-checked; hf_ar_drafter, transformers' assisted generation) and the Hugging Face
export, whose logits transformers reproduces.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch

from conftest import make_decoder, perturb_drafter, tiny_config
from d3d.async_engine import async_generate
from d3d.bench.harness import run_benchmark
from d3d.bench.methods import build_methods
from d3d.cli import main
from d3d.config import ConfigError, DrafterConfig, GenerationConfig, SamplingConfig
from d3d.costs import forward_costs
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate, speculative_generate
from d3d.estimate import teacher_forced_tau
from d3d.export import export_hf, hf_config
from d3d.generation import Pipeline
from d3d.loading import LoadError, Target
from d3d.masks import causal_mask
from d3d.sources import ARDrafterSource, DrafterSource, default_sources
from d3d.train.batch import sample_anchors
from d3d.train.trainer import Trainer
from test_bench import (PaddedByteTokenizer, bench_argv, bench_config, break_method, tiny_default,  # noqa: F401
                        write_prompts)  # tiny_default: a fixture
from test_estimate import greedy_sequences
from test_generation import tiny_target
from test_lossless import ALPHA, DRAFT_VOCAB, NEW_TOKENS, PROMPT, exact_law, p_value, report_unfiltered_q, sampling
from test_trainer import config, data_dir, tiny_train_target  # noqa: F401 (data_dir: the same tiny data fixture)

RUNS = 800  # as test_lossless


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def make_ar(target, layers=(0,), block_size: int = 4, seed: int = 5, scale: float = 0.05) -> Drafter:
    drafter = Drafter.from_target(target, list(layers), block_size=block_size, kind="ar").eval()
    perturb_drafter(drafter, scale=scale, seed=seed)  # a stand-in for training: not a copy of the target's first layers
    return drafter


@torch.no_grad()
def uncached_drafts(drafter: Drafter, tokens: list[int], count: int) -> list[int]:
    """The drafter's greedy chain after `tokens` from full causal forwards without a cache."""
    out: list[int] = []
    for _ in range(count):
        ids = torch.tensor([tokens + out])
        length = ids.shape[1]
        hidden = drafter.decoder.hidden_states(drafter.embed(ids), torch.arange(length)[None], None,
                                               causal_mask(length, 0)[None])
        out.append(int(drafter.logits(hidden[0, -1]).argmax()))
    return out


def test_an_ar_drafter_is_causal_with_shifted_labels_and_no_mask():
    model = tiny_config()
    assert DrafterConfig(model=model, kind="ar", block_attention="causal").kind == "ar"
    with pytest.raises(ConfigError, match="an AR drafter is causal"):
        DrafterConfig(model=model, kind="ar")  # block_attention anchor_causal
    with pytest.raises(ConfigError, match="unknown drafter kind"):
        DrafterConfig(model=model, kind="bert")
    assert DrafterConfig.from_dict({"model": model.to_dict()}).kind == "d3d"  # checkpoints from before kinds


def test_from_target_copies_layers_and_shares_embedding_and_head(target):
    drafter = Drafter.from_target(target, [1], block_size=4, block_attention="bidirectional", kind="ar")
    assert drafter.config.block_attention == "causal" and drafter.mask_embedding is None
    assert drafter.decoder.embed_tokens is target.embed_tokens and drafter.decoder.lm_head is target.lm_head
    assert torch.equal(drafter.decoder.layers[0].self_attn.qkv_proj.weight, target.layers[1].self_attn.qkv_proj.weight)
    assert not any(k.startswith("decoder.embed_tokens") for k in drafter.own_state())


def test_drafts_are_the_uncached_greedy_chain_across_rounds(target, prompt):
    """Cache handling: each proposal's drafts equal full uncached forwards, after accepts and rejects."""
    drafter = make_ar(target)
    source = ARDrafterSource(drafter)
    source.start(64, target.device)
    greedy, generator = SamplingConfig(), torch.Generator()
    first = source.propose(prompt, 3, greedy, generator)
    assert first.draft_probs is None and first.draft_tokens.tolist() == uncached_drafts(drafter, prompt, 3)
    assert source.cache.length == len(prompt) + 2  # committed tokens + drafts 1, 2 (the last is never fed)
    d = first.draft_tokens.tolist()
    for tokens in (prompt + [d[0], (d[1] + 1) % 64],  # draft 1 accepted, 2 rejected: the bonus replaces it
                   prompt + [d[0], (d[1] + 1) % 64, 7, 8, 9],  # several tokens committed at once
                   prompt[:3]):  # a shorter context than the cache holds (a new generation's start)
        proposal = source.propose(tokens, 4, greedy, generator)
        assert proposal.draft_tokens.tolist() == uncached_drafts(drafter, tokens, 4)
        assert source.cached[:len(tokens)] == tokens and source.cache.length == len(tokens) + 3
    with pytest.raises(ValueError, match="at least one draft"):
        source.propose(prompt, 0, greedy, generator)


def test_sampled_drafts_carry_their_filtered_q(target, prompt):
    drafter = make_ar(target)
    source = ARDrafterSource(drafter)
    source.start(64, target.device)
    config = SamplingConfig(temperature=0.8, top_k=5)
    proposal = source.propose(prompt, 3, config, torch.Generator().manual_seed(0))
    assert proposal.draft_probs.shape == (3, 64)
    assert torch.allclose(proposal.draft_probs.sum(-1), torch.ones(3))
    assert ((proposal.draft_probs > 0).sum(-1) <= 5).all()
    assert all(proposal.draft_probs[i, t] > 0 for i, t in enumerate(proposal.draft_tokens.tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_is_the_reference(llama_config, prompt, dtype, adaptive):
    target = make_decoder(llama_config, seed=1, dtype=dtype)
    drafter = make_ar(target, block_size=5)
    config = GenerationConfig(max_new_tokens=60)
    expected = tokens_of(reference_generate(target, prompt, config))
    steps = list(generate_from_sources(target, [ARDrafterSource(drafter)], prompt, config, adaptive))
    assert tokens_of(steps) == expected
    accepted = sum(s.num_accepted for s in steps)
    assert {s.source for s in steps[1:] if s.num_drafted} == {"ar_drafter"} and accepted > 0
    # through the default sources too: a drafter's kind picks its source
    assert tokens_of(speculative_generate(target, drafter, prompt, config, adaptive=adaptive)) == expected


def test_drafting_cost_grows_with_k(target):
    drafter = make_ar(target, block_size=16)
    costs = ARDrafterSource(drafter).draft_costs(target).at(0)  # after the first context measured
    assert len(costs) == 16 and costs[0] == 0.0
    assert all(a <= b for a, b in zip(costs, costs[1:])) and costs[15] > 2 * costs[1] > 0
    # stored apart from a D3D drafter of the same shape
    assert forward_costs(target, Drafter.from_target(target, [0], block_size=16), 15) is not forward_costs(
        target, drafter, 15)


def test_sources_and_engines_refuse_the_other_kind(target, prompt):
    ar, d3d = make_ar(target), Drafter.from_target(target, [0], block_size=4)
    with pytest.raises(ValueError, match="of kind 'ar'"):
        DrafterSource(ar)
    with pytest.raises(ValueError, match="of kind 'd3d'"):
        ARDrafterSource(d3d)
    with pytest.raises(ValueError, match="block drafting needs a drafter of kind 'd3d'"):
        ar.draft(ar.new_cache(32), prompt)
    with pytest.raises(ValueError, match="next-token drafting needs a drafter of kind 'ar'"):
        d3d.next_logits(d3d.new_cache(32), prompt)
    with pytest.raises(ConfigError, match="asynchronous drafting needs a D3D drafter"):
        list(async_generate(target, ar, prompt, GenerationConfig(max_new_tokens=4)))
    assert [type(s) for s in default_sources(ar, None)] == [ARDrafterSource]


def test_checkpoint_round_trip(target, prompt, tmp_path):
    drafter = make_ar(target, block_size=6)
    drafter.save_pretrained(tmp_path / "ar")
    document = json.loads((tmp_path / "ar" / "config.json").read_text())
    assert document["kind"] == "ar" and document["block_size"] == 6
    loaded = Drafter.from_pretrained(tmp_path / "ar", target)
    assert loaded.config == drafter.config and loaded.mask_embedding is None
    assert all(torch.equal(v, loaded.own_state()[k]) for k, v in drafter.own_state().items())
    assert uncached_drafts(loaded, prompt, 5) == uncached_drafts(drafter, prompt, 5)


def test_checkpoint_refuses_another_vocabulary_and_the_other_kinds_weights(target, tmp_path):
    make_ar(target).save_pretrained(tmp_path / "ar")
    other = make_decoder(tiny_config(vocab_size=80, tie_word_embeddings=False), seed=2)
    with pytest.raises(LoadError, match="made for a vocabulary of 64 tokens; this target has 80"):
        Drafter.from_pretrained(tmp_path / "ar", other)
    # a D3D checkpoint relabelled "ar" holds a MASK embedding an AR drafter does not have
    Drafter.from_target(target, [0], block_size=4).save_pretrained(tmp_path / "d3d")
    config_file = tmp_path / "d3d" / "config.json"
    document = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**document, "kind": "ar", "block_attention": "causal"}))
    with pytest.raises(LoadError, match="mask_embedding"):
        Drafter.from_pretrained(tmp_path / "d3d", target)


# -- lossless at T > 0 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ar_pair():
    """test_lossless's vocab-8 target, with an AR drafter over the same reduced, flattened vocabulary."""
    config = tiny_config(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, tie_word_embeddings=False, max_position_embeddings=32)
    target = make_decoder(config, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.2)
    drafter = Drafter.from_target(target, [0], block_size=4, draft_vocab=torch.tensor(DRAFT_VOCAB), kind="ar")
    perturb_drafter(drafter, scale=0.5, seed=7)
    with torch.no_grad():
        drafter.decoder.norm.weight.mul_(0.2)
    return target, drafter.eval()


def sample_ar(ar_pair, adaptive: bool):
    target, drafter = ar_pair
    counts, judged = {}, set()
    for seed in range(RUNS):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, sampling=sampling(seed))
        steps = list(generate_from_sources(target, [ARDrafterSource(drafter)], PROMPT, config, adaptive))
        key = tuple(tokens_of(steps))
        counts[key] = counts.get(key, 0) + 1
        judged |= {(s.num_drafted, s.num_accepted) for s in steps[1:] if s.source == "ar_drafter"}
    return counts, judged


@pytest.mark.parametrize("adaptive", [False, True])
def test_sampled_output_follows_the_target_law(ar_pair, adaptive):
    target, _ = ar_pair
    law = exact_law(target, PROMPT, NEW_TOKENS, sampling())
    counts, judged = sample_ar(ar_pair, adaptive)
    assert all(c in law for c in counts), "a continuation the target never produces"
    assert p_value(Counter(counts), law) >= ALPHA
    if not adaptive:
        assert {(3, 0), (3, 1), (3, 2), (3, 3)} <= judged  # rejections at every draft, and full accepts


def test_the_check_catches_an_unfiltered_q(ar_pair, monkeypatch):
    report_unfiltered_q(monkeypatch)
    target, _ = ar_pair
    counts, _ = sample_ar(ar_pair, adaptive=False)
    assert p_value(Counter(counts), exact_law(target, PROMPT, NEW_TOKENS, sampling())) < ALPHA


# -- training ------------------------------------------------------------------------------------

def test_teacher_forced_tau_is_the_greedy_drafts_accepted(target):
    """The estimator's AR path: per anchor, the leading run of the drafter's own greedy chain that
    matches the target's response — what greedy verification of B-1 drafts would accept."""
    drafter = make_ar(target, block_size=4, scale=0.0)  # the target's layer 0: a decent guesser
    sequences = greedy_sequences(target)
    estimate = teacher_forced_tau(drafter, sequences, anchors_per_sequence=12, seed=11, batch_size=2)
    rng, accepted = random.Random(11), []
    for tokens, response_start in sequences:
        for anchor in sample_anchors(len(tokens), response_start, 12, rng):
            drafts, truth = uncached_drafts(drafter, tokens[:anchor + 1], 3), tokens[anchor + 1:anchor + 4]
            count = 0
            while count < len(truth) and drafts[count] == truth[count]:
                count += 1
            accepted.append(count)
    assert estimate.num_blocks == len(accepted) and len(set(accepted)) > 1
    assert estimate.tau == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-6)


def test_training_an_ar_drafter(data_dir, tmp_path):
    """The same trainer, next-token loss only: the loss falls, the drafter it writes is an AR drafter,
    and a D3D checkpoint is refused as its starting point."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path / "run",
                      config(steps=20, warmup=1, batch_size=4, drafter_kind="ar"))
    assert trainer.drafter.config.kind == "ar" and "mask_embedding" not in trainer.parameters
    records = [trainer.train_step() for _ in range(20)]
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and all(r["diff"] == 0.0 and r["ar"] == r["loss"] for r in records)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    trainer.save()
    assert Drafter.from_pretrained(tmp_path / "run" / "checkpoint" / "drafter", trainer.target.decoder).config.kind == "ar"
    Drafter.from_target(trainer.target.decoder, [0], block_size=4).save_pretrained(tmp_path / "d3d")
    with pytest.raises(ConfigError, match="kind 'd3d'; this run trains one of kind 'ar'"):
        Trainer(tiny_train_target(), data_dir, tmp_path / "other", config(drafter_kind="ar", init_from=str(tmp_path / "d3d")))



# -- bench and CLI -------------------------------------------------------------------------------

def test_bench_method_ar_drafter_is_identity_checked(capsys, tiny_default, tmp_path, monkeypatch):
    """`d3d bench --methods ar,ar_drafter --ar-drafter PATH`: identical to AR, τ reported; a broken
    ar_drafter is caught by the same identity check; without --ar-drafter it is refused."""
    target = tiny_target(eos_token_ids=[])
    make_ar(target.decoder).save_pretrained(tmp_path / "ar")
    argv = bench_argv(tmp_path)
    argv[argv.index("ar,lookup")] = "ar,ar_drafter"
    assert main(argv + ["--ar-drafter", str(tmp_path / "ar")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["identical"] is True and summary["tau"]["ar_drafter"] > 1.0

    assert main(argv) == 2
    assert "need an AR drafter: pass --ar-drafter" in capsys.readouterr().err

    break_method(monkeypatch, "ar_drafter")
    assert main(argv + ["--ar-drafter", str(tmp_path / "ar")]) == 1
    assert "ar_drafter differs from AR" in capsys.readouterr().err


def test_cli_generate_method_ar_drafter(capsys, tiny_default, tmp_path):
    target = tiny_target(eos_token_ids=[])
    make_ar(target.decoder).save_pretrained(tmp_path / "ar")
    argv = ["generate", "hello", "--no-chat", "--drafter", "none", "--max-new-tokens", "12", "--dtype", "float32",
            "--method", "ar_drafter", "--compare-ar"]
    assert main(argv + ["--ar-drafter", str(tmp_path / "ar")]) == 0
    assert "output identical to AR: yes" in capsys.readouterr().err
    Drafter.from_target(target.decoder, [0], block_size=4).save_pretrained(tmp_path / "d3d")
    assert main(argv + ["--ar-drafter", str(tmp_path / "d3d")]) == 2
    assert "holds a drafter of kind 'd3d', not an AR drafter" in capsys.readouterr().err


# -- Hugging Face export -------------------------------------------------------------------------

@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
@torch.no_grad()
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, family, tied):
    from transformers import AutoModelForCausalLM

    target = make_decoder(tiny_config(family, tie_word_embeddings=tied), seed=1)
    drafter = make_ar(target, layers=(1, 0), scale=0.1)
    export_hf(drafter, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[family]
    assert model.config.num_hidden_layers == 2
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    hidden = drafter.decoder.hidden_states(drafter.embed(ids), torch.arange(20)[None], None, causal_mask(20, 0)[None])
    torch.testing.assert_close(model(ids).logits[0], drafter.logits(hidden[0]), atol=1e-4, rtol=1e-4)


def test_export_refuses_a_d3d_drafter_and_a_reduced_vocabulary(target, tmp_path):
    with pytest.raises(ConfigError, match="only an AR drafter exports"):
        export_hf(Drafter.from_target(target, [0], block_size=4), tmp_path / "d3d")
    reduced = Drafter.from_target(target, [0], block_size=4, kind="ar", draft_vocab=torch.arange(32))
    with pytest.raises(ConfigError, match="drafts among 32 tokens"):
        export_hf(reduced, tmp_path / "reduced")
    assert not (tmp_path / "d3d").exists() and not (tmp_path / "reduced").exists()


def test_bench_hf_ar_drafter_is_transformers_assisted_generation(tmp_path):
    """hf_ar_drafter: transformers generate with the AR drafter as assistant_model, on a tiny HF folder
    holding the target's config; greedy, its output is d3d AR's (fp32)."""
    transformers = pytest.importorskip("transformers")
    c = tiny_config("llama", tie_word_embeddings=False)
    values = hf_config(c, torch.float32)
    transformers.AutoConfig.for_model(values.pop("model_type"), **values, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0).save_pretrained(tmp_path)
    target = Target(make_decoder(c, seed=1), PaddedByteTokenizer(), "tiny-hf", [], folder=str(tmp_path))
    pipeline = Pipeline(target, None, ar_drafter=make_ar(target.decoder))
    result = run_benchmark(pipeline, bench_config(write_prompts(tmp_path), ["ar", "hf_ar_drafter", "ar_drafter"]),
                           progress=False)
    records = [r for r in result["records"] if r["method"] == "hf_ar_drafter"]
    assert result["identical"] is True and len(records) == 3
    assert all(r["first_mismatch"] is None and r["new_tokens"] == 12 for r in records)
    with pytest.raises(ConfigError, match="need an AR drafter"):
        build_methods(Pipeline(target, None), ["hf_ar_drafter"])
