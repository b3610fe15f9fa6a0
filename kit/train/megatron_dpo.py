"""RUN_TYPE=dpo on the Megatron path: the kit's DPO settings as MindSpeed-LLM's `posttrain_gpt.py --stage dpo` flags,
and the settings it has no counterpart for, refused in one line each (never dropped).

Facts, MindSpeed-LLM commit c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91: the flags and their defaults from
`mindspeed_llm/features_manager/dpo/dpo.py` (`--dpo-loss-type` sigmoid|hinge|ipo, `--is-pairwise-dataset`,
`--ref-model`, `--refer-model-iter`, `--dpo-beta`, `--dpo-label-smoothing`, `--pref-ftx`) and
`features_manager/megatron_basic/megatron_basic.py` (`--stage dpo`); the loss and the reference model from
`mindspeed_llm/tasks/posttrain/dpo/dpo_trainer.py`; the command's shape from
`examples/mcore/qwen3_moe/dpo_qwen3_30b_a3b_16K_A3_ptd.sh`.
"""

from __future__ import annotations

from typing import Any, List, Optional

# The kit's loss is DPO's sigmoid loss with cDPO label smoothing: the same formula as MindSpeed-LLM's
# `dpo_loss_type == "sigmoid"` branch (sums of answer-token log-probs, mean over the pairs of a micro-batch).
LOSS_TYPE = "sigmoid"


def setting_problems(cfg: Any) -> List[str]:
    """The kit DPO settings MindSpeed-LLM cannot run as the kit defines them (no file read)."""
    p = []
    if cfg.dpo_sft_weight:
        # dpo_trainer.py: `losses += pref_ftx * -(chosen_logps / chosen_length)`, a mean of per-answer means; the
        # kit's term is the mean over every chosen token of the micro-batch (TRL's): other numbers unless every
        # chosen answer has the same length
        p.append(
            f"DPO_SFT_WEIGHT={cfg.dpo_sft_weight}: MindSpeed-LLM's --pref-ftx averages each chosen answer's "
            f"log-probability per token and then over the pairs, the kit over all chosen tokens at once; set "
            f"DPO_SFT_WEIGHT=0 for ENGINE='megatron', or train with ENGINE='deepspeed'."
        )
    if cfg.dpo_reference == "precompute":
        p.append(
            "DPO_REFERENCE='precompute' has no MindSpeed-LLM counterpart: its DPO holds a frozen reference model "
            "(--ref-model) beside the trained one; use DPO_REFERENCE='auto' or 'copy' with ENGINE='megatron'."
        )
    return p


def dpo_flags(cfg: Any, reference: Optional[str]) -> List[str]:
    """The flags of a Megatron DPO run starting from the converted checkpoint `reference`.

    The reference model is always the starting checkpoint (`--ref-model`): MindSpeed-LLM otherwise reloads `--load`,
    which for a resumed run holds trained weights. DPO_REFERENCE 'auto' / 'copy' (full weights) and 'adapters_off'
    (DPO_LORA) all mean the starting weights, which is what a frozen copy of them computes."""
    flags = [
        "--finetune",
        "--stage", "dpo",
        "--is-pairwise-dataset",
        "--dpo-loss-type", LOSS_TYPE,
        "--dpo-beta", str(cfg.dpo_beta),
        "--dpo-label-smoothing", str(cfg.dpo_label_smoothing),
    ]  # fmt: skip
    return flags + (["--ref-model", reference] if reference else [])


def data_kind_problems(facts: dict, where: str) -> List[str]:
    """DPO trains on notebook 02's preference pairs with their pairwise Megatron files."""
    kind = facts.get("data_kind")
    if kind != "dpo":
        return [
            f"{where} holds {kind!r} data; RUN_TYPE=dpo trains on preference pairs: prepare them in notebook 02 "
            f"(DataConfig(kind='dpo'), python -m kit data dpo)."
        ]
    return []
