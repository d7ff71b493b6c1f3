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
    def load(source=None, dtype=torch.bfloat16):
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
