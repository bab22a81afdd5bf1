"""What the tests of watched jobs share: the start-up hook, installed as a user's install
would have it."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def site_dir(tmp_path):
    """A site directory holding the hook as installed, and a sitecustomize that adds it (this
    checkout is an editable install, which has no hook)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "nbdist-attach.pth").write_bytes((REPO / "nbdist-attach.pth").read_bytes())
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    return site
