"""`bench(cfg, ws) -> BenchResult`: a load test of a served model, written as vLLM's result JSON, CSVs and a plot.

Every (prompt length, output length) pair of the grid is run at each closed-loop concurrency and each open-loop
Poisson rate; `warmup` requests before each point are left out. Per point: TTFT, TPOT, ITL and E2E latency (mean,
median, std, P90, P99, max, in ms), request / output / total token throughput and goodput (requests meeting both
the TTFT and TPOT targets, per second), under vLLM's result-JSON keys (`mean_ttft_ms`, `p99_tpot_ms`,
`request_throughput`, `output_throughput`, ...), each figure defined as GuideLLM 0.8.1 defines it (docs/serve.md,
"Definitions"). The folder is written under a temporary name, renamed when complete.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from kit.core.configs import check, save_config, to_jsonable
from kit.errors import InputError, KitError
from kit.serve.config import BenchConfig, ServeConfig

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
ASCEND_CSV = "results_ascendcloud.csv"
PLOT_PNG = "latency_throughput.png"
METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p90", "p99", "max")
# AscendCloud benchmark_tools' CSV headers (input/output length, concurrency, throughput, TTFT / incremental latency)
ASCEND_COLUMNS = {
    "input_len": "输入长度",
    "output_len": "输出长度",
    "max_concurrency": "并发数",
    "request_rate": "请求速率(req/s)",
    "output_throughput": "输出tokens总吞吐(tokens/s)",
    "mean_ttft_ms": "首tokens时延mean(ms)",
    "p90_ttft_ms": "首tokens时延TP90(ms)",
    "p99_ttft_ms": "首tokens时延TP99(ms)",
    "max_ttft_ms": "首tokens时延max(ms)",
    "mean_tpot_ms": "增量时延mean(ms)",
    "p90_tpot_ms": "增量时延TP90(ms)",
    "p99_tpot_ms": "增量时延TP99(ms)",
    "max_tpot_ms": "增量时延max(ms)",
}


class LoadTestError(KitError, RuntimeError):
    """No request of a load test completed: there is nothing to measure, and nothing is published."""


def stats(values: List[float], prefix: str, weights: Optional[List[float]] = None) -> Dict[str, float]:
    """{mean_<prefix>_ms, median_..., std_..., p90_..., p99_..., max_...} of `values` (seconds) in ms.

    As GuideLLM 0.8.1 summarises a distribution (guidellm/schemas/base/statistics.py, `DistributionSummary`): each
    value has a weight (1 unless given), a percentile is the smallest value whose cumulative weight share reaches it
    (`Percentiles.from_pdf`: for 8 equal values the median is the 4th smallest), mean and std are weighted.
    """
    import numpy as np

    v = np.asarray(values, dtype=float) * 1000.0
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)
    keep = w > 0
    v, w = v[keep], w[keep]
    if not len(v):  # nothing was measured: no figure, not a zero that reads like a fast server
        return {f"{s}_{prefix}_ms": math.nan for s in STATS}
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order] / w.sum()
    cdf = np.cumsum(w)

    def pct(q: float) -> float:
        return float(v[min(int(np.searchsorted(cdf, q, side="left")), len(v) - 1)])

    mean = float(np.sum(v * w))
    return {
        f"mean_{prefix}_ms": mean,
        f"median_{prefix}_ms": pct(0.5),
        f"std_{prefix}_ms": float(np.sqrt(np.sum((v - mean) ** 2 * w))),
        f"p90_{prefix}_ms": pct(0.9),
        f"p99_{prefix}_ms": pct(0.99),
        f"max_{prefix}_ms": float(v[-1]),
    }


def completion_payloads(model: str, prompts: List[str], max_tokens: int) -> List[Dict[str, Any]]:
    """The streamed /v1/completions requests of a load-test point (greedy; the server's usage in the last chunk)."""
    return [
        {
            "model": model,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for p in prompts
    ]


def point_metrics(records, duration: float, ttft_target_ms: float, tpot_target_ms: float) -> Dict[str, Any]:
    """vLLM's result keys for one load point (failed requests count in `failed`, not in the figures).

    `duration` is `kit.serve.loadgen.span(records)`; the definitions are GuideLLM's (docs/serve.md, "Definitions").
    """
    ok = [r for r in records if r.ok]
    timed = [r for r in ok if r.tpot is not None]
    good = [
        r
        for r in ok
        if r.ttft * 1000 <= ttft_target_ms and (r.tpot is None or r.tpot * 1000 <= tpot_target_ms)
    ]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)

    def rate(n: int) -> float:  # a point where no request completed measured no rate (NaN, `valid` False)
        return n / duration if ok and duration else math.nan if not ok else 0.0

    out: Dict[str, Any] = {
        "valid": bool(ok),
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": rate(len(ok)),
        "request_goodput": rate(len(good)),
        "output_throughput": rate(n_out),
        "total_token_throughput": rate(n_in + n_out),
    }
    out.update(stats([r.ttft for r in ok], "ttft"))
    # one value per request, weighted by the tokens after the first (GuideLLM's inter_token_latency_ms)
    out.update(stats([r.tpot for r in timed], "tpot", [r.output_tokens - 1 for r in timed]))
    out.update(stats([x for r in ok for x in r.itls], "itl"))
    out.update(stats([r.e2e for r in ok], "e2el"))
    out.update(
        {
            "input_lens": [r.prompt_tokens for r in ok],
            "output_lens": [r.output_tokens for r in ok],
            "ttfts": [r.ttft for r in ok],
            "e2els": [r.e2e for r in ok],
            "errors": [r.error for r in records if not r.ok],
        }
    )
    return out


@dataclass
class BenchResult:
    """The load points (one row each) and the files written."""

    config: BenchConfig
    folder: Path
    points: List[Dict[str, Any]]
    server: Dict[str, Any] = field(default_factory=dict)

    @property
    def frame(self):
        """Every scalar of every point, one row per point."""
        import pandas as pd

        return pd.read_csv(self.folder / RESULTS_CSV)

    @property
    def table(self):
        """The served model's TTFT / TPOT percentiles and throughput per load point."""
        cols = ["load", "max_concurrency", "request_rate", "input_len", "output_len", "completed"]
        cols += [f"{s}_{m}_ms" for m in ("ttft", "tpot") for s in ("median", "p90", "p99")]
        cols += ["output_throughput", "request_goodput"]
        return self.frame[cols].round(2)

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "folder": str(self.folder),
            "results_json": str(self.folder / RESULTS_JSON),
            "results_csv": str(self.folder / RESULTS_CSV),
            "plot": str(self.folder / PLOT_PNG),
            "points": len(self.points),
            "engine": self.server.get("engine"),
        }
        for p in self.points:
            key = f"c{p['max_concurrency']}" if p["load"] == "concurrency" else f"r{p['request_rate']:g}"
            key += f"_in{p['input_len']}_out{p['output_len']}"
            for m in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput"):
                out[f"{key}_{m}"] = p[m]
        return out


def _models(url: str) -> List[Dict[str, Any]]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"]
    except OSError as exc:
        raise InputError(f"URL={url!r}: GET /v1/models failed ({exc}); is the server running?") from None


def trained_model(models: List[Dict[str, Any]]) -> str:
    """The name to load-test among GET /v1/models' entries: the LoRA adapter (vLLM lists it after its base, with a
    `parent`), else the first."""
    if not models:
        raise InputError("the server lists no model (GET /v1/models is empty); give MODEL_NAME.")
    adapters = [m["id"] for m in models if m.get("parent")]
    return adapters[0] if adapters else models[0]["id"]


def _served_folder(models: List[Dict[str, Any]], model: str) -> Optional[str]:
    """The folder vLLM loaded `model` from (its `root`; an adapter's tokenizer is its base's), when it is here."""
    by_id = {m["id"]: m for m in models}
    entry = by_id.get(model)
    while entry is not None:
        root = entry.get("root")
        if root and (Path(root) / "config.json").is_file():
            return root
        entry = by_id.get(entry.get("parent") or "")
    return None


def _tokenizer_path(server, models: List[Dict[str, Any]], model: str, ws) -> str:
    if server is not None and server.info.get("model_path"):
        return server.info["model_path"]
    if Path(model).is_dir():
        return model
    if _served_folder(models, model):
        return _served_folder(models, model)
    from kit.serve.model import resolve_model

    return str(resolve_model(ServeConfig(), ws).path)


def bench(cfg: BenchConfig, ws, serve_cfg: Optional[ServeConfig] = None, server=None, progress: bool = True):
    """Run the sweep against `server`, cfg.url, or a server started from `serve_cfg` (stopped afterwards)."""
    check(cfg)
    started = None
    if server is None and cfg.url is None:
        from kit.serve.start import serve

        server = started = serve(serve_cfg or ServeConfig(), ws)
    try:
        return _bench(cfg, ws, server, progress)
    finally:
        if started is not None:
            started.stop()


def _bench(cfg: BenchConfig, ws, server, progress: bool) -> BenchResult:
    from transformers import AutoTokenizer

    from kit.serve.loadgen import make_prompts, run_point
    from kit.serve.start import serving_dir
    from kit.storage.atomic import atomic_dir

    url = server.url if server is not None else cfg.url.rstrip("/")
    models = _models(url) if server is None else []
    model = cfg.model_name or (server.model if server is not None else trained_model(models))
    tok = AutoTokenizer.from_pretrained(_tokenizer_path(server, models, model, ws))
    folder = Path(cfg.out_dir).expanduser() if cfg.out_dir else serving_dir(ws) / cfg.name
    endpoint = url + "/v1/completions"
    loads = [("concurrency", c, None) for c in cfg.concurrency] + [
        ("poisson", None, r) for r in cfg.request_rates
    ]
    points = []
    with atomic_dir(folder, overwrite=cfg.overwrite, what="load-test folder") as tmp:
        for n_in in cfg.prompt_lengths:
            for n_out in cfg.output_lengths:
                for k, (load, conc, rate) in enumerate(loads):
                    seed = cfg.seed + 1000 * k + n_in + 7 * n_out
                    prompts = make_prompts(tok, cfg.warmup + cfg.num_prompts, n_in, seed)
                    payloads = completion_payloads(model, prompts, n_out)
                    if cfg.warmup:
                        run_point(
                            endpoint, payloads[: cfg.warmup], concurrency=conc or 1, timeout=cfg.timeout
                        )
                    records, duration = run_point(
                        endpoint,
                        payloads[cfg.warmup :],
                        concurrency=conc,
                        rate=rate,
                        seed=seed,
                        timeout=cfg.timeout,
                    )
                    row = {
                        "load": load,
                        "max_concurrency": conc,
                        "request_rate": rate,
                        "input_len": n_in,
                        "output_len": n_out,
                        "num_prompts": cfg.num_prompts,
                        **point_metrics(records, duration, cfg.ttft_target_ms, cfg.tpot_target_ms),
                    }
                    points.append(row)
                    what = f"in {n_in} / out {n_out}, " + (
                        f"concurrency {conc}" if conc else f"{rate:g} req/s"
                    )
                    if not row["valid"]:  # said even without progress: its figures are NaN everywhere
                        print(
                            f"warning: {what}: no request completed ({row['failed']} failed, first: "
                            f"{row['errors'][0] if row['errors'] else 'no error recorded'}); the point is invalid",
                            flush=True,
                        )
                    elif progress:
                        print(
                            f"{what}: {row['completed']}/{cfg.num_prompts} ok, "
                            f"TTFT p50 {row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms, "
                            f"{row['output_throughput']:.1f} tok/s",
                            flush=True,
                        )
        if not any(p["valid"] for p in points):
            first = next((e for p in points for e in p["errors"]), "no error recorded")
            raise LoadTestError(
                f"no request of the load test against {endpoint} completed ({sum(p['failed'] for p in points)} "
                f"failed; first error: {first}); nothing was written. Check that the server answers (its log, "
                f"`python -m kit serve check`) and that MODEL names a model it serves."
            )
        _write(tmp, cfg, points, server, url, model)
        from kit.core.manifest import LOAD_TEST, write_manifest

        served = getattr(server, "served", None)
        write_manifest(
            tmp,
            LOAD_TEST,
            {
                "engine": server.engine if server is not None else None,
                "url": url,
                "model": model,
                "points": len(points),
                "results": RESULTS_JSON,
            },
            inputs=served.consumed if served is not None else (),
        )
    return BenchResult(cfg, folder.resolve(), points, server=_server_facts(server, url, model))


def _server_facts(server, url: str, model: str) -> Dict[str, Any]:
    facts = server.summary() if server is not None else {"url": url}
    facts["model"] = model
    return facts


def _write(tmp: Path, cfg: BenchConfig, points, server, url: str, model: str) -> None:
    import pandas as pd

    from kit.serve.plots import plot_load

    doc = {"server": _server_facts(server, url, model), "config": to_jsonable(cfg), "points": points}
    nan_as_null = json.loads(json.dumps(to_jsonable(doc)), parse_constant=lambda _: None)  # JSON has no NaN
    (tmp / RESULTS_JSON).write_text(
        json.dumps(nan_as_null, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    scalars = [{k: v for k, v in p.items() if not isinstance(v, list)} for p in points]
    frame = pd.DataFrame(scalars)
    frame.to_csv(tmp / RESULTS_CSV, index=False, na_rep="NaN")
    frame[list(ASCEND_COLUMNS)].rename(columns=ASCEND_COLUMNS).to_csv(
        tmp / ASCEND_CSV, index=False, encoding="utf-8-sig", na_rep="NaN"
    )
    pairs = frame[["input_len", "output_len"]].drop_duplicates()  # several: the legend names each
    lengths = f", {pairs.iloc[0, 0]} tokens in / {pairs.iloc[0, 1]} out" if len(pairs) == 1 else ""
    plot_load(points, tmp / PLOT_PNG, f"latency and throughput against load: {Path(model).name}{lengths}")
    save_config(cfg, tmp)
