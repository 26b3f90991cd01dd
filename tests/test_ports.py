"""tests/_ports.free_port: a port the kernel never hands to an outgoing connection, and free when returned."""

from __future__ import annotations

import socket

from tests import _ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    floor = _ports._ephemeral_floor()
    ports = {_ports.free_port() for _ in range(20)}
    assert len(ports) > 1, "each call draws afresh (two pytest processes must not share a sequence)"
    for port in ports:
        assert _ports._FLOOR <= port < floor
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_not_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(_ports, "_FLOOR", taken)
        monkeypatch.setattr(_ports, "_ephemeral_floor", lambda: taken + 1001)
        assert all(_ports.free_port() != taken for _ in range(50))
