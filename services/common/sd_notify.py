"""systemd's readiness protocol (`Type=notify` units): a datagram to $NOTIFY_SOCKET.

`systemctl start/restart` of such a unit returns once the service says READY=1, so a
rolling restart (`for i in 0 1 2; do systemctl restart ferry-instance@$i; done`) waits for
each instance to serve before stopping the next. Outside systemd, nothing happens.
"""

from __future__ import annotations

import os
import socket


def notify_systemd(state: str) -> bool:
    """Send `state` (e.g. "READY=1", "STOPPING=1"); False where no systemd waits for it."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError:
            return False  # systemd is gone or the socket is not ours: serving matters more
    return True
