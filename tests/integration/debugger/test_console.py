"""The debugger on a rank, from a real Jupyter kernel, on both engines.

A kernel started by ``jupyter_client`` runs the magics as a notebook would and asks for input
through its stdin channel, as JupyterLab's input box does; these tests answer its input
requests line by line (nbclient cannot: a notebook run by it has no stdin, which is the
headless case, tested too). Real workers, a real gloo group, the notebook's own store.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import pytest
from clusters import ENGINES, engine_available

jupyter_client = pytest.importorskip("jupyter_client")

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[3]

Answer = Union[str, Callable[[str], Optional[str]]]  # a line, or what to do at the prompt

ALL_REDUCE = """\
%%distributed
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
t.item()
"""


@dataclass
class Reply:
    """What one cell showed: its text, the prompts it asked (in order), its result, its error."""

    text: str = ""
    prompts: list[str] = field(default_factory=list)
    result: Optional[str] = None
    ename: Optional[str] = None
    evalue: str = ""
    seconds: float = 0.0


class Kernel:
    """A kernel of this interpreter, with this checkout first on its path."""

    def __init__(self, workdir: Path) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]), NBDIST_DISPLAY="text")
        self.km.start_kernel(env=env, cwd=str(workdir))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, answers: list[Answer] = (), *, allow_stdin: bool = True,
            timeout: float = 300) -> Reply:
        """Execute ``code``; answer each input request with the next of ``answers``."""
        out, todo = Reply(), list(answers)

        def output(msg: dict) -> None:
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                out.text += content["text"]
            elif kind == "execute_result":
                out.result = content["data"].get("text/plain")
            elif kind == "error":
                out.ename, out.evalue = content["ename"], content["evalue"]
                out.text += "\n".join(content["traceback"])

        def stdin(msg: dict) -> None:
            text = msg["content"]["prompt"]
            out.prompts.append(text)
            assert todo, f"an input request nobody expected: {text!r}\n{out.text}"
            answer = todo.pop(0)
            line = answer(text) if callable(answer) else answer
            if line is not None:  # None: the test did something else (interrupted the kernel)
                self.kc.input(line)

        t0 = time.monotonic()
        reply = self.kc.execute_interactive(code, allow_stdin=allow_stdin, timeout=timeout,
                                            output_hook=output, stdin_hook=stdin)
        out.seconds = time.monotonic() - t0
        assert reply["content"]["status"] in ("ok", "error"), reply
        assert not todo, f"answers left over: {todo}\n{out.text}"
        return out

    def close(self) -> None:
        try:
            self.run("%nbdist stop", timeout=120)
        finally:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)


@pytest.fixture(scope="module", params=ENGINES)
def kernel(request, tmp_path_factory) -> Iterator[Kernel]:
    if not engine_available(request.param):
        pytest.skip(f"the {request.param} engine is not available here")
    k = Kernel(tmp_path_factory.mktemp("kernel"))
    try:
        started = k.run(f"%load_ext nbdist\n%nbdist start -n 2 --engine {request.param} "
                        "--timeout 60", timeout=300)
        assert started.ename is None, started.text
        k.run("%%distributed\nimport torch, torch.distributed as dist")
        yield k
    finally:
        k.close()


def group_works(k: Kernel) -> None:
    reply = k.run(ALL_REDUCE)
    assert reply.ename is None and reply.result == "3.0", reply.text


def test_post_mortem_prints_a_local_of_the_frame_that_failed_on_rank_1(kernel):
    failed = kernel.run(textwrap.dedent("""\
        %%distributed
        def shard_mean(values):
            total = sum(values) * (rank + 1)
            if rank == 1:
                raise ValueError(f"bad shard: {total}")
            return total / len(values)
        m = shard_mean([1.0, 2.0, 3.0])
        """))
    assert failed.ename == "DistributedError" and "bad shard: 12.0" in failed.evalue
    reply = kernel.run("%nbdist debug", ["p total", "p values", "q"])
    assert reply.ename is None, reply.text
    assert reply.prompts == ["(Pdb rank 1) "] * 3
    assert "post-mortem of rank 1: ValueError: bad shard: 12.0" in reply.text
    assert "-> raise ValueError" in reply.text
    assert "\n12.0\n" in reply.text and "[1.0, 2.0, 3.0]" in reply.text  # rank 1's locals
    group_works(kernel)
    nothing = kernel.run("%nbdist debug 0")
    assert nothing.ename == "NothingToDebug" and "rank 0 has no failure" in nothing.evalue


def test_a_breakpoint_while_rank_0_waits_in_all_reduce_is_not_a_hang_nor_a_timeout(kernel):
    def after_the_hang_doctors_floor(prompt: str) -> str:
        # The user reads the code for longer than the hang doctor's 10 s floor, longer than
        # --stall-after and longer than the cell's --timeout: none of them may end the cell.
        time.sleep(11)
        return "p x"

    cell = textwrap.dedent("""\
        %%distributed --stall-after 2 --timeout 6
        x = torch.tensor([float(rank + 1)])
        if rank == 1:
            breakpoint()
        dist.all_reduce(x)
        x.item()
        """)
    reply = kernel.run(cell, [after_the_hang_doctors_floor, "x = torch.tensor([10.0])", "c"])
    assert reply.ename is None, reply.text
    assert reply.result == "11.0"  # rank 1's assignment took part in the all_reduce
    assert reply.prompts == ["(Pdb rank 1) "] * 3 and reply.seconds > 11
    assert "rank 1 is in the debugger at In [" in reply.text and "line 5" in reply.text
    assert "-> dist.all_reduce(x)" in reply.text and "tensor([2.])" in reply.text
    assert "hang doctor: rank 1 is in the debugger (line 5)" in reply.text
    assert "no step or collective completed" not in reply.text  # never judged a hang
    group_works(kernel)


def test_q_ends_rank_1s_cell_with_debugger_quit_and_releases_rank_0(kernel):
    cell = "%%distributed\nx = torch.ones(1)\nif rank == 1:\n    breakpoint()\n" \
           "dist.all_reduce(x)\n"
    answered: list[float] = []
    reply = kernel.run(cell, [lambda prompt: answered.append(time.monotonic()) or "q"])
    assert reply.ename == "DebuggerQuit", reply.text
    assert "rank 1 quit the debugger (q)" in reply.evalue
    assert "rank 0 stopped because of it" in reply.evalue  # released from its all_reduce
    assert time.monotonic() - answered[0] < 30  # promptly, as for any error on a rank
    group_works(kernel)


def test_two_ranks_at_breakpoints_are_debugged_one_after_the_other(kernel):
    cell = "%%distributed\nt = torch.ones(1) * (rank + 1)\nbreakpoint()\ndist.all_reduce(t)\n" \
           "t.item()\n"
    reply = kernel.run(cell, ["p rank", "c", "p rank", "c"])
    assert reply.ename is None and reply.result == "3.0", reply.text
    first, second = reply.prompts[0], reply.prompts[2]
    assert reply.prompts == [first, first, second, second]
    assert {first, second} == {"(Pdb rank 0) ", "(Pdb rank 1) "}
    assert "also waits for the debugger" in reply.text


def test_input_and_a_breakpoint_on_rank_1_alone(kernel):
    reply = kernel.run("%%distributed --ranks 1\nname = input('name? ')\nname", ["ada"])
    assert reply.prompts == ["[rank 1] name? "] and reply.result == "'ada'", reply.text
    reply = kernel.run("%%distributed --ranks 1\nv = rank * 5\nbreakpoint()\nv",
                       ["p v * 2", "c"])
    assert reply.ename is None and reply.result == "5" and "\n10\n" in reply.text


def test_the_stop_button_at_a_prompt_interrupts_the_cell_on_every_rank(kernel):
    def press_stop(prompt: str) -> None:
        kernel.km.interrupt_kernel()

    cell = "%%distributed\nx = torch.ones(1)\nif rank == 1:\n    breakpoint()\n" \
           "dist.all_reduce(x)\n"
    reply = kernel.run(cell, [press_stop])
    assert reply.ename == "CellInterrupted", reply.text  # a KeyboardInterrupt
    assert "rank(s) [0, 1] were still running and were interrupted" in reply.evalue
    group_works(kernel)


def test_without_stdin_a_breakpoint_is_passed_and_debug_says_why(kernel):
    cell = "%%distributed\nx = torch.ones(1)\nfor i in range(3):\n    if rank == 1:\n" \
           "        breakpoint()\ndist.all_reduce(x)\nx.item()\n"
    reply = kernel.run(cell, allow_stdin=False, timeout=120)
    assert reply.ename is None and reply.result == "2.0", reply.text
    assert reply.text.count("passed breakpoint()") == 1  # one line, however many passes
    assert "rank 1 passed breakpoint() at In [" in reply.text and "line 5" in reply.text
    refused = kernel.run("%nbdist debug", allow_stdin=False)
    assert refused.ename == "DebuggerUnavailable" and "without a front end" in refused.evalue


def test_hang_holds_rank_1_at_its_next_collective_and_the_hang_doctor_names_it(kernel):
    said = kernel.run("%nbdist hang 1 --seconds 5")
    assert said.ename is None and "holds at its next collective for 5 s" in said.text, said.text
    reply = kernel.run("%%distributed --stall-after 2\n" + ALL_REDUCE.split("\n", 1)[1])
    assert reply.ename is None and reply.result == "3.0", reply.text  # late, but right
    assert reply.seconds > 5, reply.seconds
    # the hang doctor's verdict: rank 1 held outside the all_reduce rank 0 waits in
    assert "nbdist.runtime.faults.hang" in reply.text, reply.text
    again = kernel.run(ALL_REDUCE)  # the hold was for one collective only
    assert again.result == "3.0" and again.seconds < 5, again.text


# Last in this module: it kills a worker (then starts fresh ones).
def test_kill_fails_the_running_cell_as_a_real_failure(kernel):
    said = kernel.run("%nbdist kill 1 --after 2")
    assert said.ename is None and "2 s into the next" in said.text, said.text
    reply = kernel.run("%%distributed\nimport time\nfor _ in range(100):\n"
                       "    time.sleep(0.05)\nrank")
    assert "nbdist: sent SIGKILL to rank 1 (pid " in reply.text, reply.text
    assert reply.ename == "DistributedError", reply.text  # as for a worker that died by itself
    assert "cell failed on rank 1: WorkerError" in reply.evalue, reply.evalue
    refused = kernel.run(ALL_REDUCE)  # the worker is gone, and the next cell says so at once
    assert refused.ename == "WorkersGone" and refused.seconds < 30, refused.text
    restarted = kernel.run("%nbdist restart", timeout=300)
    assert restarted.ename is None, restarted.text
    kernel.run("%%distributed\nimport torch, torch.distributed as dist")
    group_works(kernel)
