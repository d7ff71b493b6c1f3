"""Compiling the row-exact kernels for this machine: once per source, compiler and CPU, cached.

`build()` compiles `rowexact.c` (and the headers it includes) with the local C compiler for the
running CPU (`-march=native`) into `$D3D_CACHE/kernels`, keyed by the sources, the compiler's
version, the CPU's flags and the compile flags; a half-written library is never loaded. This
module only builds: loading and calling the library is `d3d.kernels.binding`'s.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "rowexact.c"  # the translation unit; it includes the headers beside it
LTO_JOBS = 8  # parallel_flags' most code-generation jobs
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    """The row-exact kernels could not be compiled or loaded on this machine."""


def sources() -> list[Path]:
    """Every file the build reads: the C file and its headers."""
    return [SOURCE, *sorted(HERE.glob("*.h"))]


def cache_dir() -> Path:
    return Path(os.environ.get("D3D_CACHE", Path.home() / ".cache" / "d3d")) / "kernels"


def cpu_flags_line() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def parallel_flags(version: str) -> list[str]:
    """GCC's link-time optimisation over the one translation unit, its code generation split across
    the cores this process may use (`-flto=N`): the same logits at the same speed (scripts/rows_ab.py),
    built in 10.4 s instead of 17.0 on 2 AMD EPYC Zen 3 cores. Empty for other
    compilers (the build is then the single pass it always was). `version`: `cc --version`'s output.
    At most `LTO_JOBS` at once: each holds a share of the program in memory, and a container may
    report far more cores than it may use. GCC runs the jobs through `make`: without it they would
    run one after another (18.6 s), slower than the one-pass build."""
    if "Free Software Foundation" not in version or "clang" in version.lower() or shutil.which("make") is None:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return [f"-flto={min(cores, LTO_JOBS)}"]


def compiler() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C compiler found (set CC, or install gcc) to build the row-exact kernels")


def build(verbose: bool = False, profile: bool = False, march: str = "native", emulate_amx: bool = False) -> Path:
    """Compile the kernels for this machine (once; cached by sources, compiler and CPU flags).

    `profile` builds the variant whose fused forward times its stages (`stage_seconds`); `march`
    another target than this CPU's (the tests build "x86-64-v2", the portable C, to compare bits);
    `emulate_amx` the AMX path with its tile operations in plain C (amx.h), for the tests on CPUs
    without AMX (slow: never for inference).
    """
    cc = compiler()
    missing = [path for path in sources() if not path.is_file()]
    if missing or not SOURCE.is_file():
        raise KernelBuildError(f"the kernel source {missing[0] if missing else SOURCE} is missing: "
                               "reinstall d3d-decoding")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = ([f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS] + ["-DD3D_PROFILE"] * profile
             + ["-DD3D_AMX_EMULATE"] * emulate_amx)
    texts = [path.read_text() for path in sources()]
    key = hashlib.sha256("\0".join([*texts, version, cpu_flags_line(), " ".join(flags)]).encode())
    suffix = "-profile" * profile + (f"-{march}" if march != "native" else "") + "-amx-emulated" * emulate_amx
    target = cache_dir() / f"rowexact-{key.hexdigest()[:16]}{suffix}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        lto = parallel_flags(version)
        result = subprocess.run([cc, *flags, *lto, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0 and lto:  # e.g. no LTO plugin: the one-pass build
            result = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"{cc} failed to build the row-exact kernels:\n{result.stderr.strip()}")
        if verbose:
            print(f"d3d: built row-exact kernels {target}", file=sys.stderr)
        os.replace(built, target)  # atomic: a half-written library is never loaded
    return target
