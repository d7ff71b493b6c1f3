"""Every engine on every device this machine has: CPU always, CUDA when torch sees a GPU (those
cases skip cleanly without one). Greedy output is AR's token for token; seeded sampling repeats;
random numbers and drafts live on the tensors' device; a device that is not there is refused."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.async_engine import AsyncConfig, async_generate
from d3d.cli import main
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate, speculative_generate
from d3d.devices import available_devices, resolve_device, synchronize
from d3d.lookup import LookupConfig
from d3d.sampling import make_generator, sample
from d3d.simulate import SimulatedDrafter
from d3d.sources import DrafterSource, LookupSource
from d3d.verify import verify_sampling

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
PROMPT = [3, 17, 42, 5, 9, 33, 60, 1, 3, 17]


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.fixture(params=["cpu", "cpu-fixed-rows", pytest.param("cuda", marks=CUDA)])
def models(request):
    device = torch.device(request.param.removesuffix("-fixed-rows"))
    target = make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=256), seed=1).to(device)
    if request.param.endswith("-fixed-rows"):  # a GPU's forwards (d3d.graphs) in their CPU form: PyTorch's ops
        target.row_exact, target.fixed_rows = None, 16
    drafter = Drafter.from_target(target, [0], block_size=8)
    return target, drafter


def test_greedy_engines_equal_ar_on_the_device(models):
    target, drafter = models
    config = GenerationConfig(max_new_tokens=48)
    expected = tokens_of(reference_generate(target, PROMPT, config))
    runs = {
        "drafter": speculative_generate(target, drafter, PROMPT, config),
        "lookup+drafter, gated": speculative_generate(target, drafter, PROMPT, config, lookup=LookupConfig(),
                                                      adaptive=True),
        "lookup": speculative_generate(target, None, PROMPT, config, lookup=LookupConfig(min_ngram=1)),
        "async": async_generate(target, drafter, PROMPT, config, AsyncConfig(max_branches=2)),
    }
    for name, steps in runs.items():
        assert tokens_of(steps) == expected, name


def test_simulated_drafter_on_the_device(models):
    target, drafter = models
    config = GenerationConfig(max_new_tokens=48)
    expected = tokens_of(reference_generate(target, PROMPT, config))
    simulated = SimulatedDrafter(drafter, PROMPT + expected, corruption_rate=0.2)
    assert simulated.stream.device == target.device
    assert tokens_of(generate_from_sources(target, [DrafterSource(simulated)], PROMPT, config)) == expected
    assert tokens_of(async_generate(target, simulated, PROMPT, config)) == expected


def test_seeded_sampling_repeats_on_the_device(models):
    target, drafter = models
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0, top_k=8, seed=5))
    for run in (lambda: speculative_generate(target, drafter, PROMPT, config, lookup=LookupConfig()),
                lambda: async_generate(target, drafter, PROMPT, config, AsyncConfig(concurrent=False))):
        first = tokens_of(run())
        assert len(first) == 24 and first == tokens_of(run())


@pytest.mark.parametrize("device", DEVICES)
def test_random_numbers_and_drafts_live_on_the_device(device):
    generator = make_generator(SamplingConfig(temperature=1.0, seed=0), device)
    assert generator.device.type == torch.device(device).type
    probs = torch.softmax(torch.randn(3, 16), -1).to(device)
    assert sample(probs, generator).device.type == torch.device(device).type
    draft_tokens = torch.tensor([1, 2], device=device)
    verdict = verify_sampling(draft_tokens, probs[:2], probs, generator)
    assert 0 <= verdict.num_accepted <= 2
    source = LookupSource(LookupConfig())
    source.start(64, torch.device(device))
    proposal = source.propose([1, 2, 3, 1, 2], 3, SamplingConfig(), generator)
    assert proposal.draft_tokens.device.type == torch.device(device).type
    synchronize(device)


def test_cpu_generator_draws_as_before():
    """A seeded CPU generator from make_generator draws the very numbers torch.Generator did."""
    ours = make_generator(SamplingConfig(temperature=1.0, seed=11))
    before = torch.Generator().manual_seed(11)
    assert torch.equal(torch.rand(5, generator=ours), torch.rand(5, generator=before))


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert available_devices()[0] == "cpu"
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("banana")
    with pytest.raises(ConfigError, match="not supported"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            resolve_device("cuda")
    else:
        with pytest.raises(ConfigError, match="does not exist"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_cuda_without_a_gpu(capsys):
    assert main(["generate", "hi", "--device", "cuda", "--drafter", "none"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
