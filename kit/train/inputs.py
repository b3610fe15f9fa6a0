"""Find notebook 04's inputs (a model folder, prepared SFT/pretraining data) or make them from the samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple, Union

from kit.errors import MissingInputError

PathLike = Union[str, Path]


def _matches(folder: Path, kind: str, seq_len: int, tokenizer: Path) -> bool:
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return False
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    same_tok = Path(str(meta.get("tokenizer", ""))).resolve() == Path(tokenizer).resolve()
    return meta.get("kind") == kind and int(meta.get("max_length", -1)) == seq_len and same_tok


def find_prepared(ws, kind: str, seq_len: int, tokenizer: PathLike) -> Optional[Path]:
    """A `<name>_hf` folder of the workspace made for this kind, length and tokenizer (newest first), or None."""
    root = ws.data_finetune if kind == "sft" else ws.data_pretrain
    found = [p for p in root.glob("*_hf") if _matches(p, kind, seq_len, Path(tokenizer))]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def prepare_inputs(
    ws,
    model_path: Optional[PathLike] = None,
    dataset_path: Optional[PathLike] = None,
    seq_len: int = 256,
    kind: str = "sft",
    max_records: Optional[int] = None,
) -> Tuple[Path, Path]:
    """(model folder, prepared data folder): given ones are checked; missing ones come from the samples.

    The model defaults to the demo model (SmolLM2-135M-Instruct). Data: notebook 02's output for this model's
    tokenizer and SEQ_LEN if present, else the shipped sample (Alpaca SFT or the pretraining corpus) is prepared
    now with the model's own chat template, and the message says so.
    """
    from kit.samples import demo_model_dir

    model = Path(model_path) if model_path else demo_model_dir()
    if not (model / "config.json").is_file():
        raise MissingInputError(
            f"MODEL_PATH={str(model)!r} has no config.json; give an HF model folder (notebook "
            f"03's output) or None for the demo model."
        )
    if dataset_path:
        return model, Path(dataset_path)
    found = find_prepared(ws, kind, seq_len, model)
    if found is not None:
        print(f"using prepared data {found}")
        return model, found
    from kit.data import DataConfig, prepare

    name = f"{kind}_sample_{model.name}_{seq_len}".replace(".", "_")
    print(
        f"no prepared {kind} data for {model.name} at SEQ_LEN={seq_len} in the workspace (notebook 02 makes it); "
        f"preparing the shipped sample now as {name}_hf"
    )
    cfg = DataConfig(
        kind=kind,
        name=name,
        tokenizer=str(model),
        max_length=seq_len,
        template="tokenizer",
        max_records=max_records,
        overwrite=True,
    )
    return model, prepare(cfg, ws, progress=False).hf_dir
