"""Start, supervise and stop Agent Lightning's ``agl-server`` (gateway + store) and ``agl-controller``.

Both are Hydra apps of the control-plane environment; we pass only overrides, never the key (it
stays in the environment: ``key=${oc.env:AGL_KEY}``), and point Hydra's run directory under
``serving.home`` so nothing lands in the repository. ``Gateway.check()`` raises naming the process
that died and the tail of its log; ``train_ppo`` calls it while the trainer runs.

Where rollouts run decides where the gateway must be reachable: the local runner's subprocesses and
the trainer reach it on loopback; the k8s runner's Jobs run in other pods, so the server binds
``ppo.agl.host`` (0.0.0.0) and the controller hands the Jobs ``ppo.agl.advertise_url`` (a Service in
front of this pod, infra/k8s/agl-gateway.yaml) as ``agl_server.agent_url``; the Jobs go to
``ppo.agl.k8s_namespace``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import AglParams, ServingParams
from pipeline.envs import REPO_ROOT, pythonpath
from pipeline.rl import store
from pipeline.services.process import Service, ServiceError, free_port, http_ok, port_is_free, stop

UPSTREAM_KEY_ENV = "AGL_UPSTREAM_KEY"  # read by pipeline.rl.agl_server (the gateway's upstream client sends it)

AGENT_CLASS = "pipeline.rl.agent:SocietyAgent"
HOOKS_FILE = str(REPO_ROOT / "pipeline" / "rl" / "hooks.py")


@dataclass
class Gateway:
    url: str
    key: str
    model_name: str
    home: Path
    agent_url: str = ""  # the gateway as the rollouts reach it (= url for the local runner)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = self.home / f"{name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise ServiceError(f"{name} exited with code {proc.returncode} (log {log}):\n{tail}")

    def service(self, name: str) -> Service:
        return Service(name, self.home)


def _spawn(home: Path, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=os.getcwd(), start_new_session=True)
    log.close()
    Service(name, home).pid_file.write_text(str(proc.pid))
    return proc


def local_host(agl: AglParams) -> str:
    """Where processes of this pod (the controller, the trainer) reach the server: loopback when it binds every address."""
    try:
        return "127.0.0.1" if ipaddress.ip_address(agl.host).is_unspecified else agl.host
    except ValueError:
        return agl.host


def controller_overrides(agl: AglParams, url: str) -> list[str]:
    """agl-controller's Hydra overrides (AGL 1.0.2 config/controller.yaml): the store at ``url``; with the k8s runner,
    the Jobs' namespace and the URL they reach the gateway at (``agl_server.agent_url``, their AGL_OPENAI_BASE_URL)."""
    out = [f"runner_type={agl.runner}", f"agl_server.url={url}", "agl_server.key=${oc.env:AGL_KEY}"]
    if agl.runner == "local":
        return [*out, f"local_runner.maximum_size={agl.max_parallel}", f"local_runner.poll_interval={agl.poll_s}"]
    return [*out, f"agl_server.agent_url={agl.advertise_url}", f"k8s_runner.namespace={agl.k8s_namespace}",
            f"k8s_runner.poll_interval={agl.poll_s}"]


@contextmanager
def running(agl: AglParams, serving: ServingParams, model_name: str, temperature: float, run_id: str = "agl",
            python: str | None = None, trace_dir: str | Path | None = None, upstream_key: str | None = None,
            trained: str | None = None) -> Iterator[Gateway]:
    """agl-server + agl-controller (``ppo.agl.runner``) up for the block; both stopped after, whatever happened.
    ``upstream_key``: what the policy server registered with the gateway requires (a local vLLM worker's key); the
    gateway sends it on every forwarded call (``pipeline.rl.agl_server``), agents never see it. ``trained``: the role
    whose calls the rollouts send to the gateway (None: every role of ``ppo.roles``, pipeline/rl/agent.py).
    ``temperature``: what the gateway samples training rollouts at (``ppo.temperature``, the temperature verl's actor
    computes their log-probabilities at); Agent Lightning's own default (1) would hold whatever the params say."""
    home = Path(serving.home).resolve() / "agl"
    if agl.runner == "k8s":  # the Service behind advertise_url forwards to this port: no fallback
        if not port_is_free(agl.host, agl.port):
            raise ServiceError(f"ppo.agl.port {agl.port} on {agl.host} is taken; rollout Jobs reach the gateway at "
                               f"{agl.advertise_url}, whose Service forwards to that port")
        port = agl.port
    else:
        port = agl.port if port_is_free(agl.host, agl.port) else free_port(agl.host)
    url = f"http://{local_host(agl)}:{port}"
    key = os.environ.get(agl.key_env) or secrets.token_urlsafe(24)
    python = python or sys.executable
    env = {**os.environ, "AGL_KEY": key,
           "PYTHONPATH": pythonpath(),
           store.TRACE_DIR_ENV: str(Path(trace_dir or agl.trace_dir).resolve()), store.RUN_ENV: run_id,
           **({store.ROLE_ENV: trained} if trained else {})}
    env.pop(UPSTREAM_KEY_ENV, None)  # the controller and the agents it spawns never hold the upstream's key
    server_env = {**env, UPSTREAM_KEY_ENV: upstream_key} if upstream_key else env
    hydra = [f"hydra.run.dir={home}/hydra", "hydra.output_subdir=null"]
    gw = Gateway(url=url, key=key, model_name=model_name, home=home,
                 agent_url=(agl.advertise_url or url) if agl.runner == "k8s" else url)
    try:
        gw.procs["agl-server"] = _spawn(home, "agl-server", [python, "-m", "pipeline.rl.agl_server", f"host={agl.host}",
                                                            f"port={port}", "key=${oc.env:AGL_KEY}",
                                                            f"default_proxy.model_name={model_name}",
                                                            f"default_proxy.train.temperature={temperature}", *hydra], server_env)
        deadline = time.monotonic() + agl.startup_timeout_s
        while not http_ok(f"{url}/healthz"):
            gw.check()
            if time.monotonic() > deadline:
                raise ServiceError(f"agl-server not healthy at {url}/healthz after {agl.startup_timeout_s:.0f}s "
                                   f"(log {home}/agl-server.log)")
            time.sleep(0.3)
        gw.procs["agl-controller"] = _spawn(home, "agl-controller", [python, "-m", "agentlightning.controller",
                                                                    *controller_overrides(agl, url), *hydra], env)
        time.sleep(1.0)
        gw.check()
        yield gw
    finally:
        for name in ("agl-controller", "agl-server"):
            if name in gw.procs:
                stop(gw.service(name), grace_s=10)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    gw.procs[name].wait(10)  # reap it


def rollout_config(agl: AglParams) -> dict[str, object]:
    """What each enqueued rollout carries for the controller: the agent class and the task in its env."""
    config: dict[str, object] = {"timeout_seconds": agl.rollout_timeout_s,
                                 "local": {"agent_class": AGENT_CLASS, "env_map": {"PUBMEDQA_TASK": "input"}}}
    if agl.runner == "k8s":
        config["k8s"] = {"job_template": Path(agl.job_template).read_text()}
    return config
