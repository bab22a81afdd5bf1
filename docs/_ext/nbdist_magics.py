"""Sphinx directive ``nbdist-magics``: the magics' reference, read from the code's own parsers.

Every verb of ``%nbdist`` (``nbdist.magics._PARSER`` / ``_VERBS``), the options of
``%%distributed`` (its ``magic_arguments`` parser) and the docstrings of the cell magics are
turned into document nodes at build time, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import inspect
import re
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _usage(parser: argparse.ArgumentParser, prefix: str) -> str:
    """argparse's usage line, with the magic's own spelling (``%nbdist start ...``)."""
    # IPython's formatter writes "::\n\n  %prog ..." (reST), argparse's "usage: prog ..."
    text = " ".join(parser.format_usage().split())
    text = re.sub(r"^(usage:|::)\s*%?", "", text)
    text = text[len(parser.prog):] if text.startswith(parser.prog) else text
    text = text[len(parser.prog) - 1:] if text.startswith(parser.prog[1:]) else text
    text = text.replace(" [-h]", "")
    return f"{prefix}{text}"


def _option_items(parser: argparse.ArgumentParser) -> list[nodes.list_item]:
    """One list item per option or argument: its spelling, choices/default, help."""
    items = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) \
                or action.help == argparse.SUPPRESS:  # an old spelling kept working
            continue
        choices = "{" + ",".join(str(c) for c in action.choices) + "}" if action.choices \
            else None
        value = action.metavar or choices or action.dest.upper()
        if action.option_strings:
            spelling = ", ".join(action.option_strings)
            if action.nargs != 0:
                spelling += f" {value}"
        else:
            spelling = action.metavar or choices or action.dest
            if action.nargs in ("?",):
                spelling = f"[{spelling}]"
            elif action.nargs in ("+", "*", argparse.REMAINDER):
                spelling += " ..."
        para = nodes.paragraph()
        para += nodes.literal(spelling, spelling)
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog}
        if (action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
                and action.option_strings and "default" not in help_text):
            help_text += f" (default {action.default})"
        text = " — " + help_text if help_text else ""
        para += nodes.Text(text)
        item = nodes.list_item()
        item += para
        items.append(item)
    return items


def _paragraphs(doc: str) -> list[nodes.Node]:
    """A docstring as paragraphs (double backticks become literals)."""
    out: list[nodes.Node] = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc or "")):
        para = nodes.paragraph()
        for i, piece in enumerate(re.split(r"``(.+?)``", " ".join(block.split()))):
            para += nodes.literal(piece, piece) if i % 2 else nodes.Text(piece)
        out.append(para)
    return out


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=2)
    table += group
    for width in (25, 75):
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    body = nodes.tbody()
    group += body
    for target, cells in ((head, [header]), (body, rows)):
        for first, second in cells:
            row = nodes.row()
            for i, value in enumerate((first, second)):
                entry = nodes.entry()
                para = nodes.paragraph()
                para += nodes.literal(value, value) if (target is body and i == 0) \
                    else nodes.Text(value)
                entry += para
                row += entry
            target += row
    return table


class MagicsReference(SphinxDirective):
    """``.. nbdist-magics::`` (in MyST: a ``{nbdist-magics}`` fence)."""

    has_content = False

    def _entry(self, name: str, anchor: str, doc: str, parser: Any,
               prefix: str) -> list[nodes.Node]:
        target = nodes.target("", "", ids=[anchor])
        rubric = nodes.rubric(name, "")
        rubric += nodes.literal(name, name)
        out: list[nodes.Node] = [target, rubric, *_paragraphs(doc)]
        if parser is not None:
            usage = _usage(parser, prefix)
            out.append(nodes.literal_block(usage, usage))
            items = _option_items(parser)
            if items:
                lst = nodes.bullet_list()
                for item in items:
                    lst += item
                out.append(lst)
        return out

    def run(self) -> list[nodes.Node]:
        from nbdist.magics import _VERBS, NbdistMagics

        verbs = _VERBS
        out: list[nodes.Node] = []
        out += _paragraphs("Every verb of the ``%nbdist`` line magic (``%nbdist VERB ...``):")
        out.append(_table(("verb", "what it does"),
                          [(f"%nbdist {n}", p.description or _help_of(n)) for n, p in
                           verbs.items()]))
        for name, sub in verbs.items():
            out += self._entry(f"%nbdist {name}", f"nbdist-{name}", _help_of(name), sub,
                               f"%nbdist {name}")
        # magic_arguments keeps the magic's own docstring as its parser's description
        parser = NbdistMagics.distributed.parser
        out += self._entry("%%distributed", "distributed", parser.description or "", parser,
                           "%%distributed")
        out += self._entry("%%local", "local", NbdistMagics.local.__doc__ or "", None, "")
        return out


def _help_of(verb: str) -> str:
    """The help text a verb was registered with (what ``%nbdist -h`` lists)."""
    from nbdist.magics import _PARSER

    for action in _PARSER._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == verb:
                    return choice.help or ""
    return ""


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("nbdist-magics", MagicsReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
