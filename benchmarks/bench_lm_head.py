"""What scoring only the labelled positions through TRL's LM head buys on the CPU (pipeline/lm_head.py).

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_lm_head.py [--params params/learn.yaml] [--steps 4] \
        [--repeats 2] [--roles pi junior_researcher] [--out docs/benchmarks-lm-head.md]

Needs a trainer's rows as a cycle leaves them (`make run` or `make learn`: ``data/datasets/pi/train.decision.jsonl``,
the SFT rows of ``sft.roles``). For the PI (``pi.sft``) and each SFT role of ``--params``, trains ``--steps`` steps with
TRL's own head (every position through the head) and with the labelled positions only, interleaved ``--repeats`` times
(A B A B: an hour's drift falls on both), each run its own model-plane process. Prints and writes seconds a step, the
ratio labelled / every position, each run's peak RSS, and whether the per-step losses are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from report import publish

from pipeline.config import load_params
from pipeline.envs import model_python

RUN = r"""
import json, resource, sys, time
from pathlib import Path
from pipeline.config import load_params
from pipeline.stages import train_pi, train_sft

params_file, role, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
params = load_params(Path(params_file))
if role == "pi":
    pi = params.pi.at(next(iter(params.pi.roles)))
    cfg, data = pi.sft, train_pi.data_file(pi).with_name("train.decision.jsonl")
else:
    cfg, data = params.sft.at(role), train_sft.data_file(params.datasets, role)
if mode == "labelled":
    from pipeline.lm_head import score_labelled_positions_only
    score_labelled_positions_only()
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
cfg = cfg.model_copy(update={"max_steps": steps})
model, tokenizer, peft = train_sft._model_and_peft(cfg, "trl")
rows = train_sft.load_rows(data)
ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
args = SFTConfig(**{**train_sft.trainer_args(cfg, Path("/tmp/bench-lm-head"), False), "eval_strategy": "no",
                    "disable_tqdm": True})
trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer, peft_config=peft)
t0 = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - t0
print(json.dumps({"seconds_per_step": seconds / steps, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "tokens": next((h["num_tokens"] for h in reversed(trainer.state.log_history) if "num_tokens" in h), None),
                  "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}))
"""

MODES = ("every", "labelled")


def run(params: str, role: str, mode: str, steps: int) -> dict:
    done = subprocess.run([model_python(), "-c", RUN, params, role, mode, str(steps)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path.cwd()), "HF_HUB_OFFLINE": "1"},
                          timeout=1800, check=False)
    if done.returncode != 0:
        sys.exit(f"bench_lm_head: {role} ({mode}) failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--roles", nargs="*", default=None, help="pi and/or SFT roles (default: the PI and every SFT role)")
    ap.add_argument("--out", default="docs/benchmarks-lm-head.md")
    args = ap.parse_args()
    params = load_params(Path(args.params))
    roles = args.roles or (["pi"] if params.pi.roles else []) + list(params.sft.roles)
    results: dict[str, dict[str, list[dict]]] = {role: {m: [] for m in MODES} for role in roles}
    for _ in range(args.repeats):
        for role in roles:
            for mode in MODES:
                results[role][mode].append(got := run(args.params, role, mode, args.steps))
                print(f"{role} {mode}: {got['seconds_per_step']:.2f} s a step, peak {got['peak_gb']:.2f} GB", flush=True)
    lines = [f"# TRL's LM head on the labelled positions only (`{args.params}`)", "",
             f"Measured {datetime.now(UTC).isoformat(timespec='seconds')} on this host by `benchmarks/bench_lm_head.py`: "
             f"{args.steps} training steps a run, {args.repeats} runs a mode interleaved, each its own model-plane process.",
             "", "| trainer | tokens a step | s a step, every position | s a step, labelled only | ratio | peak GB, every / "
             "labelled | same losses |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for role, by in results.items():
        every, labelled = (statistics.median(r["seconds_per_step"] for r in by[m]) for m in MODES)
        same = all(a["losses"] == b["losses"] for a, b in zip(by["every"], by["labelled"], strict=True))
        tokens = (by["every"][0]["tokens"] or 0) / args.steps
        lines.append(f"| {'train_pi' if role == 'pi' else f'train_sft@{role}'} | {tokens:.0f} | {every:.2f} | {labelled:.2f} | "
                     f"**{labelled / every:.2f}x** | {max(r['peak_gb'] for r in by['every']):.2f} / "
                     f"{max(r['peak_gb'] for r in by['labelled']):.2f} | {'yes' if same else 'no'} |")
    publish(args.out, lines, {"params": args.params, "steps": args.steps, "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
