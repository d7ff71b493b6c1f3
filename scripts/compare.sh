#!/usr/bin/env bash
# The paper's comparison (docs/comparison.md): D3D, the AR drafter and the DFlash-style drafter trained
# at the same budget on the same data, then one interleaved benchmark per temperature beside the shipped
# default. Needs `d3d data --out data/smollm2-wide --sources sharegpt,sharegpt-turn2,stdlib,math` (at
# least 640 sequences); every step resumes when rerun. Hours on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
common="--data data/smollm2-wide --steps 300 --batch-size 4 --lr 5e-4 --warmup 30 --eval-every 50 --save-every 50 --max-sequences 640"
d3d train $common --draft-vocab-size 8192 --out runs/abl-hard                         # D3D
d3d train $common --draft-vocab-size 8192 --drafter-kind dflash --out runs/abl-dflash  # DFlash-style
d3d train $common --drafter-kind ar --out runs/abl-ar-full   # whole vocabulary: transformers' assistant_model runs it too

# Seconds per optimizer step of each kind, alone: steps 2-11 of a 12-step run.
for kind in d3d ar dflash; do
  rm -rf "runs/stepcost-$kind"
  d3d train ${common/--steps 300/--steps 12} --draft-vocab-size 8192 --eval-every 0 --save-every 100 \
    --drafter-kind "$kind" --out "runs/stepcost-$kind" > /dev/null 2>&1
  python - "$kind" <<'PY'
import json, sys
rows = {r["step"]: r for r in map(json.loads, open(f"runs/stepcost-{sys.argv[1]}/log.jsonl"))}
print(sys.argv[1], "seconds per step:", round((rows[11]["seconds"] - rows[1]["seconds"]) / 10, 2))
PY
done

for t in 0 1; do
  d3d bench --datasets humaneval,mtbench,math500 --num-prompts 6 --max-new-tokens 128 --temperature "$t" \
    --methods ar,drafter,async,speculative,ar_drafter,hf_ar_drafter \
    --drafter runs/abl-hard/drafter --ar-drafter runs/abl-ar-full/drafter \
    --compare-drafter dflash=runs/abl-dflash/drafter --compare-drafter shipped=d3d/drafters/smollm2-135m-instruct \
    --out "runs/compare-t$t" --report "docs/bench-compare-t$t.md"
done
