"""Prometheus metrics of the server, in the text exposition format (version 0.0.4), written by hand.

`Counter`, `Gauge` and `Histogram` hold labelled values and render themselves; `ServerMetrics` is
the set `d3d serve` exports at /metrics: requests by endpoint and status, tokens generated, τ and
acceptance by draft position per method and per draft source, tokens/s, queue depth, time in queue,
generations in flight. Glossary as in `d3d.stats`: τ = tokens committed per verification step,
bonus token included; a draft at position i is *reached* when drafts 1 … i−1 were accepted.

What it is not: a client library (no registry, no process metrics, no push). Values are updated
on the server's event loop and read there, so nothing here locks. Hand-written rather than
`prometheus_client` so that the server extra stays two packages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from d3d.sequence import Step
from d3d.stats import SpecStats

if TYPE_CHECKING:
    from d3d.batch import BatchStats

Labels = tuple[str, ...]


def number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def escape(text: str, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{escape(v, True)}"' for n, v in zip(names, values)) + "}"


class Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Labels = ()) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.values: dict[Labels, float] = {}

    def key(self, labels: dict[str, object]) -> Labels:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[name]) for name in self.labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {escape(self.help, False)}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{label_text(self.labels, key)} {number(value)}"
                                for key, value in sorted(self.values.items())]


class Counter(Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up")
        key = self.key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount


class Gauge(Metric):
    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        self.values[self.key(labels)] = value


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float], labels: Labels = ()) -> None:
        super().__init__(name, help, labels)
        self.bounds = sorted(set(buckets))
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}  # key → (bucket counts, [sum])

    def observe(self, value: float, **labels: object) -> None:
        counts, total = self.series.setdefault(self.key(labels), ([0] * (len(self.bounds) + 1), [0.0]))
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        counts[index] += 1
        total[0] += value

    def render(self) -> list[str]:
        lines = self.header()
        names = self.labels + ("le",)
        for key, (counts, total) in sorted(self.series.items()):
            cumulative = 0
            for bound, count in zip([*self.bounds, math.inf], counts):
                cumulative += count
                lines.append(f"{self.name}_bucket{label_text(names, (*key, number(bound)))} {cumulative}")
            lines.append(f"{self.name}_sum{label_text(self.labels, key)} {number(total[0])}")
            lines.append(f"{self.name}_count{label_text(self.labels, key)} {cumulative}")
        return lines


def render(metrics: Iterable[Metric]) -> str:
    return "\n".join(line for metric in metrics for line in metric.render()) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServerMetrics:
    """What `d3d serve` exports. Steps are recorded as they are served, generations when they end."""

    def __init__(self, block_size: int = 16) -> None:
        step, source = ("method", "source"), ("method", "source", "position")
        self.requests = Counter("d3d_requests_total", "HTTP requests answered, by endpoint and status code",
                                ("endpoint", "status"))
        self.tokens = Counter("d3d_generated_tokens_total", "tokens the engine generated", ("method",))
        self.step_tokens = Histogram(
            "d3d_step_tokens", "tokens committed per verification step (accepted drafts + the target's own "
            "token); sum / count is τ", range(1, block_size + 1), step)
        self.reached = Counter("d3d_draft_reached_total", "verification steps whose draft at this position "
                               "was reached (drafted, every earlier draft accepted)", source)
        self.accepted = Counter("d3d_draft_accepted_total", "verification steps whose draft at this position "
                                "was accepted; / d3d_draft_reached_total is the acceptance rate there", source)
        self.tau = Histogram("d3d_generation_tau", "τ of each generation (tokens per verification step)",
                             (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), ("method",))
        self.speed = Histogram("d3d_generation_tokens_per_second", "tokens/s of each generation (prefill included)",
                               (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000), ("method",))
        self.first_token = Histogram("d3d_time_to_first_token_seconds",
                                     "from a generation request's arrival to its first token", SECONDS)
        self.queue_seconds = Histogram("d3d_queue_seconds", "time requests waited for the engine", SECONDS)
        self.queue_depth = Gauge("d3d_queue_depth", "requests waiting for the engine")
        self.in_flight = Gauge("d3d_generations_in_flight", "generations running (decoding together when batched)")
        self.batch_forwards = Gauge("d3d_batch_forwards", "target forwards of the continuous batch so far")
        self.batch_sequences = Gauge("d3d_batch_sequences_per_forward",
                                     "mean generations per target forward of the continuous batch")
        self.batch_rows = Gauge("d3d_batch_rows_per_forward",
                                "mean rows (prompt pieces, anchors and drafts) per target forward of the batch")
        self.prompt_tokens = Counter("d3d_prompt_tokens_total", "prompt tokens of started generations")
        self.cached_tokens = Counter("d3d_prompt_tokens_cached_total",
                                     "of those, tokens whose keys and values came from the prefix cache, not a forward")
        self.cancelled = Counter("d3d_generations_cancelled_total",
                                 "generations ended early: client gone, deadline passed or shutdown", ("reason",))

    def record_step(self, method: str, step: Step) -> None:
        """One verification step (not the prefill's first token, which verifies nothing)."""
        self.step_tokens.observe(step.num_accepted + 1, method=method, source=step.source)
        for i in range(min(step.num_drafted, step.num_accepted + 1)):
            self.reached.inc(method=method, source=step.source, position=i + 1)
        for i in range(step.num_accepted):
            self.accepted.inc(method=method, source=step.source, position=i + 1)

    def record_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)

    def record_generation(self, method: str, stats: SpecStats) -> None:
        self.tokens.inc(stats.new_tokens, method=method)
        if stats.new_tokens:
            self.tau.observe(stats.tau, method=method)
            self.speed.observe(stats.tokens_per_second, method=method)

    def render(self, queue_depth: int, in_flight: int, batch: "BatchStats | None" = None) -> str:
        self.queue_depth.set(queue_depth)
        self.in_flight.set(in_flight)
        if batch is not None:
            self.batch_forwards.set(batch.forwards)
            self.batch_sequences.set(round(batch.mean_sequences, 3))
            self.batch_rows.set(round(batch.mean_rows, 3))
        return render(vars(self).values())
