"""The kernel's collector: loopback by default, only connections with its token, TLS when
given certificates, and a token file that gives a restarted kernel the same line."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time

import pytest

from nbdist.agent import wire
from nbdist.watch import collector as col
from nbdist.watch.collector import AttachError, Collector, attach, parse_listen


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
    assert wire.decode(sock.recv(100)[4:]) == {"ok": True, "nbdist": wire.PROTOCOL}
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
    assert wire.decode(sock.recv(100)[4:]) == {"ok": True, "nbdist": wire.PROTOCOL}
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
        assert wire.decode(sock.recv(100)[4:]) == {"ok": True, "nbdist": wire.PROTOCOL}
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

