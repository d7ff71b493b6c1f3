"""Safetensors files written with a normal file's mode (`d3d.files`), whatever safetensors does."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from d3d.files import current_umask, save_tensors


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_mode_follows_the_umask_as_for_any_file(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        assert current_umask() == umask
        save_tensors({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "w.safetensors", {"format": "pt"})
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == mode  # what open() gives
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.arange(6.0).reshape(2, 3))
