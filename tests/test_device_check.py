"""scripts/device_check.sh in its reduced CPU form (tiny random weights), so the GPU check cannot rot:
it runs end to end, writes at most 8 result files, and its report holds every part."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from d3d.bench.device_check import main, child_pytest

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_cpu_form(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--device", "cpu", "--size", "tiny",
                           "--threads", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["ok"] is True
    files = sorted(p.name for p in out.iterdir())
    assert files == ["device_check.json", "device_check.md", "sweep.png", "tests.txt"] and len(files) <= 8
    report = json.loads((out / "device_check.json").read_text())
    assert report["device"] == "cpu" and report["tests"]["returncode"] == 0 and "passed" in report["tests"]["summary"]
    assert report["ar"]["d3d_tokens_per_second"] > 0 and report["ar"]["transformers_tokens_per_second"] > 0
    assert report["costs"]["verify"][0] == 1.0 and len(report["costs"]["verify"]) == 16
    assert report["sweep"]["identical"] and [r["tau_set"] for r in report["sweep"]["rows"]] == [1.5, 4.0, 8.0]
    assert set(report["targets"]["met"]) == {"ar_vs_transformers", "verify16_steps", "async_vs_sync_at_tau4"}
    text = (out / "device_check.md").read_text()
    assert "| τ set |" in text and "issue 17 target" in text


def test_device_check_refuses_cuda_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["--device", "cuda", "--size", "tiny", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_device_check_runs_every_device_test_on_a_gpu():
    import torch

    cpu, cuda = child_pytest(torch.device("cpu")), child_pytest(torch.device("cuda"))
    assert cpu[-3:] == cuda[-3:] == ["tests/test_devices.py", "tests/test_simulate.py", "tests/test_graphs.py"]
    assert cpu[cpu.index("-k") + 1] == "cpu" and "-k" not in cuda and cuda[3:6] == ["-q", "-p", "no:cacheprovider"]
