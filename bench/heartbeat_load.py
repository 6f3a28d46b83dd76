"""Heartbeat load for bench/routing.py: PUT /reach/agents/{id}/heartbeat as fast as the gateway
answers, from `--concurrency` keep-alive connections, for `--duration` seconds after `--warmup`.
Prints one JSON line: {"ok", "errors", "seconds", "first_error"}.

    python bench/heartbeat_load.py --url http://127.0.0.1:7600 --ids hb- --count 10000

--client httpx (default) is an httpx.AsyncClient; --client raw writes HTTP/1.1 on asyncio
streams itself (a few µs a request instead of ~150 µs), to tell the gateway's ceiling from the
load generator's on a machine where both share the cores.

--grpc HOST:PORT sends them to the gateway's gRPC front instead (`reach.v1.Reach/Heartbeat`,
grpc.aio): `--concurrency` bidi streams, each reporting for its own instances (every
concurrency x step-th id) with up to `--window` reports unacknowledged, the next sent as an
ack arrives. "ok" counts acks without `error_type`, "errors" acks with one (and streams that
failed; such a stream is opened again). The reports are serialized once, before the clock.

    python bench/heartbeat_load.py --grpc 127.0.0.1:7601 --ids hb- --count 10000 --concurrency 40

--batch N sends batched heartbeats instead, N instances' reports a message: over HTTP
`POST /reach/heartbeats` (a JSON array), over gRPC a HeartbeatRequest whose `batch` holds
them. "ok" and "errors" then count entries (each entry's result), not messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from urllib.parse import urlsplit

import grpc
import httpx

from agent_reach_proto import gateway_pb2 as pb

PER_CLIENT = 5
BODY = b'{"status":"ok","checks":{"corpus":6},"inflight":0}'
HEARTBEAT_METHOD = "/reach.v1.Reach/Heartbeat"


class Counter:
    def __init__(self, begin: float, end: float) -> None:
        self.begin, self.end = begin, end
        self.ok = self.errors = 0
        self.first_error: str | None = None

    def count_many(self, ok: int, errors: int, detail: str = "") -> None:
        now = time.monotonic()
        if self.begin <= now < self.end:
            self.ok += ok
            self.errors += errors
            if errors:
                self.first_error = self.first_error or detail

    def count(self, ok: bool, detail: str = "") -> None:
        now = time.monotonic()
        if self.begin <= now < self.end:
            if ok:
                self.ok += 1
            else:
                self.errors += 1
                self.first_error = self.first_error or detail


def batch_body(ids: list[str]) -> bytes:
    """POST /reach/heartbeats's body: one entry per instance."""
    return json.dumps(
        [{"instance_id": i, "status": "ok", "checks": {"corpus": 6}, "inflight": 0} for i in ids],
        separators=(",", ":"),
    ).encode()


def batch_counts(status: int, body: bytes) -> tuple[int, int, str]:
    """(entries recorded, entries refused, the first refusal) of a batch's answer."""
    if status != 200:
        return 0, 1, f"HTTP {status}: {body[:200]!r}"
    answer = json.loads(body)
    first = next((r["error"] for r in answer["results"] if r.get("error")), None)
    return answer["recorded"], answer["refused"], json.dumps(first)[:200] if first else ""


def batches_of(ids: list[str], offset: int, step: int, size: int) -> list[bytes]:
    """This worker's instances (every step-th from offset) in bodies of `size` entries."""
    mine = ids[offset::step] or ids[offset % len(ids) :: step]
    return [batch_body(mine[k : k + size]) for k in range(0, len(mine), size)]


async def httpx_worker(
    client: httpx.AsyncClient,
    ids: list[str],
    offset: int,
    step: int,
    counter: Counter,
    batch: int = 0,
) -> None:
    i = offset
    headers = {"Content-Type": "application/json"}
    bodies = batches_of(ids, offset, step, batch) if batch else []
    while time.monotonic() < counter.end:
        try:
            if bodies:
                r = await client.post("/reach/heartbeats", content=bodies[i % len(bodies)])
                i += 1
                counter.count_many(*batch_counts(r.status_code, r.content))
                continue
            instance_id = ids[i % len(ids)]
            i += step
            r = await client.put(
                f"/reach/agents/{instance_id}/heartbeat", content=BODY, headers=headers
            )
            counter.count(r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as exc:
            counter.count(False, repr(exc))


async def raw_worker(
    host: str,
    port: int,
    ids: list[str],
    offset: int,
    step: int,
    counter: Counter,
    batch: int = 0,
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    i = offset
    bodies = batches_of(ids, offset, step, batch) if batch else []
    try:
        while time.monotonic() < counter.end:
            if bodies:
                body = bodies[i % len(bodies)]
                i += 1
                writer.write(
                    f"POST /reach/heartbeats HTTP/1.1\r\nHost: {host}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
            else:
                instance_id = ids[i % len(ids)]
                i += step
                writer.write(
                    f"PUT /reach/agents/{instance_id}/heartbeat HTTP/1.1\r\nHost: {host}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(BODY)}\r\n\r\n".encode()
                    + BODY
                )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            answer = await reader.readexactly(length)
            if bodies:
                counter.count_many(*batch_counts(status, answer))
            else:
                counter.count(status == 200, f"HTTP {status}: {answer[:200]!r}")
    finally:
        writer.close()


async def grpc_stream(
    channel: grpc.aio.Channel, reports: list[bytes], window: int, counter: Counter
) -> None:
    """One Heartbeat stream: `window` reports in flight, the next written as each ack is read,
    until the end of the measurement; then the stream is closed and its last acks read."""
    beat: grpc.aio.StreamStreamMultiCallable[bytes, pb.HeartbeatAck] = channel.stream_stream(
        HEARTBEAT_METHOD,
        request_serializer=None,  # the reports are bytes already
        response_deserializer=pb.HeartbeatAck.FromString,
    )
    i = 0
    while time.monotonic() < counter.end:
        call = beat()
        outstanding = 0
        try:
            while time.monotonic() < counter.end:
                while outstanding < window:
                    await call.write(reports[i % len(reports)])
                    i += 1
                    outstanding += 1
                ack = await call.read()
                if ack is grpc.aio.EOF or not isinstance(ack, pb.HeartbeatAck):
                    counter.count(False, "the gateway ended the stream")
                    break
                outstanding -= 1
                if ack.batch:
                    refused = [a for a in ack.batch if a.error_type]
                    first = ""
                    if refused:
                        first = f"{refused[0].error_type}: {refused[0].message[:200]}"
                    counter.count_many(len(ack.batch) - len(refused), len(refused), first)
                else:
                    counter.count(not ack.error_type, f"{ack.error_type}: {ack.message[:200]}")
            else:
                await call.done_writing()
                while outstanding and await call.read() is not grpc.aio.EOF:
                    outstanding -= 1
                await call.code()
        except grpc.aio.AioRpcError as exc:
            counter.count(False, f"stream failed: {exc.code().name}: {exc.details()}")
            await asyncio.sleep(0.1)
        finally:
            call.cancel()


async def grpc_load(args: argparse.Namespace, ids: list[str], counter: Counter) -> None:
    streams = range(args.offset, args.concurrency * args.step, args.step)
    every = args.concurrency * args.step
    # A few HTTP/2 connections (a local subchannel pool each, or grpc would share one), as
    # separate agents would open; the streams are spread over them.
    channels = [
        grpc.aio.insecure_channel(args.grpc, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(max(1, min(args.channels, args.concurrency)))
    ]
    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 10)
        tasks = []
        for n, first in enumerate(streams):
            singles = [
                pb.HeartbeatRequest(instance_id=ids[j], status="ok", checks_json='{"corpus":6}')
                for j in range(first, len(ids), every)
            ]
            if args.batch:
                reports = [
                    pb.HeartbeatRequest(batch=singles[k : k + args.batch]).SerializeToString()
                    for k in range(0, len(singles), args.batch)
                ]
            else:
                reports = [report.SerializeToString() for report in singles]
            if reports:
                channel = channels[n % len(channels)]
                tasks.append(grpc_stream(channel, reports, args.window, counter))
        await asyncio.gather(*tasks)
    finally:
        for channel in channels:
            await channel.close()


async def main(args: argparse.Namespace) -> None:
    ids = [f"{args.ids}{i:05d}" for i in range(args.count)]
    start = time.monotonic() + args.warmup
    counter = Counter(start, start + args.duration)
    if args.grpc:
        await grpc_load(args, ids, counter)
    elif args.client == "httpx":
        # A client per few connections: one httpx pool serving 100 connections slows to a
        # crawl (~80 requests/s here), a property of the client, not of the gateway.
        per_client = min(args.concurrency, PER_CLIENT)
        limits = httpx.Limits(max_connections=per_client, max_keepalive_connections=per_client)
        clients = [
            httpx.AsyncClient(base_url=args.url, limits=limits, timeout=10, trust_env=False)
            for _ in range(math.ceil(args.concurrency / per_client))
        ]
        try:
            await asyncio.gather(
                *(
                    httpx_worker(
                        clients[n // args.step // per_client],
                        ids,
                        args.offset + n,
                        args.concurrency * args.step,
                        counter,
                        args.batch,
                    )
                    for n in range(0, args.concurrency * args.step, args.step)
                )
            )
        finally:
            for client in clients:
                await client.aclose()
    else:
        url = urlsplit(args.url)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        await asyncio.gather(
            *(
                raw_worker(
                    host,
                    port,
                    ids,
                    args.offset + n,
                    args.concurrency * args.step,
                    counter,
                    args.batch,
                )
                for n in range(0, args.concurrency * args.step, args.step)
            )
        )
    print(
        json.dumps(
            {
                "ok": counter.ok,
                "errors": counter.errors,
                "seconds": args.duration,
                "first_error": counter.first_error,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="the gateway's HTTP API (or --grpc)")
    p.add_argument("--grpc", metavar="HOST:PORT", help="the gateway's gRPC front instead")
    p.add_argument("--window", type=int, default=2, help="--grpc: reports unacked per stream")
    p.add_argument("--channels", type=int, default=4, help="--grpc: connections per process")
    p.add_argument("--ids", default="hb-", help="instance id prefix (ids are <prefix>00000...)")
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--client", choices=["httpx", "raw"], default="httpx")
    p.add_argument("--batch", type=int, default=0, help="instances per batched heartbeat")
    p.add_argument("--offset", type=int, default=0, help="this process's first id (of --step)")
    p.add_argument("--step", type=int, default=1, help="the number of load processes")
    parsed = p.parse_args()
    if not (parsed.url or parsed.grpc):
        p.error("--url or --grpc is required")
    asyncio.run(main(parsed))
