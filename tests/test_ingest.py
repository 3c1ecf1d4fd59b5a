from __future__ import annotations

import json
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import load_params
from pipeline.data.pubmedqa import load_tasks, split_tasks
from pipeline.data.sources import SourceError
from pipeline.stages import ingest
from tests.conftest import SOURCE, TEST_IDS, set_param

CHUNK_BYTES = 4096


def _splits(root: Path) -> dict[str, pd.DataFrame]:
    return {s: pd.read_parquet(root / "data" / "tasks" / f"{s}.parquet") for s in ("train", "val", "test")}


def test_ingest_official_test_split_and_stratified_val(project: Path) -> None:
    result = ingest.run(load_params())
    frames = _splits(project)
    test_ids = set(json.loads(TEST_IDS.read_text()))
    assert set(frames["test"]["id"]) == test_ids
    assert len(frames["train"]) == 400 and len(frames["val"]) == 100
    assert result["val"]["rows"] == 100
    pool = pd.concat([frames["train"], frames["val"]])
    for label in ("yes", "no", "maybe"):
        share = (pool["final_decision"] == label).mean()
        assert abs((frames["val"]["final_decision"] == label).mean() - share) < 0.02
    row = frames["train"].iloc[0]
    assert isinstance(row["question"], str) and len(row["contexts"]) >= 1 and len(row["meshes"]) >= 1
    assert json.loads((project / "reports" / "ingest.json").read_text())["rows"] == 1000


def test_split_is_seeded_and_order_independent(pubmedqa: dict) -> None:
    tasks = load_tasks(str(SOURCE))
    test_ids = json.loads(TEST_IDS.read_text())
    a = split_tasks(tasks, test_ids, 0.2, seed=1).set_index("id")["split"]
    b = split_tasks(tasks.sample(frac=1.0, random_state=3), test_ids, 0.2, seed=1).set_index("id")["split"]
    c = split_tasks(tasks, test_ids, 0.2, seed=2).set_index("id")["split"]
    assert a.sort_index().equals(b.sort_index())
    assert not a.sort_index().equals(c.sort_index())


def test_duplicate_ids_are_kept_for_validate(tmp_path: Path, pubmedqa: dict) -> None:
    first = next(iter(pubmedqa))
    body = json.dumps(pubmedqa)[:-1] + f', "{first}": {json.dumps(pubmedqa[first])}}}'
    path = tmp_path / "dup.json"
    path.write_text(body)
    tasks = load_tasks(str(path))
    assert len(tasks) == 1001
    assert (tasks["id"] == first).sum() == 2


def test_hugging_face_row_layout(tmp_path: Path, pubmedqa: dict) -> None:
    rows = [{"pubid": int(k), "question": v["QUESTION"], "context": {"contexts": v["CONTEXTS"], "labels": v["LABELS"],
             "meshes": v["MESHES"]}, "long_answer": v["LONG_ANSWER"], "final_decision": v["final_decision"]}
            for k, v in list(pubmedqa.items())[:5]]
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(rows))
    tasks = load_tasks(str(path))
    assert list(tasks["id"]) == list(pubmedqa)[:5]
    assert tasks.iloc[0]["contexts"] == pubmedqa[tasks.iloc[0]["id"]]["CONTEXTS"]


def test_bad_sources_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="nope.json: file not found"):
        load_tasks(str(tmp_path / "nope.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"1": {"QUESTION": ')
    with pytest.raises(SourceError, match=r"broken.json: not valid JSON \(line 1"):
        load_tasks(str(broken))
    with pytest.raises(SourceError, match="unsupported scheme 'ftp'"):
        load_tasks("ftp://host/x.json")


def test_failed_ingest_keeps_previous_outputs(project: Path) -> None:
    ingest.run(load_params())
    before = (project / "data" / "tasks" / "train.parquet").read_bytes()
    set_param(project, "data.source", str(project / "missing.json"))
    with pytest.raises(SourceError):
        ingest.run(load_params())
    assert (project / "data" / "tasks" / "train.parquet").read_bytes() == before


def test_http_source(project: Path) -> None:
    handler = partial(SimpleHTTPRequestHandler, directory=str(SOURCE.parent))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        set_param(project, "data.source", f"{base}/{SOURCE.name}")
        set_param(project, "data.test_ids", f"{base}/{TEST_IDS.name}")
        with pytest.raises(SourceError, match="scheme 'http' is not in data.allow.schemes"):
            ingest.run(load_params())  # the defaults allow https only
        set_param(project, "data.allow.schemes", ["file", "http"])
        with pytest.raises(SourceError, match="host '127.0.0.1' is not in data.allow.hosts"):
            ingest.run(load_params())
        set_param(project, "data.allow.hosts", ["127.0.0.1"])
        assert ingest.run(load_params())["rows"] == 1000
        set_param(project, "data.allow.max_bytes", 1000)
        with pytest.raises(SourceError, match="over the cap of 1000 bytes"):
            ingest.run(load_params())
    finally:
        server.shutdown()


def test_source_pin_deadline_and_local_roots(project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """What a DAG run's data_source may name, and the bytes it must be: checked before anything is stored."""
    import hashlib
    import socket

    from pipeline.config import SourceAllowParams
    from pipeline.data.sources import read_bytes

    outside = tmp_path_factory.mktemp("elsewhere") / "x.json"
    outside.write_text("{}")
    set_param(project, "data.source", str(outside))
    with pytest.raises(SourceError, match="outside data.allow.local_roots"):
        ingest.run(load_params())
    assert not (project / "data/tasks").exists()  # nothing written
    set_param(project, "data.source", str(SOURCE))
    set_param(project, "data.source_sha256", "0" * 64)
    with pytest.raises(SourceError, match="does not match the pinned"):
        ingest.run(load_params())
    set_param(project, "data.source_sha256", hashlib.sha256(SOURCE.read_bytes()).hexdigest())
    assert ingest.run(load_params())["rows"] == 1000
    # a server that answers its headers and then trickles: the total deadline stops it, not the socket timeout
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def trickle() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        try:
            for _ in range(100):
                conn.sendall(b" " * CHUNK_BYTES)
                time.sleep(0.2)
        except OSError:
            pass
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    allow = SourceAllowParams(schemes=["http"], hosts=["127.0.0.1"], local_roots=[], max_bytes=1 << 30, deadline_s=1.0, retries=0)
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="deadline"):
        read_bytes(f"http://127.0.0.1:{srv.getsockname()[1]}/slow.json", timeout_s=30, allow=allow)
    assert time.monotonic() - t0 < 5
    srv.close()


@pytest.mark.slow
def test_s3_source_against_moto_server(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 against a real S3 API (moto's server mode on loopback), as with MinIO in infra/."""
    import boto3
    from moto.server import ThreadedMotoServer

    from pipeline.services.process import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="pubmedqa")
        s3.upload_file(str(SOURCE), "pubmedqa", "pqal/ori_pqal.json")
        s3.upload_file(str(TEST_IDS), "pubmedqa", "pqal/test_ground_truth.json")
        set_param(project, "data.source", "s3://pubmedqa/pqal/ori_pqal.json")
        set_param(project, "data.test_ids", "s3://pubmedqa/pqal/test_ground_truth.json")
        set_param(project, "data.allow.hosts", ["pubmedqa"])  # s3 buckets are named like hosts
        assert ingest.run(load_params())["test"]["rows"] == 500
        set_param(project, "data.source", "s3://pubmedqa/pqal/absent.json")
        with pytest.raises(SourceError, match="absent.json: S3 read failed"):
            ingest.run(load_params())
    finally:
        server.stop()


def test_hugging_face_dataset_source(tmp_path: Path, pubmedqa: dict) -> None:
    """hf://<id> goes through datasets.load_dataset; a local dataset folder stands in for the hub id."""
    rows = [{"pubid": int(k), "question": v["QUESTION"], "context": {"contexts": v["CONTEXTS"], "labels": v["LABELS"],
             "meshes": v["MESHES"]}, "long_answer": v["LONG_ANSWER"], "final_decision": v["final_decision"]}
            for k, v in list(pubmedqa.items())[:20]]
    repo = tmp_path / "pubmedqa_hf" / "pqa_labeled"
    repo.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(repo / "train-00000-of-00001.parquet", index=False)
    # the dataset card's config table, as on the hub (qiaojin/PubMedQA declares pqa_labeled this way)
    (repo.parent / "README.md").write_text(
        "---\nconfigs:\n- config_name: pqa_labeled\n  data_files:\n  - split: train\n    path: pqa_labeled/train-*\n---\n")
    tasks = load_tasks(f"hf://{tmp_path / 'pubmedqa_hf'}:pqa_labeled", "train")
    assert len(tasks) == 20
    first = tasks.iloc[0]
    assert first["contexts"] == pubmedqa[first["id"]]["CONTEXTS"] and first["final_decision"] == pubmedqa[first["id"]]["final_decision"]


def _hostile(project: Path, kind: str) -> Path:
    data = json.loads(SOURCE.read_text())
    test_ids = set(json.loads(TEST_IDS.read_text()))
    victim = next(k for k in data if k not in test_ids)
    path = project / "incoming" / f"{kind}.json"
    path.parent.mkdir(exist_ok=True)
    if kind == "invalid_utf8":
        body = json.dumps(data).encode()
        path.write_bytes(body[:5000] + b"\xff\xfe" + body[5000:])
        return path
    if kind == "deep_json":
        path.write_text("[" * 200_000 + "]" * 200_000)
        return path
    if kind == "duplicate":  # the same PMID again with the other answer: which label is gold would depend on row order
        other = {**data[victim], "final_decision": "no" if data[victim]["final_decision"] == "yes" else "yes"}
        path.write_text(json.dumps(data)[:-1] + f", {json.dumps(victim)}: {json.dumps(other)}}}")
        return path
    if kind == "three_problems":  # each named, in one run: the user fixes the file once
        rest = [k for k in data if k not in test_ids]
        data[rest[0]]["final_decision"] = "perhaps"
        data[rest[1]]["QUESTION"] = "  "
        data[rest[2]]["CONTEXTS"] = ["x" * 200_000]
    elif kind == "huge_context":
        data[victim]["CONTEXTS"] = ["x" * 7000]
    elif kind == "perhaps":
        data[victim]["final_decision"] = "perhaps"
    elif kind == "no_question":  # a missing cell reaches the checks as pandas' NaN, not as None
        del data[victim]["QUESTION"]
    elif kind == "no_label":
        del data[victim]["final_decision"]
    elif kind in ("number_contexts", "object_contexts"):  # a shape no row of the table can hold
        data[victim]["CONTEXTS"] = 7 if kind == "number_contexts" else {"background": "x"}
    elif kind == "number_question":
        data[victim]["QUESTION"] = 12
    elif kind in ("nan_year", "inf_year"):
        data[victim]["YEAR"] = float("nan") if kind == "nan_year" else float("inf")
    path.write_text(json.dumps(data))  # Python writes NaN / Infinity, as a careless exporter does
    return path


@pytest.mark.parametrize("kind, rule", [("outside", "outside data.allow.local_roots"), ("invalid_utf8", "byte 5000: not UTF-8"),
                                        ("huge_context", "contexts: 7000 characters > validate.context_chars.max"),
                                        ("perhaps", "final_decision 'perhaps': must be one of"),
                                        ("nan_year", "year 'nan'"), ("inf_year", "year 'inf'"),
                                        ("no_question", "question: missing"),
                                        ("no_label", "final_decision missing: must be one of"),
                                        ("number_contexts", "contexts: 7: must be a list of strings"),
                                        ("object_contexts", "contexts: {'background': 'x'}: must be a list of strings"),
                                        ("number_question", "question: 12: must be a string"),
                                        ("duplicate", "a PMID has one answer"), ("deep_json", "nested too deeply"),
                                        ("three_problems", "3 problem(s), nothing stored changed")])
def test_a_hostile_source_ends_in_one_line_and_changes_nothing_stored(project: Path, tmp_path_factory, kind: str,
                                                                       rule: str) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    ingest.run(load_params())
    stored = {p: p.read_bytes() for p in [*sorted((project / "data/tasks").glob("*")), project / "reports/ingest.json"]}
    if kind == "outside":
        source = tmp_path_factory.mktemp("elsewhere") / "pqal.json"
        source.write_text(SOURCE.read_text())
    else:
        source = _hostile(project, kind)
    set_param(project, "data.source", str(source))
    proc = subprocess.run([sys.executable, "-m", "pipeline", "ingest", "--no-mlflow"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = proc.stderr.strip().splitlines()
    if kind == "three_problems":  # one line each, after one saying how many
        assert proc.returncode == 1 and len(lines) == 4 and rule in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        assert all(r in proc.stderr for r in ("final_decision 'perhaps'", "question: empty", "contexts: 200000 characters"))
        assert all(line.startswith(f"{source}: row ") for line in lines[1:]), proc.stderr
        lines = lines[:1]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {source}") and rule in lines[0], proc.stderr
    if kind not in ("outside", "invalid_utf8", "deep_json", "three_problems"):
        assert "row " in lines[0] and "(id " in lines[0]
    assert {p: p.read_bytes() for p in stored} == stored
    assert sorted((project / "data/tasks").glob("*")) == [p for p in stored if p.parent.name == "tasks"]


def test_mlflow_run_lists_the_three_splits_as_datasets(project: Path) -> None:
    import warnings

    import mlflow

    params = load_params()
    result = ingest.run(params)
    was = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    try:
        # its own experiment, named on the run: the process's active one (an earlier test's) is left as it was
        experiment = mlflow.MlflowClient().create_experiment("ingest")
        with mlflow.start_run(experiment_id=experiment) as run, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ingest.log_to_mlflow(params.data, params.split, result)
        inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    finally:
        mlflow.set_tracking_uri(was)
    assert sorted(i.dataset.name for i in inputs) == ["pubmedqa-test", "pubmedqa-train", "pubmedqa-val"]
    assert {i.tags[0].value for i in inputs} == {"train", "val", "test"}  # each split's context
    assert not [w for w in seen if w.category is UserWarning], [str(w.message)[:120] for w in seen if w.category is UserWarning]
