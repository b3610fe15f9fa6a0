"""Per notebook: the tiny parameters the browser run uses (same as its papermill test) and what must be visible."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Expect:
    """Key outputs a user must see after Run All (counted over all cells; texts must all appear somewhere)."""

    tables: int = 0
    images: int = 0
    progress: int = 0
    texts: tuple = field(default_factory=tuple)


def tiny_parameters(prefix: str, root: Path) -> dict:
    """Parameter overrides for notebook `prefix` (e.g. "02") over the demo's values, with WORKSPACE inside the
    temporary lab root."""
    from kit.core.notebooks import demo_parameters, numbered_notebooks

    nb = next(p for p in numbered_notebooks() if p.name.startswith(prefix))
    params = {**demo_parameters(nb), **(TINY[prefix](root) if prefix in TINY else {})}
    params["WORKSPACE"] = str(root / "ws")
    return params


def _sample_tokenizer() -> str:
    from kit.core.samples import sample_tokenizer_dir

    return str(sample_tokenizer_dir())


def _tiny_llama(root: Path) -> str:
    """The `tiny_llama_dir` fixture of tests/conftest.py (GQA, untied, seed 0), made inside the lab root."""
    from kit.core.samples import tiny_llama

    folder = root / "fixtures" / "tiny-llama-gqa"
    return str(folder if folder.is_dir() else tiny_llama(folder, seed=0))  # made once, shared by 03 and 04


def _tiny_training_run(root: Path) -> str:
    """tests/test_evaluate_notebook.py's run: tiny base (seed 0) -> 'trained' (seed 1), manifests as 04 writes."""
    from fixtures.training_run import tiny_training_run

    # a workspace model folder of its own: notebook 04 (MODEL "tiny") must not find this data or run as its own
    trained = root / "fixtures" / "tiny-llama-trained"
    return str(tiny_training_run(root / "ws", _tiny_llama(root), trained, model="tiny-eval"))


# From each notebook's own test (its run_notebook(...) call in tests/test_*.py): callables of the lab root, so
# paths and fixtures are made there when the lab starts.
TINY = {
    "00": lambda root: {
        "CHECK_DEEPSPEED": False,
        "EXPLAIN_ERROR": "EJ0001: Failed to initialize the HCCP process.",
    },
    # tests/test_envs_notebook.py: a fake CANN set_env.sh whose kernel can `import kit_fake_cann`
    "01": lambda root: {
        "VERIFY_IMPORTS": ["json", "ipykernel"],
        "SET_ENV_SCRIPTS": [str(FAKE_SET_ENV)],
        "KERNEL_CODE": "import kit_fake_cann",
        "NAME": "nb-env",
    },
    # tests/test_data_notebook.py
    "02": lambda root: {"TOKENIZER": _sample_tokenizer(), "MAX_LENGTH": 64, "TEMPLATE": "telechat"},
    # tests/test_convert_notebook.py
    "03": lambda root: {"SOURCE": _tiny_llama(root), "TP": 2, "PP": 2, "LOGITS_TOKENS": 8},
    # tests/test_train_notebook.py
    "04": lambda root: {
        "MODEL": "tiny",
        "MODEL_PATH": _tiny_llama(root),
        "TRAIN_ITERS": 5,
        "MBS": 2,
        "GBS": 4,
        "SEQ_LEN": 64,
        "LR": 3e-3,
        "LAUNCH_ITERS": 2,
        "DPO_ITERS": 2,
        "MAX_NEW_TOKENS": 8,
    },
    # tests/test_profiling_notebook.py: profiles 04's run in this workspace (MODEL "tiny"); alone, it trains
    # notebook 04's defaults on MODEL_PATH with SEQ_LEN tokens
    "05": lambda root: {
        "MODEL": "tiny",
        "MODEL_PATH": _tiny_llama(root),
        "SEQ_LEN": 32,
        "DEVICE": "cpu",
        "WAIT": 0,
        "WARMUP": 1,
        "ACTIVE": 2,
        "TOP": 5,
    },
    # tests/test_evaluate_notebook.py
    "06": lambda root: {
        "RUN": _tiny_training_run(root),
        "MODEL": "tiny-eval",
        "TASK_LIMIT": 3,
        "ENGINE": "kit",
        "MAX_NEW_TOKENS": 4,
        "BATCH_SIZES": [1, 2],
        "PROMPT_LENGTHS": [8, 16],
        "DECODE_TOKENS": 2,
    },
    # tests/test_serve_notebook.py
    "07": lambda root: {
        "RUN": _tiny_training_run(root),
        "MODEL": "tiny-eval",
        "MAX_TOKENS": 4,
        "LMEVAL_LIMIT": 2,
        "REQUEST_RATES": [],
        "PROMPT_LENGTHS": [16],
        "OUTPUT_LENGTHS": [4],
        "NUM_PROMPTS": 2,
        "WARMUP": 1,
    },
}
FAKE_SET_ENV = (
    Path(__file__).parent.parent / "fixtures" / "envs" / "ascend_toolkit" / "ascend-toolkit" / "set_env.sh"
)

EXPECT = {
    # the doctor's report table (PASS/WARN/FAIL lines), the device table, the explained error
    "00": Expect(tables=2, texts=("torch_npu", "CANN", "PASS", "gloo", "leftover_process")),
    # envs table, the clone/pack/unpack progress bars, the steps table + plot, the kernel that ran in the clone
    # (its progress bars use leave=False: they vanish once complete)
    "01": Expect(tables=2, images=1, texts=("is the clone", "ASCEND_HOME_PATH", "nb-env", "tar.zst")),
    # the accounting tables (pretrain, sft), one packed sample explained, both length histograms, the progress bars
    # at their last frame (kit.system.progress draws them as text the kernel updates in place), the pairs' accounting
    # sentence and one pair explained
    "02": Expect(
        tables=4,
        images=2,
        texts=("records_read", "records_dropped", "padding_ratio", "records [", "pairs read:", "rejected"),
    ),
    # the source description, the rank-file table and its plot, the verification table (round trip, logits)
    "03": Expect(
        tables=3,
        images=1,
        texts=("mp_rank_01_001", "rank files (TP x PP x EP)", "bit-identical", "max |logits - HF|"),
    ),
    # the live views of the trainer's run and the launched run (their final state: table and loss curve), the
    # loss/throughput plot, the curves and the runs side by side, the DPO run's steps (TRL's metrics), the Megatron
    # plan
    "04": Expect(
        tables=2,
        images=1,
        texts=(
            "the in-kernel run",
            "completed",
            "memory (GiB)",
            "smoothed",
            "tokens/s/p",
            "before:",
            "after:",
            "speed_vs_sft",
            "rewards/accuracies",
        ),
    ),
    # top-operators chart of the capture and of the sample, step breakdown, advice tables + rendered advice, the
    # profiled training's live view; the capture is checked by what it recorded (a torch profile of the two active
    # steps), never by which operator ranked first: that depends on the machine's load
    "05": Expect(
        tables=3,
        images=3,
        texts=(
            "smoothed",
            "profiled ",
            "torch profile",
            "kernel rows, 2 steps",
            "Profile advice",
            "Findings",
            "Cast operators are slow",
            "AI_CPU",
        ),
    ),
    # the results table (metric x base / trained / change), the answers side by side, the speed table and its plot,
    # and (no DPO run in this workspace) the one sentence that says so where the preference table would be
    "06": Expect(
        tables=3,
        images=1,
        texts=(
            "heldout_perplexity",
            "kit_mc_zh_acc",
            "change",
            "decode_tokens_per_s",
            "ttft_ms",
            "preference accuracy skipped: no DPO run started from",
        ),
    ),
    # the server's URL, the lm-eval answers served vs in-process, the load-test table and its plot, the package probe
    "07": Expect(
        tables=2,
        images=1,
        texts=("ready: http://127.0.0.1:", "equal: True", "p99_ttft_ms", "median_tpot_ms", '"status": 200'),
    ),
}

# A parameter a user could get wrong, and the words of the kit's error that must be visible in the cell output.
BROKEN = {
    "00": ({"MODEL": "my model/v1"}, "is not a plain folder name"),
    "02": (
        {"PRETRAIN_INPUTS": ["/nonexistent/corpus.jsonl"]},
        "'/nonexistent/corpus.jsonl' does not exist; check the path",
    ),
    "06": ({"PROMPTS": []}, "PROMPTS is empty: give at least one prompt"),
    "07": ({"PORT": -1}, "port=-1: use a TCP port 1..65535 (0: a free one)"),
}

# Problems seen in the browser that belong to another stage's code, tolerated here (reported as warnings) until
# fixed there; each entry names the cause. Anything else still fails.
KNOWN_PROBLEMS: dict = {
    # e.g. "01": ("red progress bar",),  with a comment naming the cause and the file to fix
}
