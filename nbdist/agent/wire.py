"""The attach line and the frames on the wire: a leaf (the standard library and MessagePack)
that the job's agent and the notebook's collector both read.

``NBDIST_ATTACH=tcp://HOST:PORT/TOKEN`` (``tls://`` with certificates) says where a job's
node forwarder connects and which token it presents. A frame is 4 bytes of length (big-endian)
and a body. A body is a MessagePack map (protocol 3: bytes, such as the packed columns of a
batch of events, travel as MessagePack's own binary type), or a JSON object, the earlier forms
a collector of protocol 2 or 1 reads and that are still read: with bytes, a zero byte, 4
bytes of the JSON's length, the JSON, then the bytes, each named in the JSON by
``{"$r": [offset, length]}`` into them (protocol 2), or ``{"$b": base64}`` in the JSON
(protocol 1). The first byte tells them apart. A batch decodes about five times faster from
MessagePack than from the JSON with its references (``benchmarks/RESULTS.md``), which at a
thousand ranks is a share of a core the notebook keeps. Nothing is ever unpickled from a
socket: MessagePack builds only maps, lists, strings, numbers and bytes.

The hello, the collector's answer and its commands stay JSON, which every protocol reads.

The frames a forwarder sends after its :func:`hello` (each names its ``job``):

* ``rank`` — a rank began: ``rank``, ``world_size``, ``local_rank``, ``host``, ``pid``,
  ``restart`` (torchrun's restart count), ``t``;
* ``batch`` — a rank's event batch, as a ``%%distributed`` cell's (``batch``);
* ``dropped`` — ``count`` batches of ``rank`` that a full buffer dropped (a running total);
* ``exit`` — a rank's process ended: ``rank``, ``pid``, ``ok``, ``error`` (text or None)
  and ``failed_at`` (when it was raised), ``lost`` (True: it vanished without saying how it
  ended);
* ``bye`` — the forwarder ends (the launcher exited): ``code``, its exit status if known.

The collector sends its forwarders ``stacks`` (``id``, ``job``, ``rank``: each rank's stack
now) and ``detach`` (``job``: send nothing more of it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import struct
from typing import Any, NamedTuple, Optional

import msgpack

#: the environment variable that activates the agent in a job
ENV = "NBDIST_ATTACH"
#: the node forwarder's spool directory, for the ranks it started
SPOOL_ENV = "NBDIST_ATTACH_SPOOL"
#: set in a rank that reports (its children do not report as ranks)
RANK_ENV = "NBDIST_ATTACH_RANK_PID"
#: a ``%nbdist run`` script's rank: the spool directory its worker reads (no forwarder, no
#: notebook address: the worker relays the rank's events as its own)
RUN_SPOOL_ENV = "NBDIST_RUN_SPOOL"
#: 3: MessagePack bodies (2: bytes after a frame's JSON; 1: bytes as base64 in it). A
#: collector says its own in its answer to the hello (none said: 1), and a forwarder sends an
#: older collector what it can read (:func:`for_protocol`)
PROTOCOL = 3
#: the protocol of frames every collector and forwarder reads: the hello, its answer, commands
JSON_PROTOCOL = 2
#: bytes of one frame at most (a batch is far smaller); a hello much less
MAX_FRAME = 16 << 20
MAX_HELLO = 4096
_LEN = struct.Struct(">I")
#: the first byte of a body that carries bytes after its JSON (a JSON body starts with "{")
_BINARY = b"\x00"


class Address(NamedTuple):
    """Where the notebook's collector listens, and the token it answers to."""

    scheme: str  # "tcp" or "tls"
    host: str
    port: int
    token: str

    @property
    def line(self) -> str:
        """The value of :data:`ENV`: ``tcp://HOST:PORT/TOKEN``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{self.token}"


def new_token() -> str:
    """A fresh token: 32 random bytes, URL-safe text."""
    return secrets.token_urlsafe(32)


def parse(line: str) -> Address:
    """The address in an :data:`ENV` value (``tcp://HOST:PORT/TOKEN``).

    Raises
    ------
    ValueError
        The value is not of that form; the message says what it should look like.
    """
    text = line.strip()
    if text.startswith(f"{ENV}="):
        text = text[len(ENV) + 1:]
    scheme, sep, rest = text.partition("://")
    hostport, _, token = rest.partition("/")
    if not sep or scheme not in ("tcp", "tls") or not token or "/" in token:
        raise ValueError(f"{ENV} should be tcp://HOST:PORT/TOKEN or tls://HOST:PORT/TOKEN, "
                         f"as %nbdist attach prints it; got {line!r}")
    if hostport.startswith("["):
        host, _, port = hostport[1:].partition("]:")
    else:
        host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{ENV} names no HOST:PORT in {line!r} (expected "
                         "tcp://HOST:PORT/TOKEN)")
    return Address(scheme, host, int(port), token)


def token_matches(given: Any, token: str) -> bool:
    """True if ``given`` is ``token``, compared in constant time."""
    if not isinstance(given, str):
        return False
    return secrets.compare_digest(given.encode(), token.encode())


def token_tag(token: str) -> str:
    """A short name derived from the token, safe to show and to put in a path."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def _default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot send {type(obj).__name__} to the notebook")


def _packable(obj: Any) -> Any:
    """MessagePack's fallback: sets as lists; an integer beyond 64 bits (which MessagePack
    hands here) raises OverflowError, so the frame goes as JSON."""
    if isinstance(obj, int):
        raise OverflowError("an integer beyond 64 bits")
    return _default(obj)


def _is_msgpack(body: bytes) -> bool:
    """True if ``body`` is a MessagePack map (a fixmap, a map 16 or a map 32), not JSON."""
    return bool(body) and (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF))


def encode(message: dict[str, Any], protocol: int = PROTOCOL) -> bytes:
    """One frame: length, then ``message``'s body (see the module's docstring); ``protocol``
    2: JSON with its bytes after it, 1: its bytes as base64 in the JSON, for a collector of
    that protocol.

    Raises
    ------
    TypeError
        ``message`` holds a value the wire does not carry (it carries dicts, lists, tuples,
        sets, strings, numbers, booleans, None and bytes).
    """
    if protocol >= 3:
        try:
            body = msgpack.packb(message, use_bin_type=True, default=_packable)
        except OverflowError:  # an integer beyond 64 bits, which JSON carries
            return encode(message, JSON_PROTOCOL)
        return _LEN.pack(len(body)) + body
    blobs: list[bytes] = []
    size = 0

    def attach(obj: Any) -> Any:
        nonlocal size
        if isinstance(obj, (bytes, bytearray, memoryview)):
            if protocol < 2:
                return {"$b": base64.b64encode(bytes(obj)).decode("ascii")}
            blob = bytes(obj)
            blobs.append(blob)
            size += len(blob)
            return {"$r": [size - len(blob), len(blob)]}
        return _default(obj)

    head = json.dumps(message, default=attach, separators=(",", ":")).encode()
    if not blobs:
        return _LEN.pack(len(head)) + head
    return b"".join([_LEN.pack(1 + _LEN.size + len(head) + size), _BINARY,
                     _LEN.pack(len(head)), head, *blobs])


def decode(body: bytes) -> dict[str, Any]:
    """The message in a frame's body (without its length).

    Raises
    ------
    ValueError
        The body is neither a whole MessagePack map nor a JSON object, or names bytes it
        does not hold.
    """
    if _is_msgpack(body):
        try:
            message = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack's errors: malformed, truncated, extra data
            raise ValueError(f"a frame that is not a whole MessagePack map: {exc}") from None
        if not isinstance(message, dict):
            raise ValueError("a frame must hold a map")
        return message
    blobs = b""
    if body[:1] == _BINARY:
        if len(body) < 1 + _LEN.size:
            raise ValueError("a frame too short for its header")
        (n,) = _LEN.unpack_from(body, 1)
        start = 1 + _LEN.size
        if start + n > len(body):
            raise ValueError("a frame shorter than its JSON says")
        blobs = memoryview(body)[start + n:]
        body = body[start:start + n]

    size = len(blobs)

    def hook(obj: dict[str, Any]) -> Any:  # called for every object: the common case first
        if "$r" in obj and len(obj) == 1:
            ref = obj["$r"]
            if type(ref) is list and len(ref) == 2:
                off, length = ref
                if (type(off) is not int or type(length) is not int or off < 0
                        or length < 0 or off + length > size):
                    raise ValueError("a frame names bytes it does not hold")
                return bytes(blobs[off:off + length])
        elif "$b" in obj and len(obj) == 1:
            return base64.b64decode(obj["$b"])
        return obj

    message = json.loads(body, object_hook=hook)
    if not isinstance(message, dict):
        raise ValueError("a frame must hold a JSON object")
    return message


def for_protocol(frame: bytes, protocol: int) -> bytes:
    """``frame`` as a collector of ``protocol`` reads it (the same frame where it can)."""
    body = frame[_LEN.size:]
    if protocol < 3 and (_is_msgpack(body) or (protocol < 2 and body[:1] == _BINARY)):
        return encode(decode(body), protocol)
    return frame


def split(buffer: bytearray, limit: int = MAX_FRAME) -> list[bytes]:
    """Take the complete frames' bodies off the front of ``buffer`` (a partial one stays).

    Raises
    ------
    ValueError
        A frame says it is longer than ``limit`` bytes.
    """
    bodies = []
    while len(buffer) >= _LEN.size:
        (n,) = _LEN.unpack_from(buffer)
        if n > limit:
            raise ValueError(f"frame of {n} bytes, more than {limit}")
        if len(buffer) < _LEN.size + n:
            break
        bodies.append(bytes(buffer[_LEN.size:_LEN.size + n]))
        del buffer[:_LEN.size + n]
    return bodies


def framed(body: bytes) -> bytes:
    """A frame's body with its length in front: the frame as sent."""
    return _LEN.pack(len(body)) + body


def hello(token: str, host: str, pid: int) -> bytes:
    """The first frame of a forwarder's connection (JSON: a collector of any protocol reads
    it)."""
    return encode({"nbdist": PROTOCOL, "token": token, "host": host, "pid": pid},
                  JSON_PROTOCOL)


def job_key(env: Any) -> Optional[str]:
    """The name every rank of one job shares, from the launcher's variables: torchrun's run
    id, Slurm's job step (``slurm-JOB.STEP``, as ``sacct`` names it: each ``srun`` of a batch
    script is a job of its own) or job id, Open MPI's job (``mpirun``'s PMIx namespace, as
    every rank on every host has it), or the rendezvous address (None: none of these)."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    if env.get("PMIX_NAMESPACE"):
        return f"mpirun-{env['PMIX_NAMESPACE']}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None
