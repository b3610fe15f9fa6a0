"""The notebook chat box (kit.core.chatbox) where nobody can type: one question, its streamed answer as one sentence."""

from __future__ import annotations

from kit.core.chatbox import chat_box, has_front_end, headless_line


def _ask(question):
    asked.append(question)
    yield from ["Drink ", "water", ",\n sleep."]


asked: list = []


def test_headless_it_asks_once_and_prints_one_sentence(capsys, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "04.ipynb")  # set, but no kernel here: still headless
    assert not has_front_end()
    asked.clear()
    answer = chat_box(_ask, "Any tips?", name="the trained model")
    assert asked == ["Any tips?"] and answer == "Drink water,\n sleep."
    out = capsys.readouterr().out
    assert out == "Asked 'Any tips?', the trained model answered 'Drink water, sleep.'.\n"


def test_an_empty_answer_is_said_plainly():
    assert headless_line("the served model", "hi", " \n") == "Asked 'hi', the served model said nothing."


def test_in_a_notebook_front_ends_kernel_the_answer_streams_into_the_box():
    """A kernel that a front end started (JPY_SESSION_NAME): the box is a widget, the first answer in its output."""
    import nbformat
    from nbclient import NotebookClient

    code = (
        "import os\nos.environ['JPY_SESSION_NAME'] = 'chat.ipynb'\n"
        "from kit.core.chatbox import chat_box\n"
        "answer = chat_box(lambda q: iter(['Drink ', 'water.']), 'Any tips?')\n"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert [o["output_type"] for o in outputs] == ["display_data"], (
        outputs
    )  # the box alone: no print, no stderr
    assert "application/vnd.jupyter.widget-view+json" in outputs[0]["data"]
    states = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
    streamed = [o["text"] for s in states for o in s["state"].get("outputs", []) if o.get("name") == "stdout"]
    assert "".join(streamed) == "you: Any tips?\nthe model: Drink water.\n\n"
