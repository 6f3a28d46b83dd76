"""`reach up` names every port in use at once, each with the setting that moves it: checked one
at a time, a second `reach up` beside another was refused once per port, four runs in a row."""

from __future__ import annotations

import contextlib
import itertools
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


@contextlib.contextmanager
def _three_free_in_a_row() -> Iterator[int]:
    """A port held listening whose next two are free too, above the suite's per-worker ranges
    (10000-29999) and below the kernel's ephemeral one (32768-): nothing else hands those out, where
    the two after a port-0 bind were another test's connections' to take (CI saw one taken)."""
    for base in range(30_000, 32_700, 3):
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            held.bind(("127.0.0.1", base))
            for port in (base + 1, base + 2):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            held.close()
            continue
        held.listen()
        try:
            yield base
        finally:
            held.close()
        return
    raise AssertionError("no three free ports in a row in 30000-32699")


def test_free_ports_come_from_the_range_given_and_skip_one_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With REACH_FREE_PORTS set (the suite sets one range per xdist worker, below the ephemeral
    range) every port handed out is inside it, none twice in a row, and one in use is passed
    over: a gateway's gRPC front bound on port 0 once took the HTTP port its gateway was given."""
    with _three_free_in_a_row() as busy:
        monkeypatch.setenv("REACH_FREE_PORTS", f"{busy}-{busy + 2}")
        handed = [free_port() for _ in range(4)]
    assert busy not in handed
    assert set(handed) <= {busy + 1, busy + 2}
    assert all(a != b for a, b in itertools.pairwise(handed))


@pytest.mark.parametrize("span", ["10-", "abc", "20-10", "0-5", "60000-70000"])
def test_a_bad_free_port_range_is_named(monkeypatch: pytest.MonkeyPatch, span: str) -> None:
    monkeypatch.setenv("REACH_FREE_PORTS", span)
    with pytest.raises(ValueError, match="REACH_FREE_PORTS"):
        free_port()
