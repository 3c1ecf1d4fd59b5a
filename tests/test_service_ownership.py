"""Two clones on one machine never share services: a stage refuses another project's server (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.services.process import free_port, http_ok
from tests.conftest import ROOT, copy_project, mlflow_login

pytestmark = pytest.mark.slow

FAKE_VLLM = textwrap.dedent("""
    import http.server, json, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "other-model", "root": "/elsewhere/model"}]}).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE__", "MLFLOW_TRACKING_URI"))}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "PYTHONPATH": "", **extra}


def _pipeline(clone: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=clone, env=env, capture_output=True, text=True, timeout=300)


def test_second_clone_refuses_first_clones_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    a, b = copy_project(tmp_path / "a"), copy_project(tmp_path / "b")
    port, worker_port = free_port(), free_port()
    env = _env(PIPELINE__MLFLOW__PORT=str(port))
    up = _pipeline(a, env, "services", "up", "mlflow")
    assert up.returncode == 0, up.stderr[-2000:]
    fake = subprocess.Popen([sys.executable, "-c", FAKE_VLLM, str(worker_port)])
    try:
        pid_a = (a / ".mlflow/mlflow.pid").read_text()
        assert _pipeline(a, env, "services", "up", "mlflow").returncode == 0
        assert (a / ".mlflow/mlflow.pid").read_text() == pid_a  # its own server is reused, not restarted

        second = _pipeline(b, {**env, "PIPELINE_RUN_ID": "clone-b"}, "ingest")
        assert second.returncode != 0
        err = second.stderr
        assert f"port {port} on 127.0.0.1 is held by an MLflow" in err and "which this checkout did not start" in err
        assert "mlflow.port" in err

        import mlflow

        for name, value in mlflow_login("reader").items():  # this process's own login, whatever ran before it
            monkeypatch.setenv(name, value)
        client = mlflow.MlflowClient(f"http://127.0.0.1:{port}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        assert client.search_runs(experiments, filter_string="tags.`pipeline.run_id` = 'clone-b'") == []

        deadline = time.monotonic() + 10
        while not http_ok(f"http://127.0.0.1:{worker_port}/health") and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = f"[{{name: base, model: models/base, port: {worker_port}}}]"
        # clone b has no model plane of its own (no .venv/model): who holds the port is still what it is told first
        bare = {k: v for k, v in env.items() if k != "PIPELINE_MODEL_PYTHON"} | {"PIPELINE__SERVING__WORKERS": workers}
        serve = _pipeline(b, bare, "serve", "up")
        assert serve.returncode != 0
        assert f"port {worker_port} on 127.0.0.1 is held by an OpenAI-compatible server serving other-model (/elsewhere/model)" in serve.stderr
        assert "serving.workers[base].port" in serve.stderr and "Traceback" not in serve.stderr
        free = f"[{{name: base, model: models/base, port: {free_port()}}}]"  # a free port: then the missing interpreter, in one line
        serve = _pipeline(b, {**bare, "PIPELINE__SERVING__WORKERS": free}, "serve", "up")
        assert serve.returncode == 1 and "model-plane interpreter not found" in serve.stderr and "Traceback" not in serve.stderr

        down = _pipeline(b, env, "services", "down", "all")  # `make services-down` in clone b
        assert down.returncode == 0 and "mlflow: not running" in down.stdout
        assert http_ok(f"http://127.0.0.1:{port}/health"), "clone b stopped clone a's MLflow"
    finally:
        fake.terminate()
        _pipeline(a, env, "services", "down", "mlflow")
    assert not http_ok(f"http://127.0.0.1:{port}/health")


def test_services_starting_side_by_side_read_one_whole_generated_key(tmp_path: Path) -> None:
    """The proxy and the workers start side by side and each reads (or generates) the same key file: every process gets
    the same whole key, none an empty file another was still writing, and the file is its owner's only."""
    script = textwrap.dedent("""
        import sys, time
        from pipeline.serving.keys import read_or_create
        time.sleep(float(sys.argv[2]) - time.time())  # all start at once
        print(read_or_create(sys.argv[1]))
    """)
    path, start = tmp_path / "secrets" / "worker_key", time.time() + 3
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    keys = {out.strip() for out, _ in outs}
    assert len(keys) == 1 and next(iter(keys)).startswith("sk-") and len(next(iter(keys))) > 20
    assert path.read_text().strip() in keys and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["worker_key"]  # no temporary file left beside it
