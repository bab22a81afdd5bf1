"""The kernel's collector: loopback by default, only connections with its token, TLS when
given certificates, and a token file that gives a restarted kernel the same line."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest

from nbdist.agent import wire
from nbdist.watch import collector as col
from nbdist.watch.collector import AttachError, Collector, attach
from nbdist.watch.settings import parse_listen, read_token_file, write_token_file

#: the collector's answer to a hello that carries its token
ANSWER = {"ok": True, "nbdist": wire.PROTOCOL, "acks": True}


def _until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def _greet(address, token, wrap=None):
    sock = socket.create_connection((address.host, address.port), timeout=5)
    if wrap is not None:
        sock = wrap(sock)
    sock.sendall(wire.hello(token, "h", 1))
    return sock


def _unanswered(sock):
    """True when the collector closed ``sock`` without a word (a reset when it left bytes
    unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_it_listens_on_loopback_and_a_free_port_by_default(collector):
    a = collector.address
    assert (a.scheme, a.host) == ("tcp", "127.0.0.1") and a.port > 0
    assert collector.line == f"NBDIST_ATTACH=tcp://127.0.0.1:{a.port}/{collector.token}"
    assert wire.parse(collector.line) == a


def test_a_connection_with_the_token_is_answered_and_its_frames_folded(collector):
    sock = _greet(collector.address, collector.token)
    assert wire.decode(sock.recv(100)[4:]) == ANSWER
    sock.sendall(wire.encode({"type": "rank", "job": "j", "rank": 0, "world_size": 1,
                              "host": "h", "pid": 5}))
    _until(lambda: len(collector.jobs.records()) == 1)
    sock.close()
    _until(lambda: collector.jobs.records()[0].state == "lost")


def test_a_wrong_or_missing_token_is_closed_unanswered_and_folds_nothing(collector):
    for token in (collector.token[:-1] + "x", ""):
        sock = _greet(collector.address, token)
        sock.sendall(wire.encode({"type": "rank", "job": "j", "rank": 0, "world_size": 1}))
        assert _unanswered(sock)
    junk = socket.create_connection((collector.host, collector.port), timeout=5)
    junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert _unanswered(junk)
    _until(lambda: collector.refused == 3)
    assert collector.jobs.records() == []


@pytest.mark.parametrize("text,want", [("9000", (None, 9000)), ("0.0.0.0:9000", ("0.0.0.0", 9000)),
                                       ("[::1]:0", ("::1", 0)), (None, (None, None))])
def test_listen_is_host_and_port_or_a_port(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize("bad", ["host", "h:port", "1:99999"])
def test_a_bad_listen_says_the_form(bad):
    with pytest.raises(AttachError, match=r"\[HOST:\]PORT"):
        parse_listen(bad)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(col, "_current", None)
    yield
    if col._current is not None:
        col._current.close()


def test_attach_again_keeps_the_collector_and_its_line(fresh):
    first = attach()
    assert attach() is first and attach().line == first.line
    with pytest.raises(AttachError, match="already listens"):
        attach(listen="127.0.0.1:1")


def test_a_token_file_gives_a_restarted_kernel_the_same_line(fresh, tmp_path):
    path = str(tmp_path / "token")
    first = attach(token_file=path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    line = first.line
    first.close()  # the kernel restarts: nothing listens until attach runs again
    col._current = None
    again = attach(token_file=path)
    assert again is not first and again.line == line
    sock = _greet(again.address, wire.parse(line).token)
    assert wire.decode(sock.recv(100)[4:]) == ANSWER
    sock.close()


def test_a_token_file_others_may_read_is_refused(fresh, tmp_path):
    path = tmp_path / "token"
    path.write_text("NBDIST_ATTACH=tcp://127.0.0.1:9/t\n")
    os.chmod(path, 0o644)
    with pytest.raises(AttachError, match="chmod 600"):
        attach(token_file=str(path))
    with pytest.raises(AttachError, match="--tls-key"):
        attach(tls_cert="c.pem")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_with_a_certificate_connections_are_tls(tmp_path):
    cert, key = str(tmp_path / "c.pem"), str(tmp_path / "k.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost"], check=True,
                   capture_output=True, timeout=60)
    c = Collector(tls=(cert, key))
    try:
        assert c.line.startswith("NBDIST_ATTACH=tls://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=cert)
        ctx.check_hostname = False
        sock = _greet(c.address, c.token, lambda s: ctx.wrap_socket(s))
        assert wire.decode(sock.recv(100)[4:]) == ANSWER
        sock.close()
        plain = _greet(c.address, c.token)  # a token in clear text is not answered
        assert _unanswered(plain)
    finally:
        c.close()


def test_attach_errors_are_nbdists_errors_that_say_what_to_do(fresh, tmp_path):
    from nbdist.errors import AttachError as InErrors
    from nbdist.errors import NbdistError

    assert AttachError is InErrors and issubclass(AttachError, (NbdistError, ValueError))
    path = tmp_path / "token"
    path.write_text("not a line\n")
    os.chmod(path, 0o600)
    with pytest.raises(AttachError, match="holds no attach line .*: remove it") as bad:
        attach(token_file=str(path))
    assert bad.value._render_traceback_() == [f"\x1b[31mAttachError\x1b[0m: {bad.value}"]
    with pytest.raises(AttachError, match="give both, or neither"):
        attach(tls_key="k.pem")



def _pair(tmp_path, name="c"):
    """A self-signed certificate and its key, made by the openssl command."""
    cert, key = str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost"], check=True,
                   capture_output=True, timeout=60)
    return cert, key


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl command")


@needs_openssl
def test_other_tls_settings_than_the_running_collectors_are_refused_not_ignored(fresh,
                                                                               tmp_path):
    cert, key = _pair(tmp_path)
    plain = attach()
    with pytest.raises(AttachError, match=r"already runs with plain tcp:// .*asks for TLS "
                       r"\(certificate .*c\.pem.*close it first \(nbdist\.attach\(\)\.close\(\)\)"):
        attach(tls_cert=cert, tls_key=key)
    assert attach() is plain  # refused: the plain one runs on, unchanged
    plain.close()
    secure = attach(tls_cert=cert, tls_key=key)
    assert secure.line.startswith("NBDIST_ATTACH=tls://")
    assert attach(tls_cert=cert, tls_key=key) is secure  # the same files keep it
    assert attach() is secure  # naming no files keeps what runs, as leaving out listen does
    other_cert, other_key = _pair(tmp_path, "other")
    with pytest.raises(AttachError, match="other.pem"):
        attach(tls_cert=other_cert, tls_key=other_key)
    with pytest.raises(AttachError, match=r"listens at .*nbdist\.attach\(tls_cert="):
        attach(listen="127.0.0.1:1", tls_cert=cert, tls_key=key)


def test_a_token_file_that_is_a_directory_is_named_so(fresh, tmp_path):
    with pytest.raises(AttachError, match=f"token file {tmp_path} is a directory: give the "
                       "path of a file") as bad:
        attach(token_file=str(tmp_path))
    assert "chmod" not in str(bad.value) and col.current() is None
    with pytest.raises(AttachError, match="is a directory"):
        read_token_file(str(tmp_path))
    with pytest.raises(AttachError, match="is a directory"):
        write_token_file(str(tmp_path), wire.parse("tcp://127.0.0.1:9/t"))
    attach()  # and with a collector running, the same
    with pytest.raises(AttachError, match="is a directory"):
        attach(token_file=str(tmp_path))


@needs_openssl
def test_missing_or_bad_tls_files_are_named_before_anything_listens(fresh, tmp_path):
    cert, key = _pair(tmp_path)
    other_cert, other_key = _pair(tmp_path, "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    cases = [
        (str(tmp_path / "none.pem"), key, r"certificate .*none\.pem does not exist"),
        (cert, str(tmp_path / "none.key"), r"key .*none\.key does not exist"),
        (str(junk), key, r"certificate .*junk\.pem holds no PEM certificate"),
        (str(broken), key, r"certificate .*broken\.pem is not a valid PEM certificate"),
        (cert, cert, r"key .*c\.pem holds no PEM private key"),
        (cert, other_key, r"key .*other\.key is not the key of certificate .*c\.pem"),
        (str(tmp_path), key, r"certificate .* is a directory"),
    ]
    for c, k, want in cases:
        with pytest.raises(AttachError, match=want):
            attach(tls_cert=c, tls_key=k)
        assert col.current() is None
    if os.geteuid() != 0:  # root reads any file
        os.chmod(key, 0)
        with pytest.raises(AttachError, match=r"key .*c\.key cannot be read"):
            attach(tls_cert=cert, tls_key=key)


def _frames(sock):
    """The collector's next commands down ``sock``, its acknowledgements left out."""
    buf = bytearray()
    while True:
        buf += sock.recv(65536)
        got = [m for m in map(wire.decode, wire.split(buf)) if m.get("type") != "ack"]
        if got:
            return got


def test_stacks_ask_only_running_ranks_and_a_lost_job_answers_at_once(collector, monkeypatch):
    monkeypatch.setattr(col, "TAKE_OVER", 0.05)
    sock = _greet(collector.address, collector.token)
    assert wire.decode(sock.recv(100)[4:])["ok"] is True
    for rank in (0, 1):
        sock.sendall(wire.encode({"type": "rank", "job": "j", "rank": rank, "world_size": 2,
                                  "host": "h", "pid": 5 + rank}))
    sock.sendall(wire.encode({"type": "exit", "job": "j", "rank": 0, "pid": 5, "ok": True}))
    _until(lambda: collector.jobs.get("j") is not None
           and collector.jobs.get("j").ranks[0].ended is not None)
    out = {}
    asking = threading.Thread(target=lambda: out.update(collector.stacks("j", timeout=5)))
    asking.start()
    (ask,) = _frames(sock)
    assert (ask["type"], ask["rank"], ask["ranks"]) == ("stacks", None, [1])
    sock.sendall(wire.encode({"type": "stacks", "id": ask["id"], "rank": 1, "text": "here"}))
    asking.join(5)
    assert out == {1: "here"}
    sock.close()  # rank 1 never says its end: the job is lost, not running
    _until(lambda: collector.jobs.records()[0].state == "lost")
    t = time.monotonic()
    assert collector.stacks("j", timeout=5) == {} and collector.stacks("j", 1, 5) == {}
    assert time.monotonic() - t < 1.0  # not the 5 s a rank would be waited for


def test_the_printed_launch_reports_in_this_environment_with_or_without_the_hook(
        collector, tmp_path, monkeypatch):
    """A plain ``torchrun train.py`` reports only where the start-up hook is installed: in
    an environment without it (an editable install) the instructions lead with the agent."""
    monkeypatch.setattr(col.site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(col.site, "getusersitepackages", lambda: str(tmp_path / "user"))
    assert not col.hook_installed()
    without = collector.instructions()
    launches = [ln for ln in without.splitlines() if "torchrun" in ln]
    assert launches and all("-m nbdist.agent train.py" in ln for ln in launches), without
    assert "no start-up hook (nbdist-attach.pth is not in site-packages" in without
    assert "srun python -m nbdist.agent train.py" in without
    (tmp_path / col.HOOK).write_text("import nbdist.agent.hook\n")
    assert col.hook_installed()
    with_hook = collector.instructions()
    assert f"{collector.line} torchrun --nproc_per_node=2 train.py" in with_hook
    assert "no start-up hook" not in with_hook
