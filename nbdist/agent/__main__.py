"""``python -m nbdist.agent SCRIPT [ARGS...]``: run ``SCRIPT`` as ``__main__``, reporting to
the notebook named by ``NBDIST_ATTACH`` (see :mod:`.hook`); ``torchrun ... -m nbdist.agent
train.py`` starts every rank so. The script sees the ``sys.argv`` it would see run directly."""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType
from typing import Optional

from . import hook


def _from_script(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """``tb`` from the script's first frame on: this module's and runpy's left out."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__.strip() + "\n")
        return 0 if argv else 2
    hook.activate()
    agent = hook.rank_agent()
    sys.argv = list(argv)
    if agent is not None:
        agent.script(argv[0])  # run_path names the script's code by this path
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as when the script is run
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        if agent is not None:
            agent.end(code or 0)
        raise
    except KeyboardInterrupt as exc:  # Python ends by SIGINT itself: its status says so
        if agent is not None:
            agent.failed(exc)
            agent.end(1)
        raise
    except BaseException as exc:
        if agent is not None:
            agent.failed(exc)
            agent.end(1)
        # As Python ends a script that raised: its traceback, from the script's first frame
        # (not this module's nor runpy's), and status 1.
        tb = _from_script(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return 1
    if agent is not None:
        agent.end(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
