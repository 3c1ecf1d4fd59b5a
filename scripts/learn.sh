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
python - <<'PY'
import json
r = json.load(open("reports/promotion.json"))
for key, d in r["decisions"].items():
    print(f"promotion: {key} v{d['candidate']}: {d['status']} ({d['rule']}): {d['detail']}")
t = json.load(open("reports/test.json"))
s = t["society"]
for which in ("before", "after"):
    if which in s:
        m = s[which]
        print(f"test ({t['setting']}): the society as served {which}: yes/no accuracy {m['yes_no']['accuracy']:.3f} "
              f"[{m['yes_no']['ci_low']:.3f}, {m['yes_no']['ci_high']:.3f}] (n={m['yes_no']['n']}); failed "
              f"{m['failures']['n']}/{m['questions']}; official accuracy {m['official']['accuracy']:.3f} macro-F1 "
              f"{m['official']['macro_f1']:.3f}")
if s.get("after_vs_before"):
    c = s["after_vs_before"]["correct"]
    print(f"test: the society after vs before, exact McNemar on {c['n']} yes/no questions: b={c['b']} c={c['c']} "
          f"p={c['p_value']:.3g}")
if s.get("agreement_with_role_level"):
    a = s["agreement_with_role_level"]
    print(f"test: the society's decision is the role-level decision on {a['same']}/{a['n']} questions")
if s.get("input_effect"):
    e = s["input_effect"]
    print(f"test: the decision on the brief vs with the protocol and reviews (n={e['yes_no_n']} yes/no): "
          f"{e['brief_accuracy']:.3f} vs {e['society_accuracy']:.3f}, agree {e['agree']}/{e['n']}")
print(f"test: the society cost {s['cost']['seconds']:.0f} s for {s['questions']} questions x {s['cost']['societies']}")
for role, x in t["role_level"].items():
    for which in ("before", "after"):
        if which in x:
            m = x[which]
            print(f"test ({t['setting']}): {role} {which}: official accuracy {m['official']['accuracy']:.3f} macro-F1 "
                  f"{m['official']['macro_f1']:.3f} (n={m['questions']}); yes/no accuracy {m['yes_no']['accuracy']:.3f} "
                  f"[{m['yes_no']['ci_low']:.3f}, {m['yes_no']['ci_high']:.3f}] (n={m['yes_no']['n']}, majority "
                  f"{m['yes_no']['majority']:.3f}); AUC {m['auc']['value']:.3f} [{m['auc']['ci_low']:.3f}, {m['auc']['ci_high']:.3f}]")
    if "mcnemar" in x:
        print(f"test: {role} after vs before, exact McNemar on {x['mcnemar']['n']} yes/no questions: "
              f"b={x['mcnemar']['b']} c={x['mcnemar']['c']} p={x['mcnemar']['p_value']:.2e}")
PY
step "done"
printf 'total\t%s\n' "$(( $(date +%s) - start ))" >> "$TIMES"
echo "learn: wall time $(( $(date +%s) - start )) s (MLflow parent run ${PARENT}, experiment ${EXPERIMENT}); step times in ${TIMES}"
