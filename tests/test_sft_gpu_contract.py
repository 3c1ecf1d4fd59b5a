"""train_sft's GPU path against the GPU image's own releases: unsloth 2026.10.9, trl 1.15.0, transformers 5.17.0.

The CPU plane trains with trl 1.16 and transformers 5.19, and never imports unsloth (it needs a GPU). So on a GPU
worker, three things would be found only on the first run: a keyword unsloth's loader, LoRA patcher or merged save does
not take; an ``SFTConfig`` field the image's trl/transformers do not have; and a change in how that trl trains on our
rows. The releases are unpacked from their wheels (requirements/gpu-unpacked.txt -> .venv/gpu-unpacked). unsloth is read
(its functions' signatures, from its source); trl and transformers are imported: ``SFTConfig`` is built with the GPU
profile's arguments.

Not run here: training under trl 1.15.0. Its ``SFTTrainer`` computes every loss through a fused LM head whose kernel
is Triton only (``trl/kernels/chunked_logprob.py``; 1.16 added the torch fallback the CPU plane uses), so on CPU it
stops at "0 active drivers". Tried on the random-weight test model: it failed there, in the first evaluation.
"""
from __future__ import annotations

import ast
from pathlib import Path

from pipeline.config import SftParams, load_params
from pipeline.stages.train_sft import UNSLOTH_MERGED, trainer_args, unsloth_load_kwargs, unsloth_peft_kwargs
from tests.conftest import GPU_RELEASES, run_with_gpu_releases

ROOT = Path(__file__).resolve().parent.parent
UNSLOTH = GPU_RELEASES / "unsloth"


def _function(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    """The first ``def name`` in ``path`` (inside ``class cls`` when given), parsed, never imported."""
    assert path.exists(), f"{path} missing: run `make setup` (scripts/setup_envs.sh unpacks requirements/gpu-unpacked.txt)"
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]


def _defaults(fn: ast.FunctionDef) -> dict[str, object]:
    args = fn.args.args
    values = {a.arg: d for a, d in zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults, strict=True)}
    return {k: ast.literal_eval(v) for k, v in values.items() if isinstance(v, ast.Constant)}


def _gpu_sft() -> SftParams:
    return load_params(ROOT / "params/gpu.yaml", environ={}).sft


def test_the_unsloth_calls_name_only_parameters_the_pinned_unsloth_declares() -> None:
    """Each keyword train_sft passes is an explicit parameter (not swallowed by ``**kwargs``) of the function that
    receives it in unsloth 2026.10.9: ``FastLanguageModel.from_pretrained`` (model path first),
    ``FastLlamaModel.get_peft_model`` (``FastLanguageModel.get_peft_model`` forwards to it for text models), and the
    merged save unsloth binds to a text model as ``save_pretrained_merged``."""
    sft = _gpu_sft()
    assert sft.backend == "unsloth"
    load = _function(UNSLOTH / "models/loader.py", "from_pretrained", cls="FastLanguageModel")
    assert _params(load)[0] == "model_name", _params(load)[:3]  # train_sft passes the model path positionally
    assert set(unsloth_load_kwargs(sft)) <= set(_params(load)), set(unsloth_load_kwargs(sft)) - set(_params(load))

    forward = ast.unparse(_function(UNSLOTH / "models/loader.py", "get_peft_model", cls="FastLanguageModel"))
    assert "FastLlamaModel.get_peft_model(model, *args, **kwargs)" in forward
    peft = _function(UNSLOTH / "models/llama.py", "get_peft_model", cls="FastLlamaModel")
    assert _params(peft)[0] == "model"
    assert set(unsloth_peft_kwargs(sft)) <= set(_params(peft)), set(unsloth_peft_kwargs(sft)) - set(_params(peft))
    assert _defaults(peft)["use_gradient_checkpointing"] == unsloth_peft_kwargs(sft)["use_gradient_checkpointing"]

    save_py = UNSLOTH / "save.py"
    binding = ast.unparse(_function(save_py, "patch_saving_functions"))
    assert "_bind_saving_method(unsloth_generic_save_pretrained_merged, model, 'save_pretrained_merged')" in binding
    merged = _function(save_py, "unsloth_generic_save_pretrained_merged")
    assert _params(merged)[:4] == ["self", "save_directory", "tokenizer", "save_method"]
    assert _defaults(merged)["save_method"] == UNSLOTH_MERGED  # and what it names: 16-bit merged weights, as vLLM loads


def test_the_trainer_arguments_are_fields_of_the_pinned_trl_and_build_its_config(tmp_path: Path) -> None:
    """Every ``SFTConfig`` keyword of the GPU profile (bf16 on the device) is a field of trl 1.15.0's ``SFTConfig`` over
    transformers 5.17.0's ``TrainingArguments``; the CPU variant of the same arguments builds one (bf16 cannot be
    validated without a GPU)."""
    sft = _gpu_sft()
    script = (
        "import dataclasses, json, sys, trl, transformers\n"
        "from pathlib import Path\n"
        "from pipeline.config import load_params\n"
        "from pipeline.stages.train_sft import trainer_args\n"
        "sft = load_params(Path(sys.argv[1]) / 'params/gpu.yaml', environ={}).sft\n"
        "fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}\n"
        "unknown = sorted(set(trainer_args(sft, Path(sys.argv[2]), cuda=True)) - fields)\n"
        "cfg = trl.SFTConfig(**trainer_args(sft, Path(sys.argv[2]), cuda=False))\n"
        "print(json.dumps({'trl': trl.__version__, 'transformers': transformers.__version__, 'unknown': unknown,\n"
        "                  'max_length': cfg.max_length, 'completion_only_loss': cfg.completion_only_loss,\n"
        "                  'gradient_checkpointing': cfg.gradient_checkpointing}))\n")
    out = run_with_gpu_releases(["-c", script, str(ROOT), str(tmp_path)])
    assert (out["trl"], out["transformers"]) == ("1.15.0", "5.17.0")
    assert out["unknown"] == []
    assert (out["max_length"], out["completion_only_loss"], out["gradient_checkpointing"]) == (
        sft.max_length, True, sft.gradient_checkpointing)
    assert set(trainer_args(sft, tmp_path, cuda=True)) == set(trainer_args(sft, tmp_path, cuda=False))  # only values differ


# the model plane's tokenizer as materialize_model builds it from params.yaml's GGUF (a script's opening, argv[1] = ROOT)
GGUF_TOKENIZER = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from transformers import AutoConfig, AutoTokenizer\n"
    "from pipeline.config import load_params\n"
    "from pipeline.stages.materialize_model import _gguf_file, gguf_tokenizer\n"
    "params = load_params(Path(sys.argv[1]) / 'params.yaml', environ={})\n"
    "path = _gguf_file(params.models.base.source)\n"
    "config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)\n"
    "tok = gguf_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), config)\n")


def test_the_base_materialised_under_the_pinned_transformers_ends_a_turn_where_the_gguf_says(tmp_path: Path) -> None:
    """transformers 5.17.0 reads the GGUF's EOS as ``<|im_start|>`` and no pad; the materialised tokenizer (saved and read
    back, as the trainer loads it) carries the file's own ids, so TRL appends ``<|im_end|>`` to every completion there
    as on the CPU plane (with the wrong EOS the PI's recipe was a lottery over its seed on an H200: docs/gpu.md)."""
    script = GGUF_TOKENIZER + (
        "import transformers\n"
        "from gguf import GGUFReader\n"
        "fields = GGUFReader(str(path)).fields\n"
        "meta = {n: int(fields[f'tokenizer.ggml.{k}_token_id'].contents()) for n, k in (('eos', 'eos'), ('pad', 'padding'))}\n"
        "tok.save_pretrained(sys.argv[2])\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[2])\n"
        "print(json.dumps({'transformers': transformers.__version__, 'meta': meta, 'eos': tok.eos_token,\n"
        "                  'ids': {'eos': tok.eos_token_id, 'pad': tok.pad_token_id}}))\n")
    out = run_with_gpu_releases(["-c", script, str(ROOT), str(tmp_path)], env={"HF_HUB_OFFLINE": "1"})
    assert out["transformers"] == "5.17.0"
    assert out["ids"] == out["meta"], out
    assert out["eos"] == "<|im_end|>"


def test_the_pinned_trl_trains_the_pis_rows_as_its_own_text_rows_on_the_decision_and_the_end_of_turn(tmp_path: Path) -> None:
    """trl 1.15.0 over transformers 5.17.0 builds its labels from ``train_pi.decision_rows``' tokenized form: the decision's
    first token and, with ``pi.end_of_turn``, the EOS after it, the same ids and labels TRL builds from the text rows
    (the recipe whose seeds answer alike); without it, one position a row (a tiny random model of the GGUF's
    vocabulary; nothing trains)."""
    script = GGUF_TOKENIZER + (
        "import trl\n"
        "from datasets import Dataset\n"
        "from transformers import AutoModelForCausalLM\n"
        "from trl import SFTConfig, SFTTrainer\n"
        "from pipeline.stages import train_pi\n"
        "tiny = AutoConfig.for_model('llama', vocab_size=config.vocab_size, hidden_size=64, intermediate_size=128,\n"
        "                            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)\n"
        "chat = [{'task_id': str(i), 'rollout_id': str(i), 'label': label, 'prompt': [{'role': 'user', 'content': f'Q{i}?'}],\n"
        "         'completion': [{'role': 'assistant', 'content': json.dumps({'decision': d})}]}\n"
        "        for i, (label, d) in enumerate([('yes', 'GO'), ('no', 'NO-GO'), ('maybe', 'DEFER')])]\n"
        "prefix = load_params(Path(sys.argv[1]) / 'params/learn.yaml', environ={}).agents.decision.prefix\n"
        "def built(rows, keys):\n"
        "    data = Dataset.from_list([{k: r[k] for k in keys} for r in rows])\n"
        "    trainer = SFTTrainer(model=AutoModelForCausalLM.from_config(tiny), train_dataset=data, processing_class=tok,\n"
        "                         args=SFTConfig(output_dir=sys.argv[2], completion_only_loss=True, use_cpu=True, report_to='none'))\n"
        "    return [{'ids': r['input_ids'], 'labelled': tok.decode([x for x in r['labels'] if x != -100])}\n"
        "            for r in trainer.train_dataset]\n"
        "out = {'trl': trl.__version__}\n"
        "for eot in (True, False):\n"
        "    rows = train_pi.decision_rows(chat, tok, prefix, eot)\n"
        "    out[str(eot)] = {'completions': [r['completion'] for r in rows], 'tokenized': built(rows, ('input_ids', 'completion_mask')),\n"
        "                     'text': built(rows, ('prompt', 'completion'))}\n"
        "print(json.dumps(out))\n")
    out = run_with_gpu_releases(["-c", script, str(ROOT), str(tmp_path)], env={"HF_HUB_OFFLINE": "1"})
    assert out["trl"] == "1.15.0"
    with_eot, alone = out["True"], out["False"]
    assert with_eot["completions"] == alone["completions"] == ["GO", "NO", "DEF"]
    assert [r["labelled"] for r in with_eot["tokenized"]] == ["GO<|im_end|>", "NO<|im_end|>", "DEF<|im_end|>"]
    assert with_eot["tokenized"] == with_eot["text"] == alone["text"]  # TRL's own text rows: the same ids, the same labels
    assert [r["labelled"] for r in alone["tokenized"]] == ["GO", "NO", "DEF"]
