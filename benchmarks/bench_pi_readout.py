"""How far a PI adapter's decision goes on PubMedQA, and what a per-decision bias would add (issue #57's literature bar).

    PIPELINE_PARAMS=params/learn.yaml PYTHONPATH=. .venv/control/bin/python benchmarks/bench_pi_readout.py \
        --adapter r8=models/sft/principal_investigator/adapter [--adapter NAME=PATH ...] \
        [--served r8=http://127.0.0.1:8100/NAME] [--out docs/benchmarks-pi-readout.md]

Each adapter's decision is read in the model plane as the society reads it (``pipeline.agents.decision``: the PI's
messages on the evidence brief, the answer continued from ``agents.decision.prefix``, the decision from the 20 most
probable first tokens, :func:`decision.read`), with transformers in float32 (a child under the model-plane
interpreter), on the validation and the official test split: a sweep of trained adapters costs minutes instead of a
``make learn`` each. ``--served`` asks a vLLM worker serving that adapter by the society's own call
(``decision.ask``) and reports how often the two readouts agree (the cheaper readout is only evidence while they
do). A per-decision log-bias fitted on the validation split (grid, for accuracy or for macro-F1) is applied to the
test split: what calibration that travels with a version could add.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import envs
from pipeline.agents.decision import TOP_LOGPROBS, ask, decision_messages, read
from pipeline.agents.prompts import REPOSITORY
from pipeline.config import DecisionInput, Params, load_params
from pipeline.data.splits import load_tasks
from pipeline.evaluation.metrics import answer
from pipeline.schemas import Decision

ROLE = "principal_investigator"  # the role whose decision is read (its adapters, its call)
SPLITS = "val,test"  # the bias is fitted on val and applied to test when both are read
GRID = np.round(np.arange(-3.0, 3.01, 0.1), 1)  # log-bias of NO-GO and DEFER against GO


def offline(adapter: str, splits: str) -> list[dict[str, Any]]:
    """Each task's decision probabilities read from base + ``adapter``, in a model-plane child (torch, transformers)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        subprocess.run([envs.model_python(), __file__, "--read", adapter, "--to", str(out), "--splits", splits], check=True,
                       env={**os.environ, "PYTHONPATH": envs.pythonpath()})
        return list(json.loads(out.read_text()))


def read_adapter(params: Params, adapter: str, tasks: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Model plane: each task's decision probabilities read from base + ``adapter`` in transformers (float32, on
    CUDA when there is a device)."""
    import torch  # noqa: PLC0415 - model plane only
    from peft import PeftModel  # noqa: PLC0415 - model plane only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - model plane only

    base = params.pi.at(ROLE).sft.base_model
    tok = AutoTokenizer.from_pretrained(base)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the same float32 read, on a GPU where there is one
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).to(device).eval()
    out = []
    for split, items in tasks.items():
        for t in items:
            text = tok.apply_chat_template(messages(params, t), tokenize=False, add_generation_prompt=True)
            ids = tok(text + params.agents.decision.prefix, return_tensors="pt").to(device)
            with torch.no_grad():
                top = torch.topk(torch.log_softmax(model(**ids).logits[0, -1], -1), TOP_LOGPROBS)
            alts = zip(top.values.tolist(), top.indices.tolist(), strict=True)
            _, _, probs = read([{"token": tok.decode([i]), "logprob": v} for v, i in alts])
            out.append({"split": split, "id": t["id"], "label": t["final_decision"], "probs": probs})
        print(f"{adapter}: {split} {len(items)} read", flush=True)
    return out


def served(params: Params, url: str, model: str, tasks: dict[str, list[dict[str, Any]]], key: str | None) -> list[dict[str, Any]]:
    """The same decision asked of a vLLM worker by the society's own call (``decision.ask`` through a ``RoleClient``:
    its timeout and bounded retries); a refused call stops the benchmark, naming the question."""
    from pipeline.agents.llm import RoleClient  # noqa: PLC0415

    async def run() -> list[dict[str, Any]]:
        sem = asyncio.Semaphore(8)
        client = RoleClient.for_agents(params.agents, f"{url}/v1", key or "", timeout_s=300)

        async def one(split: str, t: dict[str, Any]) -> dict[str, Any]:
            async with sem:
                got = await ask(client, ROLE, model, params.agents.decision, messages(params, t), None, [])
            if got.error:
                raise SystemExit(f"error: {url} ({model}), {split} question {t['id']}: {got.error}")
            return {"split": split, "id": t["id"], "label": t["final_decision"], "probs": got.probs}
        try:
            return list(await asyncio.gather(*(one(s, t) for s, items in tasks.items() for t in items)))
        finally:
            await client.aclose()
    return asyncio.run(run())


def messages(params: Params, task: dict[str, Any]) -> list[dict[str, str]]:
    return decision_messages(task, params.agents, params.data.setting, REPOSITORY, what=DecisionInput.BRIEF)


def decide(probs: dict[str, float], bias: tuple[float, float] = (0.0, 0.0)) -> str:
    """The PubMedQA answer of the most probable decision after adding ``bias`` (NO-GO, DEFER) to the log-probabilities
    (no decision: ``maybe``, as PubMedQA's format writes it)."""
    if not probs:
        return answer(None)
    shift = {Decision.GO.value: 0.0, Decision.NO_GO.value: bias[0], Decision.DEFER.value: bias[1]}
    return answer(max(shift, key=lambda d: math.log(max(probs.get(d, 0.0), 1e-12)) + shift[d]))


def figures(rows: list[dict[str, Any]], bias: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    from sklearn.metrics import f1_score  # noqa: PLC0415 - control plane (PubMedQA's evaluation.py uses it)

    from pipeline.evaluation.metrics import macro_f1  # noqa: PLC0415 - control plane (sklearn)
    from pipeline.evaluation.role_level import auc, clopper_pearson  # noqa: PLC0415 - control plane (scipy)

    truth, preds = [r["label"] for r in rows], [decide(r["probs"], bias) for r in rows]
    yn = [(t, p) for t, p in zip(truth, preds, strict=True) if t in ("yes", "no")]
    right = sum(t == p for t, p in yn)
    per_class = dict(zip(("yes", "no", "maybe"), f1_score(truth, preds, labels=["yes", "no", "maybe"], average=None,
                                                          zero_division=0).tolist(), strict=True))
    # ranking apart from calibration: P(GO) against NO-GO, as decision.read gives it (a bias moves the decisions, not this)
    go = [{"label": r["label"], "p_go": r["probs"]["GO"] / (r["probs"]["GO"] + r["probs"]["NO-GO"])}
          for r in rows if r["probs"] and r["probs"]["GO"] + r["probs"]["NO-GO"] > 0]
    return {"n": len(rows), "auc": auc(go), "accuracy": float(np.mean([t == p for t, p in zip(truth, preds, strict=True)])),
            "macro_f1": macro_f1(truth, preds),
            "yes_no": {"n": len(yn), "accuracy": right / max(len(yn), 1), "ci": clopper_pearson(right, len(yn))},
            "f1_binary": per_class, "answered": {c: preds.count(c) for c in ("yes", "no", "maybe")}, "bias": bias,
            "right": [t == p for t, p in zip(truth, preds, strict=True)]}


def fitted(rows: list[dict[str, Any]], objective: str) -> tuple[float, float]:
    """The grid's log-bias that maximises ``objective`` (accuracy or macro_f1) on ``rows`` (ties: the smallest shift)."""
    best = max(itertools.product(GRID, GRID), key=lambda b: (figures(rows, b)[objective], -abs(b[0]) - abs(b[1])))
    return float(best[0]), float(best[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", action="append", default=[], help="NAME=PATH of a PI LoRA adapter folder")
    ap.add_argument("--served", action="append", default=[], help="NAME=URL/MODEL: the adapter NAME as a vLLM worker serves it")
    ap.add_argument("--out", default="docs/benchmarks-pi-readout.md")
    ap.add_argument("--splits", default=SPLITS, help="comma-separated splits to read (default: val,test)")
    ap.add_argument("--read", help=argparse.SUPPRESS)  # the model-plane child: this adapter's rows to --to
    ap.add_argument("--to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    params = load_params()
    splits = args.splits.split(",")
    tasks = {s: load_tasks(params.validate_, s, setting=params.data.setting) for s in splits}
    if args.read:
        Path(args.to).write_text(json.dumps(read_adapter(params, args.read, tasks)))
        return
    if not args.adapter:
        ap.error("name at least one --adapter NAME=PATH")
    from report import publish  # noqa: PLC0415 - control plane

    from pipeline.evaluation.significance import mcnemar_exact  # noqa: PLC0415 - control plane

    adapters = dict(a.split("=", 1) for a in args.adapter)
    rows = {name: offline(path, args.splits) for name, path in adapters.items()}
    lines = [f"# The PI's decision, read in the model plane ({params.data.setting})", "",
             f"`benchmarks/bench_pi_readout.py`, base model `{params.pi.at(ROLE).sft.base_model}`, "
             "LoRA adapters as named; every figure on the whole split (n beside it); yes/no accuracy with its exact 95% "
             "interval.", "",
             "| adapter | split | bias (NO-GO, DEFER) | n | official acc. | macro-F1 | F1 yes / no / maybe "
             "| yes/no acc. [95% CP] | AUC of P(GO) | answered yes / no / maybe |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    doc: dict[str, Any] = {"setting": params.data.setting, "adapters": adapters, "results": {}}
    for name, rs in rows.items():
        by = {s: [r for r in rs if r["split"] == s] for s in splits}
        cells = [(s, "none", (0.0, 0.0)) for s in splits]
        if {"val", "test"} <= set(splits):
            cells += [("test", f"fit on val for {obj}", fitted(by["val"], obj)) for obj in ("accuracy", "macro_f1")]
        for split, how, bias in cells:
            f = figures(by[split], bias)
            doc["results"][f"{name}/{split}/{how}"] = {k: v for k, v in f.items() if k != "right"}
            cp, c = f["yes_no"]["ci"], f["answered"]
            lines.append(f"| {name} | {split} | {how} {bias} | {f['n']} | {f['accuracy']:.3f} | {f['macro_f1']:.3f} | "
                         + " / ".join(f"{f['f1_binary'][k]:.3f}" for k in ("yes", "no", "maybe"))
                         + f" | {f['yes_no']['accuracy']:.3f} [{cp[0]:.3f}, {cp[1]:.3f}] (n={f['yes_no']['n']}) | "
                         + (f"{f['auc']:.3f}" if f["auc"] is not None else "-") + f" | {c['yes']} / {c['no']} / {c['maybe']} |")
    names = list(rows)
    if len(names) > 1 and "test" in splits:
        lines += ["", "| test, no bias | exact McNemar (all 500, right vs wrong) b / c | p (two-sided) |", "|---|---|---|"]
        for a, b in itertools.combinations(names, 2):
            m = mcnemar_exact(*(figures([r for r in rows[x] if r["split"] == "test"])["right"] for x in (a, b)))
            doc["results"][f"mcnemar/{a}/{b}"] = m.model_dump(exclude_unset=True)
            lines.append(f"| {a} vs {b} | {m.b} / {m.c} | {m.p_value:.3g} |")
    for spec in args.served:
        name, target = spec.split("=", 1)
        url, model = target.rsplit("/", 1)
        from pipeline.serving.worker import api_key  # noqa: PLC0415

        got = served(params, url, model, tasks, api_key(params.serving.workers[0]))
        live = {(r["split"], r["id"]): r["probs"] for r in got}
        same = sum(decide(r["probs"]) == decide(live[(r["split"], r["id"])]) for r in rows[name])
        gap = max(abs(r["probs"].get(d.value, 0.0) - live[(r["split"], r["id"])].get(d.value, 0.0))
                  for r in rows[name] for d in Decision)
        doc["results"][f"served/{name}"] = {"agree": same, "n": len(live), "max_probability_gap": gap}
        lines += ["", f"Served readout of `{name}` through `{url}` ({model}): the same decision on "
                      f"**{same} of {len(live)}** questions; each decision's probability within {gap:.1e}."]
    publish(args.out, [*lines, ""], doc)


if __name__ == "__main__":
    main()
