"""The unit layer's own guard: a test leaves the logging configuration as it found it.

A level raised on the ``elasticctl`` logger (or the root) and left behind hides the log records
a later test waits for, so that test fails or passes by the order the tests ran in."""

from __future__ import annotations

import logging

import pytest

WATCHED = ("", "elasticctl")


def _configuration() -> dict[str, tuple]:
    return {name or "root": (logging.getLogger(name).level, logging.getLogger(name).disabled,
                             logging.getLogger(name).propagate) for name in WATCHED} | {
        "disable": (logging.root.manager.disable,)}


@pytest.fixture(autouse=True)
def logging_left_as_found():
    before = _configuration()
    yield
    after = _configuration()
    changed = {name: (before[name], after[name]) for name in before if before[name] != after[name]}
    assert not changed, f"the test left the logging configuration changed (level, disabled, propagate): {changed}"
