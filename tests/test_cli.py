"""`python -m kit`: every stage is reachable, and a stage that cannot import does not break the others."""

from __future__ import annotations

import pytest

from kit import __main__ as cli


def test_all_stages_are_registered():
    choices = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(cli.STAGES) <= set(choices)
    assert "unavailable" not in (choices["data"].description or "")


def test_a_broken_stage_is_reported_not_fatal(monkeypatch, capsys):
    monkeypatch.setitem(cli.STAGES, "bogus", "kit.no_such_stage_module")
    assert cli.main(["doctor", "--explain", "EJ0001: Failed to initialize the HCCP process."]) == 0
    with pytest.raises(SystemExit, match="cannot run here"):
        cli.main(["bogus"])
