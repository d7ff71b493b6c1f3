"""Which device d3d runs on: the `--device` option's parsing, and clocks that wait for the device.

CPU is the default and the machine every test runs on; CUDA runs where torch sees a GPU. GPU work
is queued, so a clock read without synchronising times the queueing, not the work (gpt-fast's
`device_sync`): `synchronize` before every reading that a measurement rests on.
"""

from __future__ import annotations

import torch

from d3d.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """"cpu", "cuda" or "cuda:N" → a torch.device that exists here; a clear error otherwise."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {name!r}: use cpu or cuda (cuda:N for the N-th GPU)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device {name!r} is not supported: use cpu or cuda")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but torch sees no CUDA GPU here "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def available_devices() -> list[str]:
    """The device types this machine can run: always cpu, cuda when a GPU is visible."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose work is done when it returns)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
