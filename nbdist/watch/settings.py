"""What ``%nbdist attach`` is given, checked before anything listens: where to listen, the
token file that keeps the line across kernel restarts, and the certificate and key.

OpenSSL's own errors name neither the file nor what is wrong with it (``[SSL] PEM lib``), and
a file that is missing surfaces as a bare ``[Errno 2]``: each file is read and looked at
first, so that an error names the file and what to do.
"""

from __future__ import annotations

import os
import ssl
import stat
from typing import Optional

from ..agent import wire
from ..errors import AttachError

__all__ = ["parse_listen", "read_token_file", "server_context", "write_token_file"]


def parse_listen(listen: Optional[str]) -> tuple[Optional[str], Optional[int]]:
    """``[HOST:]PORT`` as (host or None, port or None); None: neither.

    Raises
    ------
    AttachError
        Not of that form.
    """
    if listen is None or str(listen).strip() == "":
        return None, None
    text = str(listen).strip()
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or None
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise AttachError.listen(text)
    return host, int(port)


def read_token_file(path: str) -> Optional[wire.Address]:
    """The attach line kept in ``path`` (None: no such file).

    Raises
    ------
    AttachError
        The path is a directory, others than its owner may read the file, or it holds no
        attach line.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):  # its mode (1777 for /tmp) would be blamed otherwise
        raise AttachError.token_file_dir(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AttachError.token_file_open(path, stat.S_IMODE(st.st_mode))
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return wire.parse(text)
    except ValueError as exc:
        raise AttachError.token_file_empty(path, exc) from None


def write_token_file(path: str, address: wire.Address) -> None:
    """Keep ``address``'s line in ``path``, readable by its owner only.

    Raises
    ------
    AttachError
        The path is a directory.
    OSError
        The file cannot be written.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except IsADirectoryError:
        raise AttachError.token_file_dir(path) from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(fd, 0o600)
        f.write(f"{wire.ENV}={address.line}\n")


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
