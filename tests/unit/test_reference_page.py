"""docs/reference.md is what the code says: the magics' parsers, and the signatures and
docstrings of every public function, record and error (``scripts/api-reference.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" /
                                                  "api-reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_current():
    assert (ROOT / "docs" / "reference.md").read_text(encoding="utf-8") == _generator().page(), \
        "docs/reference.md is stale: run python scripts/api-reference.py"


def test_every_public_name_and_error_has_an_anchor():
    import nbdist
    import nbdist.errors as errors

    text = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    names = [f"nbdist.{n}" for n in nbdist.__all__
             if not n.startswith("_") and n not in ("unload_ipython_extension", "elastic")]
    names += [f"nbdist.errors.{n}" for n, c in vars(errors).items()
              if isinstance(c, type) and issubclass(c, BaseException)
              and c.__module__ == errors.__name__]
    names += [f"nbdist.elastic.{n}" for n in nbdist.elastic.__all__]
    for name in names:
        assert f'<a id="{name}"></a>' in text, name


def test_docstrings_become_markdown():
    md = _generator().md
    assert md("Use ``x`` and :class:`~a.b.C` or :func:`a.f`.") == "Use `x` and `C` or `a.f`."
    assert md("Run it::\n\n    f(1)\n\nafter") == "Run it:\n\n```python\nf(1)\n```\n\nafter"
    assert md("Parameters\n----------\nn : int\n    How many.") == \
        "**Parameters**\n\n* `n` (int): How many."
