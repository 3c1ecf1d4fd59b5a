"""The PI's trainer on a GPU: ``train_pi``'s rows and trainer under the GPU image's releases (trl 1.15.0, transformers
5.17.0, PEFT, bf16 on CUDA), and how far more steps and LoRA capacity take the 135M PI (issue #57's literature bar).

On a GPU host, in the repository, with the model plane's packages (docs/gpu.md, "What ran on a GPU"):

    python benchmarks/bench_gpu_pi.py run --gguf PATH --to DIR [--budget-s 400] [--keep NAME,...]

Here, from what that run wrote:

    PYTHONPATH=. .venv/control/bin/python benchmarks/bench_gpu_pi.py report --from DIR [--out docs/benchmarks-gpu-pi.md]

Every configuration is ``params/learn.yaml`` plus the ``PIPELINE__`` overrides named in ``CONFIGS``, so any of them is a
params change. Each trains with the pipeline's own code (``materialize_model`` from the same GGUF, ``train_pi.rows``,
``train_pi.decision_rows``, ``train_sft.train``) and is read by ``bench_pi_readout.read_adapter`` (the society's
decision read: the brief, the answer continued from ``agents.decision.prefix``, the most probable decision among the
20 first tokens, float32) on the validation and the official test split. The choice among configurations is made on
validation (official accuracy + macro-F1); the test split is reported for all, the chosen one named.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tarfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_pi_readout, report: siblings of this file

LEARN = "params/learn.yaml"
ALL = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
# the worker must wrap the same layers at the rank (config.py refuses an adapter it could not serve), as learn-r16.yaml
R16 = {"PIPELINE__PI__SFT__LORA": f"{{r: 16, alpha: 32, dropout: 0.0, target_modules: {ALL}}}",
       "PIPELINE__SERVING__WORKER_DEFAULTS__MAX_LORA_RANK": "16", "PIPELINE__SERVING__WORKER_DEFAULTS__LORA_TARGET_MODULES": ALL}
# name -> overrides of params/learn.yaml, in the order they run (a run stops starting new ones at its budget)
CONFIGS: dict[str, dict[str, str]] = {
    "learn": {},  # make learn's own recipe: rank 8 on attention, maybe 3x, 225 steps of 4 (2.5 passes)
    "learn-seed1": {"PIPELINE__PI__SFT__SEED": "1"},  # the same recipe, another seed: how far one training moves
    "learn-seed2": {"PIPELINE__PI__SFT__SEED": "2"},
    # the loss on the decision's token alone (pi.end_of_turn false: the fourth lease's `learn`, committed then)
    "token-alone": {"PIPELINE__PI__END_OF_TURN": "false"},
    # and at half the rate: the token alone doubled the decision's share of each step's mean against the rows with an EOS
    "lr25": {"PIPELINE__PI__END_OF_TURN": "false", "PIPELINE__PI__SFT__LEARNING_RATE": "0.00025"},
    "lr25-seed1": {"PIPELINE__PI__END_OF_TURN": "false", "PIPELINE__PI__SFT__LEARNING_RATE": "0.00025",
                   "PIPELINE__PI__SFT__SEED": "1"},
    "lr25-seed2": {"PIPELINE__PI__END_OF_TURN": "false", "PIPELINE__PI__SFT__LEARNING_RATE": "0.00025",
                   "PIPELINE__PI__SFT__SEED": "2"},
    # float32 on the device (BENCH_FP32, not a params key): is the GPU's seed spread bf16's, or the kernels'?
    "learn-fp32": {"BENCH_FP32": "1"},
    "learn-seed1-fp32": {"BENCH_FP32": "1", "PIPELINE__PI__SFT__SEED": "1"},
    "r16": R16,  # params/learn-r16.yaml's adapter
    "r16-4x": {**R16, "PIPELINE__PI__SFT__MAX_STEPS": "900", "PIPELINE__PI__SFT__LEARNING_RATE": "0.0002"},
    "r16-b16": {**R16, "PIPELINE__PI__SFT__BATCH_SIZE": "16", "PIPELINE__PI__SFT__MAX_STEPS": "300",
                "PIPELINE__PI__SFT__LEARNING_RATE": "0.0003"},  # 10 passes at a larger batch
    "answer": {"PIPELINE__PI__LOSS_ON": "answer"},  # the loss on the whole served answer (decision + rationale)
    "r16-maybe5": {**R16, "PIPELINE__PI__OVERSAMPLE": "{'yes': 1, 'no': 1, 'maybe': 5}",
                   "PIPELINE__PI__SFT__MAX_STEPS": "600", "PIPELINE__PI__SFT__LEARNING_RATE": "0.0002"},
    "r64": {**R16, "PIPELINE__PI__SFT__LORA": f"{{r: 64, alpha: 128, dropout: 0.05, target_modules: {ALL}}}",
            "PIPELINE__SERVING__WORKER_DEFAULTS__MAX_LORA_RANK": "64",
            "PIPELINE__PI__SFT__MAX_STEPS": "450", "PIPELINE__PI__SFT__LEARNING_RATE": "0.0002"},
}
# pairs of configurations compared on the test split when both ran
PAIRS = [("learn", "learn-seed1", "The same recipe, two seeds"), ("learn", "learn-fp32", "The same seed, bf16 and float32"),
         ("learn-fp32", "learn-seed1-fp32", "Two seeds in float32"), ("learn", "learn-seed2", "The same recipe, seeds 0 and 2"),
         ("learn-seed1", "learn-seed2", "The same recipe, seeds 1 and 2"), ("lr25", "lr25-seed1", "Half the rate, seeds 0 and 1"),
         ("lr25", "lr25-seed2", "Half the rate, seeds 0 and 2"), ("lr25-seed1", "lr25-seed2", "Half the rate, seeds 1 and 2"),
         ("learn", "lr25", "Seed 0 at the rate and at half of it")]
ROLE = "principal_investigator"
ADAPTER_MB = 15  # what one file back from a lent device may hold (16 MiB)


def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    import torch  # noqa: PLC0415 - model plane only

    out: dict[str, Any] = {"python": sys.version.split()[0], "cuda": torch.cuda.is_available(),
                           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for name in ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "unsloth"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _params(name: str, work: Path, smoke: bool = False) -> Any:
    from pipeline.config import load_params  # noqa: PLC0415

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIPELINE__")}, **CONFIGS[name],
           **({"PIPELINE__PI__SFT__MAX_STEPS": "2", "PIPELINE__PI__SFT__FIT_ROWS": "2"} if smoke else {}),
           "PIPELINE__PI__SFT__BASE_MODEL": str(work / "base"),
           "PIPELINE__PI__ROLES": json.dumps({ROLE: {"out_dir": str(work / name / "sft"),
                                                      "data_dir": str(work / name / "data")}})}
    return load_params(LEARN, environ=env)


def _materialize(params: Any, gguf: Path, work: Path) -> dict[str, Any]:
    """The served base model from the same GGUF, as ``materialize_model`` makes it; its weights' digest."""
    import torch  # noqa: PLC0415 - model plane only

    from pipeline.stages import materialize_model  # noqa: PLC0415

    t0 = time.perf_counter()
    model, tokenizer = materialize_model._load_gguf(gguf, getattr(torch, params.models.base.dtype))
    meta = materialize_model._save(model, tokenizer, str(work / "base"),
                                   {"source": str(gguf), "dtype": params.models.base.dtype,
                                    "parameters": int(sum(p.numel() for p in model.parameters()))})
    digest = hashlib.sha256((work / "base" / "model.safetensors").read_bytes()).hexdigest()
    return {**meta, "seconds": round(time.perf_counter() - t0, 1), "safetensors_sha256": digest}


def _train(params: Any) -> dict[str, Any]:
    """``train_pi``'s inputs and training step, with its own functions (the served prefix is params'; the CPU run
    checks it against the base model under the workers' grammar library)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - model plane only

    from pipeline.data.splits import load_tasks  # noqa: PLC0415
    from pipeline.stages import train_pi, train_sft  # noqa: PLC0415

    pi = params.pi.at(ROLE)
    rows = train_pi.rows(load_tasks(params.validate_, "train", setting=params.data.setting), params)
    data = Path(pi.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = data / "train.jsonl"
    if pi.loss_on != "answer":
        tok = AutoTokenizer.from_pretrained(pi.sft.base_model)
        path = data / "train.decision.jsonl"
        tokenized = train_pi.decision_rows(rows, tok, params.agents.decision.prefix, pi.end_of_turn)
        path.write_text("".join(json.dumps(r) + "\n" for r in tokenized))
    metrics = train_sft.train(pi.sft, path)
    return {**metrics, "rows": len(rows)}


@contextlib.contextmanager
def _precision(overrides: dict[str, str]) -> Iterator[None]:
    """float32 weights and no bf16 autocast on CUDA while ``BENCH_FP32`` is set (the trainer's own choice is bf16)."""
    if not overrides.get("BENCH_FP32"):
        yield
        return
    import torch  # noqa: PLC0415 - model plane only
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - model plane only

    from pipeline.stages import train_sft  # noqa: PLC0415

    load, args = AutoModelForCausalLM.from_pretrained, train_sft.trainer_args
    def fp32(*a: Any, **k: Any) -> Any:
        print(f"BENCH_FP32: {a[0]} in float32 (asked {k.get('dtype')})", flush=True)
        return load(*a, **{**k, "dtype": torch.float32})

    AutoModelForCausalLM.from_pretrained = fp32  # type: ignore[method-assign]
    train_sft.trainer_args = lambda *a, **k: {**args(*a, **k), "bf16": False}  # type: ignore[assignment]
    try:
        yield
    finally:
        AutoModelForCausalLM.from_pretrained, train_sft.trainer_args = load, args  # type: ignore[method-assign]


def _selection_score(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Official accuracy and macro-F1 of the validation rows (each decided by ``bench_pi_readout.decide``, as
    ``report`` decides them), as PubMedQA's ``evaluation.py`` computes them (sklearn's ``f1_score(average="macro")``:
    the labels present in truth or predictions, an empty class scoring 0), without sklearn, which the model plane
    lacks; ``report`` recomputes both with sklearn."""
    from bench_pi_readout import decide  # noqa: PLC0415 - a sibling, on the path once this file runs

    truth = [r["label"] for r in rows]
    preds = [decide(r["probs"]) for r in rows]
    f1 = []
    for c in sorted(set(truth) | set(preds)):
        pairs = list(zip(truth, preds, strict=True))
        tp, fp, fn = (sum(t == p == c for t, p in pairs), sum(p == c != t for t, p in pairs),
                      sum(t == c != p for t, p in pairs))
        f1.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return {"accuracy": sum(t == p for t, p in zip(truth, preds, strict=True)) / len(rows), "macro_f1": sum(f1) / len(f1)}


def _pack(adapter: Path, to: Path) -> str | None:
    """The adapter as one tar back from the device, or None when it exceeds what one file may hold."""
    size = sum(p.stat().st_size for p in adapter.rglob("*") if p.is_file() and "tokenizer" not in p.name)
    if size > ADAPTER_MB * 2**20:
        return None
    with tarfile.open(to, "w:gz") as tar:
        for p in adapter.iterdir():
            if p.name.startswith(("adapter_", "README")):
                tar.add(p, arcname=p.name)
    return to.name


def run(args: argparse.Namespace) -> None:
    import bench_pi_readout  # noqa: PLC0415
    import torch  # noqa: PLC0415 - model plane only

    from pipeline.data.splits import load_tasks  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    to, work = Path(args.to), Path(args.work)
    to.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"versions": _versions(), "configs": {}, "order": list(CONFIGS)}
    save = lambda: (to / "results.json").write_text(json.dumps(doc, indent=1))  # noqa: E731 - after every step
    print(json.dumps(doc["versions"]), flush=True)
    base = _params("learn", work)
    doc["base"] = _materialize(base, Path(args.gguf), work)
    print(f"base model: {doc['base']}", flush=True)
    save()
    tasks = {s: load_tasks(base.validate_, s, setting=base.data.setting)[:4 if args.smoke else None] for s in ("val", "test")}
    for name in (args.only.split(",") if args.only else CONFIGS):
        if time.perf_counter() - t0 > args.budget_s:
            doc["configs"][name] = {"skipped": f"budget of {args.budget_s} s spent"}
            continue
        entry: dict[str, Any] = {"overrides": CONFIGS[name]}
        doc["configs"][name] = entry
        try:
            params = _params(name, work, args.smoke)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with _precision(CONFIGS[name]):
                entry["train"] = _train(params)
            entry["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
            adapter = Path(params.pi.at(ROLE).sft.out_dir) / "adapter"
            t1 = time.perf_counter()
            entry["rows"] = bench_pi_readout.read_adapter(params, str(adapter), tasks)
            entry["read_seconds"] = round(time.perf_counter() - t1, 1)
            entry["val"] = _selection_score([r for r in entry["rows"] if r["split"] == "val"])
            entry["adapter"] = str(adapter)
            print(f"{name}: {entry['train']['steps']} steps in {entry['train']['train_seconds']} s, "
                  f"val {entry['val']}, read in {entry['read_seconds']} s", flush=True)
        except Exception as exc:  # a configuration that fails is a finding, not the end of the run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"{name}: FAILED {entry['error']}", flush=True)
        save()
    if (chosen := _chosen(doc["configs"])) is not None:
        doc["chosen_on_val"] = chosen
        for name in dict.fromkeys([chosen, "learn", *args.keep.split(",")]):
            if "val" in doc["configs"].get(name, {}):
                c = doc["configs"][name]
                c["packed"] = _pack(Path(c["adapter"]), to / f"adapter-{name}.tar.gz")
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"done in {doc['seconds']} s; chosen on validation: {doc.get('chosen_on_val')}", flush=True)


def _chosen(configs: dict[str, Any]) -> str | None:
    """The configuration chosen on validation: the highest official accuracy + macro-F1 (first in order on a tie)."""
    done = {n: c for n, c in configs.items() if "val" in c}
    return max(done, key=lambda n: done[n]["val"]["accuracy"] + done[n]["val"]["macro_f1"]) if done else None


def _merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs on one device (a lease is cut into calls) as one: the same base weights and releases required, each
    configuration from the run that finished it, the choice on validation remade over all of them."""
    first = runs[0]
    for r in runs[1:]:
        if r["base"]["safetensors_sha256"] != first["base"]["safetensors_sha256"] or r["versions"] != first["versions"]:
            raise SystemExit("error: the runs differ in base weights or releases; report them apart")
    configs: dict[str, Any] = {}
    for r in runs:
        for name, c in r["configs"].items():
            if "rows" in c or name not in configs:
                configs[name] = c
    order = list(dict.fromkeys(n for r in runs for n in r["order"]))  # a later run may know configurations an earlier did not
    return {**first, "configs": configs, "order": order, "chosen_on_val": _chosen(configs),
            "seconds": sum(r.get("seconds", 0) for r in runs)}


def report(args: argparse.Namespace) -> None:
    """The markdown table (validation and test per configuration, the chosen one's test beside the learn default's)."""
    import bench_pi_readout  # noqa: PLC0415
    from report import p_text, publish  # noqa: PLC0415 - control plane

    from pipeline.evaluation.significance import mcnemar_exact  # noqa: PLC0415 - control plane

    runs = [json.loads((Path(src) / "results.json").read_text()) for src in args.source]
    doc = _merged(runs)
    v = doc["versions"]
    lines = ["# The PI's trainer on a GPU (reasoning_free)", "",
             f"`benchmarks/bench_gpu_pi.py` on {v['device']}: torch {v['torch']}, transformers {v['transformers']}, "
             f"trl {v['trl']}, peft {v['peft']}, datasets {v['datasets']}, unsloth {v['unsloth'] or 'not installed'}. "
             f"Base model from the same GGUF as the CPU path ({doc['base']['parameters']:,} parameters, "
             f"`model.safetensors` sha256 `{doc['base']['safetensors_sha256'][:16]}…`). Each configuration is "
             "`params/learn.yaml` plus its overrides, trained by `train_sft.train` on `train_pi.rows`, read by "
             "`bench_pi_readout.read_adapter`; n beside every figure, yes/no accuracy with its exact 95% interval.", "",
             "| config | steps | train s | loss on own rows (before → after) | held-out loss | split | n | official acc. "
             "| macro-F1 | F1 yes / no / maybe | yes/no acc. [95% CP] | answered yes / no / maybe |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out: dict[str, Any] = {"versions": v, "base": doc["base"], "chosen_on_val": doc.get("chosen_on_val"), "configs": {}}
    right: dict[str, list[bool]] = {}
    for name in doc["order"]:
        c = doc["configs"].get(name)
        if c is None:
            continue
        if "rows" not in c:
            why = c.get("skipped") or c.get("error", "")
            lines.append(f"| {name} | | | | | | | | | | | {why[:160]} |")
            out["configs"][name] = {k: c[k] for k in ("overrides", "skipped", "error") if k in c}
            continue
        t = c["train"]
        out["configs"][name] = {"overrides": c["overrides"], "train": t, "read_seconds": c["read_seconds"]}
        for split in ("val", "test"):
            f = bench_pi_readout.figures([r for r in c["rows"] if r["split"] == split])
            was_right = f.pop("right")
            if split == "test":
                right[name] = was_right
            out["configs"][name][split] = f
            cp, a = f["yes_no"]["ci"], f["answered"]
            label = f"**{name}** (chosen)" if name == doc.get("chosen_on_val") and split == "val" else name
            lines.append(f"| {label} | {t['steps']} | {t['train_seconds']:.0f} | {t['fit_loss_before']:.3f} → "
                         f"{t['fit_loss_after']:.3f} | {t['eval_loss_before']:.3f} → {t['eval_loss']:.3f} | {split} | "
                         f"{f['n']} | {f['accuracy']:.3f} | {f['macro_f1']:.3f} | "
                         + " / ".join(f"{f['f1_binary'][k]:.3f}" for k in ("yes", "no", "maybe"))
                         + f" | {f['yes_no']['accuracy']:.3f} [{cp[0]:.3f}, {cp[1]:.3f}] (n={f['yes_no']['n']}) | "
                         f"{a['yes']} / {a['no']} / {a['maybe']} |")
    chosen = doc.get("chosen_on_val")
    if chosen and chosen != "learn" and {chosen, "learn"} <= set(right):
        m = mcnemar_exact(right[chosen], right["learn"])
        out["mcnemar_test_chosen_vs_learn"] = m.model_dump(exclude_unset=True)
        lines += ["", f"Test split, chosen on validation (`{chosen}`) against the learn default, exact McNemar on all 500 "
                      f"(right vs wrong): b = {m.b}, c = {m.c}, p {p_text(m.p_value)} (two-sided)."]
    for a, b, what in PAIRS:
        if {a, b} <= set(right):
            m = mcnemar_exact(right[a], right[b])
            out[f"mcnemar_test_{a}_vs_{b}"] = m.model_dump(exclude_unset=True)
            lines += ["", f"{what} (`{a}` against `{b}`), test split, exact McNemar on all 500 (right vs wrong): "
                          f"b = {m.b}, c = {m.c}, p {p_text(m.p_value)} (two-sided)."]
    for spec in args.agree:  # the same adapter read on this host's model plane: does the device's readout carry over?
        name, adapter = spec.split("=", 1)
        here = {(r["split"], r["id"]): r["probs"] for r in bench_pi_readout.offline(adapter, "val,test")}
        there = doc["configs"][name]["rows"]
        same = sum(bench_pi_readout.decide(r["probs"]) == bench_pi_readout.decide(here[(r["split"], r["id"])]) for r in there)
        gap = max(abs(r["probs"].get(d, 0.0) - here[(r["split"], r["id"])].get(d, 0.0))
                  for r in there for d in ("GO", "NO-GO", "DEFER"))
        out["configs"][name]["read_here"] = {"agree": same, "n": len(there), "max_probability_gap": gap}
        lines += ["", f"`{name}`'s adapter, brought back and read on this host's model plane (CPU, float32): the same "
                      f"decision on **{same} of {len(there)}** questions, each decision's probability within {gap:.1e}."]
    lines += ["", f"Run: {doc.get('seconds')} s on the device, base materialised in {doc['base']['seconds']} s."]
    publish(args.out, [*lines, ""], out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train and read every configuration (model plane, a GPU host)")
    r.add_argument("--gguf", required=True, help="the GGUF params.models.base names (SmolLM2-135M-Instruct.Q4_1.gguf)")
    r.add_argument("--to", required=True, help="folder for results.json and the packed adapters")
    r.add_argument("--work", default="/tmp/bench-gpu-pi", help="scratch folder (the base model, adapters)")
    r.add_argument("--budget-s", type=float, default=400.0, help="start no configuration after this many seconds")
    r.add_argument("--only", default="", help="comma-separated configuration names (default: all, in order)")
    r.add_argument("--keep", default="", help="comma-separated configurations whose adapters come back too")
    r.add_argument("--smoke", action="store_true", help="2 steps, 4 questions a split: the script's own check")
    p = sub.add_parser("report", help="the markdown report from a run's results.json (control plane)")
    p.add_argument("--from", dest="source", action="append", required=True, help="a run's --to folder (repeatable)")
    p.add_argument("--out", default="docs/benchmarks-gpu-pi.md")
    p.add_argument("--agree", action="append", default=[], help="NAME=ADAPTER_DIR: read that configuration's adapter "
                   "(unpacked from the run's adapter-NAME.tar.gz) here too and report the agreement")
    args = ap.parse_args()
    if args.cmd == "run":
        shutil.rmtree(args.work, ignore_errors=True)  # a rerun starts clean: no adapter of an earlier run is read
        run(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
