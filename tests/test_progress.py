"""Progress bars in a kernel end on their final frame in the saved notebook (kit.system.progress)."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from kit.system.progress import bar, in_kernel


def _run(code: str) -> list:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    return nb.cells[0].outputs


def test_a_kernel_bar_is_saved_at_its_last_frame_and_writes_no_stderr():
    outputs = _run(
        "from kit.system.progress import bar\n"
        "with bar(total=3, desc='steps') as b:\n"
        "    for _ in range(3):\n"
        "        b.update()\n"
        "import torch\n"
        "from kit.system.hf_compat import dtype_kw\n"
        "dtype_kw(torch.float32)\n"  # what every load of the kit does first: installs transformers' hook
        "from transformers.utils import logging\n"
        "for _ in logging.tqdm(range(4), desc='Loading weights'):\n"
        "    pass\n"
    )
    from transformers.utils import logging

    texts = [o["data"]["text/plain"] for o in outputs if o.get("output_type") == "display_data"]
    assert all("widget" not in str(o.get("data", {})) for o in outputs)
    assert texts[0].startswith("steps: 100%") and "3/3" in texts[0]
    if hasattr(logging, "set_tqdm_hook"):  # transformers 5: its bars are display bars too
        assert len(texts) == 2 and texts[1].startswith("Loading weights: 100%") and "4/4" in texts[1]
    else:  # older transformers: its bars are switched off in a kernel
        assert len(texts) == 1
    assert not [o for o in outputs if o.get("name") == "stderr"]


def test_outside_a_kernel_the_bar_is_tqdms(capsys):
    assert not in_kernel()
    with bar(total=2, desc="copy") as b:
        b.update(2)
    assert "copy: 100%" in capsys.readouterr().err
