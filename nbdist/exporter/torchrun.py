"""``%nbdist export``: the session's cells as a script that runs unchanged under torchrun.

:func:`render` is pure: it turns the session's :class:`~nbdist.exporter.history.History` and the
job's shape into the script's text and its data file (the pushed values that are not literals). The
script sets up what a cell had (``rank``, ``local_rank``, ``world_size``, ``device``, the
default process group from torchrun's environment, nbdist's thread rule), then runs the cells
in order, with the pushes they read where they happened.
"""

from __future__ import annotations

import ast
import datetime
import io
import os
import pickle
import tokenize
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from ..errors import ExportError
from ..options import ClusterOptions, LaunchOptions
from .history import CellEntry, Entry, PushEntry, covers

if TYPE_CHECKING:
    from ..runtime.env import RankPlan

#: the first line of every exported script; a file without it is never overwritten
MARKER = "# Exported by nbdist"
#: torchrun's rendezvous port in the multi-host commands
RDZV_PORT = 29500


@dataclass(frozen=True)
class JobShape:
    """The job the cells ran in, as the launch command must reproduce it."""

    world_size: int
    nproc_per_node: int
    nnodes: int = 1
    device: str = "auto"
    dist_backend: str = "auto"
    threads: Optional[int] = None
    timeout: float = 300.0
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: Optional[str] = None
    #: the profile's launcher settings, for a batch-system snippet (None: no profile)
    launch: Optional[LaunchOptions] = None
    profile: Optional[str] = None


@dataclass(frozen=True)
class Export:
    """What :func:`render` produced, and what the user should be told about it."""

    script: str
    data: Optional[bytes]
    command: str
    cells: int
    pushes: int
    #: things that could not be carried over, one line each
    left_out: tuple[str, ...] = ()
    #: where :func:`write` put the script and the data file
    path: str = ""
    data_path: Optional[str] = None
    #: ``NBDIST_ATTACH=...`` of the notebook's collector where ``%nbdist attach`` runs one
    attach: Optional[str] = None
    #: launch it watched through ``-m nbdist.agent``: this environment has no start-up hook
    #: (an editable install), so a plain launch would report nothing
    agent: bool = False

    def summary(self) -> str:
        """One paragraph for the notebook: what was written, how to launch it, and how to
        launch it watched from this notebook (``docs/attach.md``)."""
        data = f"; pushed data in {self.data_path}" if self.data_path else ""
        text = (f"wrote {self.path or 'the script'}: {self.cells} cell(s), {self.pushes} "
                f"push(es){data}. Launch: {self.command}")
        for line in self.left_out:
            text += f"\nnot carried over: {line}"
        if self.attach and self.agent:
            launcher, _, script = self.command.rpartition(" ")
            text += (f"\nWatched from this notebook (%nbdist jobs; no start-up hook here, so "
                     f"through the agent): {self.attach} {launcher} -m nbdist.agent {script}")
        elif self.attach:
            text += f"\nWatched from this notebook (%nbdist jobs): {self.attach} {self.command}"
        else:
            text += ("\nTo watch it from this notebook: run %nbdist attach here, then launch "
                     "it with the NBDIST_ATTACH=... line it prints in the job's environment "
                     "(docs/attach.md)")
        return text

    def __repr__(self) -> str:
        return f"<nbdist.Export {self.path or '(not written)'}: {self.cells} cells; " \
               f"{self.command}>"


def data_name(script_path: str) -> str:
    """The data file that goes with ``script_path``: ``train.py`` -> ``train.data.pkl``."""
    stem, _ = os.path.splitext(os.path.basename(script_path))
    return f"{stem}.data.pkl"


def render(entries: Sequence[Entry], shape: JobShape, script_path: str,
           version: str = "", now: Optional[datetime.datetime] = None,
           forgotten: int = 0) -> Export:
    """The script (and data) reproducing ``entries`` under ``torchrun`` (``forgotten``: the
    cells before them the record no longer keeps, named in the script and in ``left_out``).

    Raises :class:`~nbdist.errors.ExportError` when no cell ran successfully.
    """
    cells = [e for e in entries if isinstance(e, CellEntry)]
    if not cells:
        raise ExportError("nothing to export: no %%distributed cell has run successfully since "
                          "the process group formed (start, restart and scale form it anew)")
    script = os.path.basename(script_path)
    futures: list[str] = []
    body: list[str] = []
    blobs: dict[int, bytes] = {}
    left_out: list[str] = []
    if forgotten:
        gone = (f"the first {forgotten} cell{'s' * (forgotten != 1)} since the group formed "
                f"(the record keeps the latest {len(cells)})")
        body += [f"# ---- not kept: {gone}", ""]
        left_out.append(gone)
    pushes = 0
    for i, entry in enumerate(entries):
        if isinstance(entry, CellEntry):
            body += _cell_block(entry, futures)
            continue
        later = _mentioned(e.source for e in entries[i + 1:] if isinstance(e, CellEntry))
        used = [n for n in entry.names if n in later and _read_before_replaced(entries, i, n)]
        if not used:
            body += [f"# %nbdist push {' '.join(entry.names)}: no cell below mentions these "
                     "names, left out", ""]
            continue
        pushes += 1
        block, blob = _push_block(entry, used, len(blobs))
        if blob is not None:
            blobs[len(blobs)] = blob
        body += block
        left_out += [f"pushed value {n!r} ({entry.reason(n)}; the script stops there)"
                     for n in entry.dropped if n in used]
    command = launch_command(shape, script)
    head = _header(shape, script, command, version, now or datetime.datetime.now(),
                   uses_nbdist="nbdist" in _mentioned(c.source for c in cells))
    data = pickle.dumps(blobs, protocol=pickle.HIGHEST_PROTOCOL) if blobs else None
    text = "\n".join(head + sorted(set(futures)) + [""] * bool(futures)
                     + _preamble(shape, data_name(script) if data else None) + body
                     + _epilogue()) + "\n"
    ast.parse(text, script)  # a bug here must not hand the user a broken script
    return Export(text, data, command, len(cells), pushes, tuple(left_out))


def write(path: str, entries: Sequence[Entry], plans: Sequence[RankPlan],
          options: ClusterOptions, profile: Optional[str] = None, *, version: str = "",
          force: bool = False, forgotten: int = 0) -> Export:
    """Render the session's record and write the script (and its data file) at ``path``
    (``forgotten``: as :func:`render` takes it).

    A file that is not an earlier export is kept unless ``force``.
    """
    shape = JobShape(
        world_size=len(plans), nproc_per_node=max(p.local_world_size for p in plans),
        nnodes=plans[0].num_nodes, device=options.device, dist_backend=options.dist_backend,
        threads=options.threads, timeout=options.timeout, env=dict(options.env),
        working_dir=options.working_dir, launch=options.launch,
        profile=os.path.basename(profile) if profile else None)
    out = render(entries, shape, path, version=version, forgotten=forgotten)
    data_path = os.path.join(os.path.dirname(path), data_name(path))
    if not force:
        for target in (path, data_path):
            if os.path.exists(target) and not _ours(path):
                raise ExportError(f"{target} exists and is not an earlier nbdist export: "
                                  "choose another name, or pass --force to overwrite it")
    with open(path, "w", encoding="utf-8") as f:
        f.write(out.script)
    if out.data is not None:
        with open(data_path, "wb") as f:
            f.write(out.data)
    elif os.path.exists(data_path):
        os.remove(data_path)  # an earlier export's data; this script does not read it
    return replace(out, path=path, data_path=data_path if out.data is not None else None)


def _ours(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(MARKER)
    except (OSError, UnicodeDecodeError):
        return False


# ------------------------------------------------------------------------------ commands
def launch_command(shape: JobShape, script: str) -> str:
    """The torchrun command that starts the job the notebook ran."""
    if shape.nnodes <= 1:
        return f"torchrun --nproc_per_node={shape.nproc_per_node} {script}"
    return (f"torchrun --nnodes={shape.nnodes} --nproc_per_node={shape.nproc_per_node} "
            f"--rdzv-backend=c10d --rdzv-endpoint=HOST0:{RDZV_PORT} {script}")


def sbatch_snippet(shape: JobShape, script: str) -> list[str]:
    """An sbatch file that runs the script on the Slurm resources of the profile."""
    launch = shape.launch or LaunchOptions()
    lines = ["#!/bin/bash", f"#SBATCH --job-name={os.path.splitext(script)[0]}",
             f"#SBATCH --nodes={shape.nnodes}", "#SBATCH --ntasks-per-node=1"]
    if launch.cpus:
        lines.append(f"#SBATCH --cpus-per-task={launch.cpus * shape.nproc_per_node}")
    if launch.gpus:
        lines.append(f"#SBATCH --gres=gpu:{launch.gpus * shape.nproc_per_node}")
    for flag, value in (("partition", launch.queue), ("account", launch.account),
                        ("time", launch.walltime)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [f"export {k}={_shell_quote(v)}" for k, v in shape.env.items()]
    if shape.working_dir:
        lines.append(f"cd {_shell_quote(shape.working_dir)}")
    lines += ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f'srun torchrun --nnodes="$SLURM_NNODES" --nproc_per_node={shape.nproc_per_node}'
              f' --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d '
              f'--rdzv-endpoint="$head:{RDZV_PORT}" {script}']
    return lines


def kubernetes_snippet(shape: JobShape, script: str) -> list[str]:
    """A Kubeflow PyTorchJob that runs the script (the operator sets torchrun's variables)."""
    launch = shape.launch or LaunchOptions()
    name = os.path.splitext(script)[0].replace("_", "-").lower()
    image = launch.image or "YOUR-IMAGE-WITH-TORCH"

    def replica(kind: str, count: int) -> list[str]:
        out = [f"    {kind}:", f"      replicas: {count}", "      restartPolicy: OnFailure",
               "      template:", "        spec:", "          containers:",
               "          - name: pytorch", f"            image: {image}",
               f'            command: ["torchrun", "{script}"]']
        if shape.working_dir:
            out.append(f"            workingDir: {shape.working_dir}")
        if shape.env:
            out.append("            env:")
            out += [f"            - {{name: {k}, value: {_yaml_quote(v)}}}"
                    for k, v in shape.env.items()]
        if launch.gpus:
            out.append(f'            resources: {{limits: {{nvidia.com/gpu: '
                       f'"{launch.gpus * shape.nproc_per_node}"}}}}')
        return out

    lines = ["apiVersion: kubeflow.org/v1", "kind: PyTorchJob", f"metadata: {{name: {name}}}",
             "spec:", f'  nprocPerNode: "{shape.nproc_per_node}"', "  pytorchReplicaSpecs:"]
    lines += replica("Master", 1)
    if shape.nnodes > 1:
        lines += replica("Worker", shape.nnodes - 1)
    return lines


def _shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _yaml_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ------------------------------------------------------------------------------ the script
def _header(shape: JobShape, script: str, command: str, version: str,
            now: datetime.datetime, uses_nbdist: bool) -> list[str]:
    hosts = f"{shape.nnodes} hosts" if shape.nnodes > 1 else "1 host"
    lines = [
        f"{MARKER} {version} on {now:%Y-%m-%d %H:%M} from a notebook session:".rstrip(),
        "# the %%distributed cells that ran successfully since the process group formed, in",
        "# order, with the values pushed to them. It needs torch"
        + (" and nbdist (whose progress and log" if uses_nbdist else "."),
        *(["# do nothing outside a notebook)."] if uses_nbdist else []),
        "#",
        f"# Launch it as the notebook ran it ({hosts}, {shape.world_size} processes):",
        f"#     {command}",
    ]
    if shape.nnodes > 1:
        lines.append("# on every host, with HOST0 the address of the first host.")
    launcher = shape.launch.launcher if shape.launch else "local"
    source = f"the profile {shape.profile}" if shape.profile else "the session's profile"
    snippet: list[str] = []
    if launcher == "slurm":
        job = f"{os.path.splitext(script)[0]}.sbatch"
        snippet = ["#", f"# With Slurm, as in {source}: save this as {job} and run "
                        f"`sbatch {job}`"]
        snippet += [f"#     {line}" for line in sbatch_snippet(shape, script)]
    elif launcher == "kubernetes":
        snippet = ["#", f"# On Kubernetes, as in {source}: a Kubeflow PyTorchJob (kubectl "
                        "apply -f job.yaml), in an image that holds this script"]
        snippet += [f"#     {line}" for line in kubernetes_snippet(shape, script)]
    return lines + snippet + [""]


def _preamble(shape: JobShape, data_file: Optional[str]) -> list[str]:
    """What nbdist set up before the first cell, from torchrun's environment."""
    lines = ["import os", ""]
    if shape.env:
        lines.append("# The profile's environment (variables already set win).")
        lines += [f"os.environ.setdefault({k!r}, {v!r})" for k, v in shape.env.items()]
        lines.append("")
    if data_file:
        lines += [
            "import pickle",
            "",
            "# Values pushed from the notebook that are not literals (pickled there).",
            "with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "
            f"{data_file!r}), 'rb') as _f:",
            "    _nbdist_pushed = pickle.load(_f)",
            "",
        ]
    if shape.working_dir:
        lines += [f"os.chdir({shape.working_dir!r})  # the profile's working_dir", ""]
    if shape.threads:
        threads = [f"torch.set_num_threads({shape.threads})  # as the notebook's workers had"]
    else:
        threads = ["# As nbdist does: the host's cores shared by the processes on it.",
                   "_cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') "
                   "else os.cpu_count() or 1",
                   "torch.set_num_threads(max(1, _cores // int(os.environ['LOCAL_WORLD_SIZE'])))"]
    fixed = {"cpu": "gloo", "cuda": "nccl"}.get(shape.device)
    if shape.dist_backend != "auto" or fixed:
        backend = repr(shape.dist_backend if shape.dist_backend != "auto" else fixed)
    else:
        backend = '"nccl" if device.type == "cuda" else "gloo"'
    device_id = {"cpu": "", "cuda": ", device_id=device"}.get(
        shape.device, ",\n" + " " * 24 + 'device_id=device if device.type == "cuda" else None')
    gpu = ["torch.cuda.set_device(local_rank % torch.cuda.device_count())",
           'device = torch.device("cuda", torch.cuda.current_device())']
    if shape.device == "cpu":
        pick = ['device = torch.device("cpu")']
    elif shape.device == "cuda":
        pick = gpu
    else:
        pick = ["if torch.cuda.is_available():  # one GPU per process, as nbdist pins them",
                *("    " + line for line in gpu), "else:", '    device = torch.device("cpu")']
    lines += [
        "import datetime",
        "",
        "import torch",
        "import torch.distributed as dist",
        "",
        "# What every %%distributed cell had: rank, local_rank, world_size, device, a group.",
        'rank = int(os.environ["RANK"])',
        'local_rank = int(os.environ["LOCAL_RANK"])',
        'world_size = int(os.environ["WORLD_SIZE"])',
        *threads,
        *pick,
        f"dist.init_process_group({backend}, "
        f"timeout=datetime.timedelta(seconds={shape.timeout:g}){device_id})",
        "",
    ]
    return lines


def _epilogue() -> list[str]:
    # The barrier first: a rank that tears its connections down while a peer still reads its
    # last message makes that peer abort (seen with gloo).
    return ["dist.barrier()", "dist.destroy_process_group()"]


def _cell_block(entry: CellEntry, futures: list[str]) -> list[str]:
    where = ("" if entry.ranks is None
             else f", on rank{'s' if len(entry.ranks) > 1 else ''} "
                  f"{', '.join(map(str, entry.ranks))} only")
    source = _translate(entry.source, futures)
    lines = [f"# ---- cell {entry.number}{where} " + "-" * 40]
    if entry.ranks is not None:
        lines.append(f"if rank in {tuple(entry.ranks)!r}:")
        lines += _indent(source or "pass", "    ").splitlines()
    else:
        lines += source.splitlines()
    return lines + [""]


def _push_block(entry: PushEntry, used: Sequence[str], index: int
                ) -> tuple[list[str], Optional[bytes]]:
    lines = [f"# ---- %nbdist push {' '.join(entry.names)} " + "-" * 30]
    body: list[str] = [f"{n} = {entry.code[n]}" for n in used if n in entry.code]
    pickled = [n for n in used if n in entry.pickled]
    blob = None
    if pickled:
        blob = entry.blob
        body.append(f"globals().update(pickle.loads(_nbdist_pushed[{index}]))  "
                    f"# {', '.join(pickled)}")
    for n in entry.dropped:
        if n in used:
            body.append(f"raise SystemExit({n!r} ' was pushed from the notebook but is not in "
                        f"the export ({entry.reason(n)}): load it here')")
    if entry.ranks is not None:
        lines.append(f"if rank in {tuple(entry.ranks)!r}:")
        lines += ["    " + line for line in body]
    else:
        lines += body
    return lines + [""], blob


def _read_before_replaced(entries: Sequence[Entry], i: int, name: str) -> bool:
    """Whether a cell after push ``entries[i]`` mentions ``name`` before a later push of the
    same name replaces its value (a value replaced before any cell read it is not needed)."""
    entry = entries[i]
    if not isinstance(entry, PushEntry) or name not in entry.dropped:
        return True  # a kept value goes in as it went to the workers
    between = []
    for e in entries[i + 1:]:
        if isinstance(e, PushEntry) and name in e.names and covers(e.ranks, entry.ranks):
            break
        if isinstance(e, CellEntry):
            between.append(e.source)
    return name in _mentioned(between)


def _mentioned(sources: Iterable[str]) -> set[str]:
    """Every name the sources mention (read, written or declared)."""
    names: set[str] = set()
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                names.update(node.names)
    return names


def _translate(source: str, futures: list[str]) -> str:
    """A cell's source as script code: future imports hoisted, and the calls that would form or
    destroy the group a second time turned into comments (the script does both once)."""
    tree = ast.parse(source)
    lines: list[Optional[str]] = list(source.splitlines())
    notes: dict[int, str] = {}
    for stmt in tree.body:
        first, last = stmt.lineno - 1, (stmt.end_lineno or stmt.lineno) - 1
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            futures.append("\n".join(str(line) for line in lines[first:last + 1]))
            for i in range(first, last + 1):
                lines[i] = None
        elif _group_call(stmt):
            for i in range(first, last + 1):
                lines[i] = f"# {lines[i]}"
            notes[first] = ("# (nbdist export: the script forms the process group once at "
                            "the top and destroys it at the end)")
    out: list[str] = []
    for i, line in enumerate(lines):
        if i in notes:
            out.append(notes[i])
        if line is not None:
            out.append(line)
    return "\n".join(out).strip("\n")


def _group_call(stmt: ast.stmt) -> bool:
    """``dist.init_process_group(...)`` or ``destroy_process_group()`` as a statement."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("init_process_group", "destroy_process_group")


def _indent(source: str, prefix: str) -> str:
    """Indent code lines, but not the inside of multi-line strings (that would change them)."""
    inside: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.start[0] < tok.end[0]:
                inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    return "\n".join(line if (i in inside or not line.strip()) else prefix + line
                     for i, line in enumerate(source.splitlines(), start=1))
