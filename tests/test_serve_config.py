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


def test_vllm_command_serves_the_adapter_on_its_base(tmp_path):
    from kit.serve.engines import build_command, choose_engine

    assert choose_engine("auto", "npu") == "vllm" and choose_engine("auto", "cpu") == "transformers"
    cmd = build_command(
        "vllm",
        "/env/bin/python",
        tmp_path / "hf",
        "0.0.0.0",
        8080,
        "npu",
        adapter=tmp_path / "adapter",
        base=tmp_path / "base",
        max_model_len=4096,
    )
    assert cmd.argv[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd.argv[cmd.argv.index("--model") + 1] == str(tmp_path / "base")
    assert cmd.argv[cmd.argv.index("--lora-modules") + 1] == f"model={tmp_path / 'adapter'}"
    assert "--enable-lora" in cmd.argv and cmd.argv[-2:] == ["--max-model-len", "4096"]
    assert cmd.serves_adapter and cmd.prompt_logprobs and cmd.model_name == "model"
    plain = build_command(
        "transformers", "py", tmp_path / "hf", "127.0.0.1", 1234, "cpu", adapter=tmp_path / "a"
    )
    assert plain.argv[1:5] == ["-m", "transformers.cli.transformers", "serve", str(tmp_path / "hf")]
    assert not plain.serves_adapter and plain.model_name == str(tmp_path / "hf")


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
