"""ipyparallel's place for the worker template (:mod:`nbdist.boot.template`), on this host.

:class:`TemplateEngineSetLauncher` is ipyparallel's local engine launcher with each engine
forked from the cluster's template instead of started as a fresh process. The launcher tracks
the engine's own pid, as it would a process it started: it signals it, and reads its exit
status from the template (its parent). The engine starts its nanny (which relays interrupts and
reports its death to the controller at once) as it always does.

A worker the template cannot fork safely starts as a fresh process, with a line saying why.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Any as AnyTrait

from ...boot.template import Forked, Refused, Template, fallback_line, supported
from ...runtime.boot import fork_client
from ...runtime.boot.template import BASE_MODULES
from ..registry import lookup

#: what an ipyparallel engine imports besides torch: its own start, kernel and nanny, the
#: worker half of the adapter, and the widgets tqdm.auto brings in on a kernel (when a rank
#: joins, its bars are made to report: 0.1-0.2 s of a replacement's heal otherwise)
IPP_MODULES = (*BASE_MODULES, "ipyparallel.engine.app", "ipyparallel.engine.nanny",
               "ipyparallel.serialize", "ipykernel.ipkernel", lookup("ipyparallel").worker,
               "ipywidgets", "tqdm.notebook")


def start_template() -> Optional[Template]:
    """A template for an ipyparallel cluster on this host (None where templates cannot run,
    with a line saying so)."""
    if not supported():
        print(fallback_line("each worker", f"worker templates need Linux, not {sys.platform}"),
              file=sys.stderr, flush=True)
        return None
    return Template(IPP_MODULES)


class TemplateEngineLauncher(LocalEngineLauncher):
    """One engine, forked from the engine set's template (a fresh process if it refuses)."""

    #: the exit status the template reported (None while running, or not forked)
    exit_code: Optional[int] = None
    _forked: Optional[Forked] = None

    def start(self) -> None:
        template: Optional[Template] = getattr(self.parent, "template", None)
        if template is None:
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        env[fork_client.ENV] = template.path  # the engine's nanny forks from it too
        try:
            with open(self.output_file, "ab") as out, open(os.devnull, "rb") as stdin:
                pid, conn = template.fork(self.args, env, os.path.abspath(self.work_dir),
                                          [stdin.fileno(), out.fileno(), out.fileno()])
        except Refused as why:
            print(fallback_line(f"engine {self.identifier}", str(why)), file=sys.stderr,
                  flush=True)
            return super().start()
        self._forked = Forked(pid, conn)
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()
        return None

    def _wait(self) -> None:
        """The launcher's waiting thread: the exit status comes from the template."""
        forked = self._forked
        if forked is None:
            return super()._wait()
        code = None
        while not self._stop_waiting.is_set() and self.state == "running":
            code = forked.read_exit(self.poll_seconds)
            if code is not None:
                break
        self.exit_code = code
        stop_data = dict(exit_code=code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))
        return None


class TemplateEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, each engine forked from ``template``."""

    launcher_class = TemplateEngineLauncher
    template = AnyTrait(None, allow_none=True)
