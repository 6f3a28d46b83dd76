"""The agent behind Reach while the MCP conformance suite runs (`make conformance`): an SDK
agent of capability `conformance` whose operations answer what the suite's tool scenarios
call. Run by tests/conformance/run_mcp.py; `python tests/conformance/mcp_agent.py URL`."""

from __future__ import annotations

import base64
import io
import sys
import wave
from typing import Any

from agent_reach_sdk import AgentRuntime, OperationError

runtime = AgentRuntime(
    "conformance",
    reach_address=sys.argv[1] if len(sys.argv) > 1 else None,
    protocol="http",
    service_address="127.0.0.1:0",
    heartbeat_interval=1.0,
)


# A 1x1 red PNG, base64.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx"
    "0gAAAABJRU5ErkJggg=="
)


def silent_wav() -> str:
    """A tenth of a second of silence as WAV, base64."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(8000)
        w.writeframes(b"\x80" * 800)
    return base64.b64encode(out.getvalue()).decode()


WAV = silent_wav()


def blocks(*content: dict[str, Any]) -> dict[str, Any]:
    """A result that is MCP content blocks: Reach's MCP front passes them on as they are."""
    return {"content": list(content)}


@runtime.operation("test_simple_text", idempotent=True)
def simple_text(payload: dict[str, Any]) -> dict[str, Any]:
    """Answers with a fixed text."""
    return blocks({"type": "text", "text": "This is a simple text response for testing."})


@runtime.operation("test_image_content", idempotent=True)
def image_content(payload: dict[str, Any]) -> dict[str, Any]:
    """Answers with a 1x1 PNG."""
    return blocks({"type": "image", "data": PNG, "mimeType": "image/png"})


@runtime.operation("test_audio_content", idempotent=True)
def audio_content(payload: dict[str, Any]) -> dict[str, Any]:
    """Answers with a short WAV."""
    return blocks({"type": "audio", "data": WAV, "mimeType": "audio/wav"})


@runtime.operation("test_embedded_resource", idempotent=True)
def embedded_resource(payload: dict[str, Any]) -> dict[str, Any]:
    """Answers with an embedded text resource."""
    resource = {
        "uri": "test://embedded-resource",
        "mimeType": "text/plain",
        "text": "This is an embedded resource content.",
    }
    return blocks({"type": "resource", "resource": resource})


@runtime.operation("test_multiple_content_types", idempotent=True)
def multiple_content_types(payload: dict[str, Any]) -> dict[str, Any]:
    """Answers with text, an image and a resource."""
    resource = {
        "uri": "test://mixed-content-resource",
        "mimeType": "application/json",
        "text": '{"test":"data","value":123}',
    }
    return blocks(
        {"type": "text", "text": "Multiple content types test:"},
        {"type": "image", "data": PNG, "mimeType": "image/png"},
        {"type": "resource", "resource": resource},
    )


@runtime.operation("test_error_handling")
def error_handling(payload: dict[str, Any]) -> dict[str, Any]:
    """Always fails."""
    raise OperationError("This tool intentionally returns an error for testing", status=500)


if __name__ == "__main__":
    runtime.run()
