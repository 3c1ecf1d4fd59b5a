"""Routing versions, proxy config and key handling (no services)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import load_params
from pipeline.serving import proxy, routing
from tests.conftest import ROOT, lora_safetensors

WORKERS = "[{name: base, model: models/base, port: 8101}, {name: offline, model: models/base, port: 8102}]"


@pytest.fixture
def params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(proxy.KEY_ENV, raising=False)
    (tmp_path / "versions").mkdir()
    (tmp_path / "versions" / "v1.yaml").write_text((ROOT / "serving/routing/v1.yaml").read_text())
    return load_params(ROOT / "params.yaml", environ={
        "PIPELINE__SERVING__WORKERS": WORKERS, "PIPELINE__SERVING__HOME": str(tmp_path / "home"),
        "PIPELINE__SERVING__ROUTING_DIR": str(tmp_path / "versions"),
        "PIPELINE__SERVING__PROXY__KEY_FILE": str(tmp_path / "secrets" / "key"),
        "PIPELINE__SERVING__WORKER_DEFAULTS__KEY_FILE": str(tmp_path / "secrets" / "worker_key"),
        "PIPELINE__SERVING__LIVE_FILE": str(tmp_path / "live-routing.json")})


def test_committed_version_covers_every_role() -> None:
    params = load_params(ROOT / "params.yaml", environ={})
    table = routing.load_version(params.serving, 1)
    assert set(table["roles"]) == set(params.serving.roles)


def test_write_version_numbers_and_validates(params) -> None:
    roles = {**routing.load_version(params.serving, 1)["roles"], "judge": "base/adapter-a"}
    assert routing.write_version(params.serving, roles, "judge on adapter") == 2
    assert routing.load_version(params.serving, 2)["roles"]["judge"] == "base/adapter-a"
    assert routing.expected_model(params.serving, "base/adapter-a") == "adapter-a"
    assert routing.expected_model(params.serving, "base") == "base"


@pytest.mark.parametrize("roles, message", [
    ({"judge": "base"}, "roles missing"),
    ({r: "base" for r in ["junior_researcher", "supervisor", "senior_researcher", "review_board", "judge", "intern"]}, "unknown \\['intern'\\]"),
    ({r: "nowhere" for r in ["junior_researcher", "supervisor", "senior_researcher", "review_board", "judge"]}, "no worker 'nowhere'"),
])
def test_bad_versions_are_rejected(params, roles, message) -> None:
    path = Path(params.serving.routing_dir) / "v7.yaml"
    path.write_text(yaml.safe_dump({"roles": roles}))
    with pytest.raises(routing.RoutingError, match=message):
        routing.load_version(params.serving, 7)


def test_missing_version(params) -> None:
    with pytest.raises(routing.RoutingError, match="v9.yaml: routing version 9 does not exist"):
        routing.load_version(params.serving, 9)


def test_a_baseline_without_any_routing_version_is_one_line_naming_the_folder(params) -> None:
    from pipeline import registry

    assert registry.live_target(params.serving, "supervisor") == "base"  # no live table yet: the first version's
    (Path(params.serving.routing_dir) / "v1.yaml").unlink()
    with pytest.raises(FileNotFoundError, match=r"serving.routing_dir .*versions: no routing version"):
        registry.live_target(params.serving, "supervisor")


def test_proxy_config_registers_workers_and_adapter_wildcards(params) -> None:
    cfg = yaml.safe_load(proxy.write_config(params.serving).read_text())
    names = {m["model_name"]: m["litellm_params"] for m in cfg["model_list"]}
    assert names["base"]["model"] == "hosted_vllm/base" and names["base"]["api_base"] == "http://127.0.0.1:8101/v1"
    assert names["base/*"]["model"] == "hosted_vllm/*"
    assert cfg["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"  # never the key itself
    assert cfg["litellm_settings"]["callbacks"] == "pipeline.serving.role_router.role_router"


def test_generated_key_is_private_and_stable(params) -> None:
    key = proxy.api_key(params.serving)
    path = Path(params.serving.proxy.key_file)
    assert key.startswith("sk-") and len(key) > 30
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert proxy.api_key(params.serving) == key
    os.chmod(path, 0o644)
    with pytest.raises(Exception, match="owner only"):
        proxy.api_key(params.serving)


def test_key_from_environment_wins(params, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(proxy.KEY_ENV, "sk-from-env")
    assert proxy.client_settings(params.serving) == ("http://127.0.0.1:4000/v1", "sk-from-env")
    assert not Path(params.serving.proxy.key_file).exists()


def test_worker_command_serves_in_the_configured_dtype() -> None:
    """The CPU worker in params.yaml computes in float32 (docs/benchmarks.md); unset means vLLM's auto."""
    from pipeline.serving import worker

    cpu = load_params(ROOT / "params.yaml").serving.workers[0]
    cmd = worker.command(cpu, "python")
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    gpu = cpu.model_copy(update={"dtype": "auto", "lora_modules": {"a": "adapters/a"}})
    cmd = worker.command(gpu, "python")
    assert cmd[cmd.index("--dtype") + 1] == "auto"
    assert cmd[cmd.index("--lora-modules") + 1] == f"a={(Path('adapters/a')).resolve()}"


def test_generated_versions_stay_out_of_the_tracked_folder_and_carry_policies(params) -> None:
    roles = routing.load_version(params.serving, 1)["roles"]
    number = routing.write_version(params.serving, roles, "bandit supervisor",
                                   {"supervisor_policy": "models:/supervisor_policy/2"})
    assert number == 2 and routing.versions(params.serving) == [1, 2]
    assert routing.version_path(params.serving, 2).parent == routing.generated_dir(params.serving)
    assert not (Path(params.serving.routing_dir) / "v2.yaml").exists()
    table = routing.load_version(params.serving, 2)
    assert routing.policy(table, "supervisor_policy") == "models:/supervisor_policy/2"
    assert routing.policy(routing.load_version(params.serving, 1), "supervisor_policy") == "llm"


def test_evaluation_tables_are_named_safely_and_never_fall_back(params, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    with pytest.raises(routing.RoutingError, match="letters, digits"):
        routing.eval_file(params.serving, "../live")
    roles = {**routing.load_version(params.serving, 1)["roles"], "junior_researcher": "base/cand"}
    routing.write_eval(params.serving, "cand-1", roles)
    active = proxy.active_file(params.serving)
    active.parent.mkdir(parents=True, exist_ok=True)
    active.write_text('{"version": 1, "roles": {"junior_researcher": "base"}}')
    monkeypatch.setenv("PIPELINE_ROUTING_ACTIVE", str(active))
    from pipeline.serving.role_router import RoleRouter

    router = RoleRouter()
    hook = router.async_pre_call_hook
    live = asyncio.run(hook(None, None, {"model": "junior_researcher"}, "completion"))
    assert live["model"] == "base" and live["metadata"]["routing_version"] == 1
    evald = asyncio.run(hook(None, None, {"model": "junior_researcher", "metadata": {"routing": "cand-1"}}, "completion"))
    assert evald["model"] == "base/cand" and evald["metadata"]["routing_version"] == "eval:cand-1"
    from litellm.proxy._types import ProxyException

    with pytest.raises(ProxyException, match="does not exist") as gone:  # the client's mistake: 400, never the live table
        asyncio.run(hook(None, None, {"model": "junior_researcher", "metadata": {"routing": "gone"}}, "completion"))
    assert str(gone.value.code) == "400"


def test_proxy_serves_role_names_only_and_checks_its_key(params, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit view of the two proxy hooks (the served stack's answers: test_serving_integration.py)."""
    import asyncio

    from litellm.proxy._types import ProxyException

    from pipeline.serving.auth import user_api_key_auth
    from pipeline.serving.role_router import RoleRouter

    active = proxy.active_file(params.serving)
    active.parent.mkdir(parents=True, exist_ok=True)
    active.write_text('{"version": 3, "roles": {"junior_researcher": "base/cand"}}')
    monkeypatch.setenv("PIPELINE_ROUTING_ACTIVE", str(active))
    hook = RoleRouter().async_pre_call_hook
    for name in ("base", "base/cand", "base/../../etc", "cand"):
        with pytest.raises(ProxyException, match="not a role of routing version 3") as err:
            asyncio.run(hook(None, None, {"model": name}, "completion"))
        assert err.value.code == "404"
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-right")
    assert asyncio.run(user_api_key_auth(None, "Bearer sk-right")).user_role == "proxy_admin"
    for presented, why in ((None, "missing API key"), ("", "missing API key"), ("Bearer sk-wrong", "invalid API key")):
        with pytest.raises(ProxyException, match=why) as err:
            asyncio.run(user_api_key_auth(None, presented))
        assert err.value.code == "401" and "sk-right" not in err.value.message
    settings = yaml.safe_load(proxy.write_config(params.serving).read_text())["general_settings"]
    assert settings["custom_auth"] == "pipeline.serving.auth.user_api_key_auth"


def test_the_live_table_is_tracked_and_rewritten_only_when_it_changes(params) -> None:
    """serving.live_file is a DVC dep of rollouts/evaluate: the same routing must keep the same bytes (no spurious re-run)."""
    live = Path(params.serving.live_file)
    table = routing.load_version(params.serving, 1)
    routing._track(params.serving, {**table, "applied_at": 1.0})
    first = live.read_text()
    assert json.loads(first) == {"version": 1, "roles": table["roles"], "policies": {}}
    stamp = live.stat().st_mtime_ns
    routing._track(params.serving, {**table, "applied_at": 2.0})
    assert live.stat().st_mtime_ns == stamp
    routing._track(params.serving, {**table, "version": 2, "roles": {**table["roles"], "judge": "base/adapter-a"}})
    assert json.loads(live.read_text())["version"] == 2


def test_the_committed_live_table_is_the_committed_first_version() -> None:
    """A fresh clone's first `make run` applies v1: the tracked file must already say so, or rollouts would look changed."""
    params = load_params(ROOT / "params.yaml", environ={})
    table = routing.load_version(params.serving, 1)
    assert json.loads((ROOT / params.serving.live_file).read_text()) == {"version": 1, "roles": table["roles"], "policies": {}}


def _adapter(folder: Path, rank: int, layers: list[str], **shape: Any) -> Path:
    """A PEFT adapter folder as save_pretrained writes it, with weights on ``layers``."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"}))
    (folder / "adapter_model.safetensors").write_bytes(lora_safetensors(rank, layers, **shape))
    return folder


def test_an_adapter_the_worker_would_serve_without_some_of_its_weights_is_refused(tmp_path: Path) -> None:
    """vLLM gives no LoRA path to a layer outside --lora-target-modules and loads such an adapter anyway, minus those
    weights; a rank above --max-lora-rank it refuses itself, late. Both are refused before the worker is asked."""
    from pipeline.services.process import ServiceError
    from pipeline.serving import worker

    w = load_params(ROOT / "params.yaml").serving.workers[0].model_copy(
        update={"max_lora_rank": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    cmd = worker.command(w, "python")
    assert cmd[cmd.index("--lora-target-modules") + 1:][:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert worker.adapter_shape(_adapter(tmp_path / "attn", 8, ["q_proj", "v_proj"])) == (8, {"q_proj", "v_proj"})
    worker.check_adapter(w, tmp_path / "attn")
    with pytest.raises(ServiceError, match=r"weights on \['down_proj', 'gate_proj'\].*lora_target_modules"):
        worker.check_adapter(w, _adapter(tmp_path / "mlp", 8, ["q_proj", "gate_proj", "down_proj"]))
    with pytest.raises(ServiceError, match=r"rank 16 > worker base's max_lora_rank 8"):
        worker.check_adapter(w, _adapter(tmp_path / "wide", 16, ["q_proj"]))
    with pytest.raises(ServiceError, match="rank 16"):  # the CLI's and promotion's load path checks before the request
        worker.load_lora(w, "wide", str(tmp_path / "wide"))
    worker.check_adapter(w.model_copy(update={"max_lora_rank": 16, "lora_target_modules": None}), tmp_path / "mlp")
    (tmp_path / "mlp" / "adapter_model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ServiceError, match=r"adapter_model.safetensors: not a safetensors file \(header length"):
        worker.check_adapter(w, tmp_path / "mlp")


def test_an_adapter_trained_on_another_base_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """A CPU adapter (SmolLM2-135M, hidden 576) deployed to a worker serving the GPU profile's Qwen2.5-1.5B (hidden 1536)
    is refused before the worker is asked, with the tensor and the shapes; so is one on a layer the model lacks."""
    from pipeline.services.process import ServiceError
    from pipeline.serving import worker

    qwen = tmp_path / "qwen2.5-1.5b"  # the model folder's config.json is all the check reads
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
                                                 "intermediate_size": 8960, "num_hidden_layers": 28}))
    smol = tmp_path / "smollm2-135m"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                                                 "head_dim": 64, "intermediate_size": 1536, "num_hidden_layers": 30}))
    w = load_params(ROOT / "params.yaml").serving.workers[0].model_copy(
        update={"max_lora_rank": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    cpu_adapter = _adapter(tmp_path / "cpu", 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    worker.check_adapter(w.model_copy(update={"model": str(smol)}), cpu_adapter)
    assert worker.base_dims(str(qwen)) == (28, {"q_proj": (1536, 1536), "k_proj": (1536, 256), "v_proj": (1536, 256),
                                                "o_proj": (1536, 1536), "gate_proj": (1536, 8960), "up_proj": (1536, 8960),
                                                "down_proj": (8960, 1536)})
    with pytest.raises(ServiceError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight is \[8, 576\].*maps 1536 -> 1536"):
        worker.check_adapter(w.model_copy(update={"model": str(qwen)}), cpu_adapter)
    with pytest.raises(ServiceError, match="another base model"):  # the CLI's load path refuses it before the request too
        worker.load_lora(w.model_copy(update={"model": str(qwen)}), "cpu", str(cpu_adapter))
    deep = _adapter(tmp_path / "deep", 8, ["q_proj"], decoder_layers=31)
    with pytest.raises(ServiceError, match=r"layers\.30\..* has 30 layers"):
        worker.check_adapter(w.model_copy(update={"model": str(smol)}), deep)
    worker.check_adapter(w.model_copy(update={"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}), deep)  # not readable here


def test_params_whose_trained_adapters_cannot_be_served_are_refused(tmp_path: Path) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["serving"]["worker_defaults"].update(max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    params["sft"]["lora"]["r"] = 8
    params["ppo"]["lora"]["r"] = 8
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ValueError, match=r"sft\.lora vs serving\.workers\[base\]: \['k_proj', 'o_proj'\] have no LoRA path"):
        load_params(tmp_path / "params.yaml", environ={})
    params["serving"]["worker_defaults"]["lora_target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    params["ppo"]["lora"]["r"] = 16
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ValueError, match=r"ppo\.lora vs serving\.workers\[base\]: rank 16 > max_lora_rank 8"):
        load_params(tmp_path / "params.yaml", environ={})


HEALTHY = ("import http.server, sys\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self): self.send_response(200); self.end_headers()\n"
           "    def log_message(self, *a): pass\n"
           "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def test_a_running_worker_started_with_other_settings_is_restarted_not_reused(tmp_path: Path, params,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker left running by an earlier `make run` is reused only if it was started exactly as params now ask:
    after a change of chunked_prefill (the flags seeded calls need on CPU) or of the KV cache it is restarted with
    the new settings. The worker here is a stand-in HTTP server started with the worker's own argv appended."""
    import sys

    from pipeline.services.process import free_port
    from pipeline.serving import worker

    real = worker.command
    monkeypatch.setattr(worker, "command", lambda w, python: [sys.executable, "-c", HEALTHY, str(w.port), *real(w, python)[3:]])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    w = params.serving.workers[0].model_copy(update={"model": str(model), "port": free_port()})

    def cmdline() -> str:
        pid = worker.service(params.serving, w).pid()
        assert pid is not None
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")

    try:
        worker.up(params.serving, w)
        first = worker.service(params.serving, w).pid()
        assert "--no-enable-chunked-prefill" in cmdline()
        worker.up(params.serving, w)
        assert worker.service(params.serving, w).pid() == first  # the same settings: reused
        w = w.model_copy(update={"chunked_prefill": True})
        worker.up(params.serving, w)
        second = worker.service(params.serving, w).pid()
        assert second != first and "--enable-chunked-prefill" in cmdline()
        w = w.model_copy(update={"kv_cache_gib": w.kv_cache_gib + 1})
        worker.up(params.serving, w)
        third = worker.service(params.serving, w).pid()
        assert third not in (first, second)
        Path(w.key_file).unlink()  # the worker's key rotated: restarted with the new one, which is never recorded
        worker.up(params.serving, w)
        fourth = worker.service(params.serving, w).pid()
        assert fourth not in (first, second, third)
        key = worker.api_key(w)
        assert f"{worker.KEY_ENV}={key}".encode() in Path(f"/proc/{fourth}/environ").read_bytes().split(b"\0")
        assert key not in worker.service(params.serving, w).meta_file.read_text()
    finally:
        worker.down(params.serving, w)


def test_a_running_proxy_started_with_other_deployments_is_restarted_not_reused(params,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's config comes from params (its deployments: one per worker, their addresses and timeouts). A proxy
    left running by an earlier run is reused only while params would write the same config: after a worker moves to
    another port it is restarted, and its litellm.yaml names the new address. The proxy here is a stand-in HTTP server
    started with the proxy's own argv appended; its keys stay out of what it records."""
    import sys

    from pipeline.services.process import Service, free_port

    real = proxy._command
    monkeypatch.setattr(proxy, "_command", lambda s, host: [sys.executable, "-c", HEALTHY, str(s.proxy.port), *real(s, host)])
    serving = params.serving.model_copy(update={"proxy": params.serving.proxy.model_copy(update={"port": free_port()})})
    service = Service("proxy", Path(serving.home).resolve())
    try:
        proxy.up(serving)
        first = service.pid()
        assert first is not None
        proxy.up(serving)
        assert service.pid() == first  # the same params: reused
        moved = serving.workers[0].model_copy(update={"port": serving.workers[0].port + 1})
        serving = serving.model_copy(update={"workers": [moved, *serving.workers[1:]]})
        proxy.up(serving)
        second = service.pid()
        assert second not in (None, first)
        cfg = yaml.safe_load((Path(serving.home) / "litellm.yaml").read_text())
        bases = {m["litellm_params"]["api_base"] for m in cfg["model_list"] if m["model_name"] == moved.name}
        assert bases == {f"http://{moved.host}:{moved.port}/v1"}
        recorded = service.meta_file.read_text()
        assert proxy.api_key(serving) not in recorded and "os.environ/LITELLM_MASTER_KEY" in recorded
        # a rotated key (the key file replaced): the proxy still holding the old one would refuse every client
        key_file = Path(serving.proxy.key_file)
        key_file.unlink()
        new_key = proxy.api_key(serving)  # generated anew, 0600
        proxy.up(serving)
        third = service.pid()
        assert third not in (None, first, second)
        assert f"{proxy.KEY_ENV}={new_key}".encode() in Path(f"/proc/{third}/environ").read_bytes().split(b"\0")
        assert new_key not in service.meta_file.read_text()
        proxy.up(serving)
        assert service.pid() == third  # the same key: reused
    finally:
        proxy.down(serving)


@pytest.mark.parametrize("change", ["junior_researcher=base/../../etc", "judge=base;touch x", "judge=../base", "judge",
                                    "supervisor_policy=file:///etc/passwd", "judge=nowhere/adapter"])
def test_route_new_refuses_a_bad_name_and_writes_nothing(params, change: str, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    before = sorted(p.name for p in routing.generated_dir(params.serving).glob("*")) if routing.generated_dir(
        params.serving).exists() else []
    args = argparse.Namespace(action="new", set=[change], prompt=[], description="hostile", version=None)
    with pytest.raises(routing.RoutingError) as refused:  # the CLI's one line on stderr (tests/test_cli.py)
        routing.check(args, params)  # what the CLI calls before it starts any service
    assert "\n" not in str(refused.value)
    after = sorted(p.name for p in routing.generated_dir(params.serving).glob("*")) if routing.generated_dir(
        params.serving).exists() else []
    assert after == before and routing.versions(params.serving) == [1]
