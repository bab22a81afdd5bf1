"""The job's rendezvous store, hosted in a small process of the notebook's own.

The store outlives any rank: a job whose rank 0 dies can re-form its group, which it could
not if rank 0's worker hosted the store. The notebook talks to it over this process's stdin and
stdout (one JSON request per line, one reply per line), so the notebook itself never imports
torch; workers reach it as a ``TCPStore`` bound to exactly the address given. When the notebook
goes away — even killed with SIGKILL — stdin reaches end of file and this process exits; an
interrupt of the kernel (SIGINT to its process group) leaves it running.

``python -m nbdist.runtime.boot.store_host HOST TIMEOUT`` prints ``{"port": N}`` once the store
listens, then answers ``{"op": ..., "key": ..., "value": ...}`` for the ops set, get, add,
check, open and close.
"""

from __future__ import annotations

import base64
import json
import sys


def serve(host: str, timeout: float) -> None:
    import datetime
    import signal

    # Jupyter's stop button sends SIGINT to the kernel's whole process group, this process
    # included: it interrupts cells, and must not end the store they re-form their group with.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from .. import group

    port = group.open_store(host, "cluster", timeout)
    import torch.distributed as dist

    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
    _reply({"port": port})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op, key = req["op"], req["key"]
            if op == "set":
                store.set(key, base64.b64decode(req["value"]))
                _reply({"ok": True})
            elif op == "check":
                _reply({"ok": True, "value": bool(store.check([key]))})
            elif op == "get":
                value = store.get(key) if store.check([key]) else None
                _reply({"ok": True, "value": None if value is None
                        else base64.b64encode(value).decode()})
            elif op == "open":  # another store, e.g. for a script's own group
                _reply({"ok": True, "value": group.open_store(host, key, timeout)})
            elif op == "close":
                group.close_store(key)
                _reply({"ok": True})
            elif op == "add":
                _reply({"ok": True, "value": store.add(key, int(req.get("value", 1)))})
            else:
                _reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # a bad request must not end the store the job depends on
            _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    group.close_store("cluster")


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    serve(sys.argv[1], float(sys.argv[2]))
