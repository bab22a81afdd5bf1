"""Engine adapters, chosen by short name. Each wraps an existing distributed system."""

from __future__ import annotations

from ..options import ENGINES, check_choice
from .base import Backend


def get_backend(engine: str) -> Backend:
    """A fresh, unconnected backend for ``engine`` (``"ipyparallel"`` or ``"dask"``)."""
    check_choice(engine, ENGINES, "engine")
    if engine == "dask":
        try:
            from .dask import DaskBackend
        except ImportError as exc:
            raise ImportError(
                f"the dask engine needs the `distributed` package ({exc}); "
                "install it with: pip install 'nbdist[dask]'"
            ) from None
        return DaskBackend()
    from .ipyparallel import IpyparallelBackend

    return IpyparallelBackend()
