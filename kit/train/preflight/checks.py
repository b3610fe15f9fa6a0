"""The preflight's checks: the ranks' numbers against the HF side on the same batches, and the saved checkpoint's way
back to HF (notebook 03's converter) and forth again, tensor for tensor."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import List

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-5
PARAM_ATOL = 1e-4


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check(name: str, passed: bool, value, limit, detail: str) -> dict:
    return {"check": name, "passed": bool(passed), "value": value, "limit": limit, "detail": detail}


def compare(job: dict, results: List[dict], work: Path):
    """The check rows from the ranks' numbers and the HF reference on the same batches."""
    import torch

    from kit.train.preflight import reference

    checks: List[dict] = []
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if r.get("error")]
    load = [
        f"rank {r['rank']} (tp {r.get('tp_rank')}, pp {r.get('pp_rank')}): {p}"
        for r in results
        for p in r.get("load_problems", [])
    ]
    # one count per rank file: its (TP, PP, EP) coordinates repeat over the (expert) data-parallel ranks
    files = {(r.get("tp_rank"), r.get("pp_rank"), r.get("ep_rank", 0)): r.get("tensors", 0) for r in results}
    tensors = sum(files.values())
    if errors and not any("load_problems" in r for r in results):  # stopped before any file was loaded
        return [_check("ranks ran", False, len(errors), 0, errors[0])], {}
    checks.append(
        _check(
            "shards loaded",
            not load,
            len(load),
            0,
            load[0] + (f" (+{len(load) - 1} more)" if len(load) > 1 else "")
            if load
            else f"{tensors} tensors in {len(files)} rank files, keys and shapes exact"
            + _mtp_detail(results),
        )
    )
    if load or errors:
        if errors:
            checks.append(_check("ranks ran", False, len(errors), 0, errors[0]))
        return checks, {}
    seconds = {}
    t = time.monotonic()
    hf_dir = _back_to_hf(job["checkpoint"], work / "reference_hf")
    batches = torch.load(work / "batches.pt")
    ref = reference.load(hf_dir, job)
    seconds["HF side: convert back"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    if job.get("dpo"):  # pairs: the kit's DPO step, its reference log-probs from the starting weights
        from kit.train.preflight.dpo import DpoReference, logps_check

        ref = DpoReference(ref, job)
        checks.append(logps_check(results, ref.reference_logps(batches), LOSS_RTOL))
    ref_run = reference.train(ref, batches, job)
    seconds["HF side: steps"] = round(time.monotonic() - t, 1)
    last = [r for r in results if r.get("losses")]
    mg_losses = last[0]["losses"]
    mg_norms, mg_norms64 = results[0]["grad_norms"], results[0]["grad_norms_fp64"]
    l0, n0 = mg_losses[0], mg_norms64[0]
    rl = _rel(l0, ref_run["losses"][0])
    checks.append(
        _check(
            "loss vs HF",
            rl <= LOSS_RTOL,
            rl,
            LOSS_RTOL,
            f"megatron {l0:.7f}, HF {ref_run['losses'][0]:.7f} (relative {rl:.1e})",
        )
    )
    rn = _rel(n0, ref_run["grad_norms"][0])
    checks.append(
        _check(
            "grad norm vs HF",
            rn <= NORM_RTOL,
            rn,
            NORM_RTOL,
            f"megatron {n0:.7f}, HF {ref_run['grad_norms'][0]:.7f} (relative {rn:.1e}; both summed in float64, "
            f"megatron-core's own fp32 norm {mg_norms[0]:.7f})",
        )
    )
    if job.get("moe") and job["moe"]["aux_loss_coeff"] > 0:  # GLM-4.5: no aux loss on either side
        checks.append(_aux_check(last[0].get("aux_losses") or [], ref_run, job))
    worst = max(_rel(a, b) for a, b in zip(mg_losses, ref_run["losses"]))
    lr_off = max(abs(a - b) for a, b in zip(results[0]["lrs"], ref_run["lrs"]))
    checks.append(
        _check(
            "losses over steps",
            worst <= LOSS_RTOL and lr_off <= 1e-12,
            worst,
            LOSS_RTOL,
            f"{len(mg_losses)} steps, megatron {[round(x, 6) for x in mg_losses]}, HF "
            f"{[round(x, 6) for x in ref_run['losses']]}; learning rates differ by {lr_off:.1e}",
        )
    )
    shards = [r["optimizer_shard_numel"] for r in results]
    model_numel = [r["model_numel"] for r in results]
    sharded = job["dp"] == 1 or all(s < m for s, m in zip(shards, model_numel))
    trained_dir = work / "trained_hf"
    ep_text = f" x EP{job['ep']}" if job.get("ep", 1) > 1 else ""
    t = time.monotonic()
    back_problems = _checkpoint_back(job, work, trained_dir)
    seconds["checkpoint there and back"] = round(time.monotonic() - t, 1)
    params_diff, names = _param_diff(trained_dir, ref) if not back_problems else (float("inf"), "")
    checks.append(
        _check(
            "params after steps",
            params_diff <= PARAM_ATOL and sharded,
            params_diff,
            PARAM_ATOL,
            (
                f"max |megatron - HF| {params_diff:.1e} over every weight (worst {names})"
                if sharded
                else f"the distributed optimizer did not shard: per-rank shard sizes {shards} vs model {model_numel}"
            )
            if not back_problems
            else back_problems[0],
        )
    )
    rate = (job.get("moe") or {}).get("expert_bias_rate")
    if rate:
        checks.append(_bias_check(trained_dir, work / "reference_hf", ref, rate, back_problems))
    checks.append(
        _check(
            "checkpoint back to HF",
            not back_problems,
            len(back_problems),
            0,
            back_problems[0]
            if back_problems
            else f"checkpoint/iter_{job['steps']:07d} (TP{job['tp']} x PP{job['pp']}{ep_text}) -> HF -> the same "
            f"rank files again, every trained tensor equal" + _norm_head_detail(job, work),
        )
    )
    moe_facts = {}
    if job.get("moe"):
        moe_facts = {
            "aux_losses": last[0].get("aux_losses"),
            "hf_side_aux_losses": ref_run.get("aux_losses"),
            "hf_load_balancing_loss": ref_run.get("hf_aux_losses"),
        }
    return checks, {
        "hf_side": ref.note,
        **moe_facts,
        "losses": mg_losses,
        "hf_losses": ref_run["losses"],
        "grad_norms": mg_norms64,
        "grad_norms_megatron_fp32": mg_norms,
        "hf_grad_norms": ref_run["grad_norms"],
        "lrs": results[0]["lrs"],
        "optimizer_shard_numel": shards,
        "model_numel": model_numel,
        "seconds": {**{f"ranks: {k}": v for k, v in _slowest(results).items()}, **seconds},
    }


def _aux_check(mg: List[List[float]], ref_run: dict, job: dict) -> dict:
    """megatron-core's per-layer load-balancing losses of every step against the same definition on HF's router
    logits (kit.train.preflight.reference explains the two definitions)."""
    hf = ref_run.get("aux_losses") or []
    pairs = [(a, b) for ma, ha in zip(mg, hf) for a, b in zip(ma, ha)]
    if not pairs or len(mg) != len(hf) or any(len(a) != len(b) for a, b in zip(mg, hf)):
        return _check("aux loss vs HF", False, None, LOSS_RTOL,
                      f"megatron reported {len(mg)} steps of aux losses, the HF side {len(hf)}")  # fmt: skip
    worst = max(_rel(a, b) for a, b in pairs)
    first_mg, first_hf = sum(mg[0]), sum(hf[0])
    seq = job["moe"].get("aux_loss_type") == "seq_aux_loss"
    own = (
        "transformers trains this model without an aux loss"
        if seq
        else f"transformers' own load_balancing_loss_func {ref_run['hf_aux_losses'][0]:.7f} (pooled over layers, "
        f"another definition: not compared)"
    )
    return _check(
        "aux loss vs HF",
        worst <= LOSS_RTOL,
        worst,
        LOSS_RTOL,
        f"megatron-core's {'sequence-wise ' if seq else ''}load-balancing loss per MoE layer, {len(mg)} steps x "
        f"{len(mg[0])} layers; first step's sum megatron {first_mg:.7f}, HF router logits {first_hf:.7f} "
        f"(coefficient {job['moe']['aux_loss_coeff']:g} in both objectives); {own}",
    )


def _mtp_detail(results: List[dict]) -> str:
    """The MTP tensors the ranks left out of training and carried into their checkpoint ('' for none)."""
    files = {
        (r.get("tp_rank"), r.get("pp_rank"), r.get("ep_rank", 0)): r.get("mtp_carried", 0) for r in results
    }
    n = sum(files.values())
    return (
        f"; the MTP layer's {n} tensors left out of the model and carried into the saved checkpoint as loaded "
        f"(not trained: transformers has no MTP forward)"
        if n
        else ""
    )


def _bias_check(trained_dir: Path, start_dir: Path, ref, rate: float, back_problems: List[str]) -> dict:
    """The routers' score-correction biases after the steps: megatron-core's (its checkpoint, back in HF names)
    against the reference's, moved by kit.train.expert_bias. One step moves a bias by the rate, so a tenth of it
    is the limit: any step whose count sign differs on one expert shows as at least the rate."""
    from kit.convert.hf_io import HFReader

    limit = rate / 10
    if back_problems:
        return _check("expert bias after steps", False, None, limit, back_problems[0])
    mine = ref.expert_biases()
    trained, start = HFReader(trained_dir), HFReader(start_dir)
    worst, name, moved = -1.0, "", 0.0
    for k, v in mine.items():
        got = trained.read(k).float()
        d = float((got - v.float()).abs().max())
        moved = max(moved, float((got - start.read(k).float()).abs().max()))
        if d > worst:
            worst, name = d, k
    ok = bool(mine) and worst <= limit
    return _check(
        "expert bias after steps",
        ok,
        worst,
        limit,
        f"max |megatron - HF| {worst:.1e} over {len(mine)} routers' score-correction biases (worst {name}); they "
        f"moved up to {moved:.1e} from the start (rate {rate:g} per step, megatron-core's update and "
        f"kit.train.expert_bias)"
        if mine
        else "the HF side has no score-correction biases to compare",
    )


def _slowest(results: List[dict]) -> dict:
    """Per phase, the slowest rank's seconds."""
    out: dict = {}
    for r in results:
        for k, v in (r.get("seconds") or {}).items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def _back_to_hf(megatron_dir: str, target: Path) -> Path:
    from kit.convert import ConvertConfig
    from kit.convert.convert import megatron_to_hf

    megatron_to_hf(ConvertConfig(str(megatron_dir), str(target), direction="megatron_to_hf"), progress=False)
    return target


def _checkpoint_back(job: dict, work: Path, trained_dir: Path) -> List[str]:
    """Finish the ranks' save (tracker, the converter's metadata), convert it to HF, back again, compare."""
    import torch

    from kit.convert import ConvertConfig, hf_to_megatron
    from kit.convert import megatron_layout as layout
    from kit.convert.megatron_io import HF_META_DIR, META_FILE, MegatronReader

    ckpt = work / "checkpoint"
    src = Path(job["checkpoint"])
    if (src / META_FILE).is_file():
        shutil.copy2(src / META_FILE, ckpt / META_FILE)
    if (src / HF_META_DIR).is_dir():
        shutil.copytree(src / HF_META_DIR, ckpt / HF_META_DIR)
    (ckpt / layout.TRACKER).write_text(f"{job['steps']}\n")
    try:
        _back_to_hf(str(ckpt), trained_dir)
        again = work / "again"
        hf_to_megatron(
            ConvertConfig(
                str(trained_dir),
                str(again),
                tp=job["tp"],
                pp=job["pp"],
                num_layer_list=job["layer_list"] if job["pp"] > 1 else None,
                padded_vocab_size=job["padded_vocab_size"],
                ep=job.get("ep", 1),
            ),
            progress=False,
        )
    except Exception as exc:  # the way back failed: that is this check's finding
        return [f"{type(exc).__name__}: {str(exc).splitlines()[0]}"]
    a, b = MegatronReader(ckpt), MegatronReader(again)
    problems = []
    norm_head = bool(job["spec"].get("norm_head"))
    vocab, per = job["vocab_size"], job["padded_vocab_size"] // job["tp"]
    ep = job.get("ep", 1)
    for t, p, e in [(t, p, e) for t in range(job["tp"]) for p in range(job["pp"]) for e in range(ep)]:
        where = f"tp {t}, pp {p}" + (f", ep {e}" if ep > 1 else "")
        sa, sb = a.state(t, p, e)["model"], b.state(t, p, e)["model"]
        for k, va in sa.items():
            vb = sb.get(k)
            if vb is None or tuple(vb.shape) != tuple(va.shape):
                problems.append(f"{k} ({where}) missing or reshaped on the way back")
                continue
            if va.shape and va.shape[0] == per and ("embedding" in k or "output_layer" in k):
                keep = max(0, min(per, vocab - t * per))  # padded rows are not weights of the HF model
                va, vb = va[:keep], vb[:keep]
            if norm_head and "output_layer" in k:  # 03's way in normalises NormHead rows, as at conversion
                va = torch.nn.functional.normalize(va.float(), dim=-1).to(va.dtype)
            if not torch.equal(va, vb):
                problems.append(
                    f"{k} ({where}) differs after the way back by {float((va - vb).abs().max()):.1e}"
                )
    shutil.rmtree(again, ignore_errors=True)
    return problems


def _norm_head_detail(job: dict, work: Path) -> str:
    """Baichuan2 NormHead: how far the trained output rows left unit norm (HF's NormHead computes with them
    normalised, megatron-core trained them as they are); '' for other models."""
    if not job["spec"].get("norm_head") or job["spec"].get("tied"):
        return ""
    import torch

    from kit.convert import megatron_layout as layout
    from kit.convert.megatron_io import MegatronReader

    mr = MegatronReader(work / "checkpoint")
    rows = mr.parts(layout.key_path(mr.flavor, "output"), mr.pp - 1)
    norms = [r.float().norm(dim=-1) for r in rows]
    drift = float((torch.cat(norms)[: job["vocab_size"]] - 1).abs().max())
    return (
        f"; the output layer comes back row-normalised (NormHead), as 03 converts it: the trained rows are up to "
        f"{drift:.1e} off unit norm, which HF's NormHead normalises away"
    )


def _param_diff(trained_dir: Path, ref) -> tuple:
    """max |trained (Megatron, via HF) - reference| over every HF tensor, and the worst tensor's name."""
    mine = ref.unpadded()
    worst, name = 0.0, ""
    for k, v in ref.trained(trained_dir):
        if k not in mine:
            continue
        d = float((v.float() - mine[k]).abs().max())
        if d > worst:
            worst, name = d, k
    return worst, name
