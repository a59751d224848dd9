"""Every default and range ``dpsweep <command> --help`` prints is the one its declaration holds.

A help text that restates a number drifts from the code the day the number changes; the CLI
derives them from the declarations, and this test reads the printed help back against them.
"""

from __future__ import annotations

import re

import pytest

from dpsweep.orchestrator.audit.canary import DEFAULT_WHITE_BOX_CANARIES
from dpsweep.orchestrator.cli import COMMANDS, main
from dpsweep.orchestrator.config import DEFAULT_ACCOUNTANT_TIMEOUT_S
from dpsweep.orchestrator.config.checks import MAX_EPSILON

#: (command, flag) -> the declaration its printed default must equal.
DEFAULTS = {("budget", "--accountant-timeout-s"): DEFAULT_ACCOUNTANT_TIMEOUT_S,
            ("audit", "--canaries"): DEFAULT_WHITE_BOX_CANARIES}
#: (command, flag) -> the declared upper end of its printed range "(0, X]".
RANGES = {("budget", "--epsilon"): MAX_EPSILON}
NUMBER = r"(\d+(?:\.\d+)?)"


def _entries(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each option of ``dpsweep COMMAND --help`` with its help text on one line."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    entries: dict[str, list[str]] = {}
    current = None
    for line in capsys.readouterr().out.splitlines():
        opening = re.match(r"\s{2}(--[a-z-]+)", line)
        if opening:
            current = opening.group(1)
            entries[current] = [line]
        elif current is not None and line.startswith(" " * 4):
            entries[current].append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_printed_defaults_and_ranges_are_the_declared_ones(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    for flag, text in _entries(command, capsys).items():
        for printed in re.findall(rf"default {NUMBER}", text):
            assert (command, flag) in DEFAULTS, f"{command} {flag}: undeclared default {printed}"
            assert float(printed) == DEFAULTS[command, flag], (command, flag)
        for printed in re.findall(rf"\(0, {NUMBER}\]", text):
            assert (command, flag) in RANGES, f"{command} {flag}: undeclared range {printed}"
            assert float(printed) == RANGES[command, flag], (command, flag)


def test_every_declared_default_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    for (command, flag), value in {**DEFAULTS, **RANGES}.items():
        assert f"{value:g}" in _entries(command, capsys)[flag], (command, flag)
