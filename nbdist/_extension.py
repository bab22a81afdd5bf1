"""IPython extension hooks: ``%load_ext nbdist`` registers the magics once."""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    import nbdist.magics.automode as auto

    from .magics import NbdistMagics

    # register_magics replaces same-named magics, and the auto-mode transformer is installed
    # once per shell, so loading twice is harmless.
    ipython.register_magics(NbdistMagics)
    auto.transformer(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    import nbdist.magics.automode as auto

    mm = ipython.magics_manager
    mm.magics["line"].pop("nbdist", None)
    mm.magics["cell"].pop("distributed", None)
    mm.magics["cell"].pop("local", None)
    auto.uninstall(ipython)
