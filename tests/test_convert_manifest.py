"""Conversion outputs describe themselves (kit_manifest.json) and name what they were made from; model facts come
from the family maps for every family."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.convert import models as convert_models

from kit.convert import ConvertConfig, model_facts, run
from kit.convert.sources import fingerprint
from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    HF_MODEL,
    PREPARED_DATA,
    Consumed,
    read_manifest,
    tokenizer_sha256,
    write_manifest,
)
from kit.core.parallel import parallel_problems
from kit.errors import InputError

tiny_glm_dir = convert_models.tiny_glm_dir  # shared session fixtures
tiny_baichuan_dir = convert_models.tiny_baichuan_dir
tiny_baichuan7b_dir = convert_models.tiny_baichuan7b_dir
tiny_llama4_dir = convert_models.tiny_llama4_dir

ROOT = Path(__file__).resolve().parents[1]


def _convert(source, target, **kw):
    return run(ConvertConfig(str(source), str(target), **kw), progress=False)


def test_converted_manifest_holds_layout_vocab_and_family_facts(tiny_llama4_dir, tmp_path):
    out = tmp_path / "tp2pp3"
    result = _convert(tiny_llama4_dir, out, tp=2, pp=3, num_layer_list=[1, 2, 1])
    m = read_manifest(out, expect=CONVERTED_CHECKPOINT)
    assert (m["direction"], m["family"], m["flavor"], m["tp"], m["pp"]) == (
        "hf_to_megatron",
        "llama",
        "local",
        2,
        3,
    )
    assert m["num_layer_list"] == [1, 2, 1]
    assert m["padded_vocab_size"] == 2560  # 2522 rounded up to a multiple of 128 x TP2
    assert m["dtype"] == "float32"
    model = m["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_heads"], model["num_kv_groups"]) == (
        4,
        64,
        4,
        2,
    )
    assert (model["ffn_hidden_size"], model["vocab_size"], model["qkv_bias"]) == (128, 2522, True)
    assert m["source"] == str(Path(tiny_llama4_dir).resolve())
    assert m.inputs == [] and m["source_kind"] is None
    assert m["source_sha256"] == fingerprint(
        tiny_llama4_dir
    )  # a downloaded HF model: hash of config + headers
    assert m["tokenizer"] == str(out.resolve() / "hf_meta")
    assert m["tokenizer_sha256"] == tokenizer_sha256(tiny_llama4_dir)
    flags = m["megatron_flags"]
    assert flags[flags.index("--num-layer-list") + 1] == "1,2,1"
    assert flags[flags.index("--num-query-groups") + 1] == "2" and "--add-qkv-bias" in flags
    assert flags[flags.index("--padded-vocab-size") + 1] == "2560"
    # the facts read back from the converted folder are the HF folder's, and fit kit.core.parallel's rules
    assert model_facts(out) == model_facts(tiny_llama4_dir) == model
    assert parallel_problems(model, m["tp"], m["pp"], m["num_layer_list"]) == []
    s = result.summary()
    assert (s["tp"], s["pp"], s["num_layer_list"], s["padded_vocab_size"]) == (2, 3, [1, 2, 1], 2560)
    assert s["manifest_sha256"] == m.sha256 and s["inputs"] == [] and "no kit manifest" in s["source_note"]


def test_provenance_chains_through_hf_megatron_hf_megatron(tiny_llama_dir, tmp_path):
    # the hf/ folder training exports: an HF model whose hf-model manifest names the training run it came from
    trained = tmp_path / "run" / "hf"
    shutil.copytree(tiny_llama_dir, trained)
    run_input = Consumed("training-run", str(tmp_path / "run"), "ab" * 32)
    hf_man = write_manifest(
        trained, HF_MODEL, {"family": "llama", "source": str(tmp_path / "run")}, [run_input]
    )

    from kit.convert.tables import describe

    shown = describe(ConvertConfig(str(trained), str(tmp_path / "mg"), tp=2, pp=2)).loc[
        "source manifest", "value"
    ]
    assert shown.startswith(f"hf-model (sha256 {hf_man.sha256[:12]})") and str(tmp_path / "run") in shown
    first = _convert(trained, tmp_path / "mg", tp=2, pp=2)
    m1 = first.manifest
    assert m1.inputs == [hf_man.as_input()]
    assert (m1["source_kind"], m1["source_sha256"]) == (HF_MODEL, hf_man.sha256)
    assert first.summary()["inputs"] == [
        {"kind": HF_MODEL, "path": str(trained.resolve()), "manifest_sha256": hf_man.sha256}
    ]

    reshard = _convert(tmp_path / "mg", tmp_path / "mg_tp1pp1", direction="megatron_to_megatron")
    assert reshard.manifest.inputs == [m1.as_input()] and reshard.manifest["tp"] == 1

    back = _convert(tmp_path / "mg_tp1pp1", tmp_path / "hf_back", direction="megatron_to_hf")
    m3 = read_manifest(tmp_path / "hf_back", expect=HF_MODEL)
    assert m3.inputs == [reshard.manifest.as_input()] and m3["family"] == "llama"
    assert m3["source_layout"] == {"tp": 1, "pp": 1, "ep": 1, "flavor": "local"}
    assert m3["model"] == m1["model"]
    assert back.summary()["manifest_kind"] == HF_MODEL

    again = _convert(tmp_path / "hf_back", tmp_path / "mg2", tp=2)
    # followed back: mg2 <- hf_back <- mg_tp1pp1 <- mg <- run/hf <- the training run
    chain, m = [], again.manifest
    while m.inputs:
        chain.append(m.inputs[0].kind)
        if m.inputs[0].kind == "training-run":
            break
        m = read_manifest(m.inputs[0].path)
    assert chain == [HF_MODEL, CONVERTED_CHECKPOINT, CONVERTED_CHECKPOINT, HF_MODEL, "training-run"]


def _prepared_data_manifest(folder: Path) -> None:
    fields = dict.fromkeys(
        (
            "data_kind max_length tokenizer tokenizer_sha256 template pack eos_token_id pad_token_id vocab_size "
            "hf_path megatron_prefix megatron_flags heldout counts"
        ).split()
    )
    write_manifest(folder, PREPARED_DATA, fields)


def test_wrong_kind_source_is_one_line_error_naming_the_stage(tiny_llama_dir, tmp_path):
    data = tmp_path / "data_hf"
    shutil.copytree(tiny_llama_dir, data)  # even with weights inside, a prepared-data folder is not a model
    _prepared_data_manifest(data)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kit",
            "convert",
            "--source",
            str(data),
            "--target",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
    )
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert (
        "is a prepared-data folder (made by notebook 02" in lines[0]
        and "expected a hf-model folder" in lines[0]
    )
    assert not (tmp_path / "o").exists()


def test_megatron_folder_given_to_hf_direction_points_at_the_right_direction(tiny_llama_dir, tmp_path):
    _convert(tiny_llama_dir, tmp_path / "mg")
    with pytest.raises(InputError, match="is a converted-checkpoint folder .*use direction 'megatron_to_hf'"):
        _convert(tmp_path / "mg", tmp_path / "o")
    hf = tmp_path / "hf_with_manifest"
    shutil.copytree(tiny_llama_dir, hf)
    write_manifest(hf, HF_MODEL, {"family": "llama", "source": "x"})
    with pytest.raises(InputError, match="is a hf-model folder .*use direction 'hf_to_megatron'"):
        _convert(hf, tmp_path / "o", direction="megatron_to_hf")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_manifest(
        run_dir,
        "training-run",
        dict.fromkeys("run_type config sources data model checkpoints hf metrics log".split()),
    )
    with pytest.raises(InputError, match="is a training-run folder .*exported hf/ folder"):
        _convert(run_dir, tmp_path / "o")
    with pytest.raises(InputError, match="holds no model"):
        _prepared = tmp_path / "data"
        _prepared.mkdir()
        _prepared_data_manifest(_prepared)
        model_facts(_prepared)


def test_megatron_source_without_manifest_is_accepted_and_said_so(tiny_llama_dir, tmp_path):
    mg = tmp_path / "mg"
    _convert(tiny_llama_dir, mg, tp=2)
    (mg / "kit_manifest.json").unlink()  # as if another tool wrote it (it keeps its own args and hf_meta/)
    result = _convert(mg, tmp_path / "hf", direction="megatron_to_hf")
    m = read_manifest(tmp_path / "hf", expect=HF_MODEL)
    assert m.inputs == [] and m["source_kind"] is None
    assert m["source_sha256"] == fingerprint(mg) and "no manifest" in m["source_hash_rule"]
    assert "no kit manifest" in result.summary()["source_note"]
    before = fingerprint(mg)
    (mg / "hf_meta" / "config.json").write_text(
        (mg / "hf_meta" / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1)
    )
    assert fingerprint(mg) != before  # a changed config is a different source


def test_chatglm3_and_baichuan2_facts_come_from_the_family_maps(tiny_glm_dir, tiny_baichuan_dir, tmp_path):
    glm_config = json.loads((Path(tiny_glm_dir) / "config.json").read_text())
    assert "num_hidden_layers" not in glm_config  # ChatGLM3 says num_layers / multi_query_group_num
    glm = model_facts(tiny_glm_dir)
    assert (glm["family"], glm["num_layers"], glm["num_heads"], glm["num_kv_groups"]) == (
        "chatglm",
        glm_config["num_layers"],
        glm_config["num_attention_heads"],
        glm_config["multi_query_group_num"],
    )
    assert (glm["ffn_hidden_size"], glm["vocab_size"]) == (
        glm_config["ffn_hidden_size"],
        glm_config["padded_vocab_size"],
    )
    assert glm["rotary_percent"] == 0.5 and glm["rotary_interleaved"] and glm["qkv_bias"]

    bc_config = json.loads((Path(tiny_baichuan_dir) / "config.json").read_text())
    bc = model_facts(tiny_baichuan_dir)
    assert (bc["family"], bc["num_layers"], bc["num_kv_groups"]) == (
        "baichuan",
        bc_config["num_hidden_layers"],
        bc_config["num_attention_heads"],
    )
    assert bc["norm_head"] and bc["position"] == "alibi"

    out = tmp_path / "glm_tp2pp2"
    _convert(tiny_glm_dir, out, tp=2, pp=2)
    m = read_manifest(out)
    assert m["model"] == glm and model_facts(out) == glm
    assert m["megatron_flags"].count("--rotary-interleaved") == 1


# what each Baichuan2 modeling file defines, as far as the position rule reads it (13B: an ALiBi mask, 7B: RoPE)
ALIBI_CODE = (
    "def _get_interleave(n):\n    return []\n\n\ndef _gen_alibi_mask(tensor, n_head, max_pos):\n    pass\n"
)
ROPE_CODE = "class RotaryEmbedding:\n    pass\n\n\ndef rotate_half(x):\n    return x\n"


def _baichuan_folder(where: Path, hidden: int, code, module: str = "modeling_baichuan") -> tuple:
    where.mkdir()
    cfg = {"model_type": "baichuan", "hidden_size": hidden, "num_attention_heads": 4}
    cfg["auto_map"] = {"AutoModelForCausalLM": f"{module}.BaichuanForCausalLM"}
    if code is not None:
        (where / f"{module}.py").write_text(code)
    return cfg, where


def test_baichuan2_position_encoding_comes_from_its_modeling_code(tmp_path):
    """The folder's modeling file decides RoPE vs ALiBi whatever the size; hidden 4096 only without one."""
    from kit.convert.families import baichuan_position

    assert (
        baichuan_position(*_baichuan_folder(tmp_path / "a", 4096, ALIBI_CODE))[0] == "alibi"
    )  # a 7B-sized ALiBi
    pos, why = baichuan_position(*_baichuan_folder(tmp_path / "b", 64, ROPE_CODE))
    assert pos == "rope" and "RotaryEmbedding, rotate_half" in why
    # auto_map names the module; a Megatron checkpoint's hf_meta/ carries the same file
    assert baichuan_position(*_baichuan_folder(tmp_path / "c", 64, ROPE_CODE, "modeling_custom"))[0] == "rope"
    for hidden, want in ((4096, "rope"), (5120, "alibi"), (64, "alibi")):
        pos, why = baichuan_position(*_baichuan_folder(tmp_path / f"none{hidden}", hidden, None))
        assert pos == want and "no modeling file" in why
        assert baichuan_position({"hidden_size": hidden})[0] == want  # a bare config dict
    cfg, folder = _baichuan_folder(tmp_path / "hub", 5120, None)
    cfg["auto_map"]["AutoModelForCausalLM"] = (
        "baichuan-inc/Baichuan2-7B-Base--modeling_baichuan.BaichuanForCausalLM"
    )
    (folder / "modeling_baichuan.py").write_text(ROPE_CODE)  # code of another repo: the local file is read
    assert baichuan_position(cfg, folder)[0] == "rope"
    for code, said in (
        (ALIBI_CODE + ROPE_CODE, "both RoPE"),
        ("x = 1\n", "neither RoPE"),
        ("def (:\n", "not readable"),
    ):
        with pytest.raises(InputError, match=said):
            baichuan_position(*_baichuan_folder(tmp_path / f"bad{len(code)}", 4096, code))


def test_baichuan2_7b_layout_converts_as_rope_and_its_way_back_checks_it(tiny_baichuan7b_dir, tmp_path):
    from kit.convert.checks import ConversionError
    from kit.convert.megatron_io import MegatronReader
    from kit.convert.tables import describe

    facts = model_facts(tiny_baichuan7b_dir)
    assert (facts["position"], facts["hidden_size"], facts["norm_head"]) == ("rope", 64, True)
    row = describe(ConvertConfig(str(tiny_baichuan7b_dir), str(tmp_path / "x"), tp=2)).loc[
        "position encoding"
    ]
    assert "modeling_baichuan.py defines" in row["value"]
    out = tmp_path / "tp2"
    _convert(tiny_baichuan7b_dir, out, tp=2)
    m = read_manifest(out)
    assert m["model"]["position"] == "rope" and model_facts(out)["position"] == "rope"
    flags = m["megatron_flags"]
    assert flags[flags.index("--position-embedding-type") + 1] == "rope"
    assert MegatronReader(out).args.position_embedding_type == "rope"
    # without its modeling file the checkpoint's own HF config says ALiBi (hidden 64): its args contradict that
    (out / "hf_meta" / "modeling_baichuan.py").unlink()
    with pytest.raises(ConversionError, match="position_embedding_type: checkpoint args say rope"):
        _convert(out, tmp_path / "back", direction="megatron_to_hf")
    assert not (tmp_path / "back").exists()


def test_uneven_tp4_pp4_layer_list_7887_converts_and_is_recorded(tmp_path):
    from fixtures.convert.synthetic import synthetic_checkpoint

    from kit.convert.megatron_io import MegatronReader

    src = synthetic_checkpoint(
        tmp_path / "thirty", "llama", hidden_size=32, num_layers=30, num_heads=4, num_groups=4,
        ffn_hidden_size=64, vocab_size=500, with_tokenizer=False,
    )  # fmt: skip
    out = tmp_path / "tp4pp4"
    _convert(src, out, tp=4, pp=4, num_layer_list=[7, 8, 8, 7])
    m = read_manifest(out)
    assert (m["tp"], m["pp"], m["num_layer_list"], m["padded_vocab_size"]) == (4, 4, [7, 8, 8, 7], 512)
    mr = MegatronReader(out)
    assert (mr.tp, mr.pp, mr.layer_list(30)) == (4, 4, [7, 8, 8, 7])


def test_checkpoint_inside_a_training_run_consumes_the_run(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    _convert(tiny_llama_dir, ckpt)
    (
        ckpt / "kit_manifest.json"
    ).unlink()  # what a Megatron training run saves: rank files, no manifest of its own
    fields = dict.fromkeys("run_type config sources data model hf metrics log".split())
    run_man = write_manifest(run_dir, "training-run", dict(fields, checkpoints=[str(ckpt)]))
    back = _convert(ckpt, tmp_path / "hf", direction="megatron_to_hf")
    assert back.manifest.inputs == [run_man.as_input()]
    (run_dir / "kit_manifest.json").write_text(
        "{damaged"
    )  # an unreadable parent manifest is not the source's
    assert _convert(ckpt, tmp_path / "hf2", direction="megatron_to_hf").manifest.inputs == []


def test_cli_options_come_from_the_config_and_util_flags_are_aliases(tiny_llama_dir, tmp_path, capsys):
    from kit.__main__ import main

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "--make-vocab-size-divisible-by" in help_text
        and "Megatron's --make-vocab-size-divisible-by" in help_text
    )
    assert "--num-layer-list" in help_text and "--target-tensor-parallel-size" in help_text
    rc = main(
        ["convert", "--load-dir", str(tiny_llama_dir), "--save-dir", str(tmp_path / "o"), "--tp", "2",
         "--target-pipeline-parallel-size", "2", "--num-layer-list", "1,1", "--params-dtype", "bf16", "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["tp"], s["pp"], s["num_layer_list"], s["dtype"]) == (2, 2, [1, 1], "bfloat16")
    saved = json.loads((tmp_path / "o" / "convert_config.json").read_text())
    assert (saved["tp"], saved["pp"], saved["dtype"], saved["overwrite"]) == (2, 2, "bfloat16", False)
    assert main(["convert", "--target", str(tmp_path / "p"), "--no-progress"]) == 2
    assert "--source (--load-dir)" in capsys.readouterr().err
