"""How the SDK reads `reach_address` (one gateway or several) — pure logic; the failover itself
runs against real sockets in tests/integration/test_sdk_failover.py."""

from __future__ import annotations

import pytest

from agent_reach_sdk import AgentRuntime


@pytest.mark.parametrize(
    ("given", "urls"),
    [
        ("10.0.0.5:7600", ("http://10.0.0.5:7600",)),
        ("https://reach.example/", ("https://reach.example",)),
        (
            "10.0.0.5:7600, 10.0.0.6:7600",
            ("http://10.0.0.5:7600", "http://10.0.0.6:7600"),
        ),
        (
            ["10.0.0.5:7600", "https://b.example:7600"],
            ("http://10.0.0.5:7600", "https://b.example:7600"),
        ),
        (("a:1", "b:2,c:3"), ("http://a:1", "http://b:2", "http://c:3")),
        ("a:1,,a:1/,", ("http://a:1",)),  # each once, empties ignored
    ],
)
def test_reach_address_is_one_gateway_or_several_in_order(
    given: str | list[str] | tuple[str, ...], urls: tuple[str, ...]
) -> None:
    runtime = AgentRuntime("cap", reach_address=given, instance_id="cap-01")
    assert runtime.reach_urls == urls
    assert runtime.reach_url == urls[0]  # the first is talked to first


def test_reach_address_environment_takes_several_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_ADDRESS", "g1:7600,g2:7600")
    assert AgentRuntime("cap", instance_id="cap-01").reach_urls == (
        "http://g1:7600",
        "http://g2:7600",
    )
    monkeypatch.delenv("REACH_ADDRESS")
    assert AgentRuntime("cap", instance_id="cap-01").reach_urls == ("http://127.0.0.1:7600",)


@pytest.mark.parametrize("given", [",", [" ", ""], [], ["a:1", 7]])
def test_a_reach_address_naming_no_gateway_is_refused_up_front(given: object) -> None:
    with pytest.raises(ValueError, match="reach_address"):
        AgentRuntime("cap", reach_address=given, instance_id="cap-01")  # type: ignore[arg-type]


def test_setting_reach_url_still_points_the_runtime_at_one_gateway() -> None:
    runtime = AgentRuntime("cap", reach_address="a:1,b:2", instance_id="cap-01")
    runtime.reach_url = "http://c:3"
    assert runtime.reach_urls == ("http://c:3",)
