"""A benchmark result → Markdown tables and PNG plots (speedup bars, acceptance histograms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def markdown(result: dict[str, Any], command: str) -> str:
    config, table = result["config"], result["table"]
    names = list(result["descriptions"])
    lines = [
        f"Command: `{command}`",
        "",
        f"Target: {result['target']} ({result['dtype']}); drafter: {result['drafter']}; "
        f"T = {config['temperature']}; {config['num_prompts'] or 'all'} prompts per dataset; "
        f"{config['max_new_tokens']} new tokens at most.",
        f"Machine: {result['machine']['cpu']}, {result['machine']['threads']} threads, torch "
        f"{result['machine']['torch']}; peak RSS {result['peak_rss_mb']} MB.",
        "",
        "τ = tokens committed per verification step, **bonus token included**. Speedup = tokens/s ÷ "
        "d3d AR tokens/s over the same prompts in the same run (methods interleaved per prompt, "
        "after warm-up). *TTFT* = mean time to the first new token (the prompt's prefill), over "
        "prompts of *prompt tok* tokens on average; *decode tok/s* leaves it out. *Loop-free* drops "
        "prompts whose AR output ends in a repetition loop.",
        "",
    ]
    if config["temperature"] == 0:
        verdict = "every d3d method's output is token-identical to AR" if result["identical"] else \
            "**MISMATCHES**: " + "; ".join(result["mismatches"][:10])
        lines += [f"Identity check (T = 0): {verdict}.", ""]
    lines += ["| dataset | prompt tok | loops | method | tok/s | TTFT s | decode tok/s | speedup | τ | speedup (loop-free) "
              "| τ (loop-free) | identical to AR |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for group, row in table.items():
        for name in names:
            a, f = row[name]["all"], row[name]["loop_free"]
            tau = "–" if a["tau"] is None else f"{a['tau']:.2f}"
            tau_free = "–" if f["tau"] is None else f"{f['tau']:.2f}"
            same = f"{a['identical']}/{a['prompts']}" if config["temperature"] == 0 else "n/a (T > 0)"
            decode = "–" if a.get("decode_tokens_per_second") is None else f"{a['decode_tokens_per_second']:.1f}"
            ttft = "–" if a.get("ttft_seconds") is None else f"{a['ttft_seconds']:.2f}"
            lines.append(f"| {group} | {a.get('prompt_tokens', 0)} | {row['loop_share']:.0%} | {name} | "
                         f"{a['tokens_per_second']:.1f} | {ttft} | {decode} | "
                         f"{a['speedup']:.2f}× | {tau} | {_x(f['speedup'])} | {tau_free} | {same} |")
    lines += step_table(table["all"], names)
    drafts = [f"`{n}` {table['all'][n]['all']['draft_acceptance']:.0%}" for n in names
              if table["all"][n]["all"].get("draft_acceptance") is not None]
    if drafts:
        lines += ["", "Drafts accepted (baselines without step stats, all datasets): " + ", ".join(drafts) + "."]
    if result.get("load_seconds"):
        loads = ", ".join(f"`{n}` {s:.1f} s" for n, s in result["load_seconds"].items())
        lines += ["", f"Started before any measurement (server start and model load, not timed): {loads}."]
    lines += ["", "Methods:", ""] + [f"- `{n}`: {result['descriptions'][n]}" for n in names]
    return "\n".join(lines) + "\n"


def step_table(row: dict[str, Any], names: list[str]) -> list[str]:
    """All datasets together: what one verification step costs, split by where the time goes."""
    lines = ["", "Time per verification step (all datasets, ms; *draft* = drafting the loop waited for; "
             "async: *packed* = the drafter worker's packed pass, *wait* = time verification waited "
             "for it, *hit* = share of steps whose next block was drafted ahead):", "",
             "| method | step | verify | draft | packed | wait | hit (k drafted ahead) | tokens/step (τ) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in names:
        a = row[name]["all"]
        t = a.get("per_step")
        if not t or a["tau"] is None:
            continue
        cells = [f"{t[k]:.1f}" if t.get(k) is not None else "–" for k in ("step", "verify", "draft", "packed", "wait")]
        hit = "–" if t.get("hit_rate") is None else f"{t['hit_rate']:.0%}"
        if t.get("planned_rate") is not None:
            hit += f" ({t['planned_rate']:.0%})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {hit} | {a['tau']:.2f} |")
    return lines


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def plots(result: dict[str, Any], out_dir: str | Path, stem: str) -> list[str]:
    """speedup bars per dataset and method, and acceptance histograms; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    table = result["table"]
    names = list(result["descriptions"])
    groups = list(table)
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.4))
    width = 0.8 / len(names)
    colours = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors  # one colour per method
    for i, name in enumerate(names):
        values = [table[g][name]["all"]["speedup"] or 0 for g in groups]
        axis.bar([x + i * width for x in range(len(groups))], values, width, label=name, color=colours[i % len(colours)])
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(groups))], groups)
    axis.set_ylabel("speedup over d3d AR (same run)")
    axis.set_title(f"T = {result['config']['temperature']}, {result['dtype']}")
    axis.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    figure.tight_layout()
    speed_png = out / f"{stem}-speedup.png"
    figure.savefig(speed_png, dpi=110)
    plt.close(figure)

    speculative = [n for n in names if table["all"][n]["all"]["accepted_histogram"]]
    files = [str(speed_png)]
    if speculative:
        figure, axes = plt.subplots(1, len(speculative), figsize=(4 * len(speculative), 3.2), squeeze=False)
        for axis, name in zip(axes[0], speculative):
            histogram = table["all"][name]["all"]["accepted_histogram"]
            total = max(sum(histogram), 1)
            axis.bar(range(1, len(histogram) + 1), [h / total for h in histogram])
            axis.set_title(f"{name}: τ = {table['all'][name]['all']['tau']}")
            axis.set_xlabel("tokens committed per step (bonus incl.)")
        axes[0][0].set_ylabel("share of steps")
        figure.tight_layout()
        hist_png = out / f"{stem}-acceptance.png"
        figure.savefig(hist_png, dpi=110)
        plt.close(figure)
        files.append(str(hist_png))
    return files
