"""The τ sweep (d3d.bench.sweep) and `d3d bench --simulate-tau`: identity-checked, predicted from
the measured costs, written as JSON, Markdown and PNG. Timings are reported, never asserted."""

from __future__ import annotations

import json

import pytest
import torch

import d3d.generation
import d3d.loading
from conftest import make_decoder, tiny_config
from d3d.bench.sweep import markdown, plot, run_sweep
from d3d.cli import main
from d3d.config import ConfigError
from d3d.costs import forward_costs
from d3d.drafter import Drafter
from test_generation import tiny_target

TAUS = [1.5, 4.0, 8.0]


@pytest.fixture(scope="module")
def models():
    target = make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=256), seed=1)
    return target, Drafter.from_target(target, [0], block_size=16)


def test_sweep_rows_are_identity_checked_and_predicted_from_measured_costs(models, tmp_path):
    target, drafter = models
    result = run_sweep(target, drafter, [[3, 17, 42, 5], [9, 33, 60, 1]], TAUS, max_new_tokens=48)
    assert result["identical"] and not result["mismatches"]
    assert [row["tau_set"] for row in result["rows"]] == TAUS
    costs = forward_costs(target, drafter, 15)
    assert result["costs"]["verify"] == costs.verify[15] and result["costs"]["draft"] == costs.drafter[15]
    for row in result["rows"]:
        for name in ("sync", "async"):
            run = row[name]
            assert run["speedup"] > 0 and run["tokens_per_second"] > 0 and run["tau"] >= 1
        on_path = costs.verify[15] + costs.drafter[15]
        assert row["sync"]["predicted"] == pytest.approx(row["sync"]["tau"] / on_path, abs=2e-3)  # τ is shown rounded
        hidden = costs.verify[15] + (1 - row["async"]["hit_rate"]) * costs.drafter[15]
        assert row["async"]["predicted"] == pytest.approx(row["async"]["tau"] / hidden, abs=2e-3)
    # Sync and async meet the same corrupted positions: the same τ.
    assert all(row["sync"]["tau"] == row["async"]["tau"] for row in result["rows"])
    taus = [row["sync"]["tau"] for row in result["rows"]]
    assert taus == sorted(taus) and taus[0] < 2 < 5 < taus[-1]
    table = markdown(result)
    assert table.count("\n| ") == 1 + len(TAUS) and "identical to AR: yes" in table
    assert plot(result, tmp_path / "sweep.png").endswith("sweep.png") and (tmp_path / "sweep.png").stat().st_size > 0


def test_sweep_refuses_no_prompts_and_unreachable_tau(models):
    target, drafter = models
    with pytest.raises(ConfigError, match="at least one prompt"):
        run_sweep(target, drafter, [], TAUS)
    with pytest.raises(ConfigError, match="out of reach"):
        run_sweep(target, drafter, [[1, 2]], [20.0])


@pytest.fixture
def tiny_default(monkeypatch):
    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        return tiny_target(make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=256), seed=1),
                           eos_token_ids=[])

    monkeypatch.setattr(d3d.generation, "load_target", load)
    monkeypatch.setattr(d3d.loading, "load_target", load)


def test_cli_bench_simulate_tau_writes_json_markdown_and_png(capsys, tiny_default, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "hello " * (i + 1)}) + "\n" for i in range(2)))
    report = tmp_path / "report" / "sweep.md"
    argv = ["bench", "--simulate-tau", "1.5,4", "--prompts", str(prompts), "--datasets", "", "--max-new-tokens", "32",
            "--drafter", "untrained", "--drafter-layers", "0", "--dtype", "float32", "--out", str(tmp_path / "out"),
            "--report", str(report)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["identical"] is True and summary["tau"] == [1.5, 4.0]
    assert len(summary["speedup"]["sync"]) == len(summary["speedup"]["async"]) == 2
    saved = json.loads(open(summary["result"]).read())
    assert saved["prompts"] == 2 and saved["device"] == "cpu" and saved["machine"]["cpu"]
    assert "| τ set |" in report.read_text() and report.with_suffix(".png").is_file()
    assert "| τ set |" in err


@pytest.mark.parametrize("extra, fragment", [(["--simulate-tau", "2,x"], "comma-separated"),
                                             (["--simulate-tau", "30"], "out of reach"),
                                             (["--simulate-tau", "2", "--temperature", "1"], "greedy"),
                                             (["--simulate-tau", "2", "--drafter", "none"], "real drafter")])
def test_cli_simulate_tau_bad_input_exits_2(capsys, tiny_default, tmp_path, extra, fragment):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "hello"}) + "\n")
    argv = ["bench", "--prompts", str(prompts), "--datasets", "", "--max-new-tokens", "8", "--dtype", "float32",
            "--drafter", "untrained", "--out", str(tmp_path / "out"), *extra]
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err
