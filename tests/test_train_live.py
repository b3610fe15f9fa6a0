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


def _records():
    losses = [3.0, 2.5, 2.2, 2.0]
    return [
        {"iteration": i, "loss": v, **({"eval_loss": 3.5 - 0.5 * i} if i % 2 == 0 else {})}
        for i, v in enumerate(losses, 1)
    ]


def test_the_held_out_loss_is_a_cell_a_series_and_part_of_the_line():
    view = RunView(total=4, title="sft")
    view.update(_records()[0])
    assert "<td>–</td>" in view.html() and "held-out" not in view.line()  # not measured yet
    for rec in _records()[1:]:
        view.update(rec)
    assert view.line().endswith("loss 2.0000 (smoothed 2.3821), held-out loss 1.5000 (step 4)"), view.line()
    page = view.html()
    assert "<th>held-out loss</th>" in page and "<td>1.5000 (step 4)</td>" in page
    svg = base64.b64decode(re.search(r"data:image/svg\+xml;base64,([^\"]+)", page).group(1)).decode()
    # raw, smoothed and held-out lines, a dot per held-out point; y spans train and held-out losses (1.5 .. 3)
    assert svg.count("<polyline") == 3 and svg.count("<circle") == 2 and ">3<" in svg and ">1.5<" in svg
    # x is the iteration: step 2's dot is a third of the way from step 1 to step 4, step 4's at the right edge
    xs = [float(x) for x in re.findall(r'<circle cx="([\d.]+)"', svg)]
    assert xs == pytest.approx([6 + (420 - 12) / 3, 420 - 6], abs=0.06)


def test_training_loss_png_draws_the_held_out_points(tmp_path):
    from kit.train.live import plot_loss

    fig = plot_loss(_records(), tmp_path / "training_loss.png")
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert list(lines) == ["loss", "smoothed (0.9)", "held-out"]
    assert list(lines["held-out"].get_xdata()) == [2, 4] and list(lines["held-out"].get_ydata()) == [2.5, 1.5]
    assert (tmp_path / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_log_line_carries_the_held_out_loss_to_a_launched_view():
    from kit.train.logs import parse_line
    from kit.train.metrics import format_line

    m = {
        "iteration": 4,
        "consumed_samples": 8,
        "elapsed_ms": 10.0,
        "lr": 1e-4,
        "gbs": 2,
        "loss": 2.0,
        "eval_loss": 1.5,
        "tokens_per_s_per_card": 1.0,
        "samples_per_s": 1.0,
    }
    rec = parse_line(format_line(m, 4))
    assert rec["loss"] == 2.0 and rec["eval_loss"] == 1.5
    assert "eval_loss" not in parse_line(format_line({**m, "eval_loss": None}, 4))


def test_the_trainer_scores_the_held_out_split_every_eval_every_steps(tmp_path, tiny_llama_dir):
    """The held-out loss of the last step is the loss notebook 06 computes for the exported model on those rows."""
    from datasets import load_from_disk

    from kit.evaluate.scoring import heldout_loss
    from kit.system.hf_compat import load_causal_lm
    from kit.train import train
    from kit.train.metrics import read_metrics

    held = H.make_sft(tmp_path / "h_heldout_hf", num_samples=5, seed=1)
    data = H.with_heldout(H.make_sft(tmp_path / "h_hf", num_samples=16), held, 5)
    cfg = H.tiny_config(
        tiny_llama_dir, data, tmp_path / "ws", run_type="sft", train_iters=3, eval_every=2, save_hf=True
    )
    result = train(cfg, progress=False)
    records = read_metrics(result.metrics_path)
    assert [r["iteration"] for r in records if "eval_loss" in r] == [2, 3]  # every 2 steps and the last
    assert result.eval_losses == {r["iteration"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert result.summary()["eval_loss"] == result.eval_losses[3]
    model = load_causal_lm(result.hf_dir).eval()
    assert result.eval_losses[3] == pytest.approx(
        heldout_loss(model, load_from_disk(str(held))).loss, rel=1e-4
    )
    assert "eval loss: " in result.log_path.read_text()


def test_no_held_out_loss_when_off_or_when_the_split_is_not_here(tmp_path, tiny_llama_dir):
    import shutil

    from kit.train import train
    from kit.train.metrics import read_metrics

    held = H.make_sft(tmp_path / "h_heldout_hf", num_samples=3, seed=1)
    data = H.with_heldout(H.make_sft(tmp_path / "h_hf", num_samples=8), held, 3)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", run_type="sft", train_iters=2, eval_every=0)
    result = train(cfg, progress=False)
    assert result.eval_losses == {} and not [r for r in read_metrics(result.metrics_path) if "eval_loss" in r]
    shutil.rmtree(
        held
    )  # e.g. a job given the training rows alone: it trains, and says why there is no held-out loss
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws2", run_type="sft", train_iters=2, eval_every=1)
    result = train(cfg, progress=False)
    assert result.status == "completed" and result.eval_losses == {}
    assert f"warning: {held} (the data's held-out split) is not here" in result.log_path.read_text()
