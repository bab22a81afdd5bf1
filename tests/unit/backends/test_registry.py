"""The engine registry: an engine is one folder and one registration.

A third engine, registered here (its adapter is the scripted in-memory backend) and removed after
each test, is accepted by the option records, profiles, the magics' parser and a real session
through ``get_backend``, with no other file changed. A scan of nbdist's source keeps engine-name
comparisons inside ``nbdist/backends/``.
"""

from __future__ import annotations

import ast
import shlex
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest
from fakes import ScriptedBackend
from IPython.core.error import UsageError

from nbdist import session as session_mod
from nbdist.backends import connect_target, get_backend, registry
from nbdist.backends import remote as remote_mod
from nbdist.backends.registry import Engine, Flag
from nbdist.boot.template import forks_store, supported
from nbdist.errors import OptionError
from nbdist.magics.parsers import PARSER, VERBS, build_parser
from nbdist.options import ENGINES, LAUNCHERS, ClusterOptions, LaunchOptions
from nbdist.profiles import parse_profile
from nbdist.session import Session

NBDIST = Path(__file__).resolve().parents[3] / "nbdist"


class FakeEngineBackend(ScriptedBackend):
    """The third engine's adapter: two in-memory workers."""

    name = "fake"
    targets: list[dict[str, Any]] = []  # what each connect was given

    def __init__(self) -> None:
        super().__init__(2)

    def connect(self, timeout: float, **target: Any) -> None:
        self.targets.append(target)
        super().connect(timeout, **target)

    @classmethod
    def target_from_flags(cls, fake_token: Optional[str] = None) -> dict[str, Any]:
        if fake_token == "bad":
            raise OptionError("the fake engine refuses the token 'bad'")
        return {"token": fake_token}


def fake_engine(**facts: Any) -> Engine:
    return Engine(**{"name": "fake", "adapter": f"{__name__}:FakeEngineBackend",
                     "package": "json", "worker": __name__,
                     "launchers": ("local", "ssh", "fakequeue"),
                     "ssh_client": "asyncssh", "scheduler_on_cluster": ("fakequeue",),
                     "connect_flags": (Flag("--fake-token", "the fake cluster's token",
                                            metavar="TOKEN"),),
                     **facts})


@pytest.fixture
def fake():
    engine = registry.register(fake_engine())
    FakeEngineBackend.targets = []
    yield engine
    registry.unregister("fake")


def test_a_registered_engine_is_a_choice_of_the_option_records_and_profiles(fake):
    assert "fake" in ENGINES and list(ENGINES)[-1] == "fake"
    assert "fakequeue" in LAUNCHERS  # its own launcher joins the others
    assert ClusterOptions(engine="fake").engine == "fake"
    # its launcher runs the scheduler on the cluster's side: no `listen` needed there
    queued = ClusterOptions(engine="fake", launch=LaunchOptions(launcher="fakequeue"))
    assert queued.launch.launcher == "fakequeue"
    with pytest.raises(OptionError, match="set `listen`"):  # its ssh launcher does
        ClusterOptions(engine="fake", launch=LaunchOptions(launcher="ssh", hosts={"a": 1}))
    with pytest.raises(OptionError, match="the fake engine has no 'mpi' launcher: choose one "
                                          "of local, ssh, fakequeue"):
        ClusterOptions(engine="fake", launch=LaunchOptions(launcher="mpi"))
    with pytest.raises(OptionError, match="the dask engine has no 'fakequeue' launcher"):
        ClusterOptions(engine="dask", launch=LaunchOptions(launcher="fakequeue"))
    profile = parse_profile("cluster:\n  engine: fake\n  launcher: fakequeue\n  workers: 3\n")
    assert (profile.options.engine, profile.options.n) == ("fake", 3)


def test_a_registered_engine_is_a_choice_of_the_magics_parser(fake):
    # the parser made when the magics were imported, before the engine was registered
    args = PARSER.parse_args(["start", "--engine", "fake"])
    assert args.engine == "fake"
    assert "--engine {ipyparallel,dask,fake}" in VERBS["start"].format_usage()
    # its own connect flags are on a parser made once it is registered
    parser, verbs = build_parser()
    args = parser.parse_args(["connect", "--engine", "fake", "--fake-token", "t"])
    assert args.fake_token == "t"
    assert "--fake-token TOKEN" in verbs["connect"].format_help()


def test_a_registered_engine_starts_and_connects_through_a_real_session(fake, shell,
                                                                        monkeypatch, capsys):
    session = Session(stores=None)  # get_backend: the registry's adapter
    monkeypatch.setattr(session_mod, "_default", session)
    try:
        shell.run_line_magic("nbdist", "start -n 2 --engine fake --timeout 5")
        assert "starting fake workers on this machine (2)" in capsys.readouterr().out
        assert isinstance(session.backend, FakeEngineBackend) and session.world_size == 2
        assert not forks_store(session.options)  # not registered with forks_store
        session.connect(engine="fake", token="t0", timeout=5)
        assert FakeEngineBackend.targets[-1] == {"token": "t0"}
    finally:
        session.stop()


def test_an_engines_own_connect_flags_go_to_its_adapter_and_are_refused_for_another(fake):
    assert connect_target("fake", {"fake_token": "t"}) == {"token": "t"}
    assert connect_target("fake", {}) == {}
    with pytest.raises(OptionError, match="refuses the token 'bad'"):
        connect_target("fake", {"fake_token": "bad"})
    with pytest.raises(OptionError, match="--fake-token is for --engine fake, not dask"):
        connect_target("dask", {"fake_token": "t"})
    with pytest.raises(OptionError, match="not ipyparallel"):  # the default engine
        connect_target(None, {"fake_token": "t"})
    # Dask's are the same kind of flag
    with pytest.raises(OptionError, match="--tls-ca-file, --tls-cert are for --engine dask, "
                                          "not fake"):
        connect_target("fake", {"tls_ca_file": "a.pem", "tls_cert": "c.pem"})


def test_the_remote_check_uses_the_engines_ssh_client_and_packages(fake, monkeypatch):
    code = shlex.split(remote_mod.probe_command("python3", "fake", "*"))[-1]
    assert "('nbdist', 'json', 'torch')" in code  # what its workers import
    reached = []

    def client(name):
        def check(hosts, command, how, timeout=60.0):
            reached.append((name, hosts))
            return [remote_mod.Host(h, stdout='NBDIST-PROBE {"missing": [], "shared": true}')
                    for h in hosts]
        return check

    monkeypatch.setattr(remote_mod, "check_with_asyncssh", client("asyncssh"))
    monkeypatch.setattr(remote_mod, "check_with_ssh", client("openssh"))
    launch = LaunchOptions(launcher="ssh", listen="*", hosts={"h1": 1})
    for engine in ("fake", "ipyparallel", "dask"):
        remote_mod.check_ssh_hosts(launch, engine)
    assert reached == [("asyncssh", ["h1"]), ("openssh", ["h1"]), ("asyncssh", ["h1"])]


def test_the_store_forks_from_the_template_of_engines_registered_so(monkeypatch):
    registry.register(fake_engine(forks_store=True))
    try:
        assert forks_store(ClusterOptions(engine="fake")) == supported()
        assert not forks_store(ClusterOptions(engine="fake",
                                              launch=LaunchOptions(template=False)))
    finally:
        registry.unregister("fake")
    assert not forks_store(ClusterOptions(engine="dask"))


def test_an_unknown_engine_gets_the_clear_error_it_always_did(fake):
    for make in (lambda: get_backend("spark"), lambda: ClusterOptions(engine="spark")):
        with pytest.raises(OptionError, match="unknown engine 'spark': choose one of "
                                              "ipyparallel, dask, fake"):
            make()
    with pytest.raises(UsageError, match="invalid choice: 'spark'"):
        PARSER.parse_args(["start", "--engine", "spark"])
    with pytest.raises(ValueError, match="an engine named 'fake' is registered already"):
        registry.register(fake_engine())
    with pytest.raises(ValueError, match="ssh_client 'putty'"):
        fake_engine(ssh_client="putty")


def test_after_unregistering_the_engine_is_unknown_again():
    registry.register(fake_engine())
    registry.unregister("fake")
    assert list(ENGINES) == ["ipyparallel", "dask"] and "fakequeue" not in LAUNCHERS
    with pytest.raises(OptionError, match="unknown engine 'fake'"):
        ClusterOptions(engine="fake")
    with pytest.raises(KeyError):
        registry.unregister("fake")


def test_a_missing_package_is_named_with_the_extra_that_installs_it():
    registry.register(fake_engine(package="nbdist_no_such_package", extra="fakes",
                                  adapter="nbdist_no_such_package.adapter:Backend"))
    try:
        with pytest.raises(ImportError, match=r"the fake engine needs the "
                                              r"`nbdist_no_such_package` package \(.*\); "
                                              r"install it with: pip install 'nbdist\[fakes\]'"):
            get_backend("fake")
    finally:
        registry.unregister("fake")


def test_a_broken_adapter_is_not_reported_as_a_missing_package():
    # the engine's package is there: the adapter's own import error is the news
    registry.register(fake_engine(adapter="nbdist.backends.no_such_adapter:Backend"))
    try:
        with pytest.raises(ModuleNotFoundError, match="nbdist.backends.no_such_adapter"):
            get_backend("fake")
    finally:
        registry.unregister("fake")


# ------------------------------------------------------------- no engine names outside backends/


def engine_name_comparisons(source: str, names: set[str]) -> list[int]:
    """The lines of ``source`` that compare against an engine name, or branch on one (a
    ``case``, a dict keyed by engine), as opposed to naming one in a message."""

    def is_name(node: Optional[ast.AST]) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_name(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(is_name, [node.left, *node.comparators])):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and is_name(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(map(is_name, node.keys)):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_each_kind_of_comparison_and_passes_messages():
    source = textwrap.dedent("""
        a = options.engine == "ipyparallel"
        b = engine in ("dask", "ray")
        match engine:
            case "dask":
                pass
        LAUNCHERS = {"dask": ("local",)}
        c = "dask" != engine
        print(f"the {engine} engine"); d = "use --engine dask"; e = engine == name
    """)
    assert engine_name_comparisons(source, {"ipyparallel", "dask"}) == [2, 3, 5, 7, 8]


def test_no_engine_name_comparison_outside_backends():
    names = set(registry.ENGINES)
    found = []
    for path in sorted(NBDIST.rglob("*.py")):
        if (NBDIST / "backends") in path.parents:
            continue
        for line in engine_name_comparisons(path.read_text(encoding="utf-8"), names):
            found.append(f"{path.relative_to(NBDIST.parent)}:{line}")
    assert not found, ("engine names compared outside nbdist/backends/ (read the engine's "
                       "facts from nbdist.backends.registry instead): " + ", ".join(found))
