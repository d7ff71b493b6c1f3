"""A real vLLM run of exported folders (opt-in: marker `vllm`, skipped unless D3D_VLLM_PYTHON is set).

vLLM lives in its own virtual environment (scripts/vllm.sh builds .venv-vllm), so this test drives it
through `scripts/vllm_check.py engine` with that interpreter: a tiny random target (head size 32,
the smallest vLLM's CPU attention takes) and a causal D3D drafter copied from all its layers — whose
first draft is the target's own token — exported here, then greedy outputs without and with
parallel drafting. vLLM must accept drafts, and all three outputs (vLLM plain, vLLM speculative,
d3d's plain decoding) must be token-identical (float32).

    D3D_VLLM_PYTHON=.venv-vllm/bin/python python -m pytest -m vllm tests/test_vllm.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import greedy_continuation, make_decoder, tiny_config
from d3d.drafter import Drafter
from d3d.export import export_drafter, export_target
from d3d.loading import Target
from test_export import EOS, hf_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("D3D_VLLM_PYTHON", "")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="opt-in: set D3D_VLLM_PYTHON to the vLLM environment's python (scripts/vllm.sh builds "
                       ".venv-vllm), e.g. D3D_VLLM_PYTHON=.venv-vllm/bin/python pytest -m vllm")]


def check_script():
    spec = importlib.util.spec_from_file_location("vllm_check", ROOT / "scripts" / "vllm_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_engine(target: Path, ids_file: Path, result: Path, speculative: dict | None) -> dict:
    command = [PYTHON, str(ROOT / "scripts" / "vllm_check.py"), "engine", "--target", str(target), "--ids",
               str(ids_file), "--result", str(result), "--max-tokens", "24", "--dtype", "float32",
               "--max-model-len", "256", "--eager"]
    if speculative:
        command += ["--speculative-config", json.dumps(speculative)]
    env = check_script().vllm_env("0", Path(PYTHON).resolve().parent.parent)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


def test_vllm_serves_the_exported_target_with_the_parallel_drafter(tmp_path):
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
                         max_position_embeddings=256, tie_word_embeddings=False)
    target = Target(make_decoder(config, seed=1), hf_tokenizer(60), "tiny-random", [EOS])
    drafter = Drafter.from_target(target.decoder, [0, 1], block_size=5, block_attention="causal")
    export_target(target, tmp_path / "target")
    exported = export_drafter(drafter, target, tmp_path / "drafter")
    prompts = [torch.randint(5, 60, (8,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    (tmp_path / "ids.json").write_text(json.dumps(prompts))

    plain = run_engine(tmp_path / "target", tmp_path / "ids.json", tmp_path / "plain.json", None)
    spec = run_engine(tmp_path / "target", tmp_path / "ids.json", tmp_path / "spec.json",
                      exported.speculative_config())
    reference = [greedy_continuation(target.decoder, p, 24) for p in prompts]
    assert plain["outputs"] == reference
    assert spec["outputs"] == reference
    metrics = spec["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    # the first draft is the target's own token: accepted at (nearly) every step
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"][0] >= 0.9 * metrics["vllm:spec_decode_num_drafts"]
