"""`python -m pipeline <command>`: what a refusal looks like to the person who ran it (fast, no services)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from pipeline import cli
from pipeline.registry import RegistryError
from pipeline.serving.routing import RoutingError
from pipeline.versions import VersionError


@pytest.mark.parametrize("error", [RegistryError, VersionError, RoutingError])
def test_a_registry_version_or_routing_refusal_ends_in_one_line(error: type[Exception], monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """A candidate whose artifact no longer matches its digest (deploy's RegistryError), a version the journal does not
    know (VersionError), a routing table that cannot be served: `evaluate` or `report` says so in one line, exit 1."""
    why = "senior_researcher v3: the registry's artifact has sha256 ab12, its sha256 tag says cd34"

    def main(args: object, params: object) -> int:
        raise error(why)

    module = types.ModuleType("refusing_command")
    module.add_arguments, module.main, module.TRACKING = (lambda parser: None), main, False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "refusing_command", module)
    monkeypatch.setitem(cli.COMMANDS, "evaluate", ("refusing_command", "refuses"))
    assert cli.main(["evaluate"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {why}"]


def test_a_trainers_unknown_role_is_refused_before_any_service_starts(project, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A typo in --role ends in one line naming the params' list, and leaves no MLflow server behind."""
    import socket

    from pipeline.services.process import free_port

    port = free_port()
    monkeypatch.setenv("PIPELINE__MLFLOW__PORT", str(port))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train-sft", "--role", "judge"])
    assert str(exit_.value) == "error: --role 'judge': sft.roles in params.yaml lists ['junior_researcher']"
    assert not (project / ".mlflow").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there


def test_a_refused_argument_or_a_file_only_command_starts_no_service(project, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """A typo in `rollback`, `register-aa`, `promote --approve` or `route new` is refused in one line on stderr before
    MLflow or a worker starts; `run outputs`, `report --summary` and `route status` read files only."""
    import socket

    from pipeline.services.process import free_port

    port = free_port()
    monkeypatch.setenv("PIPELINE__MLFLOW__PORT", str(port))
    assert cli.main(["rollback", "judgee"]) == 1
    from pipeline.config import load_params

    roles = list(load_params("params.yaml").promote.roles)
    assert capsys.readouterr().err.strip().splitlines() == [f"error: unknown role 'judgee'; trainable roles are {roles}"]
    assert cli.main(["register-aa", "judgee"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: 'judgee' is not a trainable role (promote.roles: {sorted(roles)})"]
    assert cli.main(["promote", "--approve", "judgee"]) == 1  # a typo costs no vLLM worker's start
    assert capsys.readouterr().err == ("error: judgee is not awaiting approval in reports/promotion.json (its decision: none; "
                                       "awaiting: nothing)\n")
    with pytest.raises(SystemExit):  # argparse's refusal (exit 2), before the serving stack the smoke run needs
        cli.main(["agl-collect", "--tasks", "0"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: argument --tasks: 0: must be 1 or more")
    assert cli.main(["promote", "--approve", ""]) == 1  # `--approve "$KEY"` with KEY unset: an answer, not the whole gate
    assert capsys.readouterr().err.startswith("error: '' is not awaiting approval in reports/promotion.json")
    assert cli.main(["run", "outputs"]) == 0 and "registry" in capsys.readouterr().out
    assert cli.main(["report", "--summary"]) == 0 and capsys.readouterr().out.strip() == ""  # no cycle yet: nothing to say
    # `route new` with a typo, on stderr where a script piping `route status` does not read it; `route status` reads files
    import shutil

    from tests.conftest import ROOT

    shutil.copytree(ROOT / "serving/routing", project / "serving/routing", dirs_exist_ok=True)
    assert cli.main(["route", "new", "--set", "judgee=base"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: --set judgee=...: neither a role") and out.err.count("\n") == 1
    assert cli.main(["route", "apply", "--version", "0"]) == 1  # not "the newest"
    assert capsys.readouterr().err == "error: routing version 0 does not exist (have [1])\n"
    assert cli.main(["route", "status"]) == 0 and json.loads(capsys.readouterr().out)["versions"] == [1]
    assert not (project / ".mlflow").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_report_summary_prints_the_cycles_decisions_and_test_figures_from_their_files(project, capsys: pytest.CaptureFixture) -> None:
    """What `make learn` ends with: the gate's decision, then the society as served before and after and the PI's
    role-level figures, each with its n and interval, read back through the files' contracts."""
    from pipeline.contracts import Level, PromotionDecision, PromotionReport, TestReport
    from pipeline.evaluation.role_level import metrics
    from pipeline.io import write_json

    def records(right: int, failed: int = 0) -> list[dict]:  # 10 yes/no questions, ``right`` answered right
        return [{"task_id": str(i), "label": "yes" if i % 2 else "no", "status": "failed" if i < failed else "ok",
                 "decision": None if i < failed else ("GO" if (i % 2) == (i < right) else "NO-GO"),
                 "p_go": 0.9 if (i % 2) == (i < right) else 0.1, "reward": 0.5, "scores": {}} for i in range(10)]

    society = {which: metrics(records(r, f), "reasoning_free", 200, 0.95, 0, Level.SOCIETY) for which, r, f in
               (("after", 7, 1), ("before", 5, 0))}
    role = {which: metrics(records(r), "reasoning_free", 200) for which, r in (("after", 9), ("before", 6))}
    report = TestReport.model_validate({
        "questions": 10, "setting": "reasoning_free", "routing_version": 3, "predictions": "role_level",
        "official": {"accuracy": 0.9, "macro_f1": 0.9},
        "society": {"questions": 10, **society, "before_version": "1",
                    "cost": {"seconds": 42.0, "societies": 2, "seconds_per_question": 4.2}},
        "role_level": {"principal_investigator": {"questions": 10, "setting": "reasoning_free", "maybe_answer": "DEFER",
                                                  "champion": "2", "previous_champion": "1", **role, "seconds": {},
                                                  "mcnemar": {"b": 3, "c": 0, "n": 10, "p_value": 0.125}}}})
    write_json(project / "reports/test.json", report.model_dump(mode="json", exclude_unset=True))
    decision = PromotionDecision(candidate="2", status="promoted", rule="significant", detail="p=0.01 < 0.05")
    write_json(project / "reports/promotion.json",
               PromotionReport(promoted=["principal_investigator"], decisions={"principal_investigator": decision}).model_dump())
    assert cli.main(["report", "--summary"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "promotion: principal_investigator v2: promoted (significant): p=0.01 < 0.05"
    assert out[1] == "champions: {}; routing version live: vNone"
    out = out[1:]
    assert "the society as served after: official accuracy 0.600" in out[1] and "failed 1/10" in out[1]
    assert "the society as served before (v1)" in out[2] and "yes/no 0.500" in out[2] and "(n=10" in out[2]
    assert any("principal_investigator after (v2), the role level: official accuracy 0.900" in line and "AUC 0.9" in line
               for line in out)
    assert any("principal_investigator after vs before, exact McNemar on 10 yes/no questions: b=3 c=0" in line for line in out)


def test_a_stage_file_that_breaks_its_contract_is_refused_in_one_line_naming_file_and_key(project,
                                                                                        capsys: pytest.CaptureFixture) -> None:
    """A hand-edited or cut-short reports file: `report --summary` (and promote, the report, the DAG, which read it the
    same way) says which file, which key and which rule, in one line; no traceback."""
    (project / "reports").mkdir()
    (project / "reports/promotion.json").write_text('{"promoted": [], "decisions": {"pi": {"candidate": "2"}}}')
    assert cli.main(["report", "--summary"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: reports/promotion.json: decisions.pi.status: Field required (not a PromotionReport; 3 error(s))"]
    (project / "reports/promotion.json").write_text('{"promoted": [], "decisions": {}')  # cut short
    assert cli.main(["report", "--summary"]) == 1
    assert capsys.readouterr().err.startswith("error: reports/promotion.json: the file: Invalid JSON")
    (project / "reports/promotion.json").write_bytes(b'{"promoted": ["\xff"]}')  # not UTF-8
    assert cli.main(["report", "--summary"]) == 1
    assert capsys.readouterr().err.startswith("error: reports/promotion.json: the file: Invalid JSON: invalid unicode")
    (project / "reports/promotion.json").unlink()
    (project / "reports/promotion.json").mkdir()
    assert cli.main(["report", "--summary"]) == 1
    assert capsys.readouterr().err.strip() == "error: reports/promotion.json: cannot be read: Is a directory"


def test_a_stage_run_before_its_input_exists_names_the_file_and_the_stage_that_writes_it(project,
                                                                                         capsys: pytest.CaptureFixture) -> None:
    """`build-index` or `train-pi` typed before `validate` ran: one line, not pyarrow's traceback or its bare path."""
    for command in ("build-index", "train-pi"):
        assert cli.main([command, "--no-mlflow"]) == 1
        assert capsys.readouterr().err == "error: data/validated/train.parquet: missing; run `python -m pipeline validate` first\n"


def test_a_hand_load_or_unload_of_an_adapter_that_cannot_happen_is_one_line(project, monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """`serve load-lora` of a folder that is not an adapter, `serve unload-lora` on a worker that is down: one line naming
    the worker, no traceback."""
    from pipeline.services.process import free_port

    port = free_port()
    monkeypatch.setenv("PIPELINE__SERVING__WORKERS", f'[{{name: base, model: models/base, port: {port}, dtype: float32}}]')
    assert cli.main(["serve", "load-lora", "--worker", "base", "--name", "x", "--path", "nowhere"]) == 1
    assert capsys.readouterr().err == (f"error: base (http://127.0.0.1:{port}): nowhere: not a PEFT adapter folder "
                                       "(no adapter_config.json)\n")
    assert cli.main(["serve", "unload-lora", "--worker", "base", "--name", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: base (http://127.0.0.1:{port}): ") and err.count("\n") == 1, err


def test_a_model_source_that_cannot_be_materialised_is_one_line(project, monkeypatch: pytest.MonkeyPatch,
                                                                capfd: pytest.CaptureFixture) -> None:
    """A typo in models.base.source, or an s3:// source on the CPU model plane (no boto3 there): the model plane's one
    line, not its traceback, and no models/ folder half-written."""
    monkeypatch.setenv("PIPELINE__MODELS__BASE__SOURCE", str(project / "nowhere"))
    assert cli.main(["materialize-model", "--no-mlflow", "--which", "base"]) == 1
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: models.base.source: {project / 'nowhere'} is not a folder (use gguf:, hf:// or s3://)"]
    assert not (project / "models").exists()


def test_status_does_not_call_another_checkouts_proxy_or_worker_ours(project, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """Something answering on serving.proxy.port, or a worker's port, that this checkout did not start (another checkout's)
    is not reported as this checkout's proxy being up, and `serve status` says it was not started here: `up` refuses both."""
    import http.server
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "theirs"}]}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        monkeypatch.setenv("PIPELINE__SERVING__PROXY__PORT", str(port))
        assert cli.main(["proxy", "status"]) == 0
        assert capsys.readouterr().out == (f"proxy: down; http://127.0.0.1:{port} answers, but from a proxy this checkout "
                                           "did not start (`up` refuses it)\n")
        monkeypatch.setenv("PIPELINE__SERVING__WORKERS", f"[{{name: base, model: models/base, port: {port}}}]")
        assert cli.main(["serve", "status"]) == 0  # the same for a worker
        assert json.loads(capsys.readouterr().out) == {"worker": "base", "url": f"http://127.0.0.1:{port}", "healthy": True,
                                                      "started_here": False, "models": ["theirs"]}
    finally:
        server.shutdown()
        server.server_close()
    assert cli.main(["proxy", "status"]) == 0 and capsys.readouterr().out == f"proxy: down at http://127.0.0.1:{port}\n"
