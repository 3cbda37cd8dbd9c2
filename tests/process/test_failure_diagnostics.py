"""A failing process test explains itself: pytest's report of it shows each node it started (the
tail of its log and whether it still ran), the tail of each record in its tmp_path, and its job's
keys in etcd (tests/conftest.py: failure_diagnostics). Run here on a test made to fail, in a
pytest of its own with this suite's conftest as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # its parent, the repository, holds bench/ (the shared harness)

FAILING = textwrap.dedent('''
    import sys

    from elasticctl.etcd.client import EtcdClient
    from elasticctl.job.keys import JobKeys


    def test_made_to_fail(nodes, default_etcd, run_id, tmp_path):
        node = nodes("a", [sys.executable, "-c", "print('hello from node a', flush=True); import time; time.sleep(60)"])
        (tmp_path / "record.jsonl").write_text('{"step": 41}\\n{"step": 42}\\n')
        with EtcdClient(default_etcd.client_settings()) as client:
            client.put(JobKeys(run_id).spec, b"{}")
        import time
        deadline = time.monotonic() + 30
        while "hello from node a" not in node.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert False, "made to fail"
''')


def test_a_failing_test_shows_its_nodes_records_and_keys(tmp_path):
    (tmp_path / "test_made_to_fail.py").write_text(FAILING)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                             str(tmp_path / "test_made_to_fail.py")], capture_output=True, text=True, timeout=180,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]))})
    out = result.stdout
    assert result.returncode == 1 and "made to fail" in out, out[-3000:]
    assert "node a (running): last 30 lines of" in out and "hello from node a" in out, out[-3000:]
    assert "record record.jsonl: last 8 lines" in out and '{"step": 42}' in out, out[-3000:]
    assert "'s keys in etcd" in out and "/spec (2 bytes)" in out, out[-3000:]
