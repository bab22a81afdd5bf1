"""This host's own address on the route to another: what a worker started elsewhere binds, so
that it listens on the network that reaches the notebook's scheduler and on no other.

``python -m nbdist.runtime.boot.route ADDRESS`` prints it (a batch job's script asks it on the
node the job runs on). Standard library only.
"""

from __future__ import annotations

import socket
import sys


def local_address(remote: str) -> str:
    """The address of this host that the kernel's routing table uses to reach ``remote``
    (nothing is sent: connecting a UDP socket only picks the route)."""
    family = socket.AF_INET6 if ":" in remote else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((remote, 9))
        return s.getsockname()[0]


if __name__ == "__main__":
    print(local_address(sys.argv[1]))
