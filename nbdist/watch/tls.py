"""The collector's certificate and key, checked before it listens.

OpenSSL's own errors name neither the file nor what is wrong with it (``[SSL] PEM lib``), and
a file that is missing surfaces as a bare ``[Errno 2]``: each file is read and looked at
first, so that an error names the file and what to do.
"""

from __future__ import annotations

import ssl

from ..errors import AttachError

__all__ = ["server_context"]


def _read(what: str, path: str) -> str:
    """``path``'s text; an :class:`AttachError` naming it where it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        raise AttachError.tls_file(what, path, "does not exist") from None
    except IsADirectoryError:
        raise AttachError.tls_file(what, path, "is a directory, not a file") from None
    except PermissionError:
        raise AttachError.tls_file(what, path, "cannot be read (permission denied: "
                                   "chmod u+r it, or run the notebook as its owner)") from None
    except OSError as exc:
        raise AttachError.tls_file(what, path, f"cannot be read ({exc.strerror})") from None


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context with ``cert`` and ``key``.

    Raises
    ------
    AttachError
        A file is missing or unreadable, is not a PEM certificate / key (an encrypted key
        included: nothing could type its passphrase), or the key is not the certificate's.
    """
    cert_text, key_text = _read("certificate", cert), _read("key", key)
    if "-----BEGIN CERTIFICATE-----" not in cert_text:
        raise AttachError.tls_file("certificate", cert, "holds no PEM certificate (no "
                                   "-----BEGIN CERTIFICATE----- line)")
    if "PRIVATE KEY-----" not in key_text:
        raise AttachError.tls_file("key", key, "holds no PEM private key (no -----BEGIN "
                                   "... PRIVATE KEY----- line)")
    if "ENCRYPTED" in key_text:
        raise AttachError.tls_file("key", key, "is encrypted (a passphrase nobody is there "
                                   "to type): decrypt it, e.g. openssl pkey -in KEY -out "
                                   "PLAIN")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=cert)  # the certificate alone parses
    except ssl.SSLError:
        raise AttachError.tls_file("certificate", cert, "is not a valid PEM certificate "
                                   "(its base64 does not decode to one)") from None

    def no_passphrase() -> bytes:  # OpenSSL would ask on the kernel's stdin otherwise
        return b""

    try:
        context.load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "values mismatch" in str(exc):
            raise AttachError.tls_file("key", key, f"is not the key of certificate {cert} "
                                       "(they were not made together)") from None
        raise AttachError.tls_file("key", key, "is not a valid PEM private key "
                                   f"({exc.reason or exc})") from None
    return context
