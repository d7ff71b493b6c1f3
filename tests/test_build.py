"""How the row-exact kernels are built: once per machine and source, their code generation spread
over the cores, and their source compiling for every x86 CPU family users run d3d on (what the
kernels compute: tests/test_kernels.py)."""

from __future__ import annotations

import pytest

from d3d.kernels import build, row_exact_kernels


def test_the_build_is_cached():
    """The library is compiled once per machine and source; a second call reuses the file."""
    kernels = row_exact_kernels()
    assert build() == kernels.path and kernels.path.exists()
    assert kernels.path_name


def test_the_build_splits_its_code_generation_over_the_cores_and_falls_back_to_one_pass(tmp_path, monkeypatch):
    """GCC builds with -flto=N (N: the cores this process may use); where that fails (no LTO plugin),
    the same flags without it. Other compilers are never asked for it."""
    import os

    from d3d.kernels.build import LTO_JOBS, parallel_flags

    gcc = "gcc (GCC) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc."
    log = tmp_path / "calls"
    fake = tmp_path / "fakecc"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {log}
case "$*" in *--version*) printf '{gcc}\\n'; exit 0;; esac
case "$*" in *-flto*) echo "lto-wrapper: fatal error: no LTO plugin" >&2; exit 1;; esac
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && : > "$2"; shift; done
""")
    fake.chmod(0o755)
    (tmp_path / "make").write_text("#!/bin/sh\nexit 1\n")  # GCC's jobs need make on the PATH (never run here)
    (tmp_path / "make").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    path = build()
    assert path.exists() and path.parent == tmp_path / "cache" / "kernels"
    compiles = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert len(compiles) == 2, compiles
    jobs = min(len(os.sched_getaffinity(0)), LTO_JOBS)
    assert f"-flto={jobs}" in compiles[0].split() and "-flto" not in compiles[1]
    assert compiles[0].replace(f" -flto={jobs}", "") == compiles[1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # a large machine: 8 jobs at most
    assert parallel_flags(gcc) == [f"-flto={LTO_JOBS}"]
    assert parallel_flags("clang version 17.0.6\nTarget: x86_64-pc-linux-gnu") == []
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no make: GCC would run the jobs one by one
    assert parallel_flags(gcc) == []
    assert parallel_flags("Ubuntu clang version 14 (Free Software Foundation compatible)") == []


OTHER_CPUS = ("x86-64-v2", "x86-64-v3", "skylake-avx512", "sapphirerapids")


def test_the_source_compiles_for_other_x86_cpus():
    """The kernels are compiled for the running CPU (-march=native), so a path this machine does not
    take — no AVX-512; AVX-512 without BF16, as on Skylake-X to Ice Lake; AMX-era Xeons — is checked
    here by the compiler, for every CPU family users run d3d on: without an error or a warning. The
    four compiles run side by side (~57 s of CPU at -O3, ~16 s each alone on 2 AMD EPYC Zen 3 cores)."""
    import subprocess

    from d3d.kernels.build import FLAGS, SOURCE, compiler as find_compiler

    compiler = find_compiler()
    flags = [flag for flag in FLAGS if not flag.startswith("-march") and flag not in ("-shared", "-fPIC")]
    known = [march for march in OTHER_CPUS
             if subprocess.run([compiler, f"-march={march}", "-x", "c", "-fsyntax-only", "/dev/null"],
                               capture_output=True).returncode == 0]
    if not known:
        pytest.skip(f"{compiler} knows none of {', '.join(OTHER_CPUS)}")
    compiles = {march: subprocess.Popen([compiler, *flags, f"-march={march}", "-c", str(SOURCE), "-o", "/dev/null"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for march in known}
    for march, process in compiles.items():
        stderr = process.communicate()[1]
        assert process.returncode == 0 and "warning" not in stderr, (march, stderr)
