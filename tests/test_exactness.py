"""The row-invariance self-check, its cache, and the row-by-row verification fallback."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_adversary, make_decoder, make_oracle, tiny_config
from d3d import exactness
from d3d.config import GenerationConfig
from d3d.engine import reference_generate, speculative_generate
from d3d.exactness import InvarianceReport, cached_check, check_row_invariance, verify_mode
from d3d.lookup import LookupConfig
from d3d.models import Decoder


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test checks afresh, in its own cache folder (the kernels' build is shared)."""
    from d3d.kernels import row_exact_kernels

    row_exact_kernels()  # built (or found) under the real cache before it moves
    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    exactness._modes.clear()


def tokens(steps) -> list[int]:
    return [t for step in steps for t in step.tokens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_exact_target_passes_for_every_row_count(dtype):
    decoder = make_decoder(tiny_config("qwen3"), dtype=dtype)
    report = check_row_invariance(decoder)
    assert report.row_counts == list(range(1, 18))
    assert report.invariant and report.mode == "batched", report.mismatched_rows
    assert report.kernels.startswith("row-exact") and report.dtype == str(dtype).removeprefix("torch.")


def test_the_report_is_cached_per_machine_and_shape(tmp_path):
    decoder = make_decoder(tiny_config())
    first = cached_check(decoder)
    files = list((tmp_path / "exactness").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["row_counts"] == first.row_counts
    # A stored verdict is read back, not recomputed: edit it and see the edit.
    files[0].write_text(json.dumps({**json.loads(files[0].read_text()), "mismatched_rows": {"5": 1}}))
    assert cached_check(decoder).mode == "row-by-row"
    other = make_decoder(tiny_config(num_layers=3))  # another shape: its own entry
    assert cached_check(other).invariant and len(list((tmp_path / "exactness").glob("*.json"))) == 2


def failing_report(decoder: Decoder) -> InvarianceReport:
    return InvarianceReport("test", "float32", list(range(1, 18)), {"16": 3})


def test_fallback_is_announced_once_and_stays_exact(monkeypatch, capsys, prompt):
    """A target that fails the check verifies row by row; output is the reference's, on every path."""
    monkeypatch.setattr(exactness, "cached_check", failing_report)
    target = make_decoder(tiny_config(tie_word_embeddings=False), seed=1)
    config = GenerationConfig(max_new_tokens=24)
    expected = tokens(reference_generate(target, prompt, config))
    for drafter in (make_oracle(target, 4), make_adversary(target, 4), None):
        lookup = LookupConfig() if drafter is None else None
        assert tokens(speculative_generate(target, drafter, prompt, config, lookup=lookup)) == expected
    assert capsys.readouterr().err.count("verifying row by row") == 1


@torch.no_grad()
def test_pytorch_kernels_are_checked_not_trusted(prompt):
    """With PyTorch's ops (no row-exact kernels) the check decides; fp32 GEMMs round by row count on
    the CPUs this project runs on, so there it must choose row-by-row — and output stays exact."""
    config = tiny_config(tie_word_embeddings=False)
    target = Decoder(config, kernels="torch")
    target.load_state_dict(make_decoder(config, seed=1).state_dict())
    target.eval()
    report = check_row_invariance(target)
    assert report.kernels == "torch"
    assert verify_mode(target) == report.mode
    generation = GenerationConfig(max_new_tokens=24)
    expected = tokens(reference_generate(target, prompt, generation))
    assert tokens(speculative_generate(target, make_oracle(target, 4), prompt, generation)) == expected
    if report.invariant:
        pytest.skip("this CPU's fp32 GEMM happens to be row-count invariant for these shapes")
    assert report.mode == "row-by-row"
