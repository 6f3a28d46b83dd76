"""The bench's OTLP collector (bench/otlp_sink.py) counts what a gateway's exporter sends it:
the production + OTLP row's proof that its spans left the gateway over OTLP."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from gateway_api.devserver import free_port
from reach.telemetry.tracing import build_provider, exporter_for
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]


def read_count(count: Path) -> tuple[int, int]:
    """The sink's count file: spans and Export calls (read here, not imported from bench/:
    tests import no bench module)."""
    try:
        spans, exports = count.read_text().split()
    except (OSError, ValueError):
        return 0, 0
    return int(spans), int(exports)


async def test_the_sink_counts_the_spans_a_batched_otlp_exporter_sends(tmp_path: Path) -> None:
    port, count = free_port(), tmp_path / "spans.count"
    sink = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench/otlp_sink.py"), "--port", str(port), "--count", str(count)
    )
    try:
        await wait_until(count.exists, 30)
        assert read_count(count) == (0, 0)
        provider = build_provider(
            exporter_for("otlp", otlp_endpoint=f"http://127.0.0.1:{port}"), service_name="t"
        )
        tracer = provider.get_tracer("test")
        for name in ("door", "workflow", "call"):
            with tracer.start_as_current_span(name):
                pass
        assert provider.force_flush(30_000)
        await wait_until(lambda: read_count(count)[0] == 3, 30)
        provider.shutdown()
    finally:
        sink.terminate()
        assert await asyncio.wait_for(sink.wait(), 30) == 0
    spans, exports = read_count(count)
    assert spans == 3
    assert exports >= 1
