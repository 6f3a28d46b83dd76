"""The CLI's rendering: ages, checks, tables (rich and plain), terminal-safe agent strings, the
spinner only on a terminal, the config summary."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from gateway_api import cli_view
from reach.config import ReachSettings


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (-1, "0.0s"),
        (0.42, "0.4s"),
        (12.4, "12s"),
        (185, "3m05s"),
        (8040, "2h14m"),
        (2 * 86_400 + 7300, "2d02h"),
    ],
)
def test_age(seconds: float, shown: str) -> None:
    assert cli_view.age(seconds) == shown


def test_compact_checks() -> None:
    assert cli_view.compact({"corpus": 6, "index": "loaded"}) == "corpus=6 index=loaded"
    assert cli_view.compact({"nested": {"a": [1, 2]}}) == 'nested={"a": [1, 2]}'
    assert cli_view.compact({}) == "-"
    long = cli_view.compact({"k": "x" * 100}, limit=20)
    assert len(long) == 20
    assert long.endswith("…")


def test_control_characters_from_agents_are_escaped() -> None:
    # An escape sequence in an agent's check must not reach the terminal as one.
    assert cli_view.clean("ok\x1b[2J\x07 done\n") == "ok\\x1b[2J\\x07 done\\n"
    assert cli_view.clean("naïve ünïcode ✓") == "naïve ünïcode ✓"


def test_plain_table_is_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    cli_view.print_table(["A", "LONGER"], [["x", "1"], ["yyyy", "22"]])
    assert capsys.readouterr().out.splitlines() == ["A     LONGER", "x     1", "yyyy  22"]


def test_rich_table_shows_agent_text_as_text() -> None:
    out = FakeTerminal()
    console = Console(file=out, force_terminal=True, width=120, color_system="standard")
    cli_view.print_table(
        ["INSTANCE", "HEALTH", "CHECKS"],
        [["a-01", "degraded", "[bold red]not markup[/] \x1b]0;title\x07"]],
        [None, cli_view.HEALTH_STYLE, None],
        console=console,
    )
    text = out.getvalue()
    assert "[bold red]not markup[/]" in text  # shown literally, not read as rich markup
    assert "\x1b]0;" not in text  # the agent's escape sequence is neutralised
    assert "\\x1b]0;title\\x07" in text
    assert "\x1b[33mdegraded" in text  # health in colour: degraded is yellow


def test_spinner_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    piped = io.StringIO()
    monkeypatch.setattr("sys.stderr", piped)
    with cli_view.progress("waiting for cap.op"):
        time.sleep(0.2)
    assert piped.getvalue() == ""

    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with cli_view.progress("waiting for cap.op"):
        time.sleep(0.3)
    assert "waiting for cap.op" in terminal.getvalue()


def test_config_summary_names_the_essentials() -> None:
    summary = dict(cli_view.summary(ReachSettings()))
    assert summary["gateway"] == "http://127.0.0.1:7600 (gRPC front: 7601)"
    assert summary["registry"].startswith("memory, heartbeat every 5s, evicted after 30s")
    assert summary["auth"].startswith("auto, 0 rules, tokens in ")
    assert summary["auth"].endswith("tokens.json (auth.tokens_file)")
    assert "history encryption off" in summary["security"]


def test_temporal_ui_url_defaults_to_the_dev_server() -> None:
    assert ReachSettings().temporal.ui_base_url == "http://127.0.0.1:8233"
    settings = ReachSettings.model_validate(
        {"temporal": {"ui_url": "https://temporal.example.com/"}}
    )
    assert settings.temporal.ui_base_url == "https://temporal.example.com"
    headless = ReachSettings.model_validate({"temporal": {"dev_server": {"headless": True}}})
    assert headless.temporal.ui_base_url is None
    with pytest.raises(ValueError, match="ui_url"):
        ReachSettings.model_validate({"temporal": {"ui_url": "javascript:alert(1)"}})
