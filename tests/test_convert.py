"""HF <-> Megatron conversion: on-disk layout, bit-exact round trips, re-sharding, CLI, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fixtures.convert import models as convert_models

from kit.convert import ConversionError, ConvertConfig, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from kit.convert.hf_io import HFReader
from kit.convert.megatron_io import MegatronReader, load_rank_file
from kit.convert.verify import compare_hf, hf_checksums, megatron_checksums, round_trip
from kit.core.configs import ConfigError
from kit.errors import OutputError
from kit.storage.atomic import OutputExistsError, check_space
from kit.system.hf_compat import dtype_kw

tiny_baichuan_dir = convert_models.tiny_baichuan_dir  # shared session fixtures
tiny_glm_dir = convert_models.tiny_glm_dir  # shared session fixtures
tiny_llama4_dir = convert_models.tiny_llama4_dir  # shared session fixtures


def to_megatron(src, out, **kw):
    return hf_to_megatron(ConvertConfig(str(src), str(out), **kw), progress=False)


def test_layout_on_disk_tp2_pp2(tiny_llama_dir, tmp_path):
    out = tmp_path / "m"
    summary = to_megatron(tiny_llama_dir, out, tp=2, pp=2)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "1"
    ranks = sorted(p.name for p in (out / "iter_0000001").iterdir())
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    state = load_rank_file(
        out / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt"
    )  # weights_only=True
    assert set(state) == {"args", "checkpoint_version", "iteration", "model"}
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 1
    a = state["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.num_layers) == (2, 2, 2)
    assert (a.num_query_groups, a.num_key_value_heads, a.group_query_attention) == (2, 2, True)
    assert a.padded_vocab_size == 2560 == summary["padded_vocab_size"]  # ceil(2522 / (128*2)) * 256
    last = sorted(state["model"])
    assert last == [
        "decoder.final_layernorm.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "output_layer.weight",
    ]
    m = state["model"]
    # hidden 64, 4 heads of 16, 2 groups: qkv rows (4 + 2*2) * 16 / 2 = 64; fc1 2*128/2; proj 64 x 32
    assert m["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)
    assert m["decoder.layers.0.mlp.linear_fc1.weight"].shape == (128, 64)
    assert m["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 32)
    assert m["output_layer.weight"].shape == (1280, 64)
    first = load_rank_file(out / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt")["model"]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    emb = first["embedding.word_embeddings.weight"]
    hf = HFReader(tiny_llama_dir).read("model.embed_tokens.weight")
    assert torch.equal(emb, hf[:1280])
    assert (out / "hf_meta" / "tokenizer.json").is_file() and (out / "hf_meta" / "config.json").is_file()
    for name in ("tokenizer.json", "config.json"):  # side files copied byte for byte, with mode and mtime
        a, b = tiny_llama_dir / name, out / "hf_meta" / name
        assert a.read_bytes() == b.read_bytes()
        assert (os.stat(a).st_mode, os.stat(a).st_mtime_ns) == (os.stat(b).st_mode, os.stat(b).st_mtime_ns)
    assert not list(out.parent.glob(".m.partial-*"))


def test_tp1_pp1_names_and_legacy_nesting(tiny_llama_tied_dir, tmp_path):
    to_megatron(tiny_llama_tied_dir, tmp_path / "a", tp=1, pp=1, flavor="legacy")
    assert [p.name for p in (tmp_path / "a" / "iter_0000001").iterdir()] == ["mp_rank_00"]
    to_megatron(tiny_llama_tied_dir, tmp_path / "b", tp=1, pp=2, flavor="legacy")
    m = load_rank_file(tmp_path / "b" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt")["model"]
    enc = m["language_model"]["encoder"]
    assert "layers.0.self_attention.query_key_value.weight" in enc and "final_norm.weight" in enc
    assert "output_layer" not in m["language_model"]  # tied: no separate output layer ...
    head = m["word_embeddings_for_head"]["weight"]  # ... but the last stage keeps a copy of the embedding
    emb = HFReader(tiny_llama_tied_dir).read("model.embed_tokens.weight")
    assert torch.equal(head[: emb.shape[0]], emb)


GRID = [(tp, pp, fl) for tp in (1, 2, 4) for pp in (1, 2) for fl in ("local", "legacy")]


@pytest.mark.parametrize("tp,pp,flavor", [g for g in GRID if not (g[0] == 4 and g[2] == "legacy")])
def test_round_trip_bit_exact_llama_gqa(tiny_llama_dir, tmp_path, tp, pp, flavor):
    r = round_trip(tiny_llama_dir, tmp_path, tp=tp, pp=pp, flavor=flavor)
    assert r["bit_exact"], r
    assert r["identical"] == r["tensors"] == len(HFReader(tiny_llama_dir).keys())


@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 2)])
def test_round_trip_tied_glm_baichuan(tiny_llama_tied_dir, tiny_glm_dir, tiny_baichuan_dir, tmp_path, tp, pp):
    assert round_trip(tiny_llama_tied_dir, tmp_path / "t", tp=tp, pp=pp)["bit_exact"]
    g = round_trip(tiny_glm_dir, tmp_path / "g", tp=2 if tp == 4 else tp, pp=pp)
    assert g["bit_exact"] and g["dropped"] == ["transformer.rotary_pos_emb.inv_freq"], g
    b = round_trip(tiny_baichuan_dir, tmp_path / "b", tp=tp, pp=pp)
    assert b["bit_exact"] and b["transformed"] == ["lm_head.weight"], b
    head = HFReader(b["hf"]).read("lm_head.weight")
    want = torch.nn.functional.normalize(HFReader(tiny_baichuan_dir).read("lm_head.weight"), dim=-1)
    assert torch.equal(head, want)


def test_megatron_to_hf_loads_with_from_pretrained(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    to_megatron(tiny_llama_dir, tmp_path / "m", tp=2, pp=2)
    megatron_to_hf(
        ConvertConfig(str(tmp_path / "m"), str(tmp_path / "hf"), direction="megatron_to_hf", max_shard_mb=1),
        progress=False,
    )
    out = tmp_path / "hf"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    ids = torch.tensor([[5, 17, 300, 2000, 9]])
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), **dtype_kw(torch.float32)).eval()
    got = AutoModelForCausalLM.from_pretrained(str(out), **dtype_kw(torch.float32)).eval()
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    assert AutoTokenizer.from_pretrained(str(out)).encode("hello") == AutoTokenizer.from_pretrained(
        str(tiny_llama_dir)
    ).encode("hello")


def test_megatron_resharding_equals_direct_conversion(tiny_llama4_dir, tmp_path):
    to_megatron(tiny_llama4_dir, tmp_path / "a", tp=2, pp=2)
    megatron_to_megatron(
        ConvertConfig(
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            direction="megatron_to_megatron",
            tp=1,
            pp=2,
            num_layer_list=[1, 3],
            flavor="legacy",
        ),
        progress=False,
    )
    to_megatron(tiny_llama4_dir, tmp_path / "c", tp=1, pp=2, num_layer_list=[1, 3], flavor="legacy")
    b, c = megatron_checksums(tmp_path / "b"), megatron_checksums(tmp_path / "c")
    assert b == c and len(b) == 4 * 7 + 3  # 4 layers x 7 tensors (with qkv bias) + embedding, norm, output
    assert MegatronReader(tmp_path / "b").meta["num_layer_list"] == [1, 3]
    megatron_to_hf(
        ConvertConfig(str(tmp_path / "b"), str(tmp_path / "hf"), direction="megatron_to_hf"), progress=False
    )
    assert compare_hf(tiny_llama4_dir, tmp_path / "hf")["bit_exact"]


def test_bin_shards_give_the_same_rank_files(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    # The older layout: pytorch_model-0000i-of-0000N.bin (torch.save zips) + pytorch_model.bin.index.json.
    out = _copy(tiny_llama_dir, tmp_path / "bin")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    for i, shard in enumerate(shards, 1):
        torch.save(load_file(shard), out / f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin")
        index["weight_map"] = {
            k: (f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin" if v == shard.name else v)
            for k, v in index["weight_map"].items()
        }
        shard.unlink()
    (out / "model.safetensors.index.json").unlink()
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    to_megatron(tmp_path / "bin", tmp_path / "a", tp=2, pp=1)
    to_megatron(tiny_llama_dir, tmp_path / "b", tp=2, pp=1)
    assert megatron_checksums(tmp_path / "a") == megatron_checksums(tmp_path / "b")


def test_vocab_padding_rules(tiny_llama_dir, tmp_path):
    s = to_megatron(tiny_llama_dir, tmp_path / "a", tp=2, make_vocab_size_divisible_by=1)
    assert s["padded_vocab_size"] == 2522
    s = to_megatron(tiny_llama_dir, tmp_path / "b", tp=2, padded_vocab_size=3000)
    m = load_rank_file(tmp_path / "b" / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt")["model"]
    assert m["embedding.word_embeddings.weight"].shape == (1500, 64)
    assert not m["embedding.word_embeddings.weight"][1022:].any()  # rows past the vocabulary are zero


def test_cli_accepts_the_modelarts_manual_util_py_flags(tiny_llama_dir, tmp_path, capsys):
    from kit.__main__ import main

    out = tmp_path / "converted_weights"
    rc = main(
        [
            "convert",
            "--model-type",
            "GPT",
            "--loader",
            "llama2_hf",
            "--saver",
            "megatron",
            "--target-tensor-parallel-size",
            "2",
            "--target-pipeline-parallel-size",
            "2",
            "--load-dir",
            str(tiny_llama_dir),
            "--save-dir",
            str(out),
            "--tokenizer-model",
            str(tiny_llama_dir / "tokenizer.json"),
            "--no-progress",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["tp"], summary["pp"], summary["family"]) == (2, 2, "llama")
    assert MegatronReader(out).tp == 2
    rc = main(
        [
            "convert",
            "--loader",
            "megatron",
            "--saver",
            "megatron",
            "--save-model-type",
            "hf",
            "--load-dir",
            str(out),
            "--save-dir",
            str(tmp_path / "back"),
            "--no-progress",
        ]
    )
    assert rc == 0 and compare_hf(tiny_llama_dir, tmp_path / "back")["bit_exact"]
    rc = main(["convert", "--source", str(tiny_llama_dir), "--target", str(out), "--no-progress"])
    assert rc == 2 and "already exists" in capsys.readouterr().err


# ---- bad input: every case fails before writing, with a message naming the value --------------------------


def test_tp_must_divide_heads_and_groups(tiny_llama_dir, tmp_path):
    with pytest.raises(ConversionError, match="tensor parallel size 3 does not divide the 4 attention heads"):
        to_megatron(tiny_llama_dir, tmp_path / "x", tp=3)
    with pytest.raises(ConversionError, match="4 does not fit the 2 KV groups .* 'legacy'"):
        to_megatron(tiny_llama_dir, tmp_path / "x", tp=4, flavor="legacy")
    with pytest.raises(ConfigError, match="padded_vocab_size 2522 must be an integer divisible by tp=4"):
        to_megatron(tiny_llama_dir, tmp_path / "x", tp=4, padded_vocab_size=2522)
    with pytest.raises(ConversionError, match="padded vocabulary 2000 is smaller than the vocabulary 2522"):
        to_megatron(tiny_llama_dir, tmp_path / "x", tp=4, padded_vocab_size=2000)
    assert not (tmp_path / "x").exists()


def test_pp_layouts(tiny_llama_dir, tiny_llama4_dir, tmp_path):
    with pytest.raises(ConversionError, match="pipeline parallel size 3 is larger than the 2 layers"):
        to_megatron(tiny_llama_dir, tmp_path / "x", pp=3)
    with pytest.raises(ConversionError, match=r"explicit layer list .*\[2, 1, 1\]"):
        to_megatron(tiny_llama4_dir, tmp_path / "x", pp=3)
    with pytest.raises(ConversionError, match="summing to 4"):
        to_megatron(tiny_llama4_dir, tmp_path / "x", pp=2, num_layer_list=[1, 2])


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_shard_and_unknown_and_mismatched_tensors(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    a = _copy(tiny_llama_dir, tmp_path / "a")
    shard = sorted(a.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: \\['{shard.name}'\\]"):
        to_megatron(a, tmp_path / "x")
    b = _copy(tiny_llama_dir, tmp_path / "b")
    index = json.loads((b / "model.safetensors.index.json").read_text())
    first = sorted(b.glob("model-*.safetensors"))[0]
    sd = load_file(first)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(sd, first, metadata={"format": "pt"})
    index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = first.name
    (b / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ConversionError, match="'model.layers.0.self_attn.q_norm.weight' is not in the llama key map"
    ):
        to_megatron(b, tmp_path / "x")
    c = _copy(tiny_llama_dir, tmp_path / "c")
    cfg = json.loads((c / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (c / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConversionError, match=r"mlp.gate_proj.weight' has shape \[128, 64\] but config.json implies"
    ):
        to_megatron(c, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_existing_output_refused_and_disk_space_checked(tiny_llama_dir, tmp_path):
    to_megatron(tiny_llama_dir, tmp_path / "m")
    before = megatron_checksums(tmp_path / "m")
    with pytest.raises(OutputExistsError, match="already exists"):
        to_megatron(tiny_llama_dir, tmp_path / "m", tp=2)
    assert megatron_checksums(tmp_path / "m") == before
    to_megatron(tiny_llama_dir, tmp_path / "m", tp=2, overwrite=True)
    assert MegatronReader(tmp_path / "m").tp == 2
    with pytest.raises(OutputError, match=r"not enough space for .* GiB free"):
        check_space(tmp_path / "new", 1 << 60, "the converted checkpoint")


def test_interrupted_conversion_leaves_nothing_that_looks_complete(tiny_llama_dir, tmp_path):
    a = _copy(tiny_llama_dir, tmp_path / "a")
    last = sorted(a.glob("model-*.safetensors"))[-1]
    last.write_bytes(
        last.read_bytes()[:200]
    )  # truncated download: fails after the first rank files are written
    with pytest.raises(Exception):  # noqa: B017  (the safetensors error type is internal)
        to_megatron(a, tmp_path / "out", tp=2, pp=2)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == ["a"]  # the temporary folder was removed too


def test_checksums_cover_every_tensor(tiny_glm_dir):
    sums = hf_checksums(tiny_glm_dir)
    assert len(sums) == 3 + 1 + 2 * 7  # emb, final norm, output, inv_freq; 7 tensors per layer (qkv w+b)
    assert sums["transformer.encoder.layers.0.self_attention.query_key_value.weight"]["shape"] == [128, 64]


def test_te_flavor_key_names_and_round_trip(tiny_llama_dir, tmp_path):
    r = round_trip(tiny_llama_dir, tmp_path, tp=2, pp=1, flavor="te")
    assert r["bit_exact"], r
    keys = MegatronReader(r["megatron"]).all_keys(0, 0)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys
    assert not [k for k in keys if "input_layernorm" in k or "pre_mlp_layernorm" in k]


def test_megatron_checkpoint_not_made_by_the_kit_needs_and_uses_an_hf_config(tiny_llama4_dir, tmp_path):
    """A training run's checkpoint has no hf_meta/ or kit_convert.json: layout from args, config from the user."""
    import shutil

    out = tmp_path / "m"
    to_megatron(tiny_llama4_dir, out, tp=2, pp=2, num_layer_list=[3, 1])
    shutil.rmtree(out / "hf_meta")
    (out / "kit_convert.json").unlink()
    back = ConvertConfig(str(out), str(tmp_path / "hf"), direction="megatron_to_hf")
    with pytest.raises(FileNotFoundError, match="Pass hf_config_dir"):
        megatron_to_hf(back, progress=False)
    back.hf_config_dir = str(tiny_llama4_dir)
    megatron_to_hf(back, progress=False)  # uneven stages come from args.num_layer_list = "3,1"
    assert compare_hf(tiny_llama4_dir, tmp_path / "hf")["bit_exact"]
    wrong = ConvertConfig(
        str(out), str(tmp_path / "hf2"), direction="megatron_to_hf", hf_config_dir=str(tmp_path / "hf")
    )
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="num_layers: checkpoint args say 4"):
        megatron_to_hf(wrong, progress=False)


@pytest.mark.slow
def test_peak_memory_stays_far_below_the_model_size(tmp_path):
    """Streaming: converting a ~120 MB model raises the process's peak RSS by far less than the model size."""
    import subprocess
    import sys

    from fixtures.convert.synthetic import synthetic_checkpoint

    src = synthetic_checkpoint(
        tmp_path / "src",
        "llama",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_groups=2,
        ffn_hidden_size=1408,
        vocab_size=8000,
        max_shard_mb=40,
        with_tokenizer=False,
    )
    model_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1024**2
    code = (
        "import re, torch\n"
        "from kit.convert import ConvertConfig, hf_to_megatron\n"
        "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024\n"
        "torch.zeros(1); before = hwm()\n"
        f"hf_to_megatron(ConvertConfig({str(src)!r}, {str(tmp_path / 'out')!r}, tp=1, pp=1), progress=False)\n"
        "print(hwm() - before)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    growth_mb = float(res.stdout.strip().splitlines()[-1])
    assert model_mb > 100
    # one TP1 rank file is the whole model here; whole-model converters grow by >= model_mb
    assert growth_mb < 0.35 * model_mb, (growth_mb, model_mb)


def test_megatron_side_unknown_or_missing_tensors_are_errors(tiny_llama_dir, tmp_path):
    from kit.convert.megatron_io import save_rank

    out = tmp_path / "m"
    to_megatron(tiny_llama_dir, out, tp=2, pp=1)
    path = out / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    state = load_rank_file(path)
    model = {k: v.clone() for k, v in state["model"].items()}
    model["decoder.layers.0.self_attention.linear_proj.bias"] = torch.zeros(
        64
    )  # a bias the map does not know
    model["decoder.layers.1.mlp.linear_fc1._extra_state"] = None  # metadata entries are fine
    del model["decoder.layers.1.mlp.linear_fc2.weight"]
    save_rank(path, state["args"], model)
    with pytest.raises(ConversionError) as err:
        megatron_to_hf(
            ConvertConfig(str(out), str(tmp_path / "hf"), direction="megatron_to_hf"), progress=False
        )
    msg = str(err.value)
    assert (
        "mp_rank_01: tensor 'decoder.layers.0.self_attention.linear_proj.bias' is not in the llama map" in msg
    )
    assert "mp_rank_01: missing ['decoder.layers.1.mlp.linear_fc2.weight']" in msg
    assert "_extra_state" not in msg and not (tmp_path / "hf").exists()
