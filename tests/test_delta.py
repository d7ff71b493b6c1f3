"""A drafter stored as 4-bit differences from the target layers it was copied from (`d3d.delta`,
`Drafter.save_pretrained(delta_from=…)`, `d3d compress`): the decoded blocks are gguf-py's reference
values, a round trip moves each weight by at most a block step of its difference and leaves
every other tensor as it was, the file shrinks, decoding stays the target's own, and a drafter is
never rebuilt on another target's weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import d3d.loading
from conftest import make_decoder, perturb_drafter, tiny_config
from d3d.cli import main
from d3d.config import GenerationConfig
from d3d.delta import SUFFIX, dequantize, encode
from d3d.drafter import DELTA_FORMAT_VERSION, Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.loading import LoadError, Target
from test_generation import EOS, ByteTokenizer


def trained_drafter(target, scale: float = 0.01) -> Drafter:
    """A drafter copied from both target layers and moved a little, as training moves a deep one."""
    drafter = Drafter.from_target(target, [0, 1], block_size=4, block_attention="causal").eval()
    perturb_drafter(drafter, scale, seed=5)
    return drafter


@pytest.fixture
def target():
    decoder = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1, dtype=torch.bfloat16)
    return decoder.requires_grad_(False)


def test_the_blocks_decode_to_gguf_reference_values():
    """`dequantize` gives gguf-py's Q4_0 values bit for bit (a zero block, tiny and large scales included)."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((8, 256)) * rng.choice([1e-4, 1e-2, 3.0], size=(8, 1))).astype(np.float32)
    values[0, :32] = 0.0
    blocks = quants.quantize(values, GGMLQuantizationType.Q4_0)
    reference = quants.dequantize(blocks, GGMLQuantizationType.Q4_0).astype(np.float32)
    assert np.array_equal(dequantize(torch.from_numpy(blocks)).numpy(), reference)


def test_a_round_trip_moves_copied_matrices_within_a_step_and_nothing_else(target, tmp_path):
    """Saved with `delta_from` (format version 2, the bases' fingerprint beside it) and loaded: every
    matrix copied from a target layer within one block step of its difference (Q4_0 rounds to half a
    step, and clips the block's far end by up to one) and not back on the target's values; every
    other tensor bit for bit; a smaller file than the plain bf16 one."""
    drafter = trained_drafter(target)
    drafter.save_pretrained(tmp_path / "plain", dtype=torch.bfloat16)
    drafter.save_pretrained(tmp_path / "delta", dtype=torch.bfloat16, delta_from=target)
    document = json.loads((tmp_path / "delta" / "config.json").read_text())
    assert document["format_version"] == DELTA_FORMAT_VERSION and document["delta_base"]
    assert ((tmp_path / "delta" / "model.safetensors").stat().st_size
            < (tmp_path / "plain" / "model.safetensors").stat().st_size)

    rebuilt = Drafter.from_pretrained(tmp_path / "delta", target)
    before, after = drafter.own_state(), rebuilt.own_state()
    assert before.keys() == after.keys()
    target_state = target.state_dict()
    encoded = encode({k: v for k, v in before.items()}, target_state, drafter.config.target_layers)
    copied = {k.removesuffix(SUFFIX) for k in encoded if k.endswith(SUFFIX)}
    assert copied == {k for k, v in before.items() if k.startswith("decoder.layers.") and v.dim() == 2}
    for name, value in before.items():
        if name not in copied:
            assert torch.equal(after[name], value), name  # norms, the MASK embedding, …: as they were
            continue
        layer = int(name.split(".")[2])
        base = target_state[name.removeprefix("decoder.").replace(f"layers.{layer}.", f"layers.{[0, 1][layer]}.", 1)]
        difference = value.float() - base.float()
        step = difference.abs().reshape(difference.shape[0], -1, 32).amax(-1, keepdim=True) / 8
        error = (after[name].float() - value.float()).abs().reshape(step.shape[0], -1, 32)
        assert (error <= step + value.float().abs().max() * 2 ** -8).all(), name  # + one bf16 rounding
        assert not torch.equal(after[name], base), name  # the difference survived


def test_decoding_with_a_compressed_drafter_is_the_targets_own(target, tmp_path):
    drafter = trained_drafter(target, scale=0.3)  # sometimes wrong, so verification rejects some drafts
    drafter.save_pretrained(tmp_path, dtype=torch.bfloat16, delta_from=target)
    rebuilt = Drafter.from_pretrained(tmp_path, target)
    config = GenerationConfig(max_new_tokens=24, eos_token_ids=[])
    prompt = [5, 9, 13, 2, 7, 11]
    expected = [t for step in reference_generate(target, prompt, config) for t in step.tokens]
    steps = list(speculative_generate(target, rebuilt, prompt, config))
    assert [t for step in steps for t in step.tokens] == expected
    assert len(steps) < len(expected)  # it drafted, and some drafts were accepted


def test_another_targets_weights_are_refused(target, tmp_path):
    """Same shapes and vocabulary, other values: the differences would rebuild another drafter."""
    trained_drafter(target).save_pretrained(tmp_path, dtype=torch.bfloat16, delta_from=target)
    other = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=2, dtype=torch.bfloat16)
    with pytest.raises(LoadError, match="another target's weights"):
        Drafter.from_pretrained(tmp_path, other)
    Drafter.from_pretrained(tmp_path, target)  # its own target loads it


def test_cli_compress(capsys, target, tmp_path, monkeypatch):
    """`d3d compress`: a JSON line with both sizes; the result loads; bad input exits 2, no traceback."""
    monkeypatch.setattr(d3d.loading, "load_target", lambda source=None, dtype=torch.bfloat16, weights="stored":
                        Target(target, ByteTokenizer(), "tiny", [EOS]))
    drafter = trained_drafter(target)
    drafter.config.tokenizer_fingerprint = ""
    drafter.save_pretrained(tmp_path / "drafter", dtype=torch.bfloat16)
    assert main(["compress", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "small")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bytes_after"] < result["bytes_before"] and result["max_weight_change"] < 0.05
    Drafter.from_pretrained(tmp_path / "small", target)
    for argv in (["--drafter", str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
                 ["--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "drafter")]):
        assert main(["compress", *argv]) == 2
        err = capsys.readouterr().err
        assert "d3d: error:" in err and "Traceback" not in err
