"""kit.serve against one real `transformers serve` on 127.0.0.1 (a free port), serving a tiny training run's model.

One server for the module: the chat, the load test and lm-eval all talk to it. The package check, a model the
engine cannot load, the owner's death and the routed-MoE families (a tiny GLM-4.5 and a tiny DeepSeek-V3 with MLA,
MTP layer included: health, a chat answer, a load test, a clean stop) each need a server of their own.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from fixtures.convert import routed_moe as routed_models

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(
        f"transformers {transformers.__version__}: `transformers serve` with /health needs transformers>=5.0",
        allow_module_level=True,
    )
pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e .[serve])")
pytest.importorskip("openai", reason="needs the serve extra (pip install -e .[serve])")

from kit.system.procs import group_alive  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    """(server, workspace, run folder): the newest run of a tiny workspace, served."""
    from fixtures.training_run import tiny_training_run

    from kit.core.workspace import get_workspace
    from kit.serve import ServeConfig, serve

    root = tmp_path_factory.mktemp("serve")
    run = tiny_training_run(root / "ws", tiny_llama_dir, root / "trained")
    ws = get_workspace(root / "ws", model="tiny")
    server = serve(ServeConfig(startup_timeout=300), ws)
    yield server, ws, run
    pgid = server.proc.pid
    server.stop()
    assert not group_alive(pgid)


def test_the_run_is_served_from_its_manifests(served):
    server, ws, run = served
    assert server.health()
    from kit.core.manifest import read_manifest

    assert server.info["model_path"] == read_manifest(run)["hf"]  # the run's exported model
    assert server.info["template"] == "chatml"  # the prepared data's template, via the run's manifest
    assert server.info["context_length"] == 512
    ids = [m.id for m in server.openai_client().models.list().data]
    assert server.model in ids
    assert server.url.startswith("http://127.0.0.1:")


def test_chat_streams_the_same_answer_it_gives_whole(served):
    from kit.serve.client import chat

    server, _, _ = served
    streamed = chat(
        server, "Give three tips for staying healthy.", max_tokens=6, template="tokenizer", echo=False
    )
    whole = chat(
        server, "Give three tips for staying healthy.", max_tokens=6, template="tokenizer", stream=False
    )
    assert streamed["endpoint"] == "chat.completions" and streamed["chunks"] >= 2
    assert streamed["text"] == whole["text"] and streamed["text"]
    assert streamed["completion_tokens"] == whole["completion_tokens"] <= 6
    assert streamed["prompt_tokens"] == whole["prompt_tokens"] > 5


def test_chat_in_the_datas_template_goes_through_completions(served):
    from transformers import AutoTokenizer

    from kit.data.templates import prompt_text
    from kit.serve.client import chat

    server, _, _ = served
    out = chat(server, "hello", max_tokens=4, echo=False)  # template from the run: chatml
    assert out["template"] == "chatml" and out["endpoint"] == "completions"
    tok = AutoTokenizer.from_pretrained(server.info["model_path"])
    text = prompt_text(tok, "hello", "chatml")
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_tokens"] == len(tok(text)["input_ids"])


def test_the_chat_box_streams_the_served_answer_in_the_datas_template(served, capsys):
    from kit.serve.client import chat, chat_box, stream

    server, _, _ = served
    facts: dict = {}
    pieces = list(stream(server, "hello", max_tokens=6, usage=facts))  # template from the run: chatml
    whole = chat(server, "hello", max_tokens=6, stream=False)
    assert "".join(pieces) == whole["text"] and len(pieces) >= 2
    assert facts["template"] == "chatml" and facts["endpoint"] == "completions"
    assert facts["prompt_tokens"] == whole["prompt_tokens"]
    # headless (no front end): the one question, its answer in one sentence
    assert chat_box(server, "hello", max_tokens=6) == whole["text"]
    assert (
        capsys.readouterr().out
        == f"Asked 'hello', the served model answered {' '.join(whole['text'].split())!r}.\n"
    )


def test_a_prompt_longer_than_the_context_is_one_line(served):
    from kit.errors import InputError
    from kit.serve.client import chat

    server, _, _ = served
    with pytest.raises(InputError) as err:
        chat(server, "hello world " * 400, max_tokens=4, echo=False)
    assert "\n" not in str(err.value) and "context of 512" in str(err.value)


def test_an_error_status_of_the_engine_is_one_line(served):
    from kit.serve.client import RequestRefusedError, chat

    server, _, _ = served

    class Other:  # the same server asked for a model it does not serve: its 400
        info = dict(server.info)
        model = "some-other-model"
        openai_client = server.openai_client

    with pytest.raises(RequestRefusedError) as err:
        chat(Other(), "hi", max_tokens=2, template="tokenizer", echo=False)
    msg = str(err.value)
    assert msg.startswith("the engine refused the request (400)") and "\n" not in msg


def test_a_busy_port_is_one_line_naming_the_fix(served, capsys):
    from kit.__main__ import main

    server, ws, _ = served
    code = main(
        ["serve", "--workspace", str(ws.root), "--workspace-model", "tiny", "--port", str(server.port)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"error: port {server.port} on 127.0.0.1 is already in use") and "PORT" in err[0]


def test_load_test_at_two_concurrency_levels(served, tmp_path):
    from kit.serve import BenchConfig, bench
    from kit.serve.loadtest import METRICS, STATS

    server, ws, _ = served
    cfg = BenchConfig(
        concurrency=[1, 2],
        request_rates=[5.0],
        prompt_lengths=[16],
        output_lengths=[4],
        num_prompts=3,
        warmup=1,
        out_dir=str(tmp_path / "bench"),
    )
    result = bench(cfg, ws, server=server, progress=False)
    doc = json.loads((result.folder / "results.json").read_text())
    points = doc["points"]
    assert [(p["load"], p["max_concurrency"], p["request_rate"]) for p in points] == [
        ("concurrency", 1, None),
        ("concurrency", 2, None),
        ("poisson", None, 5.0),
    ]
    keys = {f"{s}_{m}_ms" for m in METRICS for s in STATS}
    keys |= {
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "duration",
    }
    for p in points:
        assert keys <= set(p), keys - set(p)
        assert p["completed"] == 3 and p["failed"] == 0
        # the server's own counts: max_tokens=4 each (a random model does not stop early), prompts ~16 tokens
        assert p["output_lens"] == [4, 4, 4] and p["total_output_tokens"] == 12
        assert all(12 <= n <= 20 for n in p["input_lens"]) and p["total_input_tokens"] == sum(p["input_lens"])
        assert all(0 < t <= e for t, e in zip(p["ttfts"], p["e2els"]))
        assert p["mean_ttft_ms"] <= p["mean_e2el_ms"] and p["median_ttft_ms"] <= p["max_ttft_ms"]
        assert p["p90_tpot_ms"] <= p["p99_tpot_ms"] <= p["max_tpot_ms"] and p["mean_itl_ms"] > 0
        assert p["output_throughput"] == pytest.approx(12 / p["duration"])
        assert p["request_goodput"] <= p["request_throughput"]
    with open(result.folder / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 and float(rows[1]["p99_ttft_ms"]) == pytest.approx(points[1]["p99_ttft_ms"])
    assert (result.folder / "latency_throughput.png").stat().st_size > 5000
    assert "首tokens时延TP99(ms)" in (result.folder / "results_ascendcloud.csv").read_text(
        encoding="utf-8-sig"
    )
    assert list(result.table["max_concurrency"][:2]) == [1, 2]
    from kit.core.manifest import read_manifest

    assert read_manifest(result.folder, expect="load-test")["points"] == 3


def test_a_load_test_where_no_request_completed_publishes_nothing(served, tmp_path):
    from kit.serve import BenchConfig, bench
    from kit.serve.loadtest import LoadTestError

    server, ws, _ = served
    out = tmp_path / "bench"
    cfg = BenchConfig(
        concurrency=[1],
        request_rates=[],
        prompt_lengths=[8],
        output_lengths=[2],
        num_prompts=2,
        warmup=0,
        model_name="no-such-model",  # the engine answers every request with an error status
        out_dir=str(out),
    )
    with pytest.raises(LoadTestError, match="no request of the load test .* completed .*2 failed"):
        bench(cfg, ws, server=server, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".bench*"))


def test_lm_eval_through_the_endpoint_equals_in_process(served, tmp_path):
    pytest.importorskip("lm_eval")
    from kit.serve.lmeval import compare

    server, _, _ = served
    result = compare(server, tmp_path / "tasks", limit=3)
    assert result["model_type"] == "local-chat-completions"  # transformers serve returns no prompt logprobs
    assert result["endpoint"]["n"] == result["in_process"]["n"] == 3
    assert all(result["endpoint"]["answers"]) and result["equal"]
    assert result["endpoint"]["answers"] == result["in_process"]["answers"]


def test_the_package_run_sh_answers_health_and_a_completion(served, tmp_path):
    from kit.serve import PackageConfig, package
    from kit.serve.modelarts import check_package

    server, ws, _ = served
    result = package(PackageConfig(out_dir=str(tmp_path / "pkg")), ws)
    docker = (result.folder / "Dockerfile").read_text()
    assert "FROM quay.io/ascend/vllm-ascend" in docker and "CMD sh /home/mind/run.sh" in docker
    assert "-u 1000 -g 100 ma-user" in docker and "COPY --chown=1000:100 model /home/mind/model" in docker
    assert (result.folder / "model" / "config.json").is_file()
    out = check_package(result.folder)
    assert out["health"] == {"status": 200, "body": {"status": "ok"}} and out["completion_tokens"] == 4


def test_a_model_the_engine_cannot_load_is_one_line(tmp_path, workspace):
    from kit.serve import ServeConfig, serve
    from kit.serve.server import EngineStartError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')  # no tokenizer, no weights
    with pytest.raises(EngineStartError) as err:
        serve(ServeConfig(model_path=str(bad), startup_timeout=300), workspace)
    msg = str(err.value)
    assert "\n" not in msg and "exited with code" in msg and f"could not load {bad.resolve()}" in msg


def test_a_model_with_a_nan_weight_is_refused_before_the_engine_starts(tmp_path, workspace, tiny_llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    from kit.convert.weights_check import NonFiniteWeights
    from kit.serve import ServeConfig, serve

    bad = tmp_path / "nan"
    shutil.copytree(tiny_llama_dir, bad)
    weights = sorted(bad.glob("*.safetensors"))[-1]  # sharded: damage the last shard
    state = load_file(str(weights))
    name = sorted(state)[0]
    state[name].view(-1)[3] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeights, match=name):
        serve(ServeConfig(model_path=str(bad), startup_timeout=300), workspace)
    assert not list((workspace.model_output / "serving" / "logs").glob("*.log"))  # no engine was started


def test_the_engine_dies_with_the_process_that_started_it(tiny_llama_dir, tmp_path):
    script = (
        "import sys, time\n"
        "from kit.serve import ServeConfig, serve\n"
        "from kit.core.workspace import get_workspace\n"
        f"s = serve(ServeConfig(model_path={str(tiny_llama_dir)!r}), get_workspace({str(tmp_path)!r}, model='t'))\n"
        "print('PID', s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    pid = None
    for line in owner.stdout:
        if line.startswith("PID"):
            pid = int(line.split()[1])
            break
    assert pid is not None
    assert group_alive(pid)
    owner.send_signal(signal.SIGTERM)  # no atexit here: the engine goes because its parent died
    owner.wait(timeout=60)
    deadline = time.monotonic() + 30
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid)


def test_a_kernel_shutdown_stops_the_engine(tiny_llama_dir, tmp_path):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path), env=dict(os.environ, KIT_WORKSPACE=str(tmp_path / "ws")))
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=300)
        code = (
            "from kit.serve import ServeConfig, serve\n"
            "from kit.core.workspace import get_workspace\n"
            f"s = serve(ServeConfig(model_path={str(tiny_llama_dir)!r}), get_workspace(None, model='k'))\n"
            "print('PID', s.proc.pid)\n"
        )
        outputs = []
        kc.execute_interactive(
            code, timeout=300, output_hook=lambda m: outputs.append(m["content"].get("text", ""))
        )
        found = re.search(r"PID (\d+)", "".join(outputs))
        assert found, outputs
        pid = int(found.group(1))
        assert group_alive(pid)
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=False)  # a shutdown request: the kernel exits and its atexit stops the engine
    deadline = time.monotonic() + 30
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid)


def _kit_serve(model, tmp_path) -> subprocess.Popen:
    """`python -m kit serve` in the foreground, as a user starts it in a terminal."""
    argv = [
        sys.executable,
        "-m",
        "kit",
        "serve",
        "--model-path",
        str(model),
        "--workspace",
        str(tmp_path / "ws"),
    ]
    argv += ["--workspace-model", "t", "--startup-timeout", "300"]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )


@pytest.mark.parametrize(
    "sig, when",
    [(signal.SIGINT, "serving"), (signal.SIGTERM, "serving"), (signal.SIGTERM, "starting")],
    ids=["ctrl-c-serving", "sigterm-serving", "sigterm-starting"],
)
def test_a_signal_to_kit_serve_stops_the_engine_and_exits_130(tiny_llama_dir, tmp_path, sig, when):
    """Ctrl-C or SIGTERM to `python -m kit serve`, once it serves or while the engine starts: the engine and every
    process below it are gone, stderr is one line, the exit code is the kit's for an interruption (130)."""
    import psutil

    owner = _kit_serve(tiny_llama_dir, tmp_path)
    try:
        wanted = "serving; Ctrl-C stops it" if when == "serving" else "starting transformers on "
        for line in owner.stdout:  # the owner prints it; an early exit ends the loop and fails below
            if line.startswith(wanted):
                break
        deadline = time.monotonic() + 300  # a ceiling only: the engine is started right after the line
        while (
            not psutil.Process(owner.pid).children() and owner.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        engines = psutil.Process(owner.pid).children()
        assert engines, owner.stderr.read()
        tree = engines + engines[0].children(recursive=True)
        owner.send_signal(sig)
        _out, err = owner.communicate(timeout=300)  # a ceiling only
    finally:
        if owner.poll() is None:
            owner.kill()
    assert owner.returncode == 130 and err.strip() == "error: interrupted", (owner.returncode, err)
    _, alive = psutil.wait_procs(tree, timeout=60)  # a ceiling only
    assert alive == [], [p.cmdline() for p in alive]
    assert not group_alive(engines[0].pid)


ROUTED_BUILDERS = {"glm4_moe": routed_models.tiny_glm45, "deepseek_v3": routed_models.tiny_deepseek3}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(ROUTED_BUILDERS))
def test_the_cpu_engine_serves_a_routed_moe_family(model_type, tmp_path):
    from kit.core.workspace import get_workspace
    from kit.serve import BenchConfig, ServeConfig, bench, serve
    from kit.serve.client import chat

    folder = ROUTED_BUILDERS[model_type](tmp_path / model_type)
    ws = get_workspace(tmp_path / "ws", model=model_type)
    server = serve(ServeConfig(model_path=str(folder), device="cpu", startup_timeout=120), ws)
    pgid = server.proc.pid
    try:
        assert server.health()
        assert server.info["model_path"] == str(folder.resolve())
        out = chat(server, "hello", max_tokens=5, template="tokenizer", stream=False)
        assert out["endpoint"] == "chat.completions" and out["text"]
        assert out["completion_tokens"] == 5  # a random model does not stop early
        assert out["prompt_tokens"] > 1
        cfg = BenchConfig(
            concurrency=[2],
            request_rates=[],
            prompt_lengths=[8],
            output_lengths=[3],
            num_prompts=2,
            warmup=0,
            out_dir=str(tmp_path / "bench"),
        )
        result = bench(cfg, ws, server=server, progress=False)
        (point,) = json.loads((result.folder / "results.json").read_text())["points"]
        assert point["max_concurrency"] == 2 and point["completed"] == 2 and point["failed"] == 0
        assert point["output_lens"] == [3, 3] and point["total_output_tokens"] == 6
    finally:
        server.stop()
    assert not group_alive(pgid)
