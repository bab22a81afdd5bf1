"""How the magics read their lines: the ``%nbdist`` verbs' parsers (one sub-parser per verb,
each naming its handler in :mod:`nbdist.magics`), ``-h`` everywhere, comments dropped, and the
small readers of parsed options. Pure argparse over IPython's magic parser: no session here.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, NoReturn, Optional

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

from ..backends import connect_target
from ..backends.registry import connect_flags, default_engine
from ..options import DEVICES, DIST_BACKENDS, ENGINES, ClusterOptions


def _cluster_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``start`` and ``connect``: defined once. Their defaults are None, so
    that only the options given override a profile."""
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help=f"engine that runs the workers (default: {default_engine()})")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="auto (default): one GPU per worker where GPUs exist, else CPU")
    p.add_argument("--dist-backend", choices=DIST_BACKENDS, default=None,
                   help="torch.distributed backend; auto (default): nccl on GPU, gloo on CPU")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds allowed for start-up and for any collective (default 300)")
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="torch threads per worker (default: host cores / workers on host)")


class HelpShown(Exception):
    """``-h``/``--help`` printed a magic's help: there is nothing to run."""


class _Parser(MagicArgumentParser):
    """IPython's magic parser, with ``-h``/``--help`` on the magic and on every verb.

    argparse ends its help with ``exit()``, which would raise SystemExit in the kernel; here it
    raises :class:`HelpShown`, which the magic takes as "done". Errors stay UsageErrors.
    """

    def __init__(self, *args: Any, add_help: bool = True, **kwargs: Any):
        super().__init__(*args, add_help=add_help, **kwargs)

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        if status:
            self.error(message or "")
        raise HelpShown


class CellHelp(argparse._HelpAction):
    """``%%distributed -h``: print the cell magic's help, run nothing."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        parser.print_help()
        raise HelpShown


def split_line(line: str) -> list[str]:
    """A magic's line as shell words, its ``# comment`` dropped as Python would drop it (a
    ``#`` inside quotes stays)."""
    try:
        return shlex.split(line, comments=True)
    except ValueError as exc:  # unbalanced quotes
        raise UsageError(str(exc)) from None


_PARSED: dict[tuple[int, str], argparse.Namespace] = {}  # (parser, line) -> its arguments
_PARSED_MAX = 64


def parse_cached(parser: argparse.ArgumentParser, line: str) -> argparse.Namespace:
    """``parser.parse_args`` of a magic's line, remembered: a cell magic's line is parsed on
    every run of the cell (argparse: about 50 µs), and is most often the same few lines. Each
    call gets its own copy; lines that fail (or ask for help) are not remembered."""
    key = (id(parser), line)
    args = _PARSED.get(key)
    if args is None:
        args = parser.parse_args(split_line(line))
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = args
    return argparse.Namespace(**vars(args))


def build_parser() -> tuple[MagicArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``%nbdist`` parser and its sub-parser per verb; each verb names its handler."""
    parser = _Parser(prog="nbdist", description="Manage the nbdist cluster.")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    subs: dict[str, argparse.ArgumentParser] = {}

    def verb(name: str, handler: str, help: str) -> argparse.ArgumentParser:
        p = subs[name] = verbs.add_parser(name, help=help)
        p.set_defaults(handler=handler)
        return p

    p = verb("start", "_start", "start a local cluster (controller + N workers, loopback), "
                                "or the one a profile describes")
    p.add_argument("-n", type=int, default=None, metavar="N",
                   help="workers (default: visible GPUs, else 2)")
    p.add_argument("--profile", default=None, metavar="FILE.yaml",
                   help="a cluster profile (docs/profiles.md); the options given here win")
    p.add_argument("--no-template", dest="template", action="store_false", default=None,
                   help="start each worker as a fresh process, not forked from a process "
                        "that has imported torch (docs/usage.md)")
    _cluster_options(p)

    p = verb("connect", "_connect", "attach to a running cluster")
    p.add_argument("address", nargs="?", default=None,
                   help="dask: scheduler address tcp://HOST:PORT")
    p.add_argument("--cluster-id", default=None, help="ipyparallel cluster id")
    p.add_argument("--ipp-profile", default=None, metavar="NAME",
                   help="ipyparallel profile the cluster was started with (ipcluster "
                        "--profile NAME)")
    # connect's --profile before it was --ipp-profile: start's --profile is a YAML file
    p.add_argument("--profile", dest="old_profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url-file", default=None, metavar="FILE",
                   help="ipyparallel client connection file (ipcontroller-client.json)")
    p.add_argument("--scheduler-file", default=None, metavar="FILE",
                   help="dask scheduler file")
    for _, flag in connect_flags():  # each engine's own (Dask's --tls-*)
        p.add_argument(flag.option, dest=flag.dest, default=None, metavar=flag.metavar,
                       help=flag.help)
    _cluster_options(p)

    verb("status", "_status", "workers: rank, host, pid, device, alive")
    verb("stop", "_stop", "stop the workers nbdist started (or disconnect)")
    verb("restart", "_restart", "fresh workers with the same options")

    p = verb("scale", "_scale", "resize to N workers and re-form the process group")
    p.add_argument("n", type=int, metavar="N",
                   help="the workers (world size) wanted: not a number to add or remove. The "
                        "highest ranks leave; workers that stay keep their ranks; new workers "
                        "take the ranks of workers that left, then the next ones")

    p = verb("push", "_push", "send notebook variables to every worker")
    p.add_argument("names", nargs="+", metavar="NAME")

    p = verb("pull", "_pull", "bring a worker variable into the notebook (on CPU)")
    p.add_argument("name", metavar="NAME", help="variable (or dotted attribute) on the worker")
    p.add_argument("--rank", type=int, default=0, help="which rank to pull from (default 0)")
    p.add_argument("--as", dest="as_name", default=None, metavar="VAR",
                   help="notebook name to bind (default: NAME's last part)")

    verb("cluster", "_cluster", "cluster panel: one row per worker, a Scale control")

    p = verb("timeline", "_timeline", "write the last run's telemetry as a Chrome trace")
    p.add_argument("file", metavar="FILE.json",
                   help="open it in https://ui.perfetto.dev or chrome://tracing")

    p = verb("auto", "_auto", "run every cell on the ranks (on) or in the kernel (off)")
    p.add_argument("state", nargs="?", choices=("on", "off"), default=None,
                   help="on: each cell runs as if it began with %%%%distributed, except cells "
                        "starting with a magic or %%%%local; off: back to normal; "
                        "none: say which")

    p = verb("profile", "_profile", "save this session's options as a profile, or check one")
    p.add_argument("action", choices=("save", "check"),
                   help="save: write the running session's options; check: validate FILE")
    p.add_argument("file", metavar="FILE.yaml")

    p = verb("export", "_export", "write the cells since the group formed as a torchrun script")
    p.add_argument("file", metavar="FILE.py")
    p.add_argument("--force", action="store_true",
                   help="overwrite FILE even if it is not an earlier nbdist export")

    p = verb("tune", "_tune", "the DDP setting %%%%distributed --tune chose: show it, or drop "
                              "it (torch's defaults, or the profile's, again)")
    p.add_argument("action", choices=("show", "reset"),
                   help="show: the setting DDP models built from now on get; reset: drop the "
                        "tuned one")

    p = verb("compare", "_compare", "named runs side by side: speed, traffic, memory per rank")
    p.add_argument("names", nargs="*", metavar="NAME", help="runs to show (default: all named)")

    p = verb("debug", "_debug", "post-mortem pdb on the frame where the last cell failed on a "
                                "rank, answered here")
    p.add_argument("rank", nargs="?", type=int, default=None, metavar="RANK",
                   help="the rank to inspect (default: the first rank that failed)")

    p = verb("kill", "_kill", "kill a rank's worker process from outside, as a real failure")
    p.add_argument("rank", type=int, metavar="RANK")
    p.add_argument("--signal", default="SIGKILL", metavar="NAME",
                   help="the signal, e.g. SIGTERM or 15 (default SIGKILL)")
    p.add_argument("--after", type=float, default=None, metavar="S",
                   help="send it S seconds into the next %%%%distributed cell (default: now)")

    p = verb("hang", "_hang", "make a rank hold at its next collective, as a hung rank would")
    p.add_argument("rank", type=int, metavar="RANK")
    p.add_argument("--seconds", type=float, default=60.0, metavar="S",
                   help="how long it holds (default 60); an interrupt ends it sooner")

    p = verb("run", "_run_script", "run a torchrun-style script on every worker")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="interrupt the script on every rank after S seconds (default: never)")
    p.add_argument("--all-output", action="store_true", help="show output of every rank")
    p.add_argument("script", metavar="SCRIPT", help="the script, as torchrun would be given it")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="the script's arguments: everything after SCRIPT, -h included")

    p = verb("attach", "_attach", "watch jobs started elsewhere (torchrun, sbatch): print the "
                                  "NBDIST_ATTACH line their environment needs")
    p.add_argument("--listen", default=None, metavar="[HOST:]PORT",
                   help="where to listen (default: 127.0.0.1 and a free port, this machine's "
                        "jobs only)")
    p.add_argument("--token-file", default=None, metavar="F",
                   help="keep the line in F (mode 0600): a restarted kernel given F listens "
                        "again with the same line")
    p.add_argument("--tls-cert", default=None, metavar="F", help="certificate (PEM): TLS")
    p.add_argument("--tls-key", default=None, metavar="F", help="its key (PEM)")

    verb("jobs", "_jobs", "the jobs watched: id, ranks, hosts, state, steps per rank")

    p = verb("job", "_job", "one watched job: show it, its ranks' stacks, or stop watching it")
    p.add_argument("id", metavar="ID", help="the job's id, as %%nbdist jobs lists it")
    p.add_argument("action", choices=("show", "stacks", "detach"),
                   help="show: its record and run table; stacks: each running rank's Python "
                        "stack now; detach: stop watching it")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="stacks: this rank's only")
    return parser, subs


PARSER, VERBS = build_parser()


def cluster_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The options ``start`` and ``connect`` share that were given, validated together."""
    opts = dict(engine=args.engine, device=args.device, dist_backend=args.dist_backend,
                timeout=args.timeout, threads=args.threads)
    ClusterOptions().override(**opts)
    return {k: v for k, v in opts.items() if v is not None}


def engine_target(args: argparse.Namespace) -> dict[str, Any]:
    """What the engines' own ``connect`` flags given on the line add to its target (Dask's
    ``--tls-*`` files make a ``security``); ``{}`` when none is given.

    Raises
    ------
    OptionError
        A flag of another engine than ``--engine`` (default: the default engine), or values
        the engine refuses (see :func:`nbdist.backends.connect_target`).
    """
    given = {flag.dest: getattr(args, flag.dest) for _, flag in connect_flags()
             if getattr(args, flag.dest, None) is not None}
    return connect_target(args.engine, given) if given else {}


def prompt_number(shell: Any) -> Optional[int]:
    """The number the prompt shows for the cell running now (``In [n]``); None outside a
    stored cell.

    ``shell.execution_count`` is not it on every IPython: 8.x adds one after the cell ran,
    9.x before running it. Both hand the cell's ExecutionResult, numbered as its prompt, to
    the display hook before the code runs (9.x numbers an unstored cell too: the next one's).
    """
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    info = getattr(result, "info", None)
    if info is None or not info.store_history or info.silent:
        return None
    return result.execution_count
