#!/usr/bin/env bash
# The main job on the embedded default: local MLflow server, `dvc repro` of the whole loop under one
# MLflow parent run, outputs pushed to the local DVC remote, then a summary of where things are.
# Called by `make run` (which has set up the environments and PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

export PIPELINE_RUN_ID="${PIPELINE_RUN_ID:-run-$(date -u +%Y%m%dT%H%M%SZ)}"
# what this command spends outside the stages, beside what each stage records (benchmarks/bench_cycle.py reads both)
mkdir -p ".runs/${PIPELINE_RUN_ID}"
timed() {  # timed <name> <command...>: run it, append its wall time to the run's timings, keep its exit status
  local t0=${EPOCHREALTIME/,/.} rc=0  # a decimal comma (the locale's) would cut the fraction in awk
  "${@:2}" || rc=$?
  awk -v name="$1" -v t0="$t0" -v t1="${EPOCHREALTIME/,/.}" -v pid=$$ \
    'BEGIN {printf "{\"stage\": null, \"phase\": \"%s\", \"seconds\": %.3f, \"plane\": \"command\", \"pid\": %d}\n", name, t1 - t0, pid}' \
    >> ".runs/${PIPELINE_RUN_ID}/timings.jsonl"
  return $rc
}
timed "services up mlflow" python -m pipeline services up mlflow
read -r _ PARENT EXPERIMENT < <(python -m pipeline run open | tail -n 1)

status=FINISHED
if ! timed "dvc repro" dvc repro; then status=FAILED; fi
# serving plane on the materialised model: vLLM worker(s), the role-routing proxy, routing verified
if [ "$status" = FINISHED ] && ! timed "services up serving" python -m pipeline services up serving; then status=FAILED; fi
python -m pipeline run close --status "$status" > /dev/null
[ "$status" = FINISHED ] && timed "dvc push" dvc push -q

python -m pipeline report --summary || true  # the gate's decisions, the champions, the test split's figures
echo "stage wall times (MLflow stage runs of this pipeline run; stages DVC skipped are not listed):"
python -m pipeline run times || true
URI="${MLFLOW_TRACKING_URI:-$(python -c 'from pipeline.config import load_params; from pipeline.services.mlflow_server import tracking_uri; print(tracking_uri(load_params().mlflow))')}"
cat <<EOT

pipeline run ${PIPELINE_RUN_ID}: ${status}
  data            data/tasks/ (ingested splits), data/validated/ (validated splits + quarantine.parquet)
  reports         reports/ingest.json, reports/validation.json, reports/validation/ (GX results, Data Docs: reports/validation/data_docs/index.html)
  mlflow UI       ${URI}/#/experiments/${EXPERIMENT}/runs/${PARENT}  (local login: pipeline-reader, password in ~/.config/pubmedqa-society/mlflow/mlflow_reader_password)
  mlflow CLI      MLFLOW_TRACKING_URI=${URI} MLFLOW_TRACKING_USERNAME=pipeline-reader MLFLOW_TRACKING_PASSWORD="\$(cat ~/.config/pubmedqa-society/mlflow/mlflow_reader_password)" .venv/control/bin/mlflow runs list --experiment-id ${EXPERIMENT}
  tools index     data/index/ (BM25 + MeSH gene/protein headings)
  rollout traces  data/rollouts/shard-*.jsonl ; metrics reports/rollouts.json (dvc metrics show)
  datasets        data/datasets/{sft,rl,bandit} ; reports/datasets.json, reward histogram reports/plots/rewards.png (dvc plots show)
  each role's training (one DVC stage each; dvc metrics show, dvc plots show):
$(python -m pipeline run outputs)
  evaluation      data/evaluation/summary.json ; reports/evaluate.json, reports/plots/evaluate.png ; notebooks/compare_checkpoints.ipynb
  test split      reports/test.json ; PubMedQA-format predictions reports/test/predictions.json
  models          models/base (SmolLM2-135M-Instruct HF folder), models/test-tiny; reports/models.json
  dvc             dvc.lock; remote 'local' -> dvc-remote/ ; \`dvc status\`, \`dvc metrics show\`
  airflow UI      make airflow (the same loop as the agent_retraining DAG)
  services        stop with: make services-down
EOT
[ "$status" = FINISHED ]
