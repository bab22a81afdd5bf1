"""``%nbdist <verb>`` and ``%%distributed``: parse, call one Session method, show the result."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, needs_local_scope
from IPython.core.magic_arguments import argument, magic_arguments

import nbdist.magics.automode as auto

from ..backends.registry import default_engine
from ..errors import AUTO_NO_CLUSTER, AUTO_ON, NO_CLUSTER, TUNE_FLAGS, OptionError
from ..options import CellOptions, ClusterOptions, parse_ranks
from ..session import Session, default_session
from ..telemetry.units import fmt_ranks
from ..tuning import DEFAULT_STEPS
from .parsers import PARSER as _PARSER
from .parsers import VERBS as _VERBS
from .parsers import (
    CellHelp,
    HelpShown,
    cluster_kwargs,
    engine_target,
    parse_cached,
    prompt_number,
    split_line,
)


@magics_class
class NbdistMagics(Magics):
    """The nbdist magics. State lives in the Session, never here."""

    @line_magic
    @needs_local_scope
    def nbdist(self, line: str, local_ns: Optional[dict] = None) -> Any:
        try:
            args = _PARSER.parse_args(split_line(line))
        except HelpShown:
            return None
        except UsageError as exc:
            raise UsageError(f"%nbdist: {exc}") from None
        if args.verb is None:
            raise UsageError(_PARSER.format_usage() + "\nSee %nbdist? for the verbs.")
        try:
            return getattr(self, args.handler)(default_session(), args)
        except OptionError as exc:
            raise UsageError(f"%nbdist {args.verb}: {exc}") from None

    # One handler per verb: parse results in, one Session call, something to show out.
    def _start(self, session: Session, args: argparse.Namespace) -> Any:
        opts = cluster_kwargs(args)
        ClusterOptions().override(n=args.n)  # a bad -n is a usage error before anything starts
        if session.running:
            pass  # the session says whether it keeps the running cluster or what it stops
        elif args.profile:
            _say(f"starting the workers profile {args.profile} describes and forming the "
                 "process group ...")
        else:
            how_many = args.n or "one per GPU (else 2)"
            _say(f"starting {args.engine or default_engine()} workers on this machine "
                 f"({how_many}) and forming the process group ...")
        return session.start(args.n, profile=args.profile, template=args.template,
                             **opts).status()

    def _connect(self, session: Session, args: argparse.Namespace) -> Any:
        opts = cluster_kwargs(args)
        if args.old_profile is not None:
            if args.ipp_profile is not None:
                raise UsageError("%nbdist connect: give --ipp-profile only (--profile is its "
                                 "old spelling)")
            print("nbdist: `%nbdist connect --profile NAME` is deprecated: use --ipp-profile "
                  "NAME (the ipyparallel profile); --profile is start's profile file",
                  file=sys.stderr, flush=True)
            args.ipp_profile = args.old_profile
        target = {k: v for k, v in dict(
            cluster_id=args.cluster_id, ipp_profile=args.ipp_profile, url_file=args.url_file,
            address=args.address, scheduler_file=args.scheduler_file).items() if v is not None}
        target.update(engine_target(args))
        if not session.running:  # else the session says whether it keeps the running one
            _say(f"connecting to the {args.engine or default_engine()} cluster and forming the "
                 "process group ...")
        return session.connect(**opts, **target).status()

    def _status(self, session: Session, args: argparse.Namespace) -> Any:
        return session.status()

    def _cluster(self, session: Session, args: argparse.Namespace) -> Any:
        from ..display import make_cluster_view

        return make_cluster_view(session.status, session.scale)

    def _profile(self, session: Session, args: argparse.Namespace) -> None:
        if args.action == "save":
            print(f"wrote {session.save_profile(args.file)}")
            return
        from ..profiles import dump_profile, load_profile

        print(dump_profile(load_profile(args.file), f"{args.file}: valid. With defaults:"))

    def _export(self, session: Session, args: argparse.Namespace) -> None:
        print(session.export(args.file, force=args.force).summary())

    def _timeline(self, session: Session, args: argparse.Namespace) -> None:
        count = session.timeline(args.file)
        print(f"wrote {count} trace events to {args.file} (open in https://ui.perfetto.dev)")

    def _stop(self, session: Session, args: argparse.Namespace) -> None:
        _say(session.stop() or "no cluster was running; nothing to stop")
        if auto.set_auto(self.shell, False):  # with no ranks, auto cells could only fail
            _say("auto mode off: cells run in the kernel again")

    def _auto(self, session: Session, args: argparse.Namespace) -> None:
        if args.state is None:
            print(f"nbdist auto mode is {'on' if auto.is_on(self.shell) else 'off'}")
        elif args.state == "on":
            if not session.running:
                raise UsageError(f"%nbdist auto on: {NO_CLUSTER}")
            auto.set_auto(self.shell, True)
            _say(f"auto mode on: every cell runs on ranks {fmt_ranks(range(session.world_size))}"
                 "; cells starting with %%local or another magic run here; "
                 "`%nbdist auto off` ends it")
        else:
            auto.set_auto(self.shell, False)
            _say("auto mode off: cells run in the kernel again")

    def _restart(self, session: Session, args: argparse.Namespace) -> Any:
        _say("restarting the workers ...")
        return session.restart().status()

    def _scale(self, session: Session, args: argparse.Namespace) -> Any:
        if args.n < 1:
            raise UsageError(f"%nbdist scale: N must be at least 1, got {args.n}")
        _say(f"scaling to {args.n} workers and re-forming the process group ...")
        return session.scale(args.n).status()

    def _push(self, session: Session, args: argparse.Namespace) -> None:
        ns = self.shell.user_ns
        missing = [n for n in args.names if n not in ns]
        if missing:
            raise UsageError(f"%nbdist push: not defined in the notebook: {', '.join(missing)}")
        session.push({n: ns[n] for n in args.names})

    def _pull(self, session: Session, args: argparse.Namespace) -> None:
        value = session.pull(args.name, rank=args.rank)
        self.shell.user_ns[args.as_name or args.name.split(".")[-1]] = value

    def _compare(self, session: Session, args: argparse.Namespace) -> Any:
        return session.compare(*args.names)

    def _debug(self, session: Session, args: argparse.Namespace) -> None:
        session.debug(args.rank)

    def _kill(self, session: Session, args: argparse.Namespace) -> None:
        _say(session.kill(args.rank, args.signal, after=args.after))

    def _hang(self, session: Session, args: argparse.Namespace) -> None:
        _say(session.hang(args.rank, args.seconds))

    def _tune(self, session: Session, args: argparse.Namespace) -> None:
        print(session.tune_show() if args.action == "show" else session.tune_reset())

    def _attach(self, session: Session, args: argparse.Namespace) -> None:
        from ..watch.collector import AttachError, attach

        try:
            collector = attach(args.listen, args.token_file, args.tls_cert, args.tls_key)
        except (AttachError, OSError) as exc:
            raise UsageError(f"%nbdist attach: {exc}") from None
        print(collector.instructions())

    def _jobs(self, session: Session, args: argparse.Namespace) -> None:
        from .. import jobs
        from ..watch.collector import no_jobs

        print("\n".join(r.line() for r in jobs()) or no_jobs("%nbdist attach"))

    def _job(self, session: Session, args: argparse.Namespace) -> None:
        from .. import job
        from ..watch.collector import missing_job

        try:
            handle = job(args.id)
        except LookupError:  # the function's message names nbdist.attach(); this, the magic
            raise UsageError(f"%nbdist job: {missing_job(args.id, '%nbdist attach')}") from None
        if args.action == "show":
            handle.show()
        elif args.action == "stacks":
            try:
                stacks = handle.stacks(args.rank)
            except LookupError as exc:  # a rank not in the job
                raise UsageError(f"%nbdist job {args.id} stacks: {exc.args[0]}") from None
            print("\n".join(f"rank {r}:\n{text}" for r, text in stacks.items())
                  or f"job {handle.id}: no running rank to ask")
        else:
            print(handle.detach())

    def _run_script(self, session: Session, args: argparse.Namespace) -> None:
        session.run_script(args.script, args.args, timeout=args.timeout,
                           output="all" if args.all_output else "rank0")

    @magic_arguments()
    @argument("-h", "--help", action=CellHelp, help="show this help and run nothing")
    @argument("--ranks", default=None, metavar="SPEC",
              help="run on these ranks only, e.g. 0 or 0,2-3 (default: all)")
    @argument("--timeout", type=float, default=None, metavar="S",
              help="interrupt the cell on every rank after S seconds")
    @argument("--quiet", action="store_true", help="show no worker output")
    @argument("--all-output", action="store_true",
              help="show stdout/stderr of every rank (default: rank 0 only)")
    @argument("--no-telemetry", action="store_true",
              help="do not time steps, all-reduces and collectives in this cell")
    @argument("--no-collective-timing", action="store_true",
              help="time DDP steps and buckets, but not torch.distributed calls in the cell")
    @argument("--bucket-timing", action="store_true",
              help="time each gradient bucket's all-reduce of DDP models built in this cell "
                   "(a few per cent slower on small steps; default: one span per step)")
    @argument("--name", default=None, metavar="LABEL",
              help="label this run; %%nbdist compare shows named runs side by side")
    @argument("--stall-after", type=float, default=None, metavar="S",
              help="after S seconds without a completed step or collective, show where each "
                   "rank is (default: 5 median steps, at least 10 s; 0: never)")
    @argument("--tune", type=int, nargs="?", const=DEFAULT_STEPS, default=None,
              metavar="STEPS",
              help="run the cell as short trials of STEPS optimizer steps (default "
                   f"{DEFAULT_STEPS}), each with one DDP setting (bucket size, bucket view, "
                   "static graph, compression); the fastest exact one becomes the default "
                   "for DDP models built later (docs/tuning.md)")
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every worker as one torch.distributed data-parallel job.

        The default process group is formed once and kept across cells; RANK, LOCAL_RANK,
        WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set as torchrun sets them,
        and the names ``rank``, ``local_rank``, ``world_size`` and ``device`` are defined. The
        namespace persists across cells. Output streams live, prefixed with the rank; the value
        of the last expression on rank 0 is the cell's result. An error on any rank is raised
        here, naming the rank. Start workers first with ``%nbdist start``.

        Training telemetry is on by default: DDP steps, their gradient all-reduce (each
        bucket's with ``--bucket-timing``) and the cell's collectives are timed and shown live
        under the cell (``nbdist.progress``
        and ``nbdist.log`` add bars and values); ``%nbdist timeline FILE.json`` writes the
        last run as a Chrome trace. See docs/telemetry.md.

        When no step or collective completes for a while (``--stall-after``), the hang doctor
        shows which ranks wait in which collective and where the others are in the cell;
        ``--timeout`` and interrupting the kernel name them in the error too. See
        docs/fault-tolerance.md.
        """
        try:
            args = parse_cached(self.distributed.parser, line)
        except HelpShown:
            return None
        except UsageError as exc:
            raise UsageError(f"%%distributed: {exc}") from None
        if args.quiet and args.all_output:
            raise UsageError("%%distributed: use --quiet or --all-output, not both")
        session = default_session()
        auto_on = auto.is_on(self.shell)
        if not session.running:
            raise UsageError(NO_CLUSTER + (" " + AUTO_NO_CLUSTER if auto_on else ""))
        if args.tune is not None:
            return self._tune_cell(session, args, cell)
        # Flags not given are None: the session's defaults (a profile's training section) apply.
        output = "quiet" if args.quiet else ("all" if args.all_output else None)
        try:
            options = CellOptions(ranks=args.ranks, timeout=args.timeout, name=args.name,
                                  stall_after=args.stall_after)
            selected = parse_ranks(options.ranks, session.world_size)
        except OptionError as exc:  # bad --ranks / --timeout values
            raise UsageError(f"%%distributed: {exc}") from None
        # The %%distributed line is the editor's line 1: the cell's code starts on line 2,
        # unless auto mode put that line there, above the editor's line 1.
        first_line = 2
        if auto_on:  # the indicator: no cell leaves the kernel unannounced
            print(AUTO_ON.format(ranks=fmt_ranks(selected)), flush=True)
            if auto.sent_by_auto_mode(self.shell, cell):
                first_line = 1
        return session.run_cell(cell, ranks=options.ranks, timeout=options.timeout,
                                output=output, telemetry=False if args.no_telemetry else None,
                                time_collectives=False if args.no_collective_timing else None,
                                first_line=first_line,
                                execution_count=prompt_number(self.shell),
                                name=options.name, stall_after=options.stall_after,
                                bucket_timing=True if args.bucket_timing else None)

    def _tune_cell(self, session: Session, args: argparse.Namespace, cell: str) -> Any:
        """``%%distributed --tune [STEPS]``: the trials' table (a DataFrame with pandas)."""
        given = [flag for flag, on in (("--ranks", args.ranks), ("--name", args.name),
                                       ("--no-telemetry", args.no_telemetry),
                                       ("--all-output", args.all_output)) if on]
        if given:
            raise UsageError("%%distributed: " + TUNE_FLAGS.format(flags=", ".join(given)))
        try:
            CellOptions(timeout=args.timeout, stall_after=args.stall_after)
            result = session.tune(cell, args.tune, timeout=args.timeout,
                                  time_collectives=False if args.no_collective_timing else None,
                                  bucket_timing=True if args.bucket_timing else None,
                                  stall_after=args.stall_after, first_line=2,
                                  execution_count=prompt_number(self.shell), quiet=args.quiet)
        except OptionError as exc:
            raise UsageError(f"%%distributed: {exc}") from None
        try:
            return result.to_pandas()
        except ImportError:
            return result

    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """Run this cell in the notebook's own kernel, also while auto mode is on.

        With ``%load_ext nbdist`` a cell that starts with ``%%local`` runs as if the line were
        not there (IPython syntax, display of the last value and errors as usual); this magic
        answers only when ``%%local`` is called some other way.
        """
        if line.strip():
            raise UsageError("%%local takes no options")
        t = auto.transformer(self.shell)
        assert t is not None
        was, t.enabled = t.enabled, False
        try:
            result = self.shell.run_cell(cell, store_history=False)
        finally:
            t.enabled = was
        result.raise_error()  # so that "Run All" stops here too


def _say(message: str) -> None:
    """One progress line for work that takes seconds; the result table follows it."""
    print(f"nbdist: {message}", flush=True)


NbdistMagics.nbdist.__doc__ = (
    "Manage nbdist's cluster of warm workers.\n\n"
    "Examples::\n\n"
    "    %nbdist start -n 2                 # local cluster, gloo on CPU / nccl on GPUs\n"
    "    %nbdist start --profile gpu.yaml   # the cluster a profile describes (-n etc. win)\n"
    "    %nbdist connect --ipp-profile mpi  # an ipcluster started by SSH/MPI/Slurm launchers\n"
    "    %nbdist connect --engine dask tls://sched:8786 --tls-ca-file ca.pem --tls-cert me.pem\n"
    "    %nbdist status\n"
    "    %nbdist push lr epochs\n"
    "    %nbdist pull model --rank 0\n"
    "    %nbdist run train.py --epochs 3    # a torchrun script, unchanged\n"
    "    %nbdist scale 4\n"
    "    %nbdist cluster                    # worker table with a Scale control\n"
    "    %nbdist timeline run.json          # last run as a Chrome/Perfetto trace\n"
    "    %nbdist auto on                    # every cell runs on the ranks (%%local: here)\n"
    "    %nbdist export train.py            # the cells so far as a torchrun script\n"
    "    %nbdist profile save my.yaml       # this session's options as a profile\n"
    "    %nbdist compare                    # runs named with %%distributed --name, side by side\n"
    "    %nbdist debug 1                    # pdb on the frame where rank 1's last cell failed\n"
    "    %nbdist kill 1 --after 3           # SIGKILL rank 1's worker 3 s into the next cell\n"
    "    %nbdist hang 1 --seconds 30        # rank 1 holds at its next collective for 30 s\n"
    "    %nbdist tune show                  # the DDP setting %%distributed --tune chose\n"
    "    %nbdist attach                     # the NBDIST_ATTACH line for jobs started elsewhere\n"
    "    %nbdist jobs                       # the jobs watched; %nbdist job 1 show\n"
    "    %nbdist job 1 stacks --rank 1      # rank 1's Python stack now\n"
    "    %nbdist stop\n\n"
    + _PARSER.format_help()
    + "".join(f"\n%nbdist {name}:\n{sub.format_help()}" for name, sub in _VERBS.items())
)
