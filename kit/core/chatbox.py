"""A chat box for a notebook: a text field, and the model's answer streaming into the output below it.

The model side is any `ask(question) -> iterable of text pieces`: `kit.serve.client.stream` for a served endpoint
(notebook 07), `kit.evaluate.chat.stream_answer` for a trained model in this process (after notebook 04). The first
question is asked at once. Where nobody can type (papermill, nbclient, a script) the box would wait for nothing, so
it asks that one question and prints one sentence with the answer streamed back.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

Ask = Callable[[str], Iterable[str]]
# set in a kernel that a person's front end started: jupyter_server >= 2 (JupyterLab, Notebook 7) names the notebook's
# session in JPY_SESSION_NAME; VS Code's Jupyter sets VSCODE_PID. Papermill's and nbclient's kernels have neither.
FRONT_END_VARIABLES = ("JPY_SESSION_NAME", "VSCODE_PID")


def has_front_end() -> bool:
    """True in a kernel that a notebook front end started (someone can type into a widget)."""
    from kit.system.progress import in_kernel

    return in_kernel() and any(os.environ.get(v) for v in FRONT_END_VARIABLES)


def headless_line(name: str, question: str, answer: str) -> str:
    """The one sentence a chat box prints where nobody can type."""
    answer = " ".join(answer.split())
    return (
        f"Asked {question!r}, {name} answered {answer!r}."
        if answer
        else f"Asked {question!r}, {name} said nothing."
    )


def chat_box(ask: Ask, question: str, name: str = "the model", interactive: Optional[bool] = None) -> str:
    """Show a chat box and ask `question` in it (the answer streams in); headless, print one sentence instead.
    `interactive`: None decides by has_front_end(). Returns the first answer."""
    if interactive is None:
        interactive = has_front_end()
    if not interactive:
        answer = "".join(ask(question))
        print(headless_line(name, question, answer))
        return answer
    import ipywidgets as widgets
    from IPython.display import display

    from kit.errors import KitError

    box = widgets.Text(
        placeholder="ask something, then Enter",
        description="you:",
        continuous_update=False,  # the value changes on Enter (ipywidgets 8 deprecates on_submit for this)
        layout=widgets.Layout(width="90%"),
    )
    out = widgets.Output(layout=widgets.Layout(border="1px solid #ddd", padding="4px"))

    def send(q: str) -> str:
        out.append_stdout(f"you: {q}\n{name}: ")
        pieces = []
        try:
            for piece in ask(q):
                pieces.append(piece)
                out.append_stdout(piece)
        except KitError as exc:  # a refused request or a too-long prompt: its line, and the box stays usable
            out.append_stdout(f"\nerror: {exc}")
        out.append_stdout("\n\n")
        return "".join(pieces)

    def submitted(change) -> None:
        q = change["new"].strip()
        if q:
            box.value = ""  # observed again with "", ignored
            send(q)

    box.observe(submitted, names="value")
    display(widgets.VBox([out, box]))
    return send(question)
