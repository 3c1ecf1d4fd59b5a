#!/usr/bin/env bash
# What ran on the lent GPU host (docs/gpu.md, "What ran on a GPU"): the PI's trainer under the GPU image's trl 1.15.0
# (bench_gpu_pi.py), then, only if that release could not train, the same sweep under the CPU plane's trl 1.16.0.
# The host has torch 2.11.0, transformers 5.17.0 and accelerate 1.15.0 and no network: the rest travels as wheels
# (.whl: trl 1.15.0, datasets 4.8.5, peft 0.21.2, pydantic, gguf, ... as requirements/gpu.lock.txt pins them; .whl16:
# trl 1.16.0), the GGUF in two parts (a device call carries at most 64 MiB), data/validated from `make learn`'s stages.
# Usage there: bash benchmarks/bench_gpu_pi.sh GGUF_PART_A GGUF_PART_B OUT [BUDGET_S [BUDGET16_S]]   (everything it says: OUT/run.log)
set -uo pipefail
a=$1 b=$2 out=$3 budget=${4:-330} budget16=${5:-150}
exec > >(tee "$out/run.log") 2>&1
mkdir -p /tmp/gpu-pi && cat "$a" "$b" > /tmp/gpu-pi/model.gguf || exit 1
sha256sum /tmp/gpu-pi/model.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 benchmarks/bench_gpu_pi.py run --gguf /tmp/gpu-pi/model.gguf --to "$out/t15" --budget-s "$budget"
if ! python3 -c "import json,sys; sys.exit('val' not in json.load(open('$out/t15/results.json'))['configs'].get('learn', {}))"; then
  echo "trl 1.15.0 did not train the learn recipe: the same sweep under trl 1.16.0"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site16 .whl16/*.whl || exit 1
  PYTHONPATH=/tmp/site16:$PYTHONPATH python3 benchmarks/bench_gpu_pi.py run --gguf /tmp/gpu-pi/model.gguf \
    --to "$out/t16" --budget-s "$budget16"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
