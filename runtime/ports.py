"""A TCP port for a rendezvous that another process binds later (rank 0's ``init_process_group``
store, a served app): :func:`free_port`. Imports neither ray nor torch."""

from __future__ import annotations

import random
import socket

__all__ = ["RENDEZVOUS_PORTS", "free_port"]


#: Rendezvous ports are drawn from this range: above Ray's worker ports (10002-19999 by default)
#: and cut below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``,
#: 32768-60999 by default), from which the kernel hands out ports to every port-0 bind and
#: outgoing connection of every process.
RENDEZVOUS_PORTS = (20000, 32767)


def _ephemeral_low() -> int | None:
    """The lowest port of this machine's ephemeral range, or ``None`` where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "") -> int:
    """A TCP port that was free on this machine a moment ago, for a rendezvous that another
    process binds later (rank 0's ``init_process_group`` store).

    The port is drawn at random from :data:`RENDEZVOUS_PORTS` below the ephemeral range, not taken
    from the kernel's port-0 choice: between this check and the later bind, any process's outgoing
    connection or port-0 bind may take an ephemeral port (seen as gloo's ``EADDRINUSE`` with two
    launches on one machine), while none takes these. After 64 ports found busy, the kernel's
    port-0 choice."""
    lo, hi = RENDEZVOUS_PORTS
    eph = _ephemeral_low()
    if eph is not None:
        hi = min(hi, eph - 1)
    draw = random.SystemRandom()
    for _ in range(64 if hi >= lo else 0):
        port = draw.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
