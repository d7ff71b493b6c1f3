"""Shared fixtures: tiny random decoders and drafters with known behaviour.

Everything here is built from fixed seeds in fp32 on the CPU, so every test is deterministic and
needs no network. The "oracle" drafter proposes exactly the target's greedy continuation and the
"adversarial" drafter never does; both still honour the `Drafter.draft` contract (block logits
(block_size, V), drafter cache kept as a prefix of the committed tokens).
"""

from __future__ import annotations

import pytest
import torch

from d3d.config import ModelConfig
from d3d.drafter import Drafter
from d3d.models import Decoder

# Tiny models spend their time in thread synchronisation, not arithmetic: with 2 threads one CPU
# SDPA call on a 1×20 problem takes ~6 ms, with 1 thread ~10 µs. One thread keeps the suite fast.
torch.set_num_threads(1)

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, max_position_embeddings=128)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The kernels' team of 1 or 2 threads (the suite runs 1): a pass splits its work between them."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def tiny_config(family: str = "llama", **overrides) -> ModelConfig:
    """A tiny ModelConfig of the given family (Qwen2: q/k/v bias, Qwen3: q/k norm)."""
    extra = {"qwen2": dict(attention_bias=True), "qwen3": dict(qk_norm=True)}.get(family, {})
    return ModelConfig(**{**TINY, **extra, "family": family, **overrides})


def make_decoder(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Decoder:
    """A Decoder with seeded random weights (norm weights perturbed too, biases non-zero), eval mode."""
    torch.manual_seed(seed)
    decoder = Decoder(config)
    with torch.no_grad():
        for name, param in decoder.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif name == "lm_head.weight":
                # A sharp untied head makes greedy output depend on the context instead of
                # settling on one token, which the engine tests need.
                param.normal_(0.0, 1.0)
    return decoder.to(dtype).eval()


@pytest.fixture
def llama_config() -> ModelConfig:
    return tiny_config("llama", tie_word_embeddings=False)


@pytest.fixture
def qwen2_config() -> ModelConfig:
    return tiny_config("qwen2", tie_word_embeddings=False)


@pytest.fixture
def qwen3_config() -> ModelConfig:
    return tiny_config("qwen3", tie_word_embeddings=False)


@pytest.fixture
def target(llama_config) -> Decoder:
    """The tiny Llama target (2 layers, vocab 64, context 128, untied head), fp32, eval mode."""
    return make_decoder(llama_config, seed=1)


@pytest.fixture
def prompt() -> list[int]:
    return [3, 17, 42, 5, 9, 33, 60, 1]


@torch.no_grad()
def greedy_continuation(target: Decoder, tokens: list[int], count: int) -> list[int]:
    """The target's next `count` greedy tokens after `tokens` (fewer if the context runs out)."""
    count = min(count, target.config.max_position_embeddings - len(tokens))
    if count <= 0:
        return []
    cache = target.new_cache(len(tokens) + count)
    logits = target(torch.tensor([tokens]), cache=cache, last_only=True)[0, -1]
    cache.commit()
    out = [int(logits.argmax())]
    while len(out) < count:
        logits = target(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
        cache.commit()
        out.append(int(logits.argmax()))
    return out


def one_hot_logits(tokens: list[int], rows: int, vocab: int, filler: int = 0) -> torch.Tensor:
    """(rows, vocab) logits whose row i has its argmax at tokens[i] (filler past the end)."""
    ids = tokens + [filler] * (rows - len(tokens))
    logits = torch.full((rows, vocab), -10.0)
    logits[torch.arange(rows), torch.tensor(ids[:rows])] = 10.0
    return logits


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation: every draft is accepted under greedy decoding."""

    def __init__(self, config, target: Decoder) -> None:
        super().__init__(config, target)
        object.__setattr__(self, "oracle_target", target)  # not a submodule: nothing to save

    @torch.no_grad()
    def draft_together(self, requests):
        out = super().draft_together(requests)  # keeps the drafter caches exactly as the real one
        return [one_hot_logits(greedy_continuation(self.oracle_target, tokens, logits.shape[0]), logits.shape[0],
                               logits.shape[-1]).to(logits.dtype) for logits, (_, tokens, _) in zip(out, requests)]


class AdversarialDrafter(Drafter):
    """Row 0 is never the target's greedy token, so the first draft is always rejected."""

    def __init__(self, config, target: Decoder) -> None:
        super().__init__(config, target)
        object.__setattr__(self, "oracle_target", target)

    @torch.no_grad()
    def draft_together(self, requests):
        out = []
        for logits, (_, tokens, _) in zip(super().draft_together(requests), requests):
            vocab = logits.shape[-1]
            wanted = greedy_continuation(self.oracle_target, tokens, logits.shape[0])
            wrong = [(t + 1) % vocab for t in wanted]
            out.append(one_hot_logits(wrong, logits.shape[0], vocab, filler=1).to(logits.dtype))
        return out


def perturb_drafter(drafter: Drafter, scale: float, seed: int) -> None:
    """Add seeded noise to the drafter's own weights (a stand-in for training: its drafts now differ)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in drafter.own_state().values():
            if param.is_floating_point():  # not the draft vocabulary's ids
                param.add_(scale * torch.randn(param.shape, generator=generator))


def make_oracle(target: Decoder, block_size: int, layers: list[int] | None = None) -> OracleDrafter:
    return OracleDrafter.from_target(target, layers or [0], block_size=block_size)


def make_adversary(target: Decoder, block_size: int, layers: list[int] | None = None) -> AdversarialDrafter:
    return AdversarialDrafter.from_target(target, layers or [0], block_size=block_size)


@pytest.fixture
def oracle_drafter(target) -> OracleDrafter:
    return make_oracle(target, block_size=4)


@pytest.fixture
def adversarial_drafter(target) -> AdversarialDrafter:
    return make_adversary(target, block_size=4)


def sampling_pair(block_size: int):
    """A vocab-8 target with moderate logits (several tokens survive top-k / top-p) and a drafter
    whose drafts are far from it, plus a prompt: the setup of the T > 0 distribution tests."""
    config = tiny_config(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=8, tie_word_embeddings=False, max_position_embeddings=32)
    target = make_decoder(config, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.35)
    drafter = Drafter.from_target(target, [0], block_size=block_size)
    perturb_drafter(drafter, scale=0.5, seed=7)
    return target, drafter, [1, 5, 2]


def kernels_built_for(march: str, needs: set[str] = frozenset(), why: str = ""):
    """The row-exact kernels compiled for another x86-64 level (-march), beside this machine's own
    build; the test is skipped off x86-64 or where the CPU lacks the flags `needs`."""
    import ctypes
    import platform

    from d3d.kernels import RowExactKernels, build
    from d3d.kernels.build import cpu_flags_line

    flags = set(cpu_flags_line().partition(":")[2].split())
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= flags:
        pytest.skip(why)
    path = build(march=march)
    return RowExactKernels(ctypes.CDLL(str(path)), path)


@pytest.fixture(scope="session")
def avx2():
    """The kernels built for AVX2 without AVX-512 (the build that reads tiled keys), where this CPU runs it."""
    return kernels_built_for("x86-64-v3", {"avx2", "fma"}, "the AVX2 build runs on x86-64 CPUs with AVX2 and FMA")
