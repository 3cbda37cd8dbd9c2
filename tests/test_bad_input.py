"""Bad input meets one sentence: `elasticctl: error: ...` naming the value, a non-zero exit,
no traceback, nothing left in etcd and nothing left running.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.spec import JobSpec, validate_name

# -- 5: one naming rule for job names, run ids and node ids ------------------------------------

@given(st.text(max_size=80))
def test_validate_name_accepts_only_key_safe_names(value):
    try:
        assert validate_name(value, "run id") == value
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("The run id ") and "\n" not in message
        return
    assert 1 <= len(value) <= 63 and value[0].isascii() and value[0].isalnum()
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in value)


def test_validate_name_refuses_a_trailing_newline():
    with pytest.raises(ConfigError, match=r"^The node id 'abc\\n' must be 1-63 letters"):
        validate_name("abc\n", "node id")
    assert validate_name("job-1.a_b", "job name") == "job-1.a_b"


@pytest.mark.parametrize("ttl", [1, 3601, 9999999999, 99999999999999999999])
def test_node_ttl_is_bounded_in_the_spec(ttl):
    with pytest.raises(ConfigError, match=rf"^The node liveness TTL \({ttl} s\) must be between 2 and 3600"):
        JobSpec(name="job", script="train.py", node_ttl=ttl)
