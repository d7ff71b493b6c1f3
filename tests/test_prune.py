"""Layer pruning: removing a layer makes a new, smaller drafter (the input untouched); each round
drops the layer whose removal keeps teacher-forced τ highest; pruned drafters stay lossless."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from d3d.cli import main
from d3d.config import ConfigError, GenerationConfig
from d3d.drafter import Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.estimate import teacher_forced_tau
import d3d.prune as prune_module
from d3d.prune import PruneConfig, best_round, prune, remove_layer, time_rounds
from d3d.train.trainer import load_sequences
from test_trainer import data_dir, patched_load_target, tiny_train_target  # noqa: F401 (fixtures)


def four_layer_drafter(target):
    drafter = Drafter.from_target(target.decoder, [0, 1, 0, 1], block_size=4)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # make the layers differ, as training would
        for name, param in drafter.own_state().items():
            if param.is_floating_point() and name.startswith("decoder.layers."):
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return drafter.eval()


def test_remove_layer_returns_a_new_smaller_drafter_and_leaves_the_input():
    """The pruned drafter has one layer fewer, the kept layers' weights, and the input is unchanged."""
    target = tiny_train_target()
    drafter = four_layer_drafter(target)
    before = {k: v.clone() for k, v in drafter.own_state().items()}
    pruned = remove_layer(drafter, 1, target.decoder)
    assert len(pruned.decoder.layers) == 3 and pruned.config.model.num_layers == 3
    assert pruned.config.target_layers == [0, 0, 1]
    for new, old in zip(range(3), [0, 2, 3]):
        for (_, a), (_, b) in zip(pruned.decoder.layers[new].state_dict().items(),
                                  drafter.decoder.layers[old].state_dict().items()):
            assert torch.equal(a, b)
    assert all(torch.equal(before[k], v) for k, v in drafter.own_state().items())
    with pytest.raises(ConfigError):
        remove_layer(remove_layer(remove_layer(pruned, 0, target.decoder), 0, target.decoder), 0, target.decoder)


def test_each_round_removes_the_layer_that_keeps_tau_highest(data_dir):  # noqa: F811
    """Round 1 removes the argmax of the candidates' τ, and its τ is that candidate's τ."""
    target = tiny_train_target()
    sequences = load_sequences(data_dir, 64)[:8]
    drafter = four_layer_drafter(target)
    rounds, drafters = prune(drafter, target, sequences, PruneConfig(min_layers=2), progress=False)
    assert [len(r.layers) for r in rounds] == [4, 3, 2]
    first = rounds[1]
    assert first.tau == pytest.approx(max(first.candidates.values()))
    for position in range(4):
        candidate = remove_layer(drafter, position, target.decoder)
        expected = teacher_forced_tau(candidate, sequences, 8, 0).tau
        assert first.candidates[position] == pytest.approx(expected)
    assert first.removed == max(range(4), key=lambda p: (first.candidates[p], -p))
    assert rounds[0].retention == 1.0 and all(r.retention == pytest.approx(r.tau / rounds[0].tau) for r in rounds)
    assert best_round(rounds) == 2  # no speed measured: the shallowest kept round


def test_min_retention_stops_pruning(data_dir):  # noqa: F811
    """With a retention floor of 100%+, nothing that loses τ is accepted."""
    target = tiny_train_target()
    sequences = load_sequences(data_dir, 64)[:8]
    drafter = four_layer_drafter(target)
    rounds, _ = prune(drafter, target, sequences, PruneConfig(min_retention=1.0), progress=False)
    assert all(r.retention >= 1.0 for r in rounds)


def test_pruned_drafter_is_lossless(data_dir):  # noqa: F811
    """Greedy speculative output with every pruned depth equals the target's own greedy output."""
    target = tiny_train_target()
    sequences = load_sequences(data_dir, 64)[:4]
    _, drafters = prune(four_layer_drafter(target), target, sequences, PruneConfig(min_layers=1), progress=False)
    config = GenerationConfig(max_new_tokens=24)
    prompt = [5, 9, 13, 7, 3]
    reference = [t for s in reference_generate(target.decoder, prompt, config) for t in s.tokens]
    for drafter in drafters[1:]:
        assert [t for s in speculative_generate(target.decoder, drafter, prompt, config) for t in s.tokens] == reference


def test_healing_fine_tunes_each_round_on_the_training_share_and_never_touches_the_target(
        data_dir, monkeypatch):  # noqa: F811
    """--heal-steps: each kept round is fine-tuned through the trainer (its weights move off the bare
    removal) on the data's first `heal_sequences` only, with the recipe asked (--heal-lr,
    --heal-ce-weight), in fp32 master weights, while the bf16
    target that decodes keeps its dtype and every bit; the healed drafter stays lossless."""
    import d3d.train.trainer as trainer_module

    seen = []

    class Spy(trainer_module.Trainer):
        def __init__(self, target, data, out, config):
            seen.append((config.max_sequences, config.steps, target.decoder.dtype, config.lr, config.ce_weight))
            super().__init__(target, data, out, config)

    monkeypatch.setattr(trainer_module, "Trainer", Spy)
    target = tiny_train_target()
    target.decoder.to(torch.bfloat16)
    before = {n: p.clone() for n, p in target.decoder.state_dict().items()}
    every = load_sequences(data_dir, 64)
    drafter = four_layer_drafter(target)
    config = PruneConfig(min_layers=2, heal_steps=2, heal_sequences=len(every) - 8, heal_lr=1e-3, heal_ce_weight=0.5)
    rounds, drafters = prune(drafter, target, every[-8:], config, str(data_dir), progress=False)
    assert seen == [(len(every) - 8, 2, torch.float32, 1e-3, 0.5)] * 2
    after = target.decoder.state_dict()
    assert all(after[n].dtype == torch.bfloat16 and torch.equal(after[n], p) for n, p in before.items())
    bare = remove_layer(drafter, rounds[1].removed, target.decoder).own_state()
    healed = drafters[1].own_state()
    assert any(not torch.equal(bare[k], healed[k]) for k in bare if k.startswith("decoder.layers."))
    assert drafters[1].decoder.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    generation = GenerationConfig(max_new_tokens=16)
    prompt = [5, 9, 13, 7, 3]
    reference = [t for s in reference_generate(target.decoder, prompt, generation) for t in s.tokens]
    assert [t for s in speculative_generate(target.decoder, drafters[-1], prompt, generation)
            for t in s.tokens] == reference


def test_time_rounds_interleaves_ar_and_every_depth_prompt_by_prompt(data_dir, monkeypatch):  # noqa: F811
    """Every prompt is decoded by AR and by each round's drafter in an order that rotates by one per
    prompt (after one warm-up decode each), so no depth is timed alone in a slow minute; each round
    gets its tokens/s and the decoded τ of its own runs."""
    target = tiny_train_target()
    sequences = load_sequences(data_dir, 64)[-4:]
    rounds, drafters = prune(four_layer_drafter(target), target, sequences, PruneConfig(min_layers=3), progress=False)
    calls = []
    real_ar, real_spec = prune_module.reference_generate, prune_module.speculative_generate

    def ar(decoder, prompt, config):
        calls.append("ar")
        return real_ar(decoder, prompt, config)

    def spec(decoder, drafter, prompt, config):
        calls.append(f"d{len(drafter.decoder.layers)}")
        return real_spec(decoder, drafter, prompt, config)

    monkeypatch.setattr(prune_module, "reference_generate", ar)
    monkeypatch.setattr(prune_module, "speculative_generate", spec)
    prompts = [[5, 9, 13, 7], [3, 8, 2], [11, 4, 6, 1, 9]]
    rate = time_rounds(target.decoder, rounds, drafters, prompts, 6)
    assert calls[:3] == ["ar", "d4", "d3"]  # warm-up
    assert calls[3:] == ["ar", "d4", "d3", "d4", "d3", "ar", "d3", "ar", "d4"]
    assert rate > 0 and all(r.tokens_per_second > 0 and r.decoded_tau >= 1 for r in rounds)


def test_cli_prune_refuses_a_bad_healing_recipe_before_loading(capsys, data_dir, tmp_path):  # noqa: F811
    """--heal-lr 0 or a negative --heal-distill: exit 2 with the reason, nothing loaded or written."""
    for option in (["--heal-lr", "0"], ["--heal-distill", "-1"]):
        code = main(["prune", "--drafter", str(tmp_path / "missing"), "--data", str(data_dir),
                     "--out", str(tmp_path / "out"), "--heal-steps", "2", *option])
        assert code == 2
        assert "heal_lr must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_prune_writes_a_smaller_checkpoint_and_never_touches_the_input(
        capsys, data_dir, tmp_path, patched_load_target):  # noqa: F811
    """`d3d prune` writes the chosen depth, prune.json and prune.png (and with --keep-all every depth);
    the input file's bytes are unchanged."""
    target = tiny_train_target()
    four_layer_drafter(target).save_pretrained(tmp_path / "in")
    digest = hashlib.sha256((tmp_path / "in" / "model.safetensors").read_bytes()).hexdigest()
    code = main(["prune", "--drafter", str(tmp_path / "in"), "--data", str(data_dir), "--out", str(tmp_path / "out"),
                 "--min-layers", "2", "--calibration", "8", "--speed-prompts", "2", "--max-new-tokens", "8",
                 "--speed-async", "--keep-all"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert hashlib.sha256((tmp_path / "in" / "model.safetensors").read_bytes()).hexdigest() == digest
    loaded = Drafter.from_pretrained(tmp_path / "out", target.decoder)
    report = json.loads((tmp_path / "out" / "prune.json").read_text())
    # The shipped depth is the measured fastest round; which one that is depends on the machine's
    # timings, so the test checks the rule, not a depth.
    fastest = max(report["rounds"], key=lambda r: r["tokens_per_second"])
    assert loaded.config.target_layers == summary["chosen_layers"] == fastest["layers"]
    assert [len(r["layers"]) for r in report["rounds"]] == [4, 3, 2]
    assert all(r["tokens_per_second"] > 0 and r["async_tokens_per_second"] > 0 for r in report["rounds"])
    assert all(1.0 <= r["decoded_tau"] <= 4 for r in report["rounds"])
    assert report["ar_tokens_per_second"] > 0
    assert report["estimator_correlation"] is None or -1 <= report["estimator_correlation"] <= 1
    assert (tmp_path / "out" / "prune.png").is_file()
    for r in report["rounds"]:  # --keep-all: every depth, loadable
        kept = Drafter.from_pretrained(tmp_path / "out" / f"layers-{len(r['layers'])}", target.decoder)
        assert kept.config.target_layers == r["layers"]


def test_correlation():
    """Pearson's r: ±1 on lines, None without enough points or spread."""
    from d3d.prune import correlation
    assert correlation([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert correlation([1, 2], [1, 2]) is None and correlation([1, 1, 1], [1, 2, 3]) is None
