"""A tiny OTLP/gRPC trace receiver of the bench's own: the collector a production gateway
exports its spans to (bench/invoke.py's "reach inline, production + OTLP" row).

    python bench/otlp_sink.py --port 4317 --count /tmp/spans.count

It answers every Export at once and counts the spans it received, writing the running total
to --count about once a second (and at exit): the bench reads it to show the spans did arrive.
It does no more work than that, as a collector's receiver handing batches to a queue would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[
            trace_service_pb2.ExportTraceServiceRequest,
            trace_service_pb2.ExportTraceServiceResponse,
        ],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.exports += 1
        self.spans += sum(
            len(scope.spans)
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )
        return trace_service_pb2.ExportTraceServiceResponse()


async def serve(port: int, count: Path) -> None:
    sink = Sink()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def write() -> None:
        count.write_text(f"{sink.spans} {sink.exports}\n")

    write()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        write()
    await server.stop(1)
    write()


def read_count(count: Path) -> tuple[int, int]:
    """The spans and Export calls the sink has counted so far (0, 0 before it wrote any)."""
    try:
        spans, exports = count.read_text().split()
    except (OSError, ValueError):
        return 0, 0
    return int(spans), int(exports)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=Path, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.count))
