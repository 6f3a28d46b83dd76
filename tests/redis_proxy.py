"""A TCP proxy in the test's process in front of a private redis-server: each command chunk
a client sends is put to `admit`, which forwards it (True), holds it (by awaiting first) or
drops its connection unforwarded (False), so a test can make the store away for chosen keys
only (a send-once claim, a pin, an idempotency key) while everything else reaches Redis."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Self

from gateway_api.devserver import free_port


class RedisProxy:
    """Forwards everything; subclasses decide in `admit`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def admit(self, chunk: bytes) -> bool:
        """Whether to forward `chunk` (a client's bytes on their way to Redis)."""
        return True

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        both = [
            asyncio.create_task(self._pump(reader, up_writer, check=True)),
            asyncio.create_task(self._pump(up_reader, writer, check=False)),
        ]
        self._pumps.update(both)
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in both:
                task.cancel()
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._pumps.difference_update(both)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, check: bool
    ) -> None:
        while chunk := await reader.read(65536):
            if check and not await self.admit(chunk):
                return  # never forwarded: the command is not run
            writer.write(chunk)
            await writer.drain()
