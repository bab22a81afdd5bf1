"""IPython extension hooks: ``%load_ext nbdist`` registers the magics once."""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    from .magics import NbdistMagics

    # register_magics replaces same-named magics, so loading twice is harmless.
    ipython.register_magics(NbdistMagics)


def unload_ipython_extension(ipython: Any) -> None:
    mm = ipython.magics_manager
    mm.magics["line"].pop("nbdist", None)
    mm.magics["cell"].pop("distributed", None)
