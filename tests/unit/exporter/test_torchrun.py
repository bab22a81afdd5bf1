"""The torchrun script made from the session's record, without processes: the script is run
here by exec with torchrun's environment and a stand-in for torch.distributed. (The record
itself: ``test_history.py``.)"""

from __future__ import annotations

import ast
import os
import sys
import types
from fractions import Fraction

import pytest

from nbdist.errors import ExportError
from nbdist.exporter.history import CellEntry, History, PushEntry
from nbdist.exporter.torchrun import JobShape, data_name, launch_command, render, write
from nbdist.options import ClusterOptions, LaunchOptions
from nbdist.runtime.env import RankPlan

SHAPE = JobShape(world_size=2, nproc_per_node=2)


class FakeDevice:
    def __init__(self, kind: str, index: int | None = None) -> None:
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return self.type


def run_script(text: str, rank: int, world: int = 2, data: bytes | None = None,
               tmp_path=None) -> dict:
    """Execute an exported script as rank ``rank`` of ``world`` in this process, with
    torchrun's environment and a stand-in for torch (the unit tests never load torch)."""
    calls: list[tuple] = []
    dist = types.ModuleType("torch.distributed")
    dist.init_process_group = lambda *a, **k: calls.append(("init", a, k))
    dist.destroy_process_group = lambda: calls.append(("destroy",))
    dist.barrier = lambda: calls.append(("barrier",))
    torch = types.ModuleType("torch")
    torch.distributed = dist
    torch.device = FakeDevice
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)
    torch.set_num_threads = lambda n: calls.append(("threads", n))
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_mods = {k: sys.modules.get(k) for k in ("torch", "torch.distributed")}
    os.environ.update(env)
    sys.modules.update({"torch": torch, "torch.distributed": dist})
    script = tmp_path / "train.py"
    script.write_text(text)
    if data is not None:
        (tmp_path / data_name(str(script))).write_bytes(data)
    ns = {"__name__": "__main__", "__file__": str(script)}
    try:
        exec(compile(text, str(script), "exec"), ns)
    finally:
        for k, mod in saved_mods.items():
            if mod is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = mod
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ns["_calls"] = calls
    return ns


def test_the_script_sets_up_what_a_cell_had_and_runs_the_cells_in_order(tmp_path):
    h = History()
    h.push({"lr": 0.5, "w": Fraction(3, 2)})
    h.cell(1, "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
              "acc = [('lr', lr)]")
    h.push({"unused": 1})
    h.cell(2, "acc.append(('w', w * 2, rank, world_size, str(device)))")
    h.cell(4, "acc.append(('only', rank))", ranks=(1,))
    out = render(h.entries, SHAPE, str(tmp_path / "train.py"), version="9.9")
    assert out.command == "torchrun --nproc_per_node=2 train.py"
    assert out.cells == 3 and out.pushes == 1 and out.data is not None
    assert "no cell below mentions these names, left out" in out.script
    for rank in (0, 1):
        ns = run_script(out.script, rank, data=out.data, tmp_path=tmp_path)
        expected = [("lr", 0.5), ("w", 3, rank, 2, "cpu")] + ([("only", 1)] if rank else [])
        assert ns["acc"] == expected
        assert (ns["rank"], ns["local_rank"], ns["world_size"]) == (rank, rank, 2)
        # the cell's own init is a comment; the script forms the group once and ends it
        assert [c[0] for c in ns["_calls"]] == ["threads", "init", "barrier", "destroy"]
        assert ns["_calls"][1][1] == ("gloo",)


def test_header_gives_the_launch_command_and_the_script_parses(tmp_path):
    h = History()
    h.cell(1, "x = 1")
    out = render(h.entries, SHAPE, "job.py", version="1.2")
    assert out.script.startswith("# Exported by nbdist 1.2 on ")
    assert "#     torchrun --nproc_per_node=2 job.py" in out.script
    assert out.data is None and "pickle" not in out.script
    ast.parse(out.script)


def test_multi_host_command():
    shape = JobShape(world_size=8, nproc_per_node=4, nnodes=2)
    assert launch_command(shape, "t.py") == (
        "torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d "
        "--rdzv-endpoint=HOST0:29500 t.py")


def test_partial_rank_cells_keep_multiline_strings_intact(tmp_path):
    h = History()
    h.cell(1, 'text = """a\n  b\nc"""\nif True:\n    n = len(text)', ranks=(0,))
    out = render(h.entries, SHAPE, "t.py")
    ns = run_script(out.script, 0, tmp_path=tmp_path)
    assert ns["text"] == "a\n  b\nc" and ns["n"] == 7
    assert "text" not in run_script(out.script, 1, tmp_path=tmp_path)


def test_future_imports_move_to_the_top(tmp_path):
    h = History()
    h.cell(1, "from __future__ import annotations\ndef f(x: Undefined) -> None: ...")
    out = render(h.entries, SHAPE, "t.py")
    assert out.script.index("from __future__ import annotations") < out.script.index(
        "import os")
    run_script(out.script, 0, tmp_path=tmp_path)


def test_nothing_to_export():
    h = History()
    h.push({"x": 1})
    with pytest.raises(ExportError, match="no %%distributed cell has run successfully"):
        render(h.entries, SHAPE, "t.py")


def test_dropped_values_stop_the_script_where_they_were_needed():
    entries = [PushEntry(("big",), {}, None, ("big",)), CellEntry(1, "big.sum()")]
    out = render(entries, SHAPE, "t.py")
    assert out.left_out == ("pushed value 'big' (too large to keep; the script stops there)",)
    assert "raise SystemExit('big'" in out.script


def test_profile_environment_working_dir_and_threads(tmp_path):
    shape = JobShape(2, 2, device="cpu", threads=1, env={"MY_FLAG": "on"},
                     working_dir=str(tmp_path))
    h = History()
    h.cell(1, "import os\nseen = (os.environ['MY_FLAG'], os.getcwd())")
    out = render(h.entries, shape, "t.py")
    before = os.getcwd()
    try:
        ns = run_script(out.script, 0, tmp_path=tmp_path)
    finally:
        os.chdir(before)
        os.environ.pop("MY_FLAG", None)
    assert ns["seen"] == ("on", str(tmp_path))
    assert ("threads", 1) in ns["_calls"]


def test_slurm_profile_adds_an_sbatch_file():
    launch = LaunchOptions(launcher="slurm", listen="*", queue="gpu", account="proj",
                           walltime="01:00:00", gpus=1, cpus=4)
    shape = JobShape(8, 4, nnodes=2, device="cuda", env={"NCCL_DEBUG": "WARN"},
                     launch=launch, profile="slurm.yaml")
    h = History()
    h.cell(1, "x = 1")
    text = render(h.entries, shape, "train.py").script
    for line in ("#SBATCH --nodes=2", "#SBATCH --gres=gpu:4", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=01:00:00",
                 "export NCCL_DEBUG=WARN", "--nproc_per_node=4", "as in the profile slurm.yaml"):
        assert line in text


def test_kubernetes_profile_adds_a_pytorchjob():
    import yaml

    launch = LaunchOptions(launcher="kubernetes", image="reg/img:1", gpus=1)
    shape = JobShape(4, 2, nnodes=2, launch=launch, profile="k8s.yaml", env={"A": "1"})
    h = History()
    h.cell(1, "x = 1")
    text = render(h.entries, shape, "train.py").script
    lines = text.splitlines()
    start = lines.index("#     apiVersion: kubeflow.org/v1")
    manifest = []
    for line in lines[start:]:
        if not line.startswith("#     "):
            break
        manifest.append(line[6:])
    job = yaml.safe_load("\n".join(manifest))
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"] == "2"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/img:1" and container["command"] == ["torchrun",
                                                                          "train.py"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"


def plan(rank: int) -> RankPlan:
    return RankPlan(worker_id=rank, hostname="h", rank=rank, local_rank=rank, world_size=2,
                    local_world_size=2, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                    threads=1, gpu=None)


def test_write_keeps_files_it_did_not_write(tmp_path):
    h = History()
    h.push({"t": bytearray(b"data")})
    h.cell(1, "u = t")
    mine = tmp_path / "train.py"
    mine.write_text("my own training script\n")
    with pytest.raises(ExportError, match="not an earlier nbdist export"):
        write(str(mine), h.entries, [plan(0), plan(1)], ClusterOptions())
    assert mine.read_text() == "my own training script\n"
    out = write(str(mine), h.entries, [plan(0), plan(1)], ClusterOptions(), force=True)
    assert out.data_path == str(tmp_path / "train.data.pkl")
    assert "1 cell(s), 1 push(es); pushed data in" in out.summary()
    # an earlier export is overwritten, and its data file goes when no longer needed
    h2 = History()
    h2.cell(1, "v = 2")
    again = write(str(mine), h2.entries, [plan(0), plan(1)], ClusterOptions())
    assert again.data_path is None and not (tmp_path / "train.data.pkl").exists()


def test_no_public_function_shares_its_name_with_a_submodule():
    # Importing a submodule binds it to the package's attribute of that name: nbdist.export()
    # would become a module after its first call (when export.py was nbdist/export.py).
    import pkgutil

    import nbdist

    modules = {m.name for m in pkgutil.iter_modules(nbdist.__path__)}
    functions = {n for n in nbdist.__all__ if callable(getattr(nbdist, n))}
    assert functions & modules == set(), functions & modules
