"""What a conversion will do and what it wrote, as tables and a plot for the notebook."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from kit.convert import megatron_layout as layout
from kit.convert.config import ConvertConfig
from kit.convert.families import family_for_config, position_reason
from kit.convert.hf_io import HFReader
from kit.convert.megatron_io import MegatronReader
from kit.convert.sources import source_manifest
from kit.core.parallel import padded_vocab_size, stage_layers

PathLike = Union[str, Path]


def describe(cfg: ConvertConfig):
    """The source model's architecture facts, its manifest, and the planned Megatron layout (a pandas DataFrame)."""
    import pandas as pd

    src_man = source_manifest(cfg.source, cfg.direction)
    reader = HFReader(cfg.source)
    fam = family_for_config(reader.config, cfg.family)
    spec = fam.read_config(reader.config, reader.folder)
    padded = padded_vocab_size(
        spec.vocab_size, cfg.tp, cfg.make_vocab_size_divisible_by, cfg.padded_vocab_size
    )
    stages = stage_layers(spec.num_layers, cfg.pp, cfg.num_layer_list)
    why = position_reason(fam.name, reader.config, reader.folder)  # Baichuan2: which file or size decided
    rows = [
        ("family", f"{fam.name} ({fam.notes})"),
        ("layers", spec.num_layers),
        ("hidden size", spec.hidden_size),
        ("attention heads / KV groups", f"{spec.num_heads} / {spec.num_groups}"),
        ("head dim", spec.head_dim),
        ("FFN size", spec.ffn_hidden_size),
        ("vocabulary -> padded", f"{spec.vocab_size} -> {padded}"),
        ("tied embeddings", spec.tied),
        (
            "position encoding",
            spec.position
            + (
                f" (percent {spec.rotary_percent}, interleaved {spec.rotary_interleaved})"
                if spec.position == "rope"
                else ""
            )
            + (
                f", {spec.rope_scaling} scaling x{spec.rope_scaling_factor} from "
                f"{spec.original_max_position_embeddings} positions"
                if spec.rope_scaling
                else ""
            )
            + (f" ({why})" if why else ""),
        ),
        *(
            [("multi-head latent attention", mla_note(spec))]
            if spec.multi_latent_attention
            else [("q/k norm (per head, before rotary)", spec.qk_norm)]
        ),
        *(
            [
                (
                    "experts",
                    f"{spec.num_experts} of FFN {spec.moe_ffn_hidden_size}, top-{spec.moe_router_topk}"
                    f"{' renormalised' if spec.moe_norm_topk_prob else ''}, aux-loss coefficient "
                    f"{spec.moe_aux_loss_coeff}, MoE layers {sum(spec.moe_layer_freq)}/{spec.num_layers}",
                )
            ]
            if spec.num_experts
            else []
        ),
        *(
            [("routing, shared experts, MTP", routed_note(spec))]
            if spec.moe_router_enable_expert_bias
            else []
        ),
        (
            "source weights",
            f"{reader.weight_bytes() / 1024**2:.1f} MiB in {len(set(reader.weight_map.values()))} file(s)",
        ),
        (
            "source manifest",
            f"{src_man.kind} (sha256 {src_man.sha256[:12]}), made from "
            f"{[f'{c.kind} {c.path}' for c in src_man.inputs] or 'nothing recorded'}"
            if src_man is not None
            else "none (a folder from outside the kit: identified by a hash of its config and shard headers)",
        ),
        (
            "target layout",
            f"TP{cfg.tp} x PP{cfg.pp}"
            + (f" x EP{cfg.ep}" if cfg.ep > 1 else "")
            + f", {cfg.flavor} key names"
            + (", grouped GEMM" if cfg.moe_grouped_gemm else ""),
        ),
        ("layers per stage", [len(s) for s in stages] if stages else "invalid"),
    ]
    return pd.DataFrame(rows, columns=["item", "value"]).set_index("item")


def layout_table(folder: PathLike):
    """One row per rank file: folder name, layers, tensors, MiB."""
    import pandas as pd

    mr = MegatronReader(folder)
    rows = []
    for (t, p, e), path in sorted(mr.files.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        flat = layout.flatten(mr.state(t, p, e)["model"])
        layers = {k.split("layers.")[1].split(".")[0] for k in flat if "layers." in k}
        rows.append(
            {
                "rank file": f"{layout.rank_dir(t, p, mr.pp, e, mr.ep)}/model_optim_rng.pt",
                "tp": t,
                "pp": p,
                "ep": e,
                "layers": len(layers),
                "tensors": len(flat),
                "MiB": round(path.stat().st_size / 1024**2, 2),
            }
        )
    return pd.DataFrame(rows)


def plot_layout(folder: PathLike, png: Optional[PathLike] = None):
    """Heat map of rank-file sizes (TP across, PP down), saved as PNG beside the checkpoint; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    mr = MegatronReader(folder)
    sizes = np.zeros((mr.pp, mr.tp))
    for (t, p, e), path in mr.files.items():
        if e == 0:  # EP ranks differ only by their experts: EP rank 0's files stand for the others
            sizes[p, t] = path.stat().st_size / 1024**2
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * mr.tp, 1.0 + 0.8 * mr.pp))
    im = ax.imshow(
        sizes, cmap="Blues", vmin=0, vmax=max(float(sizes.max()), 1e-9)
    )  # from zero: equal ranks look equal
    for (p, t), v in np.ndenumerate(sizes):
        ax.text(t, p, f"{v:.1f}", ha="center", va="center")
    ax.set_xticks(range(mr.tp), [f"TP{t}" for t in range(mr.tp)])
    ax.set_yticks(range(mr.pp), [f"PP{p}" for p in range(mr.pp)])
    ax.set_title("rank file size (MiB)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    out = Path(png) if png else Path(folder) / "rank_file_sizes.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def routed_note(spec) -> str:
    """One line on a DeepSeek-V3 / GLM-4.5 MoE block: its router, shared experts and MTP layers."""
    groups = (
        f", top-{spec.moe_router_group_topk} of {spec.moe_router_num_groups} groups"
        if spec.moe_router_num_groups
        else ""
    )
    scale = f", x{spec.moe_router_topk_scaling_factor}" if spec.moe_router_topk_scaling_factor else ""
    return (
        f"{spec.moe_router_score_function} + expert bias{groups}{scale}; shared FFN "
        f"{spec.moe_shared_expert_intermediate_size or 'none'}; MTP layers {spec.mtp_num_layers}"
    )


def mla_note(spec) -> str:
    """One line on DeepSeek-V3's multi-head latent attention: its latent ranks and head dims."""
    q = f"q latent {spec.q_lora_rank}" if spec.q_lora_rank else "q projection (no latent)"
    return (
        f"{q}, kv latent {spec.kv_lora_rank}; per head q/k {spec.qk_head_dim} + rope "
        f"{spec.qk_pos_emb_head_dim}, v {spec.v_head_dim}"
    )
