"""The data channel's certificate: made for the session where ``cryptography`` is installed,
else the cluster's own client certificate (as PEM text or files, the key apart or in the
certificate's file); the fingerprint is the SHA-256 of what a TLS peer actually receives."""

from __future__ import annotations

import hashlib
import socket
import ssl
import threading

import pytest

from nbdist.backends.base import TlsIdentity
from nbdist.group import channel_tls
from nbdist.group.channel_tls import ephemeral_pem, server_tls

pytestmark = pytest.mark.timeout(60)


def presented(tls) -> bytes:
    """The DER certificate a client receives from a listener with ``tls``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        with tls.context.wrap_socket(conn, server_side=True) as s:
            s.recv(1)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with ctx.wrap_socket(socket.create_connection(srv.getsockname(), timeout=10)) as c:
        der = c.getpeercert(binary_form=True)
        c.sendall(b"x")
    th.join(10)
    srv.close()
    return der


def test_a_certificate_made_for_the_session_is_pinned_by_what_peers_receive():
    a, b = server_tls(TlsIdentity()), server_tls(TlsIdentity())
    assert a.origin == "ephemeral" and a.fingerprint != b.fingerprint  # new for each channel
    assert hashlib.sha256(presented(a)).digest() == a.fingerprint


@pytest.mark.parametrize("form", ["text", "files", "key-in-cert-file"])
def test_without_cryptography_the_clusters_client_certificate_is_presented(
        monkeypatch, tmp_path, form):
    cert, key = ephemeral_pem()  # stands in for a site's client certificate and key
    monkeypatch.setattr(channel_tls, "ephemeral_pem", lambda: None)
    if form == "text":
        identity = TlsIdentity(cert, key)
    elif form == "files":
        (tmp_path / "c.pem").write_text(cert)
        (tmp_path / "k.pem").write_text(key)
        identity = TlsIdentity(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    else:
        (tmp_path / "both.pem").write_text(key + cert)
        identity = TlsIdentity(str(tmp_path / "both.pem"))
    tls = server_tls(identity)
    assert tls.origin == "cluster"
    assert presented(tls) == ssl.PEM_cert_to_DER_cert(cert)
    assert tls.fingerprint == hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert)).digest()


def test_neither_a_made_nor_a_given_certificate_is_none(monkeypatch):
    monkeypatch.setattr(channel_tls, "ephemeral_pem", lambda: None)
    assert server_tls(TlsIdentity()) is None


def test_the_key_file_ssl_loads_from_is_gone_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(channel_tls.tempfile, "tempdir", None)  # read TMPDIR again
    server_tls(TlsIdentity())
    assert list(tmp_path.iterdir()) == []
