"""Engine adapters, chosen by short name. Each wraps an existing distributed system.

The package itself imports nothing: workers import their engine's worker half from it
(:mod:`.dask_runner`, :mod:`.ipp_events`) without the notebook's side of the adapters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Backend


def get_backend(engine: str) -> Backend:
    """A fresh, unconnected backend for ``engine`` (``"ipyparallel"`` or ``"dask"``)."""
    from ..options import ENGINES, check_choice

    check_choice(engine, ENGINES, "engine")
    if engine == "dask":
        try:
            from .dask.adapter import DaskBackend
        except ImportError as exc:
            raise ImportError(
                f"the dask engine needs the `distributed` package ({exc}); "
                "install it with: pip install 'nbdist[dask]'"
            ) from None
        return DaskBackend()
    from .ipyparallel.adapter import IpyparallelBackend

    return IpyparallelBackend()
