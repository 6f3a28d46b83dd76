"""FastAPI's own HTTP telemetry, when a process turns it on, still sees `POST /reach/invoke`
(which is otherwise answered ahead of FastAPI's middleware stack)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process: OpenTelemetry's global providers can be set only once per process.
PROBE = """
import asyncio
import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

from gateway_api.app import create_app
from reach.config import ReachSettings

app = create_app(ReachSettings(), None, run_worker=False)  # no lifespan: a 500 envelope

async def main():
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        r = await client.post("/reach/invoke", content=b"{}")
        print("status", r.status_code)
    for span in exporter.get_finished_spans():
        print("span", span.name)

asyncio.run(main())
"""


def test_invokes_are_in_fastapis_telemetry_when_it_is_on() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    spans = [line.removeprefix("span ") for line in out.stdout.splitlines() if "span " in line]
    assert any(name.startswith("POST") for name in spans), out.stdout
