"""A free TCP port on 127.0.0.1 for a server a test starts in another process.

The kernel's own pick (bind to port 0) comes from the ephemeral range, the same range it hands to every outgoing
connection: with four pytest processes side by side talking to local servers, the port can be taken as a client's
local port in the seconds before the server binds it (the fresh-clone CI at bf980d7 failed so: "Address already in
use" on install.sh --demo's port). A port below the ephemeral range is never given out that way.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FLOOR = 20000  # above the usual service ports; below Linux's default ephemeral floor (32768)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port below the ephemeral range that nothing holds now (checked by binding it)."""
    top = _ephemeral_floor()
    if top - _FLOOR < 1000:  # a machine whose ephemeral range starts low: the kernel's pick is all there is
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()  # not the seeded `random`: two processes must not draw the same sequence
    for _ in range(200):
        port = rng.randrange(_FLOOR, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_FLOOR}-{top - 1} on 127.0.0.1 after 200 tries")
