"""Stage 07 on the routed-MoE families: the kit's CPU engine (`transformers serve`) serves a tiny GLM-4.5 and a tiny
DeepSeek-V3 (MLA) folder, MTP layer included, through kit.serve's API: health, a chat answer, a load test, a clean stop.
"""

from __future__ import annotations

import json

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

BUILDERS = {"glm4_moe": routed_models.tiny_glm45, "deepseek_v3": routed_models.tiny_deepseek3}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_the_cpu_engine_serves_a_routed_moe_family(model_type, tmp_path):
    from kit.core.workspace import get_workspace
    from kit.serve import BenchConfig, ServeConfig, bench, serve
    from kit.serve.client import chat

    folder = BUILDERS[model_type](tmp_path / model_type)
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
