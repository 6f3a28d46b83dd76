"""How the CLI says an envelope's error: the agent's own error once, not twice when Reach's
message quotes it already (an MCP tool's validation error was printed in full two times)."""

from __future__ import annotations

from gateway_api.cli_api import error_text


def test_an_agent_message_quoted_by_reach_is_said_once() -> None:
    said = "Error executing tool fail: reason Field required"
    text = error_text(
        {
            "error": {
                "type": "agent_error",
                "message": f"MCP server m-1: the tool failed: {said}",
                "agent": {"type": "tool_error", "message": said},
            }
        }
    )
    assert text == f"agent_error: MCP server m-1: the tool failed: {said} (agent: tool_error)"
    assert text.count(said) == 1


def test_an_agent_message_reach_did_not_quote_is_said() -> None:
    text = error_text(
        {
            "error": {
                "type": "agent_error",
                "message": "retriever-01 answered an error",
                "agent": {"type": "not_found", "message": "no document 7"},
            }
        }
    )
    assert text == "agent_error: retriever-01 answered an error (agent: not_found: no document 7)"


def test_an_agent_without_a_message_keeps_its_type() -> None:
    text = error_text({"error": {"type": "agent_error", "message": "x", "agent": {"type": "t"}}})
    assert text == "agent_error: x (agent: t)"


def test_the_type_is_said_once() -> None:
    """No `error: error: ...` for an envelope without a type, nor the type twice when the
    message starts with it (a 403 printed `forbidden: forbidden: ...`)."""
    assert error_text({"error": {"message": "no such thing"}}) == "no such thing"
    said = error_text({"error": {"type": "forbidden", "message": "forbidden: not yours"}})
    assert said == "forbidden: not yours"
    assert error_text({"error": {"type": "forbidden", "message": "not yours"}}) == (
        "forbidden: not yours"
    )
