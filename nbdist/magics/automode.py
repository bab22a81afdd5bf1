"""Auto mode: while on, every code cell runs on the ranks as if it began with ``%%distributed``.

It is an IPython input transformer (``shell.input_transformers_cleanup``), the documented hook
for rewriting a cell's text before IPython parses it, so nothing of IPython is patched:

* auto mode on: a cell that does not start with IPython syntax (``%`` / ``%%`` magics, ``!``
  shell commands, ``name?`` help) gets ``%%distributed`` put in front of it;
* always (while the extension is loaded): a cell that starts with ``%%local`` runs in the
  kernel, as written; the ``%%local`` line becomes a blank line, so line numbers still match
  the editor.

Like ipyparallel's ``%autopx``, but a transformer rather than a replaced ``run_cell``.
"""

from __future__ import annotations

from typing import Any, Optional

#: the cell magic that keeps a cell in the kernel while auto mode is on
LOCAL = "%%local"


def _first_code_line(lines: list[str]) -> Optional[int]:
    """Index of the first line that is neither blank nor a comment (None: the cell has none)."""
    for i, line in enumerate(lines):
        text = line.strip()
        if text and not text.startswith("#"):
            return i
    return None


def _is_local_magic(line: str) -> bool:
    word = line.strip().split(maxsplit=1)
    return bool(word) and word[0] == LOCAL


class AutoMode:
    """The transformer; one per shell, installed by ``%load_ext nbdist``.

    ``enabled`` is the whole of auto mode's state: it lives on the transformer the shell holds.
    """

    # IPython's check_complete (a terminal deciding whether Enter runs the cell) skips
    # transformers that say so; otherwise every line typed would look like a finished cell magic.
    has_side_effects = True

    def __init__(self) -> None:
        self.enabled = False
        #: the last cell this transformer sent to the ranks, until ``%%distributed`` runs it
        self.sent: Optional[str] = None

    def __call__(self, lines: list[str]) -> list[str]:
        self.sent = None
        first = _first_code_line(lines)
        if first is None:
            return lines
        line = lines[first]
        if _is_local_magic(line):
            if line.strip() != LOCAL:  # options would be silently ignored: say so instead
                return ["raise SyntaxError('%%local takes no options')\n"]
            rest = lines[first + 1:]
            if rest and rest[0].startswith("%%"):  # another cell magic must stay first
                return lines[:first] + rest
            return [*lines[:first], "\n", *rest]
        if not self.enabled or _stays_in_kernel(lines, first):
            return lines
        self.sent = "".join(lines)
        return ["%%distributed\n", *lines]

    def __repr__(self) -> str:
        return f"<nbdist auto mode: {'on' if self.enabled else 'off'}>"


def _stays_in_kernel(lines: list[str], first: int) -> bool:
    """Cells written for the kernel: magics, shell commands, a one-line ``name?`` help."""
    text = lines[first].lstrip()
    if text.startswith(("%", "!")):
        return True
    code = [ln for ln in lines[first:] if ln.strip() and not ln.strip().startswith("#")]
    return len(code) == 1 and text.rstrip().endswith("?")


def transformer(shell: Any, install: bool = True) -> Optional[AutoMode]:
    """The shell's :class:`AutoMode` transformer, installed first if ``install``."""
    for t in shell.input_transformers_cleanup:
        if isinstance(t, AutoMode):
            return t
    if not install:
        return None
    t = AutoMode()
    shell.input_transformers_cleanup.append(t)
    return t


def uninstall(shell: Any) -> None:
    """Remove the transformer (``%unload_ext nbdist``)."""
    shell.input_transformers_cleanup[:] = [
        t for t in shell.input_transformers_cleanup if not isinstance(t, AutoMode)]


def is_on(shell: Any) -> bool:
    """True while auto mode is on in ``shell``."""
    t = transformer(shell, install=False)
    return t is not None and t.enabled


def sent_by_auto_mode(shell: Any, cell: str) -> bool:
    """True if ``cell`` is the cell auto mode just sent to ``%%distributed`` (whose first line
    is then the editor's first line, not the line after ``%%distributed``)."""
    t = transformer(shell, install=False)
    if t is None or t.sent is None:
        return False
    sent, t.sent = t.sent, None
    return sent == cell


def set_auto(shell: Any, on: bool) -> bool:
    """Switch auto mode on or off in ``shell``; return whether it was on before."""
    t = transformer(shell)
    assert t is not None
    was, t.enabled = t.enabled, bool(on)
    return was
