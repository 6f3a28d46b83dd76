"""`reach up` names every port in use at once, each with the setting that moves it: checked one
at a time, a second `reach up` beside another was refused once per port, four runs in a row."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gateway_api.devserver import PortInUse, free_port, require_all_free


@pytest.fixture
def held() -> Iterator[list[int]]:
    """Two ports something listens on, for the test's length."""
    sockets = []
    for _ in range(2):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        s.listen()
        sockets.append(s)
    try:
        yield [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_every_port_in_use_is_named_in_one_error(held: list[int]) -> None:
    free = free_port()
    wanted = [
        (held[0], "gateway", "REACH_LISTEN_PORT", "127.0.0.1"),
        (free, "gateway gRPC front", "REACH_TRANSPORT__PORTS__GRPC", "127.0.0.1"),
        (held[1], "Temporal dev server", "REACH_TEMPORAL__DEV_SERVER__PORT", "127.0.0.1"),
    ]
    with pytest.raises(PortInUse) as refused:
        require_all_free(wanted)
    lines = str(refused.value).splitlines()
    assert lines == [
        f"port {held[0]} (gateway) is already in use on 127.0.0.1. Stop whatever holds it, "
        "or choose another port with REACH_LISTEN_PORT.",
        f"port {held[1]} (Temporal dev server) is already in use on 127.0.0.1. Stop whatever "
        "holds it, or choose another port with REACH_TEMPORAL__DEV_SERVER__PORT.",
    ]


def test_free_ports_pass() -> None:
    require_all_free([(free_port(), "gateway", "REACH_LISTEN_PORT", "127.0.0.1")])
