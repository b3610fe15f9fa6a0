"""kit.train.mtp_carry: an HF export of GLM-4.5 keeps the MTP layer transformers does not build (from the base
folder, its embedding and output copies from the exported model), single-file or sharded, and 03 reads it back."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.convert import routed_moe
from safetensors import safe_open

from kit.convert.hf_io import HFReader
from kit.train.mtp_carry import MTP_SHARD, carry_mtp_layers

tiny_glm45_dir = routed_moe.tiny_glm45_dir  # shared session fixture


@pytest.mark.parametrize("shard", ["1GB", "100KB"])  # one model.safetensors, or shards with their index
def test_export_keeps_the_mtp_layer(tiny_glm45_dir, tmp_path, shard):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_glm45_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # as if trained
    out = tmp_path / "export"
    model.save_pretrained(out, max_shard_size=shard)
    mtp = [k for k in HFReader(tiny_glm45_dir).keys() if k.startswith("model.layers.3.")]
    assert mtp and not any(
        k.startswith("model.layers.3.") for k in HFReader(out).keys()
    )  # what save_pretrained drops

    assert carry_mtp_layers(tiny_glm45_dir, out) == len(mtp)
    assert not (
        out / "model.safetensors"
    ).exists()  # beside an index it would be the only file transformers reads
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(k for k, f in index.items() if f == MTP_SHARD) == sorted(mtp)
    base, back = HFReader(tiny_glm45_dir), HFReader(out)
    assert torch.equal(back.read("model.layers.3.eh_proj.weight"), base.read("model.layers.3.eh_proj.weight"))
    trained_embed = model.model.embed_tokens.weight.detach()
    assert torch.equal(
        back.read("model.layers.3.embed_tokens.weight"), trained_embed
    )  # the copy follows the model
    assert len(back.keys()) == len(base.keys())
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers still loads the folder
    assert torch.equal(reloaded.model.embed_tokens.weight, trained_embed)
    assert carry_mtp_layers(tiny_glm45_dir, out) == 0  # nothing left to carry


def test_models_without_mtp_layers_are_left_alone(tiny_glm45_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from kit.core.samples.paths import sample_tokenizer_dir

    out = tmp_path / "export"
    AutoModelForCausalLM.from_pretrained(tiny_glm45_dir).save_pretrained(out)
    assert carry_mtp_layers(sample_tokenizer_dir(), out) == 0  # no config.json there
    cfg = json.loads((tiny_glm45_dir / "config.json").read_text())
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    assert carry_mtp_layers(plain, out) == 0 and (out / "model.safetensors").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert not any(k.startswith("model.layers.3.") for k in fh.keys())
