"""What a restarted rank's fresh process imports again: the names of a namespace that an import
bound (modules, and classes and functions under their own module's name), and binding them
again in another namespace, and in another process, to the same objects."""

from __future__ import annotations

import json
import subprocess
import sys
import types

from nbdist.runtime import worker as rt


def namespace() -> dict:
    ns: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    exec("import json\n"
         "import os.path as osp\n"
         "import xml.dom\n"
         "from collections import OrderedDict\n"
         "from json import dumps\n"
         "from email import message as msg\n"
         "from os import getpid\n"
         "from math import pi\n"
         "class Local:\n"
         "    pass\n"
         "def helper():\n"
         "    return 1\n"
         "made = type(json)('made_here')\n"
         "t = [1, 2]\n"
         "rank = 0\n", ns)
    return ns


def test_the_names_an_import_bound_are_found_with_what_imports_them():
    found = rt.imports_in(namespace())
    assert found == [
        ("OrderedDict", "collections", "OrderedDict"),
        ("dumps", "json", "dumps"),
        ("getpid", getpid_module(), "getpid"),
        ("json", "json", ""),
        ("msg", "email.message", ""),
        ("osp", osp_module(), ""),
        ("xml", "xml", ""),  # `import xml.dom` binds xml
    ]


def getpid_module() -> str:
    import os

    return os.getpid.__module__  # posix on Linux


def osp_module() -> str:
    import os.path

    return os.path.__name__  # posixpath on Linux


def test_values_classes_defined_in_cells_and_modules_made_in_process_are_not_imports():
    bound = {name for name, _, _ in rt.imports_in(namespace())}
    assert not bound & {"pi", "Local", "helper", "made", "t", "rank", "__builtins__"}


def test_only_what_its_module_holds_under_its_own_name_is_an_import():
    impostor = type("dumps", (), {"__module__": "json"})  # json.dumps is another object
    ns = {"orphan": types.ModuleType("not_imported_anywhere"), "impostor": impostor,
          "stranger": types.FunctionType(compile("None", "<cell>", "eval"), {}, "stranger"),
          "alias": json.JSONDecoder}
    assert rt.imports_in(ns) == [("alias", "json.decoder", "JSONDecoder")]


def test_the_imports_are_bound_again_to_the_same_objects():
    old = namespace()
    fresh: dict = {}
    failed = rt.reimport(fresh, rt.imports_in(old))
    assert failed == {}
    assert set(fresh) == {"OrderedDict", "dumps", "getpid", "json", "msg", "osp", "xml"}
    assert all(fresh[k] is old[k] for k in fresh)


def test_an_import_that_fails_is_named_with_why_and_the_others_bound():
    fresh: dict = {}
    failed = rt.reimport(fresh, [("gone", "no_such_module_here", ""), ("json", "json", ""),
                                 ("nope", "json", "no_such_name")])
    assert set(failed) == {"gone", "nope"}
    assert failed["gone"].startswith("ModuleNotFoundError: No module named")
    assert failed["nope"].startswith("AttributeError")
    assert fresh == {"json": json}


def test_a_fresh_process_binds_the_same_imports_again():
    found = rt.imports_in(namespace())
    code = ("import sys, json\n"
            "from nbdist.runtime.worker import reimport\n"
            "ns = {}\n"
            "failed = reimport(ns, [tuple(i) for i in json.loads(sys.argv[1])])\n"
            "print(json.dumps([failed, {k: getattr(v, '__name__', '?') for k, v in ns.items()},"
            " 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(found)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    failed, names, torch_loaded = json.loads(out)
    assert failed == {}
    assert names == {"OrderedDict": "OrderedDict", "dumps": "dumps", "getpid": "getpid",
                     "json": "json", "msg": "email.message", "osp": osp_module(), "xml": "xml"}
    assert not torch_loaded  # the runtime's module names no torch at import
