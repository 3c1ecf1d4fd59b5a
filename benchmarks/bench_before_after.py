"""One role trained on the gold signal, before and after: does GRPO on CPU change what the PI decides?

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_before_after.py [--train-tasks 64] [--steps 24] \
        [--group-size 8] [--learning-rate 1e-3] [--balanced] [--out docs/benchmarks-before-after.md]

The defaults are the documented run's (which ran once more with ``--balanced``). benchmarks/bench_learning.py runs the
same measurement as its part (c), with these options as ``--pi-...``.

Item 6(c) of docs/benchmarks-learning.md, measured. The role is the principal investigator, whose GO/NO-GO is
the one output of the society a PubMedQA label checks. Its prompt is the society's own
(``pipeline.agents.graph.pi_prompt``: the question, its abstract, the protocol, the reviews), with no protocol
and no reviews: a protocol per question would cost a whole society run each (about 3 min on 2 cores), and the
evidence for yes/no is in the abstract. So this measures the PI's decision skill on the evidence, not the
society's accuracy.

1. **Before.** The served base model answers the PI prompt of every yes/no validation question, decoded under
   the ``PIDecision`` schema (as the society decodes it) at temperature 0, straight to worker 0.
2. **Train.** The ``train_ppo`` stage's CPU trainer (TRL GRPO + LoRA, completions under the same schema;
   ``pipeline.rl.grpo_cpu``) on the PI prompts of ``--train-tasks`` training questions, with the gold-only
   reward: ``ppo.reward`` validity 0.2 + alignment 0.5 x decision credit, judge weight 0 (the judge is noise at
   135M: docs/benchmarks-learning.md (a)). Its signal figures (valid fraction, reward spread, groups with zero
   advantage) are reported with the result; a run with no signal says so and compares nothing.
3. **After.** The trained adapter is hot-loaded into the same worker and answers the same prompts the same way.
4. **The test.** Accuracy before and after with exact (Clopper-Pearson) 95% intervals, the exact McNemar test on
   the paired right/wrong answers, and the share of GO answers each way (a shift toward the majority answer
   raises accuracy without any reading of the abstract: the GO share tells the two apart).
5. **The probabilities.** P(GO) at the decision token (vLLM logprobs, `p_go`) before and after: the mean P(right
   answer) with the paired sign-flip test, which sees a move before a greedy answer flips, and the AUC of P(GO)
   between yes and no questions, which stays at 0.5 for a policy that learned only the majority answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from datasets import Dataset
from intervals import clopper_pearson  # benchmarks/ (the script's folder is on sys.path)
from pydantic import ValidationError
from report import write_report

from pipeline.agents.decision import TOP_LOGPROBS, read
from pipeline.agents.prompts import NO_PROTOCOL, REPOSITORY, brief, pi_prompt
from pipeline.config import Params, load_params
from pipeline.data.splits import load_tasks
from pipeline.envs import model_python, pythonpath
from pipeline.evaluation.metrics import answer, bootstrap_ci
from pipeline.evaluation.significance import mcnemar_exact, sign_flip
from pipeline.io import write_json
from pipeline.rl.grpo_cpu import JUDGE_KEY_ENV, JUDGE_URL_ENV
from pipeline.schemas import PIDecision
from pipeline.serving import stack, worker

ADAPTER = "bench-pi-grpo"


def p_go(content: list[dict[str, Any]]) -> float | None:
    """P(GO) at the first token of a decoded answer that spells GO or NO (the whole answer under the grammar)."""
    for entry in content:
        if (entry.get("token") or "").strip().lstrip('"').strip() in ("GO", "NO"):
            return read(entry.get("top_logprobs") or [])[1]
    return None


def prompt(params: Params, task: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": pi_prompt(REPOSITORY, brief(task, params.agents.context_chars), NO_PROTOCOL, [])}]


def rows(params: Params, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GRPO trainer's prompt rows (the columns the datasets stage writes for ``rl/hf``)."""
    return [{"prompt": prompt(params, t), "agent": "principal_investigator", "task_id": t["id"], "rollout_id": f"{t['id']}-pi",
             "run_id": "bench_before_after", "label": t["final_decision"], "question": t["question"],
             "abstract": " ".join(t["contexts"]), "rollout_reward": None} for t in tasks]


Answer = tuple[str | None, float | None]  # (greedy decision or None: no valid PIDecision, P(GO) at the decision token)


async def decide(params: Params, model: str, tasks: list[dict[str, Any]], concurrency: int) -> dict[str, Answer]:
    """Each task's greedy decision by ``model`` on worker 0 and its P(GO) (`p_go`)."""
    w = params.serving.workers[0]
    sem = asyncio.Semaphore(concurrency)
    cap = max(params.agents.max_tokens, PIDecision.token_budget())

    async def one(http: httpx.AsyncClient, task: dict[str, Any]) -> tuple[str, Answer]:
        body = {"model": model, "messages": prompt(params, task), "max_tokens": cap, "temperature": 0.0,
                "response_format": PIDecision.response_format(), "logprobs": True, "top_logprobs": TOP_LOGPROBS}
        async with sem:
            for attempt in range(3):  # transport errors only; an invalid answer is the model's and counts as none
                try:
                    resp = await http.post(f"{worker.base_url(w)}/v1/chat/completions", json=body, timeout=300)
                    resp.raise_for_status()
                    break
                except httpx.HTTPError:
                    if attempt == 2:
                        raise
                    await asyncio.sleep(2 ** attempt)
        choice = resp.json()["choices"][0]
        prob = p_go((choice.get("logprobs") or {}).get("content") or [])
        try:
            return task["id"], (PIDecision.model_validate_json(choice["message"]["content"] or "").decision, prob)
        except ValidationError:
            return task["id"], (None, prob)

    async with httpx.AsyncClient(headers=worker.headers(w)) as http:
        return dict(await asyncio.gather(*[one(http, t) for t in tasks]))


def train(params: Params, train_tasks: list[dict[str, Any]], args: argparse.Namespace, work: Path,
          proxy: tuple[str, str]) -> dict[str, Any]:
    """``train_ppo``'s CPU trainer in the model plane, in ``work`` (its reports and adapter stay out of the checkout)."""
    Dataset.from_list(rows(params, train_tasks)).save_to_disk(str(work / "datasets" / "rl" / "hf"))
    url, key = proxy  # the stack main brought up (the trainer's reward function reads it, though judge weight 0 calls nothing)
    overrides = {"DATASETS__OUT_DIR": str(work / "datasets"), "PPO__OUT_DIR": str(work / "ppo"),
                 "PPO__BASE_MODEL": str(Path(params.ppo.base_model).resolve()), "PPO__AGENTS": "[principal_investigator]",
                 "PPO__MAX_STEPS": str(args.steps), "PPO__PROMPTS_PER_STEP": str(args.prompts_per_step),
                 "PPO__GROUP_SIZE": str(args.group_size), "PPO__LEARNING_RATE": str(args.learning_rate),
                 "PPO__KL_COEF": str(args.kl_coef),
                 "PPO__REWARD__JUDGE": "0", "PPO__AGL__TRACE_DIR": str(work / "rl_traces")}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIPELINE__")},
           **{f"PIPELINE__{k}": v for k, v in overrides.items()},
           "PYTHONPATH": pythonpath(), JUDGE_URL_ENV: url, JUDGE_KEY_ENV: key}
    params_file = str(Path(os.environ.get("PIPELINE_PARAMS", "params.yaml")).resolve())
    subprocess.run([model_python(), "-m", "pipeline", "--params", params_file, "train-ppo", "--in-model-plane"],
                   cwd=work, env=env, check=True)
    return json.loads((work / "ppo" / "train_meta.json").read_text())


def score(tasks: list[dict[str, Any]], answers: dict[str, Answer]) -> dict[str, Any]:
    right = [answer(answers[t["id"]][0]) == t["final_decision"] for t in tasks]
    k, n = sum(right), len(tasks)
    probs = [answers[t["id"]][1] for t in tasks]
    return {"right": right, "k": k, "n": n, "accuracy": k / n, "ci": clopper_pearson(k, n),
            "go": sum(answers[t["id"]][0] == "GO" for t in tasks) / n,
            "invalid": sum(answers[t["id"]][0] is None for t in tasks),
            # P(the right answer) at the decision token, None where the token was not found
            "p_right": [None if p is None else (p if t["final_decision"] == "yes" else 1 - p)
                        for p, t in zip(probs, tasks, strict=True)],
            "p_go": probs, "labels": [t["final_decision"] for t in tasks]}


def options(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """This benchmark's options (``prefix``: bench_learning's part (c) takes them as ``--pi-...``)."""
    ap.add_argument(f"--{prefix}train-tasks", type=int, default=64, help="training questions whose PI prompts GRPO samples")
    ap.add_argument(f"--{prefix}val-tasks", type=int, default=None, help="validation questions (default: every yes/no one)")
    ap.add_argument(f"--{prefix}balanced", action="store_true",
                    help="train on as many yes as no questions (the prior earns nothing)")
    ap.add_argument(f"--{prefix}steps", type=int, default=24)
    ap.add_argument(f"--{prefix}prompts-per-step", type=int, default=1)
    ap.add_argument(f"--{prefix}group-size", type=int, default=8)
    ap.add_argument(f"--{prefix}learning-rate", type=float, default=1e-3)
    ap.add_argument(f"--{prefix}kl-coef", type=float, default=0.0,
                    help="0 skips the reference model's forward pass (a quarter of a CPU step)")
    ap.add_argument(f"--{prefix}concurrency", type=int, default=8)


def unprefixed(args: argparse.Namespace, prefix: str) -> argparse.Namespace:
    """The options `options` added under ``prefix``, by their own names."""
    key = prefix.replace("-", "_")
    return argparse.Namespace(**{k.removeprefix(key): v for k, v in vars(args).items() if k.startswith(key)})


def measure(params: Params, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Before, train, after (module docstring): the report's lines and the per-question answers."""
    val = [t for t in load_tasks(params.validate_, "val") if t["final_decision"] in ("yes", "no")][: args.val_tasks]
    # maybe-labelled questions give every decision the same credit: a group of equal rewards teaches nothing
    train_tasks = [t for t in load_tasks(params.validate_, "train") if t["final_decision"] in ("yes", "no")]
    if args.balanced:  # as many yes as no, interleaved: a constant answer earns nothing, only reading the abstract can
        yes, no = ([t for t in train_tasks if t["final_decision"] == label] for label in ("yes", "no"))
        train_tasks = [t for pair in zip(yes, no, strict=False) for t in pair]
    train_tasks = train_tasks[: args.train_tasks]
    proxy = stack.ensure(params.serving, params.mlflow)
    w = params.serving.workers[0]
    t0 = time.perf_counter()
    before = asyncio.run(decide(params, worker.served_name(w), val, args.concurrency))
    eval_s = time.perf_counter() - t0
    print(f"before: {sum(answer(before[t['id']][0]) == t['final_decision'] for t in val)}/{len(val)} right", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-before-after-") as folder:
        t0 = time.perf_counter()
        meta = train(params, train_tasks, args, Path(folder), proxy)
        train_s = time.perf_counter() - t0
        after = None
        if not meta["no_signal"]:
            worker.load_lora(w, ADAPTER, str(Path(folder) / "ppo" / "adapter"))
            try:
                after = asyncio.run(decide(params, ADAPTER, val, args.concurrency))
            finally:
                worker.unload_lora(w, ADAPTER)
    lines = render(params, args, val, train_tasks, before, after, meta, train_s, eval_s)
    # the per-question answers: a later reading (per-class recall, other tests) needs no rerun
    record = {"questions": [{"id": t["id"], "label": t["final_decision"],
                             "before": before[t["id"]][0], "p_go_before": before[t["id"]][1],
                             "after": after[t["id"]][0] if after else None, "p_go_after": after[t["id"]][1] if after else None}
                            for t in val],
              "train_task_ids": [t["id"] for t in train_tasks], "train": meta}
    return lines, record


def command(args: argparse.Namespace) -> str:
    return (f"--train-tasks {args.train_tasks} --steps {args.steps} --prompts-per-step {args.prompts_per_step} "
            f"--group-size {args.group_size} --learning-rate {args.learning_rate} --kl-coef {args.kl_coef}"
            f"{' --balanced' if args.balanced else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines, record = measure(load_params(), args)
    lines = ["# Benchmark: the PI before and after GRPO on the gold signal", "",
             f"`benchmarks/bench_before_after.py {command(args)}`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
             f"{platform.machine()}, {os.cpu_count()} cores; {lines[0]}", "", *lines[1:]]
    print("\n".join(lines))
    if args.out:
        write_report(args.out, lines)
        write_json(Path(args.out).with_suffix(".json"), record)


def render(params: Params, args: argparse.Namespace, val: list[dict[str, Any]], train_tasks: list[dict[str, Any]],
           before: dict[str, Answer], after: dict[str, Answer] | None, meta: dict[str, Any], train_s: float,
           eval_s: float) -> list[str]:
    w = params.serving.workers[0]
    r = params.ppo.reward
    yes = sum(t["final_decision"] == "yes" for t in val) / len(val)
    # the first line goes after the caller's command line (this script's or bench_learning's); headings are level 2
    lines = [f"worker `{w.name}` ({w.model}, {w.dtype}); PI prompt without protocol or reviews, decoded under `PIDecision` "
             "at temperature 0.",
             "## Training (train_ppo's CPU trainer, gold-only reward)", "",
             "| training questions | steps | completions scored | valid fraction | reward std | groups with zero advantage | "
             "reward first step → last | decision accuracy of the samples | train time |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| {len(train_tasks)} | {meta['steps']} | {meta['completions_scored']} | {meta['valid_fraction']:.2f} | "
             f"{meta['reward_std']:.3f} | {meta['zero_advantage_groups']}/{meta['groups']} | "
             f"{meta['reward_first']:.3f} → {meta['reward_last']:.3f} | "
             f"{(meta['decision_accuracy'] or 0):.2f} | {train_s / 60:.1f} min |", "",
             f"Reward per completion: {r.validity} x valid + {r.alignment} x decision credit (judge weight 0, not called); "
             f"LoRA r={params.ppo.lora.r}, KL coefficient {args.kl_coef}, sampling temperature {params.ppo.temperature}.", ""]
    b = score(val, before)
    lines += ["## Validation decision accuracy (yes/no questions)", "",
              "| policy | questions | right | accuracy [exact 95% CI] | GO share | no valid decision |",
              "|---|---|---|---|---|---|",
              f"| base (before) | {b['n']} | {b['k']} | {b['accuracy']:.3f} [{b['ci'][0]:.3f}, {b['ci'][1]:.3f}] | "
              f"{b['go']:.2f} | {b['invalid']} |"]
    if after is None:
        lines += ["", f"**No after:** the training data carried no signal ({meta['no_signal_reason']}); nothing to compare.", ""]
        return lines
    a = score(val, after)
    test = mcnemar_exact(a["right"], b["right"])
    lines += [f"| GRPO adapter (after) | {a['n']} | {a['k']} | {a['accuracy']:.3f} [{a['ci'][0]:.3f}, {a['ci'][1]:.3f}] | "
              f"{a['go']:.2f} | {a['invalid']} |", "",
              f"Majority answer (yes = GO) on these questions: {yes:.3f}. Exact McNemar, after vs before: right only after "
              f"{test.b}, right only before {test.c}, two-sided p = {test.p_value:.3f} (n = {test.n}). "
              f"One validation pass took {eval_s / 60:.1f} min ({args.concurrency} in flight, base model).", ""]
    return lines + probability_table(b, a)


def probability_table(b: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """The paired shift in P(right answer) at the decision token: it sees a policy move that has not yet flipped a greedy
    answer. Sign-flip permutation test (two-sided) on the per-question differences, questions where both were read."""
    pairs = [(x, y) for x, y in zip(a["p_right"], b["p_right"], strict=True) if x is not None and y is not None]
    if not pairs:
        return ["No decision token was found in the logprobs: no probability comparison.", ""]
    diffs = [x - y for x, y in pairs]
    lo, hi = bootstrap_ci(diffs, 10000)

    def mean(values: list[float | None]) -> float:
        kept = [v for v in values if v is not None]
        return sum(kept) / len(kept)

    def row(name: str, s: dict[str, Any]) -> str:
        value, (low, high) = auc_ci(s["p_go"], s["labels"])
        return (f"| {name} | {sum(p is not None for p in s['p_right'])} | {mean(s['p_right']):.3f} | {mean(s['p_go']):.3f} | "
                f"{value:.3f} [{low:.3f}, {high:.3f}] |")

    return ["## P(right answer) at the decision token", "",
            "| policy | questions read | mean P(right) | mean P(GO) | AUC of P(GO), yes vs no [95% bootstrap CI] |",
            "|---|---|---|---|---|", row("base (before)", b), row("GRPO adapter (after)", a),
            "",
            "The AUC asks whether P(GO) is higher on the questions labelled yes than on those labelled no: 0.5 is no "
            "reading of the abstract at all, whatever the GO share. A policy that only learned the majority answer moves "
            "mean P(GO) and leaves the AUC where it was.",
            "",
            f"Paired difference after − before: mean {sum(diffs) / len(diffs):+.4f}, 95% bootstrap CI [{lo:+.4f}, {hi:+.4f}], "
            f"sign-flip permutation p = {sign_flip(diffs, 'two-sided'):.4f} (two-sided, n = {len(diffs)}). "
            "P(right) is the chance a sample at temperature 1 gives the labelled answer, so its mean is the expected "
            "accuracy of that sampling policy.", ""]


def auc(p_go: list[float | None], labels: list[str]) -> float:
    """P(a yes question gets a higher P(GO) than a no question), ties half: the Mann-Whitney statistic, scaled."""
    yes = np.array([p for p, y in zip(p_go, labels, strict=True) if p is not None and y == "yes"])
    no = np.array([p for p, y in zip(p_go, labels, strict=True) if p is not None and y == "no"])
    if not yes.size or not no.size:
        return float("nan")
    return float(((yes[:, None] > no[None, :]).sum() + 0.5 * (yes[:, None] == no[None, :]).sum()) / (yes.size * no.size))


def auc_ci(p_go: list[float | None], labels: list[str], draws: int = 2000, level: float = 0.95,
           seed: int = 0) -> tuple[float, tuple[float, float]]:
    """`auc` with a percentile bootstrap over questions (resampled whole, labels with them)."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    boots = []
    for _ in range(draws):
        idx = rng.integers(0, n, n)
        boots.append(auc([p_go[i] for i in idx], [labels[i] for i in idx]))
    lo, hi = np.nanquantile(boots, ((1 - level) / 2, 1 - (1 - level) / 2))
    return auc(p_go, labels), (float(lo), float(hi))


if __name__ == "__main__":
    main()
