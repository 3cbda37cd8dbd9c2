"""The unit layer does not depend on the machine's speed: no unit test reads the real clock or
sleeps on it.

A test that asserts a window of wall time (``0.5 <= time.monotonic() - began < 0.7``) or sleeps
for something to have happened fails CI at random on a loaded machine. Code that waits takes its
clock and its sleep as arguments (elasticctl.etcd.retry, wait_until_listening, the bench's
``Cluster.clock``), and its test drives a clock of its own (tests/support/clock.py), asserting the
exact schedule of pauses instead. This test parses every file of tests/unit/ and names each call
of the time module's clocks or sleep that is not in ALLOWED, with its reason.

Code that a test runs in a child process is a string literal here (``"import time; time.sleep(60)"``,
a textwrap'd script): it is the child's, not the test's, and is not counted.

Layer tests/unit: reads files only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent

# The time module's clocks and its sleep: reading any of them makes a result depend on how fast
# the machine ran the test.
CLOCKS = frozenset({"sleep", "time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"})

# (file, the top-level test or class the call is in, the call as written): why it must stay. One
# line each; a test that checks a real process's or socket's bound belongs here only when it cannot
# be made deterministic, and then with an upper bound of seconds on a sub-second operation.
ALLOWED: dict[tuple[str, str, str], str] = {}


def clock_calls(source: str) -> list[tuple[int, str, str]]:
    """(line, the top-level def or class it is in ("" at module level), the call as written) of
    each call of a time-module clock or sleep in ``source``: through ``import time``, ``import time
    as t`` or ``from time import sleep [as pause]``, wherever in the file the import is."""
    tree = ast.parse(source)
    modules: set[str] = set()  # names bound to the time module
    functions: dict[str, str] = {}  # names bound to one of its clocks -> the clock's name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name for alias in node.names if alias.name == "time")
        elif isinstance(node, ast.ImportFrom) and node.module == "time" and node.level == 0:
            for alias in node.names:
                if alias.name == "*":
                    functions.update({name: name for name in CLOCKS})
                elif alias.name in CLOCKS:
                    functions[alias.asname or alias.name] = alias.name
    found = []
    for top in tree.body:
        owner = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else ""
        for node in ast.walk(top):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in CLOCKS
                    and isinstance(func.value, ast.Name) and func.value.id in modules):
                found.append((node.lineno, owner, f"{func.value.id}.{func.attr}"))
            elif isinstance(func, ast.Name) and func.id in functions:
                found.append((node.lineno, owner, func.id))
    return sorted(found)


@pytest.mark.parametrize("source, calls", [
    ("import time\ndef test_x():\n    time.sleep(1)\n", [(3, "test_x", "time.sleep")]),
    ("import time\nbegan = time.monotonic()\n", [(2, "", "time.monotonic")]),
    ("import time as t\ndef test_x():\n    return t.time()\n", [(3, "test_x", "t.time")]),
    ("def test_x():\n    import time\n    time.perf_counter()\n", [(3, "test_x", "time.perf_counter")]),
    ("from time import sleep\ndef test_x():\n    sleep(0.1)\n", [(3, "test_x", "sleep")]),
    ("from time import monotonic as now\nclass Job:\n    def at(self):\n        return now()\n",
     [(4, "Job", "now")]),
    ("from time import *\ndef test_x():\n    monotonic()\n", [(3, "test_x", "monotonic")]),
    # code a child process runs is a string, not a call of the test
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])\n", []),
    ("import textwrap\nCODE = textwrap.dedent('''\n    import time\n    time.sleep(600)\n''')\n", []),
    # an injected clock is not the time module's, nor is a reference that is not called
    ("def test_x(clock):\n    clock.sleep(1)\n    clock.time()\n", []),
    ("import time\nfrom x import retry\nretry(f, clock=time.monotonic, sleep=time.sleep)\n", []),
    ("from time import strftime\nimport datetime\nstrftime('%Y')\ndatetime.time()\n", []),
    ("from .time import sleep\nsleep(1)\n", []),  # a module of the package's own, not the standard one
])
def test_the_calls_of_a_clock_are_found_and_strings_are_not(source, calls):
    assert clock_calls(source) == calls


def _unit_files() -> list[Path]:
    return sorted(UNIT.rglob("*.py"))


def test_no_unit_test_reads_the_real_clock_or_sleeps():
    found = [(path.relative_to(UNIT).as_posix(), line, owner, call)
             for path in _unit_files() for line, owner, call in clock_calls(path.read_text())]
    offenders = [f"tests/unit/{file}:{line}: {call}() in {owner or 'the module'}"
                 for file, line, owner, call in found if (file, owner, call) not in ALLOWED]
    assert not offenders, (
        "unit tests that depend on the machine's speed: give the code under test a clock and a sleep "
        "to inject (e.g. clock=time.monotonic, sleep=time.sleep) and drive tests/support/clock.py's "
        "FakeClock, or name the call in ALLOWED with its reason:\n  " + "\n  ".join(offenders))
    stale = sorted(set(ALLOWED) - {(file, owner, call) for file, _, owner, call in found})
    assert not stale, f"ALLOWED names calls that are no longer there: {stale}"


def test_each_allowed_call_has_its_reason_on_one_line():
    for key, reason in ALLOWED.items():
        assert reason.strip() and "\n" not in reason, key
