#!/usr/bin/env bash
# `make learn`: one learning cycle of the PI in the reasoning-free setting (params/learn.yaml), timed end to end, as
# the pipeline's own DVC stages with the profile's values standing in for params.yaml (`run repro`: dvc.lock records
# them, and a stage runs only when its code, data or values changed): data + model -> train the PI on the gold decision
# -> an A/A copy of its champion -> role-level evaluation on every validation question -> the gate promotes on evidence
# and moves the routing -> the official test split: the PI's decision on all 500 questions and the society as served on
# report.limit of them, each before vs after. Run again with nothing changed, it reproduces nothing and says so.
# PARAMS=<file> picks another profile.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIPELINE_PARAMS="${PARAMS:-params/learn.yaml}"
export PIPELINE_RUN_ID="${PIPELINE_RUN_ID:-learn-$(date -u +%Y%m%dT%H%M%SZ)}"
start=$(date +%s)
TIMES=reports/learn-times.tsv   # step<TAB>seconds, read by benchmarks/bench_improvement.py
mkdir -p reports && : > "$TIMES"
last=$start
step() {
  now=$(date +%s)
  [ -n "${current:-}" ] && printf '%s\t%s\n' "$current" "$(( now - last ))" >> "$TIMES"
  current="$*"; last=$now
  echo "learn: [$(( now - start )) s] $*"
}

python -m pipeline services up mlflow
read -r _ PARENT EXPERIMENT < <(python -m pipeline run open --write-params | tail -n 1)
status=FAILED
trap 'python -m pipeline run close --status "$status" > /dev/null || true' EXIT
LOCK_BEFORE=$(sha256sum dvc.lock 2>/dev/null || true)
step "data, model and tools index"
python -m pipeline run repro --stages validate materialize_model build_index
step "serving plane up"
python -m pipeline services up serving
for stage in train_pi@principal_investigator evaluate promote report; do  # evaluate registers the A/A candidate (evaluate.aa)
  step "$stage"
  settle=("$stage")  # promote moves the live routing evaluate read: evaluate is recorded with it (the cycle's decision)
  [ "$stage" = promote ] && settle+=(evaluate)
  python -m pipeline run repro --single-item --stages "$stage" --settle "${settle[@]}"
done
status=FINISHED
echo "learn: dvc status of the cycle's stages with its values:"
python -m pipeline run status --stages validate materialize_model build_index train_pi@principal_investigator evaluate promote report
if [ "$(sha256sum dvc.lock 2>/dev/null || true)" = "$LOCK_BEFORE" ]; then
  echo "learn: nothing changed since the last cycle with these values: DVC reproduced nothing (the figures below are that cycle's)"
fi
python -m pipeline report --summary  # the gate's decisions, then the test split's figures, each with its n
step "done"
printf 'total\t%s\n' "$(( $(date +%s) - start ))" >> "$TIMES"
echo "learn: wall time $(( $(date +%s) - start )) s (MLflow parent run ${PARENT}, experiment ${EXPERIMENT}); step times in ${TIMES}"
