"""A demo `knowledge-retriever` agent built on the SDK, on any protocol.

    python examples/knowledge_retriever.py --reach 127.0.0.1:7600 --instance-id retriever-01
    python examples/knowledge_retriever.py --protocol grpc   # or websocket, or mqtt

Operations: `query` ({"text", "top_k"} -> ranked passages), `get_metadata`, `create` (a
non-idempotent write: {"note"} -> a new note id), `generate` ({"prompt"} -> text, slow with
--delay-ms), and `fail` (answers the agent's own error
`index_unavailable`, with {"status"} as its HTTP-style status). Flags make it misbehave on
purpose for demos and tests: --delay-ms (slow), --defer (answer 202, POST the result later),
--late-error TYPE (with --defer: answer late with an error of the agent's own TYPE),
--reply-bytes N (pad every result with N bytes), --max-message-bytes N, --weight N (share under
weighted round robin / hash ring) and --max-inflight N (in-flight limit) are proposed at Join,
--health-file (read ok/degraded/unhealthy from a file at every heartbeat), --ledger (append every
executed RequestID to a file, to check nothing runs twice), --fail-first N (the first N `query`,
`create` and `generate` calls fail with --fail-status, 503 by default; with --fail-shared, the
first N calls of all the instances sharing the --ledger).

Traces: with `REACH_AGENT_TRACES=file:PATH` (or `console`, `otlp`, `otlp:ENDPOINT`) each
request's handler runs in a span continuing the traceparent Reach sent (`agent_reach_sdk.tracing`).

`query` and `get_metadata` are declared idempotent at Join, so Reach retries them on retryable
failures; `create` is not, so it is retried only for requests that carry an idempotency_key.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import signal
from pathlib import Path
from typing import Any

from agent_reach_sdk import (
    AgentRuntime,
    OperationError,
    RequestContext,
    install_request_id_logging,
)
from reach.limits import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger("knowledge_retriever")

CORPUS = [
    "Temporal persists workflow history, so a crashed worker's request resumes elsewhere.",
    "A capability name routes a request; addresses of instances drift and are never needed.",
    "Heartbeats carry a light self-check; an unhealthy instance receives no traffic.",
    "Idempotent operations retry with exponential backoff: 1 s, 2 s, 4 s.",
    "The RequestID travels through every hop, including the agent's own logs.",
    "Round robin spreads requests evenly over the healthy instances of a capability.",
]


def _stem(word: str) -> str:
    """A plural's singular, roughly: "retries" is "retry", "instances" is "instance"."""
    word = word.strip(".,;:!?\"'()")
    return word[:-3] + "y" if word.endswith("ies") else word.rstrip("s")


def _words(text: str) -> set[str]:
    return {_stem(w) for w in text.lower().split()}


def rank(text: str, top_k: int) -> list[dict[str, Any]]:
    words = _words(text)
    scored = [(len(words & _words(doc)), i, doc) for i, doc in enumerate(CORPUS)]
    scored.sort(key=lambda t: (-t[0], t[1]))
    return [{"id": i, "score": s, "text": doc} for s, i, doc in scored[: max(0, top_k)]]


def build(args: argparse.Namespace) -> AgentRuntime:
    health_file = Path(args.health_file) if args.health_file else None

    def health() -> dict[str, Any]:
        status = health_file.read_text().strip() if health_file and health_file.exists() else "ok"
        return {"status": status or "ok", "checks": {"corpus": len(CORPUS)}}

    runtime = AgentRuntime(
        args.capability,
        reach_address=args.reach,
        instance_id=args.instance_id,
        protocol=args.protocol,
        service_address=args.broker if args.protocol == "mqtt" else f"{args.host}:{args.port}",
        heartbeat_interval=args.heartbeat_interval,
        health_check=health,
        max_message_bytes=args.max_message_bytes,
        weight=args.weight,
        max_inflight=args.max_inflight,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
    )
    ledger = Path(args.ledger) if args.ledger else None
    pending: set[asyncio.Task[None]] = set()

    async def answer_later(request_id: str, result: dict[str, Any]) -> None:
        await asyncio.sleep(args.delay_ms / 1000)
        if args.late_error:
            await runtime.send_result(
                request_id, error_type=args.late_error, error_message="the index is rebuilding"
            )
        else:
            await runtime.send_result(request_id, result)
        log.info("late answer sent for %s", request_id)

    failures_left = [args.fail_first]

    def record(request_id: str) -> None:
        if ledger:
            with ledger.open("a") as f:
                f.write(f"{request_id} {args.instance_id}\n")
        if args.fail_shared and ledger:
            # Counted over every instance writing this ledger: the first N calls of them all.
            if len(ledger.read_text().splitlines()) <= args.fail_first:
                raise OperationError("failing on purpose (--fail-first)", status=args.fail_status)
        elif failures_left[0] > 0:
            failures_left[0] -= 1
            raise OperationError("failing on purpose (--fail-first)", status=args.fail_status)

    @runtime.operation("query", idempotent=True)
    async def query(payload: dict[str, Any], ctx: RequestContext) -> Any:
        log.info("query from %s (attempt %d)", ctx.caller, ctx.attempt)
        record(ctx.request_id)
        text = str(payload.get("text", ""))
        result = {
            "instance_id": args.instance_id,
            "request_id": ctx.request_id,
            "passages": rank(text, int(payload.get("top_k", 3))),
            "fingerprint": hashlib.sha256(text.encode()).hexdigest()[:12],
        }
        if ctx.context_id:  # the conversation it belongs to (an A2A client's contextId)
            result["context_id"] = ctx.context_id
        if args.reply_bytes:
            result["padding"] = "x" * args.reply_bytes
        if args.defer:
            task = asyncio.create_task(answer_later(ctx.request_id, result))
            pending.add(task)
            task.add_done_callback(pending.discard)
            return ctx.defer()
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        return result

    @runtime.operation("create")
    async def create(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        log.info(
            "create from %s (attempt %d, key %s)", ctx.caller, ctx.attempt, ctx.idempotency_key
        )
        record(ctx.request_id)
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        return {"instance_id": args.instance_id, "note_id": f"note-{ctx.request_id}"}

    @runtime.operation("generate")
    async def generate(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        # A slow content-generator-style operation (R23: its own, longer timeout).
        record(ctx.request_id)
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        prompt = str(payload.get("prompt", ""))
        words = rank(prompt, 1)[0]["text"].split()[:8]
        return {"instance_id": args.instance_id, "text": " ".join(words)}

    @runtime.operation("fail")
    def fail(payload: dict[str, Any]) -> dict[str, Any]:
        # The agent's own error: its type and message travel inside Reach's agent_error.
        raise OperationError(
            str(payload.get("message", "the index is missing")),
            type="index_unavailable",
            status=int(payload.get("status", 422)),
        )

    @runtime.operation("get_metadata", idempotent=True)
    def get_metadata(payload: dict[str, Any]) -> dict[str, Any]:
        return {"instance_id": args.instance_id, "documents": len(CORPUS)}

    return runtime


async def amain(args: argparse.Namespace) -> None:
    runtime = build(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with runtime:
        print(f"agent {args.instance_id} serving at {runtime.service_address}", flush=True)
        await stop.wait()


def parser() -> argparse.ArgumentParser:
    """The agent's options, each with its help text (`--help` listed half of them bare)."""
    p = argparse.ArgumentParser(description="demo knowledge-retriever agent")
    p.add_argument(
        "--reach",
        default=None,
        help="gateway address (default: $REACH_ADDRESS, else 127.0.0.1:7600)",
    )
    p.add_argument(
        "--capability",
        default="knowledge-retriever",
        help="the capability this agent serves (default: %(default)s)",
    )
    p.add_argument(
        "--instance-id",
        default="retriever-01",
        help="this instance's id at Join, one per running agent (default: %(default)s)",
    )
    p.add_argument(
        "--protocol",
        default="http",
        choices=["http", "grpc", "websocket", "mqtt"],
        help="how Reach calls this agent (default: %(default)s)",
    )
    p.add_argument(
        "--broker",
        default="127.0.0.1:1883",
        help="MQTT broker, with --protocol mqtt (default: %(default)s)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address this agent listens on (default: %(default)s)",
    )
    p.add_argument("--port", type=int, default=0, help="the port it listens on; 0 = any free port")
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=5.0,
        help="seconds between heartbeats (default: %(default)s)",
    )
    p.add_argument(
        "--delay-ms",
        type=int,
        default=0,
        help="answer query, create and generate this many ms late (with --defer: the late answer)",
    )
    p.add_argument(
        "--defer",
        action="store_true",
        help="query answers 202 at once and POSTs its result later (a late answer)",
    )
    p.add_argument("--late-error", help="with --defer: answer late with this error type")
    p.add_argument("--reply-bytes", type=int, default=0, help="pad each result with N bytes")
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="the largest message it takes, proposed at Join (default: %(default)s)",
    )
    p.add_argument(
        "--weight", type=int, default=1, help="share under weighted routing (1-1000), at Join"
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="requests in flight at which routing passes this instance over, at Join",
    )
    p.add_argument("--tls-cert", help="mTLS: this instance's certificate (reach certs issue)")
    p.add_argument("--tls-key", help="mTLS: its key")
    p.add_argument("--tls-ca", help="mTLS: the CA that signs Reach's certificate (ca.pem)")
    p.add_argument(
        "--health-file",
        metavar="PATH",
        help="read the health status (ok, degraded, unhealthy) from this file at every heartbeat",
    )
    p.add_argument(
        "--ledger",
        metavar="PATH",
        help="append every executed RequestID (and this instance's id) to this file",
    )
    p.add_argument(
        "--fail-first",
        type=int,
        default=0,
        metavar="N",
        help="fail the first N query, create and generate calls, with --fail-status",
    )
    p.add_argument(
        "--fail-status",
        type=int,
        default=503,
        help="the HTTP-style status of the --fail-first failures (default: %(default)s)",
    )
    p.add_argument(
        "--fail-shared",
        action="store_true",
        help="with --ledger: --fail-first counts the calls of every instance sharing the ledger",
    )
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    install_request_id_logging()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s",
    )
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
