"""The multi-token-prediction layers of an exported HF folder. GLM-4.5 and DeepSeek-V3 checkpoints hold them as
model.layers.{num_hidden_layers + i}.*, which transformers does not build, so save_pretrained drops them and 03 could
not convert the trained folder back. They are carried over from the base folder unchanged (HF training does not
train them), their copies of the embedding and output layer taken from the trained model, as the published
checkpoints hold them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]

MTP_SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"
# the MTP layer's copies of the main model's tensors (HF key suffix -> the main model's key)
COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def carry_mtp_layers(base_path: PathLike, folder: PathLike) -> int:
    """Add the base folder's MTP layers that `folder` (a save_pretrained output) lacks; returns how many tensors."""
    from safetensors.torch import save_file

    from kit.convert.hf_io import HFReader, read_json

    base, folder = Path(base_path), Path(folder)
    cfg = read_json(base / "config.json") if (base / "config.json").is_file() else {}
    n = int(cfg.get("num_hidden_layers") or 0)
    if not n or not cfg.get("num_nextn_predict_layers"):
        return 0
    src, saved = HFReader(base), HFReader(folder)
    saved_map = dict(saved.weight_map)
    out = {}
    try:
        for key in src.weight_map:  # the layers past num_hidden_layers (the MTP layers) the export lacks
            if not key.startswith("model.layers.") or int(key.split(".")[2]) < n or key in saved_map:
                continue
            main = next((m for suffix, m in COPIES.items() if key.endswith("." + suffix)), None)
            out[key] = saved.read(main) if main in saved_map else src.read(key)
    finally:
        src.close()
        saved.close()
    if not out:
        return 0
    save_file(out, str(folder / MTP_SHARD), metadata={"format": "pt"})
    if (folder / "model.safetensors").is_file() and not (folder / INDEX).is_file():
        # an index beside model.safetensors is not read by transformers: name the single shard like the others
        (folder / "model.safetensors").rename(folder / "model-main.safetensors")
        saved_map = {k: "model-main.safetensors" for k in saved_map}
    saved_map.update({k: MTP_SHARD for k in out})
    total = sum((folder / f).stat().st_size for f in set(saved_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(saved_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return len(out)
