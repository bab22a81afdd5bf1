"""ipyparallel's engine nanny, started while the engine starts instead of after it registers.

An ipyparallel engine starts its nanny (the process that relays signals to it and tells the
controller at once when it exits) only once the controller has accepted its registration, and
waits for the nanny to import ipyparallel before it completes registration: half a second of
a cold start, on the engine's critical path. :func:`spawn` starts the nanny's process at engine
start-up, where its imports overlap the engine's own; :func:`install` makes the engine hand its
settings to that process instead of starting a new one. The nanny itself is ipyparallel's.

``python -m nbdist.runtime.nanny``: import the nanny, then wait for its settings on stdin (a
pickle, as ipyparallel's own ``start_nanny`` sends them). Standard library only until then.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any, Callable, Optional

_ready: Optional[subprocess.Popen] = None


def spawn() -> subprocess.Popen:
    """Start a nanny process that imports its modules and then waits for its settings."""
    global _ready
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # As ipyparallel starts it: its own session, so a SIGINT meant for the engine's process
    # group does not reach it.
    _ready = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, start_new_session=True)
    return _ready


def install(app: Any) -> None:
    """Have the engine app module ``app`` (``ipyparallel.engine.app``) use the spawned nanny
    for its first ``start_nanny`` call; any later call starts one the usual way."""
    original: Callable[..., Any] = app.start_nanny

    def start_nanny(**kwargs: Any) -> tuple[str, subprocess.Popen]:
        global _ready
        proc, _ready = _ready, None
        if proc is None or proc.poll() is not None:
            return original(**kwargs)
        kwargs["pid"] = os.getpid()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pickle.dumps(kwargs))
        proc.stdin.close()
        url = proc.stdout.readline().decode("utf8").strip()
        if not url:
            proc.terminate()
            raise RuntimeError("nanny failed")
        return url, proc  # the engine keeps the handle: the nanny watches the pipe

    app.start_nanny = start_nanny


def main() -> None:
    from ipyparallel.engine.nanny import KernelNanny

    with os.fdopen(sys.stdin.fileno(), mode="rb") as f:
        data = f.read()
    if not data:  # the engine ended, or never registered: nothing to watch
        return
    kwargs = pickle.loads(data)
    kwargs["pipe"] = sys.stdout
    KernelNanny.main(**kwargs)


if __name__ == "__main__":
    main()
