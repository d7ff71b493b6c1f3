"""The DFlash-style baseline: a block drafter conditioned on the target's hidden states (`d3d.dflash`).

Reading the target's hidden states changes no bit of its logits; the keys and values `inject`
writes at decoding time are the ones a training row of context gets, so a drafted block equals the
packed training forward's rows; the engine hands every committed token's hidden states to the
source, which drafts only when it holds them, and whose greedy output is the target's token for
token (alone, beside lookup, gated, bf16); the drafter saves, loads, trains through the same
trainer and benchmarks as a challenger — and refuses to run where its hidden states cannot be had.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_decoder, perturb_drafter, tiny_config
from d3d.async_engine import async_generate
from d3d.config import ConfigError, DrafterConfig, GenerationConfig, SamplingConfig
from d3d.costs import forward_costs
from d3d.dflash import attach_features, default_feature_layers, target_features
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate, speculative_generate
from d3d.estimate import teacher_forced_tau
from d3d.loading import LoadError
from d3d.lookup import LookupConfig
from d3d.sources import DFlashSource, LookupSource, Proposal, default_sources, drafter_source
from d3d.train.batch import collate, pack_example
from d3d.train.trainer import Trainer
from test_estimate import greedy_sequences
from test_trainer import config, data_dir, tiny_train_target  # noqa: F401 (data_dir: the tiny data fixture)

PROMPT = [5, 9, 14, 3, 22, 9, 14, 3, 40, 7]


def target_of(dtype=torch.float32, layers: int = 4):
    return make_decoder(tiny_config("llama", num_layers=layers), seed=2, dtype=dtype)


def make_dflash(target, block_size: int = 4, seed: int = 3) -> Drafter:
    drafter = Drafter.from_target(target, [0], block_size=block_size, kind="dflash").eval()
    perturb_drafter(drafter, scale=0.05, seed=seed)
    with torch.no_grad():
        drafter.feature_projection.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return drafter


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def greedy(new_tokens: int = 30) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, eos_token_ids=[])


# -- the target's hidden states ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_reading_hidden_states_changes_no_bit_and_gives_the_residual_stream(dtype):
    """logits_and_features: the same logits as forward (one C call or split at the read layers),
    and features equal to the residual stream after those layers in the per-layer path."""
    target = target_of(dtype)
    if target.row_exact is None:
        pytest.skip("the row-exact kernels did not build here: bit equality across call shapes is theirs alone")
    ids = torch.tensor([PROMPT])
    plain_cache, read_cache = target.new_cache(32), target.new_cache(32)
    plain = target(ids, cache=plain_cache)
    logits, features = target.logits_and_features(ids, [0, 1, 3], cache=read_cache)  # segments start at 1, 2, 4
    assert torch.equal(plain, logits) and features.shape == (1, len(PROMPT), 3 * target.config.hidden_size)
    plain_cache.commit()
    read_cache.commit()
    assert torch.equal(plain_cache.keys[:, :, :, :len(PROMPT)], read_cache.keys[:, :, :, :len(PROMPT)])
    # the per-layer path (no cache) computes the same residual streams
    x = target.embed_tokens(ids)
    cos, sin = target.rope(torch.arange(len(PROMPT))[None], x.dtype)
    kernels = target.kernels_for(x)
    streams = []
    for index, layer in enumerate(target.layers):
        x = layer(x, cos, sin, None, None, index, kernels)
        streams.append(x)
    torch.testing.assert_close(features, torch.cat([streams[0], streams[1], streams[3]], -1), rtol=0, atol=0)


def test_default_feature_layers_spread_from_shallow_to_deep():
    assert default_feature_layers(30, 4) == [1, 10, 18, 27]
    assert default_feature_layers(4, 1) == [1]
    assert default_feature_layers(4, 3) == [1]  # 4 layers: 1 … 1
    assert default_feature_layers(1, 2) == [0]


# -- drafting and training read the same context -------------------------------------------------

@torch.no_grad()
def test_a_drafted_block_equals_the_training_forward_over_the_same_context():
    """Drafting after `read_features` gives the block rows of the packed training forward whose clean
    rows are the target's hidden states: inject's keys and values are the training rows'."""
    target = target_of()
    drafter = make_dflash(target)
    tokens = PROMPT + [11, 12, 13]
    features = target_features(target, [tokens], drafter.config.feature_layers)[0]
    cache = drafter.new_cache(64)
    drafter.read_features(cache, features[:7])  # two rounds' worth, as the engine hands them
    drafter.read_features(cache, features[7:len(tokens) - 1])
    drafted = drafter.draft(cache, tokens)  # (B, V)
    sequence = tokens + [17]  # a block needs a token after its anchor to label; the block never sees it
    example = pack_example(sequence, 3, [len(tokens) - 1], drafter.block_size, drafter.config.mask_token_id,
                           drafter.config.block_attention)
    batch = attach_features(collate([example]), [sequence], target, drafter.config.feature_layers)
    trained = drafter.logits(drafter.packed_hidden(batch)[0, len(sequence):])
    torch.testing.assert_close(drafted, trained, rtol=1e-4, atol=1e-4)


def test_it_refuses_to_draft_without_the_hidden_states():
    target = target_of()
    drafter = make_dflash(target)
    source = DFlashSource(drafter)
    source.start(64, target.device)
    sampling = SamplingConfig()
    with pytest.raises(ValueError, match="hidden states of every committed token but the anchor: it has 0 of the 9"):
        source.propose(PROMPT, 3, sampling, torch.Generator())
    with pytest.raises(ConfigError, match="reads the target's hidden states, and this batch has none"):
        drafter.packed_hidden(collate([pack_example(PROMPT, 3, [4], 4, drafter.config.mask_token_id)]))
    with pytest.raises(ConfigError, match="needs the target"):
        teacher_forced_tau(drafter, [(PROMPT, 3)])
    with pytest.raises(ConfigError, match="cannot draft ahead of verification"):
        next(async_generate(target, drafter, PROMPT, greedy()))


# -- decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_lookup", [False, True])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_is_the_targets(dtype, with_lookup, adaptive):
    """Alone, beside lookup (which then drafts some steps: the hidden states still reach the drafter)
    and gated: the target's greedy tokens, and the drafter drafted some of them."""
    target = target_of(dtype)
    drafter = make_dflash(target)
    expected = tokens_of(reference_generate(target, PROMPT, greedy(40)))
    lookup = LookupConfig() if with_lookup else None
    steps = list(speculative_generate(target, drafter, PROMPT, greedy(40), lookup, adaptive))
    assert tokens_of(steps) == expected
    assert adaptive or any(s.source == "dflash" for s in steps)


@pytest.mark.parametrize("with_lookup", [False, True])
@pytest.mark.parametrize("adaptive", [False, True])
def test_the_engine_hands_over_each_committed_tokens_hidden_states_once_in_order(with_lookup, adaptive):
    """What `observe` receives, concatenated, is the target's hidden states of prompt + output but
    the last token — whoever drafted each step (lookup too) and whatever the gate chose."""
    target = target_of()
    observed: list[torch.Tensor] = []

    class Recorder(DFlashSource):
        def observe(self, features):
            observed.append(features.clone())
            super().observe(features)

    sources = ([LookupSource(LookupConfig())] if with_lookup else []) + [Recorder(make_dflash(target))]
    output = tokens_of(generate_from_sources(target, sources, PROMPT, greedy(40), adaptive))
    full = PROMPT + output
    expected = target_features(target, [full], sources[-1].drafter.config.feature_layers)[0, :len(full) - 1]
    exact = target.row_exact is not None  # row-count invariant: the same bits in any call shape
    torch.testing.assert_close(torch.cat(observed), expected, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


def test_an_oracle_dflash_drafter_is_accepted():
    """Sources see committed hidden states in order: a source proposing the target's own continuation
    (after checking it holds one hidden state per committed token but the anchor) is always accepted."""
    target = target_of()
    drafter = make_dflash(target)
    expected = tokens_of(reference_generate(target, PROMPT, greedy(40)))

    class Oracle(DFlashSource):
        def propose(self, tokens, num_drafts, sampling, generator):
            assert self.cache.length == len(tokens) - 1  # one hidden state per committed token but the anchor
            return Proposal(torch.tensor((PROMPT + expected)[len(tokens):len(tokens) + num_drafts]), None)

    steps = list(generate_from_sources(target, [Oracle(drafter)], PROMPT, greedy(40)))
    assert tokens_of(steps) == expected
    assert all(s.num_accepted == s.num_drafted for s in steps[1:])
    assert steps[-1].stats.tau > 3.0


def test_sampling_runs_reproducibly_with_the_drafters_q():
    """At T > 0 the proposal carries q (rejection sampling keeps the target's law: test_lossless's
    check covers every source through the same verification); the same seed gives the same tokens."""
    target = target_of()
    drafter = make_dflash(target)
    sampling = GenerationConfig(max_new_tokens=30, eos_token_ids=[], sampling=SamplingConfig(temperature=1.0, seed=7))
    source = DFlashSource(drafter)
    source.start(64, target.device)
    steps = list(generate_from_sources(target, [source], PROMPT, sampling))
    again = list(generate_from_sources(target, [DFlashSource(drafter)], PROMPT, sampling))
    assert tokens_of(steps) == tokens_of(again) and len(tokens_of(steps)) == 30
    proposal_source = DFlashSource(drafter)
    proposal_source.start(64, target.device)
    proposal_source.observe(target_features(target, [PROMPT], drafter.config.feature_layers)[0, :-1])
    proposal = proposal_source.propose(PROMPT, 3, sampling.sampling, torch.Generator().manual_seed(0))
    assert proposal.draft_probs.shape == (3, target.config.vocab_size)
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(3))


def test_sources_and_costs_by_kind():
    target = target_of()
    drafter = make_dflash(target)
    assert isinstance(drafter_source(drafter), DFlashSource)
    assert [s.name for s in default_sources(drafter, LookupConfig())] == ["lookup", "dflash"]
    costs = forward_costs(target, drafter, 3, remeasure=True)
    assert len(costs.drafter) == 4 and costs.drafter[0] == 0.0 and all(c > 0 for c in costs.drafter[1:])


# -- checkpoint, training, τ ----------------------------------------------------------------------

def test_checkpoint_round_trip_and_a_target_without_its_layers(tmp_path):
    target = target_of()
    drafter = make_dflash(target)
    drafter.save_pretrained(tmp_path / "dflash")
    loaded = Drafter.from_pretrained(tmp_path / "dflash", target)
    assert loaded.config.kind == "dflash" and loaded.config.feature_layers == drafter.config.feature_layers
    assert torch.equal(loaded.feature_projection.proj.weight, drafter.feature_projection.proj.weight)
    with pytest.raises(LoadError, match=r"hidden states after layers \[1\]; this target has 1 layers"):
        Drafter.from_pretrained(tmp_path / "dflash", target_of(layers=1))
    with pytest.raises(ConfigError, match="only a dflash drafter has them"):
        DrafterConfig(model=tiny_config(), feature_layers=[1])


def test_training_a_dflash_drafter(data_dir, tmp_path):
    """The same trainer, the target's hidden states computed per batch: the block loss falls, there is
    no clean-row loss, τ is estimated with the target, and training resumes into the same weights."""
    base = config(steps=20, warmup=1, batch_size=4, drafter_kind="dflash")
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path / "run", base)
    assert trainer.drafter.config.kind == "dflash" and "feature_projection.proj.weight" in trainer.parameters
    records = [trainer.train_step() for _ in range(20)]
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and all(r["ar"] == 0.0 for r in records)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert 1.0 <= trainer.evaluate()["tau"] <= 4.0
    # resume: 4 steps in one go equal 2 + 2 across a restart
    short = config(steps=4, warmup=1, batch_size=2, drafter_kind="dflash", save_every=2)
    whole = Trainer(tiny_train_target(), data_dir, tmp_path / "whole", short)
    for _ in range(4):
        whole.train_step()
    split = Trainer(tiny_train_target(), data_dir, tmp_path / "split", short)
    for _ in range(2):
        split.train_step()
    split.save()
    resumed = Trainer(tiny_train_target(), data_dir, tmp_path / "split", short)
    for _ in range(2):
        resumed.train_step()
    for name, p in whole.parameters.items():
        torch.testing.assert_close(p, resumed.parameters[name], rtol=0, atol=0)
    with pytest.raises(ConfigError, match="feature_layers are the target layers a dflash drafter reads"):
        config(feature_layers=[1])


def test_teacher_forced_tau_reads_the_targets_states():
    """τ of a DFlash-style drafter, estimated with the target whose hidden states it reads."""
    target = target_of()
    drafter = make_dflash(target)
    sequences = greedy_sequences(target, count=3)
    estimate = teacher_forced_tau(drafter, sequences, anchors_per_sequence=2, target=target)
    assert estimate.num_blocks == 6 and 1.0 <= estimate.tau <= drafter.block_size
