"""The walkthrough as one chain: tiny 02 -> 03 -> 04 -> 05 -> 06 in one workspace, each consuming the one before.

Every notebook runs on its defaults except for size (a tiny seeded model, short sequences, few steps) and without
being told where the previous stage's output is: each finds it in the workspace through the manifests. The
assertions read the manifests and summaries the stages wrote: which folder each consumed, with which manifest hash,
where each training value came from, and that nothing was prepared twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    HF_MODEL,
    PREPARED_DATA,
    PROFILE_CAPTURE,
    TRAINING_RUN,
    find_manifests,
    read_manifest,
)

# dev_stack: the stages chain through manifests, plain Python; on the older stacks each stage's own tests and
# tests/test_evaluate_chain.py (02 -> 04 -> 06 through the kit API) run instead
pytestmark = [pytest.mark.slow, pytest.mark.dev_stack]


def _only(manifests: list, kind: str):
    found = [m for m in manifests if m.kind == kind]
    assert len(found) == 1, [str(m.folder) for m in found]
    return found[0]


def test_notebooks_chain_through_their_manifests(run_notebook, tiny_llama_dir, tmp_path):
    ws = tmp_path / "ws"
    common = {"WORKSPACE": str(ws), "MODEL": "tiny"}
    tiny = str(tiny_llama_dir)
    run_notebook("02", **common, TOKENIZER=tiny, MAX_LENGTH=64, TEMPLATE="telechat")
    after_02 = find_manifests(ws)
    data = [m for m in after_02 if m.kind == PREPARED_DATA and m["data_kind"] == "sft"][0]
    assert data["max_length"] == 64 and data["heldout"]["records"] > 0

    run_notebook("03", **common, SOURCE=tiny, TP=2, PP=2, LOGITS_TOKENS=8)
    converted = _only(find_manifests(ws), CONVERTED_CHECKPOINT)
    assert (converted["tp"], converted["pp"]) == (2, 2)

    # 04 on its defaults: no DATASET_PATH, no SEQ_LEN -> 02's folder and its length
    _, summary_04 = run_notebook(
        "04",
        **common,
        MODEL_PATH=tiny,
        TRAIN_ITERS=3,
        MBS=2,
        GBS=4,
        LR=3e-3,
        LAUNCH_ITERS=0,
        DPO_ITERS=0,  # the DPO chain has its own test (test_evaluate_chain.py)
        MAX_NEW_TOKENS=4,
    )
    # 04's Megatron preflight ran 03's TP2 x PP2 shards on 02's Megatron files with megatron-core (dev stack only)
    preflight = summary_04["megatron_preflight"]
    assert preflight["passed"], preflight["checks"]
    assert (preflight["facts"]["tp"], preflight["facts"]["pp"]) == (2, 2)
    assert preflight["facts"]["checkpoint"] == str(converted.folder)
    runs = [m for m in find_manifests(ws) if m.kind == TRAINING_RUN]
    assert len(runs) == 1
    run = runs[0]
    used = run.consumed(PREPARED_DATA)
    assert [(u.path, u.manifest_sha256) for u in used] == [(str(data.folder), data.sha256)]
    assert run["config"]["seq_len"] == 64 and run["sources"]["seq_len"].startswith("manifest")
    assert run["sources"]["train_iters"] == "explicit"
    prepared = sorted(p.name for m in find_manifests(ws) if m.kind == PREPARED_DATA for p in [m.folder])
    assert prepared == sorted(
        p.name for m in after_02 if m.kind == PREPARED_DATA for p in [m.folder]
    )  # no re-prep
    # its Megatron plan points at 03's converted checkpoint and 02's Megatron prefix with the flags the data needs
    from kit.core.workspace import get_workspace
    from kit.train.config import from_manifest, replace
    from kit.train.megatron import build
    from kit.train.resolve import resolve

    megatron = replace(
        from_manifest(run.folder), engine="megatron", model_path=None
    )  # None: 03's newest output
    plan = build(resolve(megatron, get_workspace(ws, model="tiny")))
    text = plan.describe()
    assert str(converted.folder) in text and data["megatron_prefix"] in text
    assert all(flag in text for flag in data["megatron_flags"])

    # the exported model says it came from the run
    exported = read_manifest(run["hf"], expect=HF_MODEL)
    assert exported.consumed(TRAINING_RUN)[0].manifest_sha256 == run.sha256

    run_notebook("05", **common, DEVICE="cpu", WAIT=0, WARMUP=1, ACTIVE=2, TOP=5)
    capture = _only(find_manifests(ws), PROFILE_CAPTURE)
    assert Path(capture["training_run"]) == run.folder
    assert [(c.path, c.manifest_sha256) for c in capture.consumed(TRAINING_RUN)] == [
        (str(run.folder), run.sha256)
    ]

    run_notebook(
        "06",
        **common,
        TASK_LIMIT=3,
        ENGINE="kit",
        MAX_NEW_TOKENS=4,
        BATCH_SIZES=[1, 2],
        PROMPT_LENGTHS=[8, 16],
        DECODE_TOKENS=2,
    )
    evaluation = _only(find_manifests(ws), "evaluation")
    assert run.sha256 in {c.manifest_sha256 for c in evaluation.consumed(TRAINING_RUN)}

    # the trained model goes back through 03 and its manifest says where it came from
    from kit.convert import ConvertConfig
    from kit.convert.result import run as convert_run

    back = convert_run(
        ConvertConfig(source=str(run["hf"]), target=str(tmp_path / "trained_tp2"), tp=2), progress=False
    )
    again = back.manifest
    assert again.consumed(HF_MODEL)[0].manifest_sha256 == exported.sha256
