"""A worker started through the preload runs its module as ``__main__`` with its arguments
while torch imports in a background thread: a real process (5 s of torch's import)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)


def test_preload_runs_the_module_as_main_with_its_arguments_while_torch_imports(tmp_path):
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import sys, threading
        started = [t for t in threading.enumerate() if t.name == "nbdist-preload"]
        for t in started:
            t.join(60)
        print(__name__, sys.argv[1:], len(started), "torch._dynamo" in sys.modules)
    """))
    out = subprocess.run([sys.executable, "-m", "nbdist.runtime.boot.preload", "probe", "--x", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["__main__", "['--x',", "'1']", "1", "True"]
