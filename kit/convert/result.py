"""The conversion stage as `run(cfg, ws) -> ConversionResult`: the output folder, its manifest, and a summary."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Optional

from kit.convert.config import ConvertConfig
from kit.core.manifest import Manifest, read_manifest
from kit.errors import one_line

SUMMARY = "03_weight_conversion"  # the notebook's summary in the workspace's reports/


def in_workspace(cfg: ConvertConfig, ws) -> ConvertConfig:
    """cfg with its target filled in when None: the workspace's converted_weights/tp<TP>pp<PP>[ep<EP>]_<flavor>/ (the
    folder the ModelArts training scripts read) or converted_weights/hf_from_megatron/ (Megatron -> HF)."""
    if cfg.target:
        return cfg
    if ws is None:
        raise ValueError("the conversion needs a target folder or a workspace to put the output in.")
    if cfg.direction == "megatron_to_hf":
        return replace(cfg, target=str(ws.converted_weights / "hf_from_megatron"))
    ep = f"ep{cfg.ep}" if cfg.ep > 1 else ""
    return replace(cfg, target=str(ws.converted_weights / f"tp{cfg.tp}pp{cfg.pp}{ep}_{cfg.flavor}"))


@dataclass
class ConversionResult:
    """What one conversion wrote: the config it ran with, the converter's details, and the verification if run."""

    config: ConvertConfig
    details: Dict[str, Any]
    verification: Optional[Dict[str, Any]] = None
    # the workspace whose reports/03_weight_conversion.summary.json verify() writes before it starts and after
    ws: Any = field(default=None, repr=False, compare=False)
    verification_state: str = "not run"

    @property
    def target(self) -> Path:
        return Path(self.config.target)

    @property
    def manifest(self) -> Manifest:
        """The output's manifest (converted-checkpoint, or hf-model for Megatron -> HF)."""
        return read_manifest(self.target)

    def verify(
        self, scratch, logits: bool = True, back_to_hf: bool = True, seq_len: int = 16
    ) -> Dict[str, Any]:
        """Check the output (CRCs, torch.load, bit-exact round trip, logits vs HF); kept for `summary()`."""
        from kit.convert.verify import verify_conversion

        if self.config.direction != "hf_to_megatron":
            raise ValueError("verify() checks an HF -> Megatron conversion against its HF source.")
        # a run killed during the checks (memory, a stop) leaves a summary that says where it was
        self._report("verifying")
        try:
            self.verification = verify_conversion(
                self.config.source,
                self.target,
                scratch,
                logits=logits,
                back_to_hf=back_to_hf,
                seq_len=seq_len,
            )
        except BaseException as exc:
            self._report(f"stopped: {one_line(exc)}")
            raise
        self._report("done")
        return self.verification

    def _report(self, state: str) -> None:
        self.verification_state = state
        if self.ws is not None:
            self.ws.write_summary(SUMMARY, self.summary())

    def summary(self) -> Dict[str, Any]:
        """Scalars and paths for the notebook's summary.json: layout, sizes, the consumed input and its hash."""
        m, d = self.manifest, self.details
        out: Dict[str, Any] = {
            "direction": self.config.direction,
            "source": m["source"],
            "source_kind": m.get("source_kind"),
            "source_sha256": m.get("source_sha256"),
            "source_note": d.get("source_note"),
            "inputs": [
                {"kind": c.kind, "path": c.path, "manifest_sha256": c.manifest_sha256} for c in m.inputs
            ],
            "target": str(self.target.resolve()),
            "manifest_kind": m.kind,
            "manifest_sha256": m.sha256,
            "family": m["family"],
            "bytes_written": d.get("bytes_written"),
            "convert_seconds": d.get("seconds"),
            "weights_check_seconds": d.get(
                "weights_check_seconds"
            ),  # NaN / inf counting, summed over threads
        }
        if m.kind != "hf-model":
            out.update(
                flavor=m["flavor"],
                tp=m["tp"],
                pp=m["pp"],
                ep=m.get("ep", 1),
                num_layer_list=m["num_layer_list"],
                padded_vocab_size=m["padded_vocab_size"],
                dtype=m["dtype"],
                rank_files=d.get("rank_files"),
                bytes_read=d.get("bytes_read"),
            )
        out["model"] = {k: m["model"][k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_groups")}
        out["leftover_partials"] = d.get("leftover_partials", [])
        out["verification"] = self.verification_state
        v = self.verification
        if v is not None:
            out.update(
                verified=v["passed"],
                checks_skipped=v["skipped"],
                logits_max_abs_diff=v["details"].get("logits", {}).get("max_abs_diff"),
                round_trip_bit_exact=v["details"].get("round_trip", {}).get("bit_exact"),
                checks=v["table"].to_dict("records"),
            )
        return out


def run(cfg: ConvertConfig, ws=None, progress: bool = True) -> ConversionResult:
    """Convert as cfg says (target None: the workspace's converted_weights/ folder); returns the result."""
    from kit.convert.convert import convert

    cfg = in_workspace(cfg, ws)
    return ConversionResult(cfg, convert(cfg, progress=progress), ws=ws)
