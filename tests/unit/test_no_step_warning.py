"""A script that never reaches a step boundary: the worker says so, in its log
and as a ``no_step`` event; a function that returns at step 0 is warned about; a SIGTERM that no
boundary answers ends the worker within the runtime's bound, in one line.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_no_step.py.
"""

from __future__ import annotations

import pytest

from elasticctl.train.runtime import no_step_warning_after


@pytest.mark.parametrize(("node_ttl", "seconds"), [(None, 120.0), (5.0, 120.0), (60.0, 120.0), (90.0, 180.0)])
def test_no_step_warning_after(node_ttl, seconds):
    assert no_step_warning_after(node_ttl) == seconds
