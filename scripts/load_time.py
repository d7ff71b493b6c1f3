"""How long a CLI run waits before its first token: fresh processes, each importing d3d, loading the
embedded target and the shipped drafter (`Pipeline.load`) and generating a few tokens — alternated
between source trees, since a shared machine's speed drifts between minutes.

A tree is a checkout, e.g. the commit before a change:
    git worktree add /tmp/before HEAD~1
Usage: python scripts/load_time.py [--trees before=/tmp/before,this] [--rounds 5] [--tokens 8]
Prints one line per process, then one JSON line: per tree, the median seconds of the import, the load,
the generation and the whole process (its wall clock, the interpreter's start included).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from d3d.exactness import cpu_name

CHILD = """
import json, sys, time
started = time.perf_counter()
from d3d.generation import Pipeline
imported = time.perf_counter()
pipeline = Pipeline.load()
loaded = time.perf_counter()
text = "".join(chunk.text for chunk in pipeline.generate("Say hi.", max_new_tokens={tokens}))
done = time.perf_counter()
print(json.dumps({{"import": imported - started, "load": loaded - imported, "generate": done - loaded}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", default="this", help="LABEL=PATH or 'this', comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = [("this", here) if item == "this" else (item.split("=", 1)[0], Path(item.split("=", 1)[1]).resolve())
             for item in args.trees.split(",")]
    times: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for round_ in range(args.rounds):
        for label, tree in trees:
            environment = {**os.environ, "PYTHONPATH": str(tree)}
            started = time.perf_counter()
            run = subprocess.run([sys.executable, "-c", CHILD.format(tokens=args.tokens)], cwd=tree, env=environment,
                                 capture_output=True, text=True)
            wall = time.perf_counter() - started
            if run.returncode != 0:
                sys.exit(f"{label}: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode}")
            record = {**json.loads(run.stdout.strip().splitlines()[-1]), "process": wall}
            times[label].append(record)
            print(f"round {round_ + 1} {label}: " + " ".join(f"{key} {value:.2f} s" for key, value in record.items()),
                  file=sys.stderr)
    print(json.dumps({"cpu": cpu_name(), "rounds": args.rounds,
                      "median_seconds": {label: {key: round(median(r[key] for r in records), 2) for key in records[0]}
                                         for label, records in times.items()}}))


if __name__ == "__main__":
    main()
