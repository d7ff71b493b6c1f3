"""The τ scaling fit (`d3d.train.scaling`): recovers a known log-linear law, inverts it, reads
runs' logs (final point per run, or all), draws its plot, and refuses what it cannot fit."""

from __future__ import annotations

import json
import math

import pytest

from d3d.cli import main
from d3d.config import ConfigError
from d3d.train.scaling import Point, fit, read_points


def write_run(folder, evaluations: list[tuple[int, int, float]]) -> None:
    folder.mkdir(parents=True)
    lines = [{"step": 0, "tau": 1.0}]  # step 0: no tokens yet, never fitted
    lines += [{"step": step, "loss": 1.0, "tokens_seen": tokens, "tau": tau} for step, tokens, tau in evaluations]
    (folder / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_fit_recovers_a_log_linear_law_and_inverts_it():
    points = [Point("r", n, 0.5 + 0.1 * math.log(n)) for n in (10_000, 100_000, 1_000_000, 4_000_000)]
    result = fit(points)
    assert result.intercept == pytest.approx(0.5) and result.slope == pytest.approx(0.1) and result.r2 == pytest.approx(1)
    assert result.tokens_for(0.5 + 0.1 * math.log(2e7)) == pytest.approx(2e7, rel=1e-6)
    flat = fit([Point("r", 1000, 1.2), Point("r", 10_000, 1.1)])
    assert flat.tokens_for(3.0) == math.inf


def test_runs_give_their_final_point_or_all(tmp_path):
    write_run(tmp_path / "small", [(50, 100_000, 1.2), (100, 200_000, 1.3)])
    write_run(tmp_path / "large", [(200, 400_000, 1.4), (400, 800_000, 1.5)])
    finals = read_points([tmp_path / "small", tmp_path / "large"])
    assert [(p.run, p.tokens, p.tau) for p in finals] == [("small", 200_000, 1.3), ("large", 800_000, 1.5)]
    assert len(read_points([tmp_path / "small", tmp_path / "large"], all_points=True)) == 4
    with pytest.raises(ConfigError, match="two or more"):
        fit(read_points([tmp_path / "small"]))
    with pytest.raises(ConfigError, match="log.jsonl"):
        read_points([tmp_path / "missing"])


def test_scaling_command_prints_the_fit_and_draws_it(tmp_path, capsys):
    write_run(tmp_path / "a", [(10, 100_000, 1.2)])
    write_run(tmp_path / "b", [(40, 1_000_000, 1.4)])
    png = tmp_path / "scaling.png"
    assert main(["scaling", str(tmp_path / "a"), str(tmp_path / "b"), "--png", str(png), "--targets", "2,3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["points"] == 2 and summary["r2"] == 1.0
    slope = 0.2 / math.log(10)
    assert summary["tokens_for_tau"]["2"] == pytest.approx(100_000 * math.exp(0.8 / slope), rel=1e-3)
    assert png.stat().st_size > 1000
