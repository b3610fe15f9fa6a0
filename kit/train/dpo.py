"""DPO (RUN_TYPE=dpo) on the kit trainer: the sigmoid preference loss of Rafailov et al. 2023 (arXiv:2305.18290),
optionally label-smoothed (cDPO) and with an SFT term on the chosen answer, over the pairs notebook 02 prepares
(kit.data.pairs). The trainer's loop, checkpoints, resume, SIGTERM, NaN stop and export are the SFT run's; this
module only lays a micro-batch of pairs out, computes its loss and the metrics TRL logs, and provides the reference.

Conventions (TRL's DPOTrainer 1.16, which tests/test_train_dpo.py compares against): a sequence's log-probability is
the *sum* over its answer tokens; the loss is the mean over the pairs of a micro-batch; the prompt ends where the
chat template's generation prompt ends (the answer starts with the assistant's text); the SFT term is the mean
negative log-probability over the chosen answers' tokens of the micro-batch.

The reference model: for LoRA the same model with its adapters switched off; for full training the reference
log-probabilities of every pair, computed once before the first step with the starting weights and stored in the
run folder (`reference_logps.safetensors`, read again on resume), so no second model is held in device memory; or,
DPO_REFERENCE='copy', a frozen copy of the starting model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

IGNORE = -100
REFERENCES = ("auto", "precompute", "copy", "adapters_off")
REF_FILE = "reference_logps.safetensors"
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def start_from_run(model_path: Optional[str]) -> Optional[Tuple[str, Any]]:
    """MODEL_PATH naming a training run (its folder, or its exported hf/ folder): (the HF folder to start from, the
    run's manifest), read through the manifests (kit.core.inputs); None for a plain model folder."""
    from kit.core.inputs import consumed, run_outputs
    from kit.core.manifest import HF_MODEL, TRAINING_RUN, find_manifest, read_manifest
    from kit.errors import InputError

    if not model_path or find_manifest(model_path) is None:
        return None
    man = read_manifest(model_path)
    if man.kind == TRAINING_RUN:
        hf = run_outputs(man.folder).hf
        if hf is None or not hf.is_dir():
            raise InputError(
                f"MODEL_PATH={model_path!r} is a {man['run_type']} run without an exported model (its hf/ or merged/); "
                f"train it with SAVE_HF=True, or give an HF folder."
            )
        return str(hf), man
    if man.kind == HF_MODEL:
        run = consumed(man, TRAINING_RUN)
        return (str(man.folder), run) if run is not None else None
    return None


def reference_kind(cfg: Any) -> str:
    """DPO_REFERENCE resolved: 'adapters_off' for LoRA and 'precompute' for full training unless set."""
    if cfg.dpo_reference != "auto":
        return cfg.dpo_reference
    return "adapters_off" if cfg.lora else "precompute"


def pair_batch(rows: Dict[str, Any], pad_id: int) -> Dict[str, Any]:
    """A micro-batch of pairs (lists of prompt / chosen / rejected id tensors) as one padded batch: the B chosen
    sequences, then the B rejected ones (TRL's layout), right-padded to the longest; labels -100 on the prompt and
    the padding, position_ids counting from 0 in each sequence."""
    import torch

    seqs, labels = [], []
    for side in ("chosen_ids", "rejected_ids"):
        for prompt, answer in zip(rows["prompt_ids"], rows[side]):
            prompt, answer = (
                torch.as_tensor(prompt, dtype=torch.long),
                torch.as_tensor(answer, dtype=torch.long),
            )
            seqs.append(torch.cat([prompt, answer]))
            labels.append(torch.cat([torch.full_like(prompt, IGNORE), answer]))
    width = max(s.numel() for s in seqs)
    out = {
        "input_ids": torch.full((len(seqs), width), pad_id, dtype=torch.long),
        "labels": torch.full((len(seqs), width), IGNORE, dtype=torch.long),
        "attention_mask": torch.zeros((len(seqs), width), dtype=torch.long),
        "position_ids": torch.zeros((len(seqs), width), dtype=torch.long),
    }
    for i, (s, lab) in enumerate(zip(seqs, labels)):
        n = s.numel()
        out["input_ids"][i, :n], out["labels"][i, :n] = s, lab
        out["attention_mask"][i, :n] = 1
        out["position_ids"][i, :n] = torch.arange(n)
    return out


def sequence_logps(
    model: Callable, batch: Dict[str, Any], flatten: bool = False, select: bool = False
) -> Tuple[Any, Any]:
    """(sum of the answer tokens' log-probabilities per sequence, those tokens' count per sequence), in float32.

    `flatten`: the sequences go as one padding-free row (kit attention keeps them apart by position_ids, as for SFT);
    `select`: then the LM head runs only where an answer token follows (logits_to_keep). Same numbers either way."""
    import torch

    from kit.train.trainer import flatten_padded_rows, logit_positions

    rows = batch["attention_mask"].shape[0]
    lengths = batch["attention_mask"].sum(dim=1)
    if flatten:
        flat = flatten_padded_rows(batch)
        flatten = flat is not batch  # without padding (answers of one length) the rows stay as they are
        batch = flat
    if flatten:
        seq_of = torch.repeat_interleave(torch.arange(rows, device=lengths.device), lengths)[None]
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    positions = logit_positions(labels) if flatten and select else None
    if positions is not None:
        logits = model(**inputs, logits_to_keep=positions).logits[0].float()
        targets = labels[0, 1:][positions]
    else:
        logits = model(**inputs).logits[:, :-1].float()
        targets = labels[:, 1:]
    mask = targets != IGNORE
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logps = logps * mask
    if not flatten:
        return logps.sum(dim=1), mask.sum(dim=1)
    seg = seq_of[0, 1:] if positions is None else seq_of[0, 1:][positions]
    logps, mask = logps.reshape(-1), mask.reshape(-1)
    sums = torch.zeros(rows, dtype=logps.dtype, device=logps.device).index_add(0, seg, logps)
    counts = torch.zeros(rows, dtype=torch.long, device=logps.device).index_add(0, seg, mask.long())
    return sums, counts


def dpo_loss(
    logps: Any,
    counts: Any,
    ref_logps: Any,
    beta: float,
    label_smoothing: float = 0.0,
    sft_weight: float = 0.0,
) -> Tuple[Any, Dict[str, Any]]:
    """The loss of a micro-batch of B pairs ([chosen..., rejected...] sums and counts, 2B each) and its per-pair
    metrics (rewards, logps), as TRL's DPOTrainer names them.

    loss = mean over pairs of -(1-ε) log σ(β Δ) - ε log σ(-β Δ), Δ = (πc - rc) - (πr - rr) (ε: label smoothing,
    cDPO), plus sft_weight times the mean negative log-probability per chosen-answer token."""
    import torch.nn.functional as F

    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(
        -beta * delta
    )
    loss = losses.mean()
    if sft_weight:
        loss = loss + sft_weight * (-chosen.sum() / counts.chunk(2)[0].sum().clamp(min=1))
    rc, rr = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    per_pair = {
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "rewards/accuracies": (rc > rr).float(),
        "rewards/margins": rc - rr,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }
    return loss, per_pair


class DpoObjective:
    """The trainer's loss hook for RUN_TYPE=dpo: micro-batches of pairs in, (loss, real tokens) out; the step's
    metrics summed over micro-batches and ranks (`step_metrics`)."""

    def __init__(
        self, cfg: Any, pad_id: int, device: Any, flatten: bool, select: bool, reference: Any = None
    ):
        self.cfg, self.pad_id, self.device = cfg, pad_id, device
        self.flatten, self.select = flatten, select
        self.kind = reference_kind(cfg)
        self.reference = reference  # the frozen copy (DPO_REFERENCE='copy')
        self._sums: List[Any] = []
        self.last: Dict[str, float] = {}
        self.ref_file: Optional[Path] = None

    def _logps(self, model: Callable, batch: dict) -> Tuple[Any, Any]:
        from contextlib import nullcontext

        ctx = nullcontext()
        if self.flatten:
            from kit.adapt.attention import flattened_rows

            ctx = flattened_rows()
        with ctx:
            return sequence_logps(model, batch, self.flatten, self.select)

    def reference_logps(self, engine: Any, batch: dict) -> Any:
        """The reference's sums for a laid-out batch, without gradients (adapters off, or the frozen copy)."""
        import torch

        with torch.no_grad():
            if self.kind == "copy":
                return self._logps(self.reference, batch)[0]
            with engine.module.disable_adapter():
                return self._logps(engine, batch)[0]

    def loss(self, engine: Any, rows: dict) -> Tuple[Any, int]:
        import torch

        batch = {k: v.to(self.device) for k, v in pair_batch(rows, self.pad_id).items()}
        if self.kind == "precompute":
            ref = torch.cat([rows["ref_chosen_logps"], rows["ref_rejected_logps"]]).to(self.device).float()
        else:
            ref = self.reference_logps(engine, batch)
        logps, counts = self._logps(engine, batch)
        c = self.cfg
        loss, per_pair = dpo_loss(logps, counts, ref, c.dpo_beta, c.dpo_label_smoothing, c.dpo_sft_weight)
        sums = torch.stack(
            [per_pair[k].sum() for k in METRICS]
            + [torch.tensor(float(len(rows["prompt_ids"])), device=loss.device)]
        )
        self._sums.append(sums.float())
        return loss, int(batch["attention_mask"].sum())

    def step_metrics(self, reduce: Callable[[Any], List[float]]) -> Dict[str, float]:
        """The step's metrics: means over every pair of the global batch (one all-reduce); resets the sums."""
        import torch

        total = reduce(torch.stack(self._sums).sum(dim=0))
        self._sums = []
        n = total[-1] or 1.0
        self.last = {k: v / n for k, v in zip(METRICS, total)}
        return self.last

    def start_step(self) -> None:
        self._sums = []

    def summary(self) -> Dict[str, Any]:
        """What the run manifest records (manifest_fields)."""
        return manifest_fields(self.cfg, self.last, self.ref_file)


def setup_objective(trainer: Any, resume: bool) -> DpoObjective:
    """Give `trainer` (kit.train.trainer.Trainer, set up to its engine) the DPO loss and its reference: the stored
    or freshly computed reference sums (precompute), or a frozen copy of the starting model read again from
    MODEL_PATH (copy: so that a resumed run compares with the same model)."""
    t, cfg = trainer, trainer.cfg
    pad = t.meta.pad_token_id if t.meta.pad_token_id is not None else (t.meta.eos_token_id or 0)
    kind = reference_kind(cfg)
    reference = None
    if kind == "copy":
        from kit.system.hf_compat import load_causal_lm
        from kit.train import engine as eng

        ref = load_causal_lm(cfg.model_path, None)
        ref.config.use_cache = False
        if cfg.adapt:
            eng.adapt(ref)
        dtype = next(t.engine.module.parameters()).dtype
        reference = frozen_copy(ref.to(dtype=dtype), t.device)
    obj = DpoObjective(cfg, int(pad), t.device, t.flatten, t.select_logits, reference)
    if kind == "precompute":
        obj.ref_file = t.out / REF_FILE
        data_sha = t.meta.manifest.sha256
        if resume:
            chosen, rejected = load_reference(obj.ref_file, data_sha, len(t.ds))
            t.writer.text(f"reference log-probabilities read from {obj.ref_file}")
        else:
            chosen, rejected = precompute_reference(
                t.engine, t.ds, cfg, obj.pad_id, t.rank, t.world, t.flatten
            )
            if t.rank == 0:
                save_reference(obj.ref_file, chosen, rejected, data_sha)
            t.writer.text(
                f"reference log-probabilities of {len(t.ds)} pairs computed, stored in {obj.ref_file}"
            )
        t.ds = with_reference(t.ds, chosen, rejected)
    t.objective = obj
    return obj


def precompute_reference(
    engine: Any, ds: Any, cfg: Any, pad_id: int, rank: int, world: int, flatten: bool
) -> Tuple[Any, Any]:
    """Every pair's reference sums (chosen, rejected) with the starting weights: rank r scores pairs r, r+W, ...;
    one all-reduce (fp32) gives every rank all of them."""
    import torch
    import torch.distributed as dist

    n = len(ds)
    out = torch.zeros(2, n, dtype=torch.float32, device=engine.device)
    objective = DpoObjective(cfg, pad_id, engine.device, flatten, False)
    module = engine.module
    was_training = module.training
    module.eval()
    mine = list(range(rank, n, world))
    with torch.no_grad():
        for start in range(0, len(mine), cfg.mbs):
            idx = mine[start : start + cfg.mbs]
            batch = {k: v.to(engine.device) for k, v in pair_batch(ds[idx], pad_id).items()}
            sums = objective._logps(engine, batch)[0].float()
            out[0, idx], out[1, idx] = sums.chunk(2)
    module.train(was_training)
    if world > 1:
        dist.all_reduce(out)
    return out[0].cpu(), out[1].cpu()


def save_reference(path: Path, chosen: Any, rejected: Any, data_sha256: str) -> Path:
    """Store the reference sums with the run (atomically), tagged with the data they score."""
    from safetensors.torch import save

    from kit.storage.atomic import atomic_file

    blob = save(
        {"chosen": chosen.contiguous(), "rejected": rejected.contiguous()}, metadata={"data": data_sha256}
    )
    with atomic_file(Path(path), "wb") as fh:
        fh.write(blob)
    return Path(path)


def load_reference(path: Path, data_sha256: str, rows: int) -> Tuple[Any, Any]:
    """The stored reference sums; one line when they are missing or belong to other data."""
    from safetensors import safe_open

    from kit.errors import IntegrityError

    path = Path(path)
    if not path.is_file():
        raise IntegrityError(
            f"{path} is missing: a resumed full-weight DPO run needs the reference log-probabilities computed before "
            f"its first step; start the run again (OVERWRITE=True) or copy the file back."
        )
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata() or {}
        chosen, rejected = fh.get_tensor("chosen"), fh.get_tensor("rejected")
    if meta.get("data") != data_sha256 or chosen.numel() != rows:
        raise IntegrityError(
            f"{path} scores other data ({chosen.numel()} pairs, manifest {str(meta.get('data'))[:12]}) than this run's "
            f"({rows} pairs, manifest {data_sha256[:12]}); start the run again (OVERWRITE=True)."
        )
    return chosen, rejected


def with_reference(ds: Any, chosen: Any, rejected: Any) -> Any:
    """The pairs with their reference sums as two more columns (so each micro-batch carries its own)."""
    from kit.data.prepared import COLUMNS

    plain = ds.with_format(None)
    plain = plain.add_column("ref_chosen_logps", [float(x) for x in chosen])
    plain = plain.add_column("ref_rejected_logps", [float(x) for x in rejected])
    return plain.with_format(
        "torch", columns=list(COLUMNS["dpo"]) + ["ref_chosen_logps", "ref_rejected_logps"]
    )


def frozen_copy(module: Any, device: Any) -> Any:
    """DPO_REFERENCE='copy': the starting model, frozen, on the training device."""
    import copy

    ref = copy.deepcopy(module).to(device)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def finite(metrics: Dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


def manifest_fields(cfg: Any, last: Optional[Dict[str, float]], ref_file: Optional[Path]) -> Dict[str, Any]:
    """What the training-run manifest records of a DPO run: the loss settings, the reference, the last step's
    metrics."""
    return {
        "beta": cfg.dpo_beta,
        "label_smoothing": cfg.dpo_label_smoothing,
        "sft_weight": cfg.dpo_sft_weight,
        "reference": reference_kind(cfg),
        "reference_logps": str(ref_file) if ref_file else None,
        "metrics": dict(last or {}),
    }
