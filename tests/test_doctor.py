"""`d3d doctor`: the report a user reads — kernels, the invariance check per path, step costs."""

from __future__ import annotations

import json

import pytest
import torch

import d3d.loading
from conftest import make_decoder, tiny_config
from d3d.cli import main
from d3d.doctor import PathCost, format_report
from d3d.loading import Target
from test_generation import EOS, ByteTokenizer


@pytest.fixture
def tiny_target(monkeypatch):
    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        decoder = make_decoder(tiny_config("qwen3", tie_word_embeddings=False), seed=1, dtype=dtype)
        return Target(decoder.requires_grad_(False), ByteTokenizer(), "tiny", [EOS])

    monkeypatch.setattr(d3d.loading, "load_target", load)


def test_doctor_reports_the_row_exact_path_as_invariant(tiny_target, capsys):
    assert main(["doctor", "--dtypes", "bfloat16,float32", "--drafter", "untrained", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["cpu"] and "pack_seconds_float32" in report["machine"]
    costs = report["machine"]["gate_costs_bfloat16"]  # what the speculation gate weighs
    assert costs["verify"][0] == 1.0 and len(costs["verify"]) == 16 and costs["drafter"][1] > 0
    for dtype in ("bfloat16", "float32"):
        used = [p for p in report["paths"][dtype] if p["used"]]
        assert len(used) == 1 and used[0]["kernels"].startswith("row-exact") and used[0]["invariant"]
        assert used[0]["step_ms"] > 0 and used[0]["verify_ms"] > 0
        assert any(p["kernels"] == "torch" for p in report["paths"][dtype])  # the comparison path


def test_doctor_table_marks_the_path_in_use_and_a_failing_check():
    paths = {"float32": [PathCost("row-exact: x", True, {}, 10.0, 20.0, True),
                         PathCost("torch", False, {"2": 2, "17": 17}, 12.0, 15.0, False)]}
    text = format_report({"cpu": "Test CPU", "flags": ["avx2"], "torch": "2", "threads": 2,
                          "row_exact_kernels": "built"}, paths)
    lines = text.splitlines()
    assert any(line.startswith("float32   → row-exact: x") and "identical" in line and line.endswith("2.00")
               for line in lines)
    # a path that differs verifies row by row: a verification costs 17 of its steps
    assert any("  torch" in line and "DIFFERS 2:2,17:17" in line and line.endswith("17.00") for line in lines)


def test_a_later_generation_finds_the_gate_costs_doctor_measured(tiny_target, monkeypatch, tmp_path):
    """doctor stores the costs the default method's gate asks for: with a drafter of blocks of 8 (the
    shipped one's), verifications are timed up to lookup's 15 drafts, so a speculative generation in
    a later process (memory cleared, nothing busy) measures nothing again."""
    import d3d.costs
    from d3d.drafter import Drafter
    from d3d.generation import Pipeline

    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    target = d3d.loading.load_target()
    Drafter.from_target(target.decoder, [0], block_size=8,
                        tokenizer_fingerprint=target.fingerprint).save_pretrained(tmp_path / "drafter")
    assert main(["doctor", "--dtypes", "float32", "--drafter", str(tmp_path / "drafter"), "--json"]) == 0
    d3d.costs._measured.clear()
    d3d.costs._probed.clear()
    monkeypatch.setattr(d3d.costs, "probe_step_ms", lambda decoder: 1e9)  # never "measured while busy"
    monkeypatch.setattr(d3d.costs, "measure", lambda *args, **kwargs: pytest.fail("measured the costs again"))
    target = d3d.loading.load_target(dtype=torch.float32)
    pipeline = Pipeline(target, Drafter.from_pretrained(tmp_path / "drafter", target.decoder, target.fingerprint))
    chunks = list(pipeline.generate("hello hello", chat=False, max_new_tokens=12))
    assert sum(len(c.step.tokens) for c in chunks) == 12
