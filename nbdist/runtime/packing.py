"""Values between the notebook and the workers (push, pull) as zero-copy buffers.

A value is pickled with protocol 5 (cloudpickle's pickler, so functions and classes defined
in the notebook travel too) and every large block of memory in it leaves the pickle as an
out-of-band buffer: numpy arrays by their own protocol-5 support, and CPU tensors here,
each as the span of its storage that it views (strides and offset kept, so a view or a
non-contiguous tensor comes back as one, without a copy on the way out). The buffers travel
as numpy arrays, which both engines' serializers send as separate frames without copying
(ipyparallel's canning, Dask's ``distributed.protocol``); what arrives rebuilds the tensors
over the received memory, copied once only where it is read-only.

Without numpy everything travels inside the pickle, as one copy. Tensors that are not plain
dense CPU tensors (sparse, quantized, subclasses, other devices) keep torch's own pickling.
Used on both sides: stdlib and cloudpickle; torch and numpy only where the value holds them.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import mmap
import pickle
import socket
import ssl
import struct
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import cloudpickle

from . import shared_copy
from .env import LOOPBACK
from .shared_copy import SharedCopy

#: the most out-of-band buffers one packed value keeps (ipyparallel cans a result's items
#: one by one only up to 64 of them); beyond it the smallest are joined into one
MAX_BUFFERS = 60
#: out-of-band only above this many bytes: smaller blocks are cheaper inside the pickle
MIN_BUFFER = 64 * 1024
#: out-of-band buffers this large in all go over the notebook's data channel, where there is
#: one (:class:`nbdist.group.transfer.DataChannel`): one TCP stream instead of the engine's messages
CHANNEL_MIN = 1 << 20
#: the data channel's operations (fetch a push's buffers, deliver a pull's, offer a pull's
#: shared copy) and ticket size
GET, PUT, SHARE, TICKET = b"G", b"P", b"S", 16
#: the longest a TLS handshake with the data channel may take, in seconds (either side)
HANDSHAKE_TIMEOUT = 30.0
_COUNT = struct.Struct("<I")


class Packed(NamedTuple):
    """A value as :func:`pack` packs it; :func:`unpack` takes the three fields back."""

    #: the protocol-5 pickle, with every large block of memory left out of it
    header: bytes
    #: the blocks left out, in the pickle's order: numpy ``uint8`` arrays (at most
    #: :data:`MAX_BUFFERS`; empty without numpy)
    buffers: list[Any]
    #: None: one buffer per block; else one ``(index, start, stop)`` per block, the byte
    #: range of ``buffers[index]`` that holds it (the smallest blocks joined into one)
    layout: Optional[list[tuple[int, int, int]]]

    @property
    def nbytes(self) -> int:
        """The header's and the buffers' size together, in bytes."""
        return len(self.header) + sum(memoryview(b).nbytes for b in self.buffers)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = _reduce_tensor(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def pack(obj: Any, max_buffers: int = MAX_BUFFERS) -> Packed:
    """``obj`` as a protocol-5 pickle and its large buffers (see the module docstring).

    Parameters
    ----------
    obj : object
        Anything cloudpickle pickles; CPU tensors and numpy arrays of at least
        :data:`MIN_BUFFER` bytes leave the pickle as buffers of their own.
    max_buffers : int
        The most buffers to keep; beyond it the smallest are joined (copied) into one.

    Returns
    -------
    Packed
        ``(header, buffers, layout)``: the pickle, the buffers, and where each block lies in
        them.

    Raises
    ------
    TypeError, pickle.PicklingError
        A part of ``obj`` cannot be pickled (a lock, an open file, a generator); whatever else
        such a part's own ``__reduce__`` raises passes through too.
    """
    try:
        import numpy as np
    except ImportError:
        np = None
    raw: list[pickle.PickleBuffer] = []
    f = io.BytesIO()

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        if pb.raw().nbytes < MIN_BUFFER:
            return True  # in band: small
        raw.append(pb)
        return False

    _Pickler(f, protocol=5, buffer_callback=out_of_band if np is not None else None).dump(obj)
    buffers = [np.frombuffer(pb.raw(), dtype=np.uint8) for pb in raw] if np is not None else []
    layout = None
    if len(buffers) > max_buffers:
        buffers, layout = _join_smallest(buffers, max_buffers)
    return Packed(f.getvalue(), buffers, layout)


def unpack(header: bytes, buffers: Sequence[Any], layout: Optional[list] = None) -> Any:
    """The value :func:`pack` packed, from its header and the buffers as they arrived."""
    views = [memoryview(b).cast("B") for b in buffers]
    if layout is not None:
        views = [views[i][start:stop] for i, start, stop in layout]
    return pickle.loads(header, buffers=views)


def _join_smallest(buffers: list[Any], keep: int) -> tuple[list[Any], list]:
    """Keep the ``keep - 1`` largest buffers and join the rest (copied) into the last one."""
    import numpy as np

    order = sorted(range(len(buffers)), key=lambda i: buffers[i].nbytes, reverse=True)
    big, small = order[:keep - 1], order[keep - 1:]
    out = [buffers[i] for i in big]
    layout: list[Any] = [None] * len(buffers)
    for n, i in enumerate(big):
        layout[i] = (n, 0, buffers[i].nbytes)
    joined, at = [], 0
    for i in small:
        layout[i] = (len(out), at, at + buffers[i].nbytes)
        joined.append(buffers[i])
        at += buffers[i].nbytes
    out.append(np.concatenate(joined))
    return out, layout


# ------------------------------------------------------------------------------ tensors
def _reduce_tensor(t: Any) -> Any:
    """``(rebuild, args)`` for a dense CPU tensor, its storage span out of band; None for
    tensors torch must pickle itself. (A tensor that requires grad comes back as a leaf
    that does, as torch's own pickling makes it.)"""
    import torch

    if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
            or t.is_conj() or t.is_neg() or any(s < 0 for s in t.stride())):
        return None
    try:
        import numpy  # noqa: F401 (the span goes out as a numpy array)
    except ImportError:
        return None
    size, stride = tuple(t.shape), t.stride()
    item = t.element_size()
    extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(size, stride))
    span = torch.empty(0, dtype=torch.uint8)
    if extent:
        span.set_(t.untyped_storage(), t.storage_offset() * item, (extent * item,), (1,))
    return _rebuild_tensor, (pickle.PickleBuffer(span.numpy()), t.dtype, size, stride,
                             t.requires_grad)


def _rebuild_tensor(buf: Any, dtype: Any, size: tuple, stride: tuple,
                    requires_grad: bool) -> Any:
    import torch

    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0:
        flat = torch.empty(0, dtype=dtype)
    else:
        if mv.readonly:  # a received frame the engine does not let us write: one copy
            mv = memoryview(bytearray(mv))
        flat = torch.frombuffer(mv, dtype=torch.uint8).view(dtype)
    t = torch.as_strided(flat, size, stride) if flat.numel() else flat.reshape(size)
    return t.requires_grad_(requires_grad) if requires_grad else t


# ------------------------------------------------------------------------------ data channel
def channel_bytes(buffers: Sequence[Any]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


def recv_exactly(conn: socket.socket, n: int, into: Optional[memoryview] = None) -> Any:
    """``n`` bytes from ``conn`` (into ``into`` when given); ValueError if it closes first."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = conn.recv_into(buf[got:n])
        if not k:
            raise ValueError(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf if into is not None else bytes(buf)


def send_buffers(conn: socket.socket, buffers: Sequence[Any]) -> None:
    """Their count and sizes, then each buffer's bytes from its own memory."""
    views = [memoryview(b).cast("B") for b in buffers]
    conn.sendall(_COUNT.pack(len(views)) + struct.pack(f"<{len(views)}Q",
                                                        *(v.nbytes for v in views)))
    for v in views:
        conn.sendall(v)


def receive_buffers(conn: socket.socket) -> list[Any]:
    """What :func:`send_buffers` sent, each buffer in memory of its own (writable)."""
    (count,) = _COUNT.unpack(recv_exactly(conn, _COUNT.size))
    sizes = struct.unpack(f"<{count}Q", recv_exactly(conn, 8 * count))
    out = []
    for n in sizes:
        buf = _allocate(n)
        recv_exactly(conn, n, memoryview(buf))
        out.append(buf)
    return out


def _allocate(n: int) -> Any:
    """``n`` writable bytes for a buffer about to arrive. Large ones are mapped with huge
    pages where the system has them: the received tensor's memory is touched page by page
    as the bytes come in, and 4 KiB pages made that a quarter of a pull's time."""
    if n < (4 << 20) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: plain pages
        pass
    return buf


class ChannelTlsError(ConnectionError):
    """A worker could not open TLS to the notebook's data channel, or what answered there
    was not the notebook's (its certificate is not the one the call named)."""


def connect(address: tuple[str, int], timeout: float,
            tls: Optional[bytes] = None) -> socket.socket:
    """A connection to the notebook's data channel: plain TCP, or with ``tls`` (the SHA-256
    of the certificate the channel presents, handed over with the call) TLS to a listener
    that presents exactly that certificate.

    Raises
    ------
    ChannelTlsError
        The TLS handshake failed or did not finish within ``timeout`` (at most
        :data:`HANDSHAKE_TIMEOUT`) seconds, or the certificate is another; the message names
        this host, the channel's address and what to check.
    OSError
        The channel cannot be reached at all.
    """
    conn = socket.create_connection(address, timeout=timeout)
    if tls is None:
        return conn
    # Pinned, not verified against a CA: the handshake still proves that the listener holds
    # the key of the certificate compared below.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        conn.settimeout(min(timeout, HANDSHAKE_TIMEOUT))
        wrapped = ctx.wrap_socket(conn)
    except OSError as exc:  # ssl.SSLError, a reset, socket.timeout
        conn.close()
        reason = ("no answer to the handshake within "
                  f"{min(timeout, HANDSHAKE_TIMEOUT):g} s" if isinstance(exc, TimeoutError)
                  else f"{type(exc).__name__}: {exc}")
        raise ChannelTlsError(_tls_failed(address, reason)) from None
    der = wrapped.getpeercert(binary_form=True)
    if der is None or not hmac.compare_digest(hashlib.sha256(der).digest(), tls):
        wrapped.close()
        raise ChannelTlsError(_tls_failed(
            address, "it presented a certificate other than the notebook's (SHA-256 "
            f"{hashlib.sha256(der or b'').hexdigest()[:16]}..., expected {tls.hex()[:16]}...)"))
    wrapped.settimeout(timeout)
    return wrapped


def _tls_failed(address: tuple[str, int], reason: str) -> str:
    where = f"{address[0]}:{address[1]}"
    return (f"worker host {socket.gethostname()} could not open TLS to the notebook's data "
            f"channel at {where}: {reason}. The cluster is reached over TLS, so push and pull "
            f"carry their bytes under TLS too. Check that this host reaches {where} directly "
            "(no proxy or firewall that intercepts or drops TLS on that port) and runs the "
            "notebook's version of nbdist; values under "
            f"{CHANNEL_MIN >> 20} MiB travel in the engine's own messages instead")


def fetch(address: tuple[str, int], ticket: bytes, timeout: float,
          tls: Optional[bytes] = None) -> list[Any]:
    """A push's buffers, from the notebook's data channel (under TLS with ``tls``, the
    fingerprint of its certificate: see :func:`connect`)."""
    with connect(address, timeout, tls) as conn:
        conn.sendall(GET + ticket)
        return receive_buffers(conn)


def deliver(address: tuple[str, int], ticket: bytes, buffers: Sequence[Any],
            timeout: float, shared: bool = True, tls: Optional[bytes] = None) -> None:
    """A pull's buffers, to the notebook's data channel (under TLS with ``tls``, as
    :func:`fetch`); returns once it has them all. A notebook on this machine (the channel
    on loopback) is offered one shared copy to map first (unless not ``shared``); where it
    cannot map it, the bytes follow over the channel."""
    if shared and address[0] == LOOPBACK and _share(address, ticket, buffers, timeout, tls):
        return
    with connect(address, timeout, tls) as conn:
        conn.sendall(PUT + ticket)
        send_buffers(conn, buffers)
        if recv_exactly(conn, 1) != b"k":
            raise ValueError("the notebook's data channel did not confirm")


def _share(address: tuple[str, int], ticket: bytes, buffers: Sequence[Any],
           timeout: float, tls: Optional[bytes]) -> bool:
    """Whether the notebook mapped a shared copy of ``buffers`` (closed here once it has:
    its mapping keeps the file)."""
    shared = SharedCopy.make(buffers, ticket)
    if shared is None:
        return False
    try:
        with connect(address, timeout, tls) as conn:
            conn.sendall(SHARE + ticket + shared_copy.encode(shared.spec))
            return recv_exactly(conn, 1) == b"k"
    except (OSError, ValueError):  # no answer: the bytes go over the channel after all
        return False
    finally:
        shared.close()
