"""Prometheus metrics: the exposition text parses with a strict parser of the text format (0.0.4),
and the served /metrics counters move by exactly what a request did.

`parse` is written here from the format's specification (no client library), strict where the
format is: names, label syntax and escapes, one TYPE per family before its samples, contiguous
families, no duplicate series, histograms with cumulative buckets ending at +Inf = _count.
"""

from __future__ import annotations

import math
import re

import pytest

from d3d.metrics import Counter, Histogram, ServerMetrics, render
from d3d.sequence import Step
from d3d.stats import SpecStats

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
SAMPLE = re.compile(rf"^(?P<name>{NAME})(?:\{{(?P<labels>{LABEL}(?:,{LABEL})*)?\}})? (?P<value>\S+)(?: -?\d+)?$")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}

Series = tuple[str, frozenset]


def unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], value)


def parse_value(text: str) -> float:
    if text in ("+Inf", "-Inf", "NaN"):
        return float(text.replace("Inf", "inf").replace("NaN", "nan"))
    assert re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text), f"bad value {text!r}"
    return float(text)


def family_of(name: str, types: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and types.get(base) == "histogram":
            return base
    return name


def parse(text: str) -> tuple[dict[Series, float], dict[str, str]]:
    """Samples {(name, labels): value} and types {family: type}; AssertionError on anything malformed."""
    assert text.endswith("\n"), "the exposition ends with a newline"
    samples: dict[Series, float] = {}
    types: dict[str, str] = {}
    done: set[str] = set()  # families whose samples have ended
    current = None
    for number, line in enumerate(text[:-1].split("\n"), 1):
        where = f"line {number}: {line!r}"
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if parts[1] in ("HELP", "TYPE"):
                assert len(parts) >= 3 and re.fullmatch(NAME, parts[2]), where
            if parts[1] == "TYPE":
                assert parts[2] not in types and parts[2] not in done, f"second TYPE, {where}"
                assert len(parts) == 4 and parts[3] in TYPES, where
                types[parts[2]] = parts[3]
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample, {where}"
        name, pairs = match["name"], re.findall(LABEL, match["labels"] or "")
        labels = {k: unescape(v) for k, v in pairs}
        assert len(labels) == len(pairs), f"repeated label, {where}"
        family = family_of(name, types)
        assert family in types, f"sample before its TYPE, {where}"
        if family != current:
            assert family not in done, f"family {family} is not contiguous"
            if current is not None:
                done.add(current)
            current = family
        key = (name, frozenset(labels.items()))
        assert key not in samples, f"duplicate series, {where}"
        samples[key] = parse_value(match["value"])
        if types[family] == "counter":
            assert samples[key] >= 0, where
    check_histograms(samples, types)
    return samples, types


def check_histograms(samples: dict[Series, float], types: dict[str, str]) -> None:
    for family in (f for f, kind in types.items() if kind == "histogram"):
        series: dict[frozenset, list[tuple[float, float]]] = {}
        for (name, labels), value in samples.items():
            if name == f"{family}_bucket":
                rest = frozenset((k, v) for k, v in labels if k != "le")
                series.setdefault(rest, []).append((parse_value(dict(labels)["le"]), value))
        for labels, buckets in series.items():
            buckets.sort()
            counts = [count for _, count in buckets]
            assert counts == sorted(counts), f"{family} buckets are not cumulative"
            assert buckets[-1][0] == math.inf, f"{family} has no +Inf bucket"
            assert samples[(f"{family}_count", labels)] == counts[-1]
            assert (f"{family}_sum", labels) in samples


def value(samples: dict[Series, float], name: str, **labels) -> float:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def total(samples: dict[Series, float], name: str, **labels) -> float:
    """Sum over every series of `name` whose labels include `labels`."""
    wanted = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, series), v in samples.items() if n == name and wanted <= series)


# -- the module ---------------------------------------------------------------------------------

def test_server_metrics_render_what_steps_and_generations_recorded():
    """A lookup step accepting 2 of 3 drafts, a drafter step accepting none: step-token histogram,
    reached/accepted by position, then a generation's tokens, τ and speed."""
    metrics, stats = ServerMetrics(block_size=4), SpecStats(new_tokens=6, steps=2, wall_seconds=0.5,
                                                             accepted_histogram=[1, 0, 1])
    metrics.record_step("speculative", Step([1, 2, 3], 3, 2, "lookup", None, stats))
    metrics.record_step("speculative", Step([4], 2, 0, "drafter", None, stats))
    metrics.record_generation("speculative", stats)
    metrics.requests.inc(endpoint="/v1/completions", status=200)
    samples, types = parse(metrics.render(queue_depth=3, in_flight=1))
    assert types["d3d_step_tokens"] == "histogram" and types["d3d_requests_total"] == "counter"
    assert value(samples, "d3d_step_tokens_bucket", method="speculative", source="lookup", le=2) == 0
    assert value(samples, "d3d_step_tokens_bucket", method="speculative", source="lookup", le=3) == 1
    assert value(samples, "d3d_step_tokens_sum", method="speculative", source="drafter") == 1
    for position, reached, accepted in ((1, 1, 1), (2, 1, 1), (3, 1, 0)):
        assert value(samples, "d3d_draft_reached_total", method="speculative", source="lookup",
                     position=position) == reached
        assert value(samples, "d3d_draft_accepted_total", method="speculative", source="lookup",
                     position=position) == accepted
    assert value(samples, "d3d_draft_reached_total", method="speculative", source="drafter", position=1) == 1
    assert value(samples, "d3d_draft_reached_total", method="speculative", source="drafter", position=2) == 0
    assert value(samples, "d3d_generated_tokens_total", method="speculative") == 6
    assert value(samples, "d3d_generation_tau_sum", method="speculative") == stats.tau == 2.0
    assert value(samples, "d3d_generation_tokens_per_second_count", method="speculative") == 1
    assert value(samples, "d3d_queue_depth") == 3 and value(samples, "d3d_generations_in_flight") == 1
    assert value(samples, "d3d_requests_total", endpoint="/v1/completions", status=200) == 1


def test_label_values_and_help_are_escaped():
    counter = Counter("odd_total", 'help with a \\ backslash\nand a newline', ("path",))
    counter.inc(2.5, path='a "quoted" \\ path\nwith a newline')
    histogram = Histogram("latency_seconds", "h", (0.1, 1))
    histogram.observe(5)
    samples, _ = parse(render([counter, histogram]))
    assert value(samples, "odd_total", path='a "quoted" \\ path\nwith a newline') == 2.5
    assert value(samples, "latency_seconds_bucket", le="+Inf") == 1
    assert value(samples, "latency_seconds_bucket", le=1) == 0


def test_metrics_refuse_misuse():
    counter = Counter("c_total", "c", ("a",))
    with pytest.raises(ValueError, match="labels"):
        counter.inc(b=1)
    with pytest.raises(ValueError, match="only goes up"):
        counter.inc(-1, a=1)


def test_the_parser_is_strict():
    """The parser used above refuses what Prometheus refuses (so its passing means something)."""
    for bad in ("x 1\n",  # no TYPE
                "# TYPE x counter\nx{a=\"1\"} 1\nx{a=\"1\"} 2\n",  # duplicate series
                "# TYPE x counter\nx{a=1} 1\n",  # unquoted label value
                "# TYPE x counter\nx 1",  # no final newline
                "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
                "# TYPE x counter\n# TYPE y counter\nx 1\ny 1\nx{a=\"b\"} 1\n"):  # not contiguous
        with pytest.raises(AssertionError):
            parse(bad)


# -- the server -----------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
d3d_server = pytest.importorskip("d3d.server")

from test_server import running  # noqa: E402  (after the extras' skips)
from test_generation import tiny_pipeline  # noqa: E402


def test_served_metrics_move_by_what_a_request_did():
    """/metrics before and after one completion: one request counted under its endpoint and status,
    the generated tokens, one step-token observation per verification step summing to the tokens
    after the first, the accepted drafts; a refused request and an unknown path count too."""
    app = d3d_server.create_app(tiny_pipeline(eos_token_ids=[]), "tiny", "lookup")
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        before, _ = parse(http.get("/metrics").text)
        body = {"prompt": "hello hello hello hello", "temperature": 0, "max_tokens": 30}
        answer = http.post("/v1/completions", json=body).json()
        assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400
        assert http.get("/no/such/path").status_code == 404
        response = http.get("/metrics")
        after, _ = parse(response.text)
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")

    def moved(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    stats = answer["d3d"]
    assert stats["accepted"] > 0  # lookup drafts were accepted: the counters below are not all zero
    assert moved("d3d_requests_total", endpoint="/v1/completions", status=200) == 1
    assert moved("d3d_requests_total", endpoint="/v1/completions", status=400) == 1
    assert moved("d3d_requests_total", endpoint="other", status=404) == 1
    assert moved("d3d_requests_total", endpoint="/metrics", status=200) == 1  # the first scrape
    assert moved("d3d_generated_tokens_total", method="lookup") == answer["usage"]["completion_tokens"] == 30
    assert moved("d3d_step_tokens_count", method="lookup") == stats["steps"]
    assert moved("d3d_step_tokens_sum", method="lookup") == 30 - 1  # every token but the prefill's
    assert moved("d3d_draft_accepted_total", method="lookup") == stats["accepted"]
    assert moved("d3d_draft_accepted_total", method="lookup", source="lookup", position=1) > 0
    assert moved("d3d_generation_tau_count", method="lookup") == 1
    assert moved("d3d_generation_tau_sum", method="lookup") == pytest.approx(stats["tau"], abs=1e-3)
    assert moved("d3d_queue_seconds_count") == 2  # the empty prompt too: the engine refuses it
    assert moved("d3d_time_to_first_token_seconds_count") == 1
    assert value(after, "d3d_queue_depth") == 0 and value(after, "d3d_generations_in_flight") == 0
