"""Throwaway Redis topologies for integration tests, on loopback and free ports: a Redis Cluster
(`redis-server --cluster-enabled` nodes joined by `redis-cli --cluster create`) and a Sentinel
pair (a master, its replica and a few `redis-server --sentinel` processes). Never the machine's
own Redis: every process here is started, and stopped, by the test that asked for it.

Each helper waits on the topology's own word (`cluster info`, `SENTINEL` replies) with a
deadline, never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from gateway_api.devserver import free_port

HOST = "127.0.0.1"
MASTER_NAME = "mymaster"


def _exe(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not on PATH (the Redis server package installs it)")
    return found


def _until(what: str, check: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s}s")
        time.sleep(every_s)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


@dataclass
class RedisProcess:
    """One `redis-server` (data node or sentinel) in a directory of its own."""

    port: int
    workdir: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        with log:
            self.proc = subprocess.Popen(
                [_exe("redis-server"), *self.args],
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _until(f"redis on {self.port}", lambda: self._alive() and _listening(self.port), 10)
        return self

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis on {self.port} exited:\n{self.log()}")
        return True

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, decode_responses=True, socket_timeout=2)

    def kill(self) -> None:
        """SIGKILL: a crash, as an operator's failover drill would have it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _data_node_args(port: int) -> list[str]:
    return ["--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]


# -- Redis Cluster --------------------------------------------------------------------------


@dataclass
class RedisClusterServers:
    nodes: list[RedisProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Reach's URL for it: `redis+cluster://` and every node (any one would do)."""
        return "redis+cluster://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def redis_cluster(tmp: Path, masters: int = 3) -> Iterator[RedisClusterServers]:
    """A Redis Cluster of `masters` nodes (no replicas), every slot covered, `cluster_state:ok`."""
    servers = RedisClusterServers()
    try:
        for n in range(masters):
            port, bus = free_port(), free_port()
            # The bus port is named: the default (port + 10000) may be taken, or past 65535.
            args = [
                *_data_node_args(port),
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-port", str(bus),
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
            servers.nodes.append(RedisProcess(port, tmp / f"cluster-{n}", args).start())
        create = [_exe("redis-cli"), "--cluster", "create"]
        create += [f"{HOST}:{node.port}" for node in servers.nodes]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}")

        def every_node_agrees() -> bool:
            for node in servers.nodes:
                with node.client() as c:
                    info = c.execute_command("CLUSTER", "INFO")
                    text = info if isinstance(info, str) else str(info)
                    if "cluster_state:ok" not in text or "cluster_known_nodes:" not in text:
                        return False
                    known = int(text.split("cluster_known_nodes:")[1].split()[0])
                    if known != masters:
                        return False
            return True

        _until("cluster_state:ok on every node", every_node_agrees, 30)
        yield servers
    finally:
        servers.stop()


# -- Sentinel ---------------------------------------------------------------------------------


@dataclass
class SentinelServers:
    data: list[RedisProcess] = field(default_factory=list)  # the first master, then replicas
    sentinels: list[RedisProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Reach's URL for it: `redis+sentinel://`, every sentinel, then the master's name."""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}"

    def master_port(self) -> int:
        """The master as the sentinels see it now."""
        with self.sentinels[0].client() as c:
            _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            return int(port)

    def node(self, port: int) -> RedisProcess:
        return next(n for n in self.data if n.port == port)

    def failover(self, timeout_s: float = 20.0) -> int:
        """Ask the sentinels to promote the replica; returns the new master's port once every
        sentinel names it and it takes writes."""
        old = self.master_port()
        with self.sentinels[0].client() as c:
            c.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        return self.wait_new_master(old, timeout_s)

    def wait_new_master(self, old: int, timeout_s: float = 30.0) -> int:
        def moved() -> bool:
            for sentinel in self.sentinels:
                if sentinel.proc is None or sentinel.proc.poll() is not None:
                    continue
                with sentinel.client() as c:
                    _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
                    if int(port) == old:
                        return False
            with self.node(self.master_port()).client() as c:
                return bool(c.execute_command("ROLE")[0] == "master")

        _until(f"a master other than {old}", moved, timeout_s)
        return self.master_port()

    def stop(self) -> None:
        for proc in [*self.sentinels, *self.data]:
            proc.stop()


@contextlib.contextmanager
def redis_sentinel(tmp: Path, replicas: int = 1, sentinels: int = 3) -> Iterator[SentinelServers]:
    """A master, `replicas` replicas and `sentinels` sentinels watching it as `mymaster`
    (quorum 2), ready for a failover: every sentinel sees the replicas and the other sentinels."""
    servers = SentinelServers()
    try:
        master_port = free_port()
        servers.data.append(
            RedisProcess(master_port, tmp / "master", _data_node_args(master_port)).start()
        )
        for n in range(replicas):
            port = free_port()
            args = [*_data_node_args(port), "--replicaof", HOST, str(master_port)]
            servers.data.append(RedisProcess(port, tmp / f"replica-{n}", args).start())

        def replicas_synced() -> bool:
            with servers.data[0].client() as c:
                info = c.info("replication")
                return bool(info.get("connected_slaves") == replicas) and all(
                    info[f"slave{i}"]["state"] == "online" for i in range(replicas)
                )

        _until("replicas in sync", replicas_synced, 20)
        for n in range(sentinels):
            port = free_port()
            workdir = tmp / f"sentinel-{n}"
            workdir.mkdir(parents=True)
            conf = workdir / "sentinel.conf"  # sentinels rewrite their own file: one each
            conf.write_text(
                f"port {port}\nbind {HOST}\ndir {workdir}\n"
                f"sentinel monitor {MASTER_NAME} {HOST} {master_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            servers.sentinels.append(RedisProcess(port, workdir, [str(conf), "--sentinel"]).start())

        def every_sentinel_sees_all() -> bool:
            for sentinel in servers.sentinels:
                with sentinel.client() as c:
                    seen = c.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
                    peers = c.execute_command("SENTINEL", "SENTINELS", MASTER_NAME)
                    if len(seen) < replicas or len(peers) < sentinels - 1:
                        return False
                    for replica in seen:
                        flags = str(replica["flags"])  # redis-py parses each into a dict
                        if "down" in flags or "disconnected" in flags:
                            return False
            return True

        _until("every sentinel sees the replicas and its peers", every_sentinel_sees_all, 30)
        yield servers
    finally:
        servers.stop()
