"""What one benchmark method gives for one prompt (`MethodRun`), and the call shape every method has
(`Method`): d3d's engines (`d3d.bench.methods`), the transformers baselines and llama.cpp's
(`d3d.bench.llamacpp`) all return it, and the harness (`d3d.bench.harness`) only reads it. It
defines no method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from d3d.config import GenerationConfig
from d3d.stats import SpecStats


@dataclass
class MethodRun:
    tokens: list[int]
    seconds: float
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_seconds: float | None = None  # up to the first new token (prompt + its sample); None: not measured
    extra: dict[str, float] = field(default_factory=dict)  # figures only this method has (llama.cpp's drafts)


Method = Callable[[list[int], GenerationConfig], MethodRun]
