"""The data channel's TLS, the notebook's half: the certificate its listener presents when the
cluster is reached over TLS, and the fingerprint the workers pin it by.

The certificate is made for the session, in memory, with the ``cryptography`` package where it
is installed (Dask's ``Security.temporary`` needs it too): a new P-256 key that never leaves
the notebook's process and dies with the channel. Without ``cryptography`` the listener
presents the client certificate and key the cluster's own TLS was given (Dask's
``Security``). Either way the workers do not look at who signed it: each transfer's call
hands them the SHA-256 of the certificate's DER bytes, over the engine's authenticated and
encrypted channel, and a worker talks only to a listener that presents exactly that
certificate (proving it holds its key in the handshake). The worker's half is
:func:`nbdist.runtime.packing.connect`.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile
from typing import NamedTuple, Optional

from ..backends.base import TlsIdentity

#: the oldest protocol either side accepts
MIN_VERSION = ssl.TLSVersion.TLSv1_2


class ChannelTls(NamedTuple):
    """A listener's TLS: the server context, and the fingerprint workers pin."""

    #: server-side context with the certificate and its key loaded (no client certificates)
    context: ssl.SSLContext
    #: SHA-256 of the certificate's DER bytes (32 bytes)
    fingerprint: bytes
    #: where the certificate came from, for the docs' and tests' sake: "ephemeral" or
    #: "cluster"
    origin: str


def server_tls(identity: TlsIdentity) -> Optional[ChannelTls]:
    """The data channel's TLS on a cluster whose own channel is TLS with ``identity``.

    Returns
    -------
    ChannelTls or None
        A certificate made for the session (with ``cryptography``), else ``identity``'s
        certificate and key; None when there is neither (the values then travel in the
        engine's own, encrypted messages).
    """
    made = ephemeral_pem()
    if made is not None:
        return ChannelTls(*_load(*made), "ephemeral")
    if identity.cert:
        cert = _text(identity.cert)
        key = _text(identity.key) if identity.key else cert  # key and certificate in one file
        return ChannelTls(*_load(cert, key), "cluster")
    return None


def ephemeral_pem() -> Optional[tuple[str, str]]:
    """A new self-signed certificate and its P-256 key, as PEM text; None without
    ``cryptography``."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nbdist data channel")])
    now = datetime.datetime.now(datetime.timezone.utc)
    # The workers pin the certificate itself, so its dates are not checked; a year covers a
    # notebook left open.
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=365))
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode())


def _text(pem_or_path: str) -> str:
    """PEM text as given, or read from the file it names (Dask's fields hold either)."""
    if "-----BEGIN" in pem_or_path:
        return pem_or_path
    with open(pem_or_path, encoding="ascii") as f:
        return f.read()


def _load(cert: str, key: str) -> tuple[ssl.SSLContext, bytes]:
    """A server context with ``cert`` (its first certificate is the one presented) and
    ``key`` loaded, and that certificate's fingerprint."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    # ssl loads keys from files only: a private directory, removed at once
    with tempfile.TemporaryDirectory(prefix="nbdist-tls-") as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, text in ((cert_path, cert), (key_path, key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(text)
        ctx.load_cert_chain(cert_path, key_path)
    first = cert[cert.index("-----BEGIN CERTIFICATE-----"):]
    first = first[:first.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    return ctx, hashlib.sha256(ssl.PEM_cert_to_DER_cert(first)).digest()
