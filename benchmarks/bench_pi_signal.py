"""Does train_pi's signal check tell a PI that learned the decision from one trained on shuffled labels?

    PIPELINE_PARAMS=params/learn.yaml PYTHONPATH=. .venv/model/bin/python benchmarks/bench_pi_signal.py \
        [--arms gold shuffled-0 shuffled-1] [--max-steps N] [--json docs/benchmarks-pi-signal.json] \
        [--out docs/benchmarks-pi-signal.md]

Each arm runs train_pi's own training path (its rows, ``training_file``, ``train_sft.train`` with ``discrimination``,
``learned``) on the train split in the model plane, into a scratch folder: ``gold`` on the labels, ``shuffled-<seed>``
on the same questions with their labels permuted by that seed (the label counts unchanged). The loss on its own rows
(``pi.sft.min_fit_drop``) falls in both; the held-out ranking of yes above no questions (``pi.signal``) should only
beat its permuted labels in the first.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.config import Params, load_params
from pipeline.data.splits import load_tasks
from pipeline.io import write_json, write_text
from pipeline.stages import train_pi, train_sft

ROLE = "principal_investigator"


def arm(name: str, params: Params, tasks: list[dict[str, Any]], work: Path, max_steps: int | None) -> dict[str, Any]:
    pi = params.pi.at(ROLE)
    sft = pi.sft.model_copy(update={"out_dir": str(work / name / "model"), **({"max_steps": max_steps} if max_steps else {})})
    pi = pi.model_copy(update={"sft": sft, "data_dir": str(work / name / "data")})
    if name.startswith("shuffled-"):
        labels = [t["final_decision"] for t in tasks]
        random.Random(int(name.removeprefix("shuffled-"))).shuffle(labels)
        tasks = [{**t, "final_decision": label} for t, label in zip(tasks, labels, strict=True)]
    rows = train_pi.rows(tasks, params)
    write_text(train_pi.data_file(pi), "".join(json.dumps(r) + "\n" for r in rows))
    prefix, t0 = params.agents.decision.prefix, time.perf_counter()
    metrics = train_sft.train(pi.sft, train_pi.training_file(pi, prefix, params.serving.decoding),
                              lambda model, tok, held: train_pi.discrimination(model, tok, held, prefix))
    metrics = train_pi.learned(metrics, pi.signal)
    print(f"{name}: {train_pi.summary(metrics)}; no_signal={metrics['no_signal']} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    keep = ("steps", "train_rows", "eval_rows", "fit_loss_before", "fit_loss_after", "fit_drop", "eval_loss_before",
            "eval_loss", "held_out_before", "held_out", "held_out_gain_p", "no_signal", "no_signal_reason", "train_seconds")
    return {"arm": name, **{k: metrics[k] for k in keep}}


def markdown(results: list[dict[str, Any]], setting: str, min_fit_drop: float) -> list[str]:
    lines = ["# train_pi's signal check against shuffled labels (`benchmarks/bench_pi_signal.py`)", "",
             f"make learn's PI recipe (params/learn.yaml, {setting}) on the train split's labels and on the same questions "
             "with their labels permuted. The loss on its own rows is `pi.sft.min_fit_drop`'s check; training's gain "
             "in the held-out AUC of P(GO) between yes and no questions, with its label-permutation p, is `pi.signal`'s.", "",
             "| arm | steps | loss on its own rows | fit drop | the fit check alone | held-out AUC before → after | "
             "p of the gain | held-out yes / no | no_signal |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        b, a = r["held_out_before"], r["held_out"]
        lines.append(f"| {r['arm']} | {r['steps']} | {r['fit_loss_before']:.3f} → {r['fit_loss_after']:.3f} | "
                     f"{r['fit_drop']:+.1%} | {'registered' if r['fit_drop'] >= min_fit_drop else 'no_signal'} | "
                     f"{b['auc']:.3f} → {a['auc']:.3f} | {r['held_out_gain_p']:.4f} | "
                     f"{a['yes']} / {a['no']} | {r['no_signal']} |")
    lines += ["", f"The fit check alone is `pi.sft.min_fit_drop` ({min_fit_drop:.0%}), what registered a PI before "
              "`pi.signal`. The reasons recorded for each no_signal:", "",
              *[f"- {r['arm']}: {r['no_signal_reason']}" for r in results if r["no_signal"]], ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["gold", "shuffled-0", "shuffled-1"],
                        help="gold, or shuffled-<seed>: the train labels permuted by that seed")
    parser.add_argument("--max-steps", type=int, help="fewer steps than pi.sft.max_steps (a smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--from-json", type=Path, help="write the markdown of an earlier run's --json, training nothing")
    args = parser.parse_args()
    params = load_params()
    if args.from_json:
        results = json.loads(args.from_json.read_text())["results"]
    else:
        tasks = load_tasks(params.validate_, "train", setting=params.data.setting)
        with tempfile.TemporaryDirectory(prefix="pi-signal-") as work:
            results = [arm(name, params, tasks, Path(work), args.max_steps) for name in args.arms]
    if args.json:
        write_json(args.json, {"setting": params.data.setting, "min_fit_drop": params.pi.sft.min_fit_drop, "results": results})
    lines = markdown(results, params.data.setting, params.pi.sft.min_fit_drop)
    print("\n".join(lines))
    if args.out:
        write_text(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
