"""``runtime.ports.free_port``: rendezvous ports below the ephemeral range, bindable, with a fallback."""

from __future__ import annotations

import socket

import runtime.ports as ports


def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound():
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port("127.0.0.1")
        lo, hi = ports.RENDEZVOUS_PORTS
        assert lo <= port <= hi and (low is None or port < low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_range_falls_back_to_the_kernels_choice(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports, "RENDEZVOUS_PORTS", (taken, taken))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: None)
        port = ports.free_port("127.0.0.1")
        assert port != taken and port > 0
