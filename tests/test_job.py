"""`python -m kit job`: the ModelArts training job built from a TrainConfig + manifests, sent with the official SDK
to a loopback stand-in for the ModelArts API that checks the SDK's signature like the API gateway does, and the
manual's submission errors as one line. Nothing here reaches Huawei Cloud."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import test_train_helpers as H

from kit.__main__ import main
from kit.core.known_errors import explain
from kit.train.config import TrainConfig
from kit.train.job import JobConfig, build_job
from kit.train.resolve import resolve

sdk = pytest.importorskip(
    "huaweicloudsdkmodelarts", reason="the job extra (huaweicloudsdkmodelarts) is not installed"
)

AK, SK, PROJECT = (
    "HPUAKIT0EXAMPLE0AK00",
    "kitExampleSecretKey0000000000000000000000",
    "0123456789abcdef0123456789abcdef",
)


def _expected_signature(method: str, path: str, headers: dict, body: bytes, signed: list) -> str:
    """SDK-HMAC-SHA256 as Huawei Cloud's API gateway checks it (APIG "AK/SK signing": canonical request of method,
    URI with a trailing '/', query, the signed headers, SHA-256 of the body; HMAC-SHA256 with the secret key)."""
    lower = {k.lower(): v.strip() for k, v in headers.items()}
    uri = path.split("?", 1)[0]
    canonical = "\n".join(
        [
            method,
            uri if uri.endswith("/") else uri + "/",
            "",
            "".join(f"{h}:{lower[h]}\n" for h in signed),
            ";".join(signed),
            hashlib.sha256(body).hexdigest(),
        ]
    )
    to_sign = f"SDK-HMAC-SHA256\n{lower['x-sdk-date']}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    return hmac.new(SK.encode(), to_sign.encode(), hashlib.sha256).hexdigest()


class _ModelArtsStandIn(BaseHTTPRequestHandler):
    """Records every request; refuses a bad signature with the gateway's 401; otherwise answers the next queued
    reply (default: the job was created)."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = dict(self.headers.items())
        self.server.requests.append({"method": "POST", "path": self.path, "headers": headers, "body": body})
        auth = headers.get("Authorization", "")
        fields = dict(p.strip().split("=", 1) for p in auth.split(" ", 1)[-1].split(",") if "=" in p)
        signed = fields.get("SignedHeaders", "").split(";")
        ok = auth.startswith("SDK-HMAC-SHA256 ") and fields.get("Access") == AK and "x-sdk-date" in signed
        ok = ok and hmac.compare_digest(
            fields.get("Signature", ""), _expected_signature("POST", self.path, headers, body, signed)
        )
        if not ok:
            status, reply = (
                401,
                {
                    "error_code": "APIGW.0301",
                    "error_msg": "Incorrect IAM authentication information: verify aksk signature fail",
                },
            )
        elif self.server.replies:
            status, reply = self.server.replies.pop(0)
        else:
            status, reply = (
                201,
                {
                    "kind": "job",
                    "metadata": {"id": "0b1d2f3e-job", "name": json.loads(body)["metadata"]["name"]},
                },
            )
        raw = isinstance(reply, str)  # a gateway's own page, not the API's JSON
        data = reply.encode() if raw else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html" if raw else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Request-Id", "req-0001")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # the test reads the records, not the console
        pass


@pytest.fixture(scope="module")
def modelarts():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModelArtsStandIn)
    server.requests, server.replies = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def api(modelarts, monkeypatch):
    """The stand-in, emptied, and the environment a user exports (credentials only there)."""
    modelarts.requests.clear()
    modelarts.replies.clear()
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "HUAWEICLOUD_SDK_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("HUAWEICLOUD_SDK_AK", AK)
    monkeypatch.setenv("HUAWEICLOUD_SDK_SK", SK)
    monkeypatch.setenv("HUAWEICLOUD_SDK_PROJECT_ID", PROJECT)
    monkeypatch.setenv("KIT_MODELARTS_ENDPOINT", f"http://127.0.0.1:{modelarts.server_address[1]}")
    return modelarts


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_llama_dir):
    """Notebook 02's prepared data (a real prepared-data manifest) and the tiny HF model."""
    root = tmp_path_factory.mktemp("job")
    return root, H.prepared(root / "sft_tiny_48_hf", tiny_llama_dir), tiny_llama_dir


JOB = dict(
    obs_dir="obs://kit-bucket/jobs/tiny/",
    nodes=2,
    flavor="modelarts.pool.visual.8xlarge",
    pool_id="pool-0a1b2c",
    image_url="kit-org/ascend-kit:1.0",
)


def _cli(inputs, *extra):
    root, data, model = inputs
    return [
        "job",
        "--work-dir", str(root / "ws"), "--model-name", "tiny", "--model-path", str(model),
        "--dataset-path", str(data), "--train-iters", "7", "--gbs", "32", "--lr", "0.0002",
        "--obs-dir", JOB["obs_dir"], "--nodes", "2", "--pool-id", JOB["pool_id"], "--image-url", JOB["image_url"],
        "--name", "kit-tiny-sft",
        *extra,
    ]  # fmt: skip


def _no_secret_anywhere(root, *texts):
    for text in texts:
        assert SK not in text and AK not in text
    for path in root.rglob("*"):
        if path.is_file():
            raw = path.read_bytes()
            assert SK.encode() not in raw and AK.encode() not in raw, path


def test_submit_sends_the_signed_dry_run_body(api, inputs, capsys, caplog):
    root = inputs[0]
    caplog.set_level(logging.DEBUG)  # whatever the SDK logs is checked for credentials too
    assert main(_cli(inputs)) == 0  # the dry run: nothing is sent
    dry = capsys.readouterr()
    assert api.requests == [] and '"node_count": 2' in dry.out
    printed = json.loads(dry.out[dry.out.index("\n{") : dry.out.index("\neach of the 2 nodes runs:")])

    assert main(_cli(inputs, "--submit")) == 0
    sent = capsys.readouterr()
    assert "submitted: training job 0b1d2f3e-job" in sent.out
    (req,) = api.requests  # accepted: the stand-in verified the SDK-HMAC-SHA256 signature with the secret key
    assert req["path"] == f"/v2/{PROJECT}/training-jobs"
    assert req["headers"]["Authorization"].startswith(f"SDK-HMAC-SHA256 Access={AK}, SignedHeaders=")
    assert len(req["headers"]["X-Sdk-Date"]) == 16 and req["headers"]["X-Sdk-Date"].endswith("Z")
    assert req["headers"]["X-Project-Id"] == PROJECT
    body = json.loads(req["body"])
    assert body == printed  # exactly what the dry run printed

    algo, spec = body["algorithm"], body["spec"]
    assert spec["resource"] == {"flavor_id": JOB["flavor"], "node_count": 2, "pool_id": JOB["pool_id"]}
    assert algo["engine"] == {"image_url": JOB["image_url"]} and body["metadata"]["name"] == "kit-tiny-sft"
    inputs_ = {i["name"]: (i["local_dir"], i["remote"]["obs"]["obs_url"]) for i in algo["inputs"]}
    assert inputs_ == {
        "data_url": (
            "/home/ma-user/modelarts/inputs/data_url_0",
            "obs://kit-bucket/jobs/tiny/data/sft_tiny_48_hf/",
        ),
        "model_url": (
            "/home/ma-user/modelarts/inputs/model_url_1",
            f"obs://kit-bucket/jobs/tiny/model/{inputs[2].name}/",
        ),
    }
    (out,) = algo["outputs"]
    assert (out["local_dir"], out["remote"]["obs"]["obs_url"]) == (
        "/home/ma-user/modelarts/outputs/train_url_0",
        "obs://kit-bucket/jobs/tiny/output/",
    )
    assert spec["log_export_path"] == {"obs_url": "obs://kit-bucket/jobs/tiny/logs/"}
    # each node: the kit launcher on the job's folders with the run's settings; NNODES / NODE_RANK / MASTER_ADDR
    # come from the variables ModelArts injects, so none is in the command
    cmd = algo["command"].split()
    assert cmd[:6] == ["python", "-m", "kit", "train", "launch", "--launcher"]
    opts = dict(zip(cmd[5::2], cmd[6::2]))
    assert (
        opts["--dataset-path"] == inputs_["data_url"][0] and opts["--model-path"] == inputs_["model_url"][0]
    )
    assert opts["--work-dir"] == out["local_dir"] and opts["--model-name"] == "tiny"
    assert (opts["--train-iters"], opts["--gbs"], opts["--lr"]) == ("7", "32", "0.0002")
    assert not {"--nnodes", "--node-rank", "--master-addr", "--nproc-per-node"} & set(opts)
    from kit.core.manifest import read_manifest

    assert f"prepared {read_manifest(inputs[1]).sha256[:12]}" in body["metadata"]["description"]
    _no_secret_anywhere(root, dry.out, dry.err, sent.out, sent.err, caplog.text, json.dumps(body))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_a_wrong_secret_key_is_the_gateways_401_as_one_line(api, inputs, capsys, monkeypatch):
    monkeypatch.setenv("HUAWEICLOUD_SDK_SK", "not-the-users-secret-key-000000000000000")
    assert main(_cli(inputs, "--submit")) == 2
    err = _one_line_error(capsys)
    assert "HTTP 401 APIGW.0301" in err and "HUAWEICLOUD_SDK_AK and HUAWEICLOUD_SDK_SK" in err
    assert "not-the-users-secret-key" not in err and len(api.requests) == 1


@pytest.mark.parametrize(
    "reply, explained",
    [
        (
            (
                400,
                {
                    "error_code": "ModelArts.2793",
                    "error_msg": "Exception: You have attempted to create more buckets than allowed",
                },
            ),
            "as many OBS buckets as its quota allows",
        ),
        (
            (
                400,
                {
                    "error_code": "SVCSTG.SWR.4000043",
                    "error_msg": "The number of namespaces exceeds the upper limit",
                },
            ),
            "SWR allows few organizations",
        ),
    ],
    ids=["bucket-quota", "swr-namespace-quota"],
)
def test_the_manuals_submission_errors_are_one_explained_line(api, inputs, capsys, reply, explained):
    api.replies.append(reply)
    assert main(_cli(inputs, "--submit")) == 2
    err = _one_line_error(capsys)
    assert f"HTTP 400 {reply[1]['error_code']}" in err and explained in err and SK not in err


def test_the_manuals_error_messages_map_to_their_causes():
    """The messages as the ModelArts manual (section "提交训练作业常见问题") quotes them, its typos included."""
    manual = {
        "Exception: You have attempted to create more buckets than allowed": "obs_bucket_quota",
        '"errorMessage":"The number of namespaces exceeds the upper limit"': "swr_namespace_quota",
        '"errorMessage":"namespace is invalid"': "swr_namespace_quota",
        'standard_init_linux.go:224: exec user process caused "exet format error"': "exec_format_error",
        "exec /bin/sh: exec format error": "exec_format_error",
        '报错：401，\'Unauthorized\'，b\'{errors":[{"errorCode":"SVCSTG.SWR.4010000",errorMessage":"Authenticate Error"': "huaweicloud_unauthorized",
    }
    assert {m: getattr(explain(m, env={}, on_npu=False), "key", None) for m in manual} == manual


def test_a_plan_with_problems_is_listed_and_never_sent(api, inputs, capsys):
    root, data, model = inputs
    cfg = TrainConfig(
        work_dir=str(root / "ws"), model_name="tiny", model_path=str(model), dataset_path=str(data), gbs=4
    )
    plan = build_job(resolve(cfg, environ={}), JobConfig(obs_dir="obs://kit-bucket/x/", nodes=2))
    text = "\n".join(plan.problems)
    assert (
        "POOL_ID" in text and "IMAGE_URL" in text
    )  # dedicated flavor without a pool; neither image nor engine
    assert (
        "on 2 node(s) x 8 card(s) of modelarts.pool.visual.8xlarge: GBS=4 is not divisible by MBS x DP = 1 x 16"
        in text
    )
    from kit.train.job.submit import JobSubmitError, submit

    with pytest.raises(JobSubmitError, match="problem"):
        submit(plan)
    assert main(_cli(inputs, "--gbs", "4", "--submit")) == 2  # the command line: listed, exit 2, nothing sent
    out, err = capsys.readouterr()
    assert (
        "GBS=4 is not divisible" in out
        and err.strip() == "error: the job has 1 problem(s), listed above; nothing was sent."
    )
    assert api.requests == []


def test_the_body_is_what_the_sdk_serializes_for_image_and_engine_jobs(inputs):
    from kit.train.job.submit import JobSubmitError, serialized, to_sdk

    root, data, model = inputs
    cfg = TrainConfig(
        work_dir=str(root / "ws"), model_name="tiny", model_path=str(model), dataset_path=str(data)
    )
    image = build_job(resolve(cfg, environ={}), JobConfig(**JOB))
    engine = build_job(resolve(cfg, environ={}), JobConfig(**{**JOB, "image_url": "", "engine_name": "PyTorch", "engine_version": "pytorch_2.1.0-cann_8.0-py_3.9",
                     "code_dir": "obs://kit-bucket/code/ascend-notebook-kit/"}))  # fmt: skip
    assert image.ok and engine.ok, image.problems + engine.problems
    for plan in (image, engine):
        assert serialized(plan.body) == plan.body  # every field is one the SDK's request models know
    assert (
        engine.body["algorithm"]["boot_file"]
        == "obs://kit-bucket/code/ascend-notebook-kit/kit/train/job/node.py"
    )
    assert json.loads(engine.body["algorithm"]["environments"]["KIT_NODE_ARGS"]) == engine.node_args
    with pytest.raises(JobSubmitError, match="no field 'flavour'"):
        to_sdk({**image.body, "spec": {"resource": {"flavour": "x"}}})


def test_credentials_in_the_job_environment_are_refused_and_redacted(inputs):
    root, data, model = inputs
    cfg = TrainConfig(
        work_dir=str(root / "ws"), model_name="tiny", model_path=str(model), dataset_path=str(data)
    )
    plan = build_job(
        resolve(cfg, environ={}), JobConfig(**JOB, environments={"OBS_SECRET_ACCESS_KEY": SK, "MY_FLAG": "1"})
    )
    assert any("looks like a credential" in p for p in plan.problems)
    shown = plan.describe(environ={"HUAWEICLOUD_SDK_AK": AK})
    assert SK not in shown and '"OBS_SECRET_ACCESS_KEY": "***"' in shown and '"MY_FLAG": "1"' in shown


def test_the_preset_engine_boot_file_runs_the_kit_with_the_jobs_arguments(tmp_path):
    """kit/train/job/node.py as a preset engine starts it: from another folder, arguments from KIT_NODE_ARGS."""
    import os
    import subprocess
    import sys

    from kit.core.workspace import repo_root

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KIT_NODE_ARGS"] = json.dumps(["train", "launch", "--help"])
    out = subprocess.run(
        [sys.executable, str(repo_root() / "kit" / "train" / "job" / "node.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m kit train launch")


def test_obs_paths_flavors_and_images_that_modelarts_would_refuse_are_named():
    from kit.train.job.config import JobConfig

    good = JobConfig(
        obs_dir="obs://kit-bucket/x/", pool_id="p", image_url="swr.cn-north-4.myhuaweicloud.com/org/kit:1"
    )
    assert good.problems() == []
    assert (
        JobConfig(
            obs_dir="obs://kit-bucket/x/", flavor="modelarts.p3.large.public", image_url="org/kit:1"
        ).problems()
        == []
    )
    bad = JobConfig(
        obs_dir="obs:///x",  # no bucket
        data_obs="obs://Bad_Bucket/d/",
        flavor="modelarts.pool.visual.3xlarge",  # a pool flavor that does not exist
        pool_id="p",
        image_url="org/kit image:1",
    ).problems()
    text = "\n".join(bad)
    assert len(bad) == 4, bad
    assert "OBS_DIR='obs:///x'" in text and "DATA_OBS='obs://Bad_Bucket/d/'" in text
    assert "FLAVOR='modelarts.pool.visual.3xlarge' is not a ModelArts flavor" in text
    assert "IMAGE_URL='org/kit image:1' is not an SWR image" in text
    assert "is not a ModelArts flavor" in "\n".join(
        JobConfig(obs_dir="obs://b-1/x", flavor="8 cards").problems()
    )


def test_a_job_request_that_is_never_answered_is_one_line_saying_the_job_may_exist(
    api, inputs, monkeypatch, capsys
):
    """A stand-in that accepts the connection and never answers: the read timeout (KIT_MODELARTS_TIMEOUT_S) ends it
    in one line, exit 2, naming the endpoint and the job to look for; nothing is retried."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(4)  # connections are accepted by the kernel; nothing is ever read or answered
    try:
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        monkeypatch.setenv("KIT_MODELARTS_ENDPOINT", endpoint)
        monkeypatch.setenv("KIT_MODELARTS_TIMEOUT_S", "1.5")
        assert main(_cli(inputs, "--submit")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: ModelArts ({endpoint}) did not answer the job request "
        )
        assert "within 1.5 s" in err[0] and "'kit-tiny-sft'" in err[0] and "before you submit again" in err[0]
        monkeypatch.setenv("KIT_MODELARTS_TIMEOUT_S", "soon")
        assert main(_cli(inputs, "--submit")) == 2
        assert "KIT_MODELARTS_TIMEOUT_S='soon' is not a number" in capsys.readouterr().err
    finally:
        hung.close()


BAD_GATEWAY_PAGE = (
    """<html>
<head><title>502 Bad Gateway</title></head>
<body>
<center><h1>502 Bad Gateway</h1></center>
<hr><center>nginx</center>
"""
    + "<!-- padding -->\n" * 200
    + "</body>\n</html>\n"
)


@pytest.mark.parametrize(
    "reply, shown",
    [
        ((502, BAD_GATEWAY_PAGE), "HTTP 502 502: 502 Bad Gateway"),
        (
            (
                400,
                {"error_code": "ModelArts.2709", "error_msg": "invalid job:\n- flavor missing\n- pool busy"},
            ),
            "HTTP 400 ModelArts.2709: invalid job: - flavor missing - pool busy",
        ),
    ],
    ids=["html-502-page", "multi-line-error-msg"],
)
def test_an_error_answer_over_several_lines_is_one_short_line(api, inputs, capsys, reply, shown):
    """The API stand-in answers an error whose body spans lines (a gateway's HTML page, a listed error_msg): the
    command prints one `error:` line, of bounded length, exit 2."""
    api.replies.append(reply)
    assert main(_cli(inputs, "--submit")) == 2
    err = _one_line_error(capsys)
    assert shown in err and len(err) < 600, err


def test_an_endpoint_that_refuses_the_connection_is_one_line(api, inputs, capsys, monkeypatch):
    """Nothing listens on the endpoint: one `error:` line (the SDK's own log line of the failure is not printed)."""
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # the port is free: the connection is refused
    monkeypatch.setenv("KIT_MODELARTS_ENDPOINT", endpoint)
    assert main(_cli(inputs, "--submit")) == 2
    err = _one_line_error(capsys)
    assert (
        err.startswith("error: could not reach ModelArts (ConnectionException: ")
        and "Connection refused" in err
    )


def test_any_other_sdk_failure_is_one_line_exit_2(api, inputs, capsys, monkeypatch):
    """An SDK exception the kit has no special case for (here: too many redirects) is one line, exit 2; its
    traceback only with --debug."""
    from huaweicloudsdkcore.exceptions import exceptions as sdk_errors

    def fail(self, request):
        raise sdk_errors.SdkException("first line of the SDK's message\nsecond line\nthird line")

    import huaweicloudsdkmodelarts.v1 as ma

    monkeypatch.setattr(ma.ModelArtsClient, "create_training_job", fail)
    assert main(_cli(inputs, "--submit")) == 2
    err = _one_line_error(capsys)
    assert "SdkException" in err and "first line of the SDK's message second line third line" in err
    monkeypatch.setenv("KIT_DEBUG", "0")  # main(--debug) sets it to 1: restored to its value before the test
    with pytest.raises(Exception) as raised:
        main(["--debug", *_cli(inputs, "--submit")])
    assert isinstance(raised.value.__cause__, sdk_errors.SdkException)
