"""The live view of a training run (kit.train.live): the smoothed loss, what it shows, and an in-kernel run that
ends on its final state with the run's training_loss.png and the log line's memory column."""

from __future__ import annotations

import base64
import re

import nbformat
import pytest
import test_train_helpers as H
from nbclient import NotebookClient

from kit.core.configs import save_config
from kit.train.live import RunView, smoothed
from kit.train.logs import parse_log


def test_smoothed_is_the_debiased_moving_average():
    # weight 0.5: 1 -> 1; (0.25 + 1) / 0.75; (0.625 + 1.5) / 0.875
    assert smoothed([1, 2, 3], weight=0.5) == pytest.approx([1.0, 5 / 3, 2.125 / 0.875])
    assert smoothed([4.0] * 5) == pytest.approx([4.0] * 5)  # no start-up bias toward 0


def test_the_view_says_where_the_run_is_with_its_curve():
    view = RunView(total=4, title="sft (run)")
    assert view.line() == "sft (run): starting (4 steps to go)"
    for i, loss in enumerate([3.0, 2.0], 1):
        view.update({"iteration": i, "loss": loss, "lr": 1e-4, "grad_norm": 0.5, "memory_gib": 1.25})
    view.update({"iteration": 2, "loss": 1.5, "lr": 1e-4})  # a restarted step replaces its earlier record
    line = view.line()
    assert (
        line.startswith("sft (run): step 2/4, ")
        and " elapsed < " in line
        and " remaining, loss 1.5000" in line
    )
    page = view.html()
    assert "<td>1.5000</td>" in page and "<th>memory (GiB)</th>" in page and "<td>–</td>" in page
    svg = base64.b64decode(re.search(r"data:image/svg\+xml;base64,([^\"]+)", page).group(1)).decode()
    assert (
        svg.count("<polyline") == 2 and ">3<" in svg and ">1.5<" in svg
    )  # raw and smoothed, y from 1.5 to 3
    view.close("trained 2 iterations")
    assert view.html().startswith("<p><b>trained 2 iterations</b></p>")


def test_an_in_kernel_run_ends_on_the_views_final_state_with_its_loss_plot(tmp_path, tiny_llama_dir):
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=8)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=3, log_interval=1)
    path = save_config(cfg, tmp_path, "run.json")
    code = f"from kit.train import train\nfrom kit.train.config import load_config\nresult = train(load_config({str(path)!r}))\n"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    shown = [o["data"] for o in outputs if o.get("output_type") == "display_data"]
    # transformers' loading bar (transformers 5), then the view alone: no step bar beside it
    assert not [d for d in shown if "steps" in d["text/plain"]] and "text/html" in shown[-1], outputs
    assert shown[-1]["text/plain"].startswith("trained 3 iterations; outputs in ")
    assert "<table>" in shown[-1]["text/html"] and "data:image/svg+xml;base64," in shown[-1]["text/html"]
    assert not [o for o in outputs if o.get("name") == "stderr"], outputs
    out = cfg.output_dir()
    assert (out / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = parse_log(cfg.log_dir() / f"{out.name}.log")
    assert list(curve["iteration"]) == [1, 2, 3] and (curve["memory_gib"] > 0).all()
