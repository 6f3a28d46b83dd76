"""Logs (R25, issue 11): JSON lines with request and trace ids, heartbeats sampled and apart,
every registry state change in the main log."""

from __future__ import annotations

import io
import json
import logging
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from reach.config import RegistrySettings, TelemetrySettings
from reach.registry import HealthReport, JoinRequest, Registry
from reach.store.memory import MemoryStore
from reach.telemetry.logs import (
    HEARTBEAT_LOGGER,
    JsonFormatter,
    SampleFilter,
    current_request_id,
    request_id_of,
    setup_logging,
)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """setup_logging configures the process's loggers: put them back after each test."""
    root = logging.getLogger()
    beats = logging.getLogger(HEARTBEAT_LOGGER)
    saved = (
        list(root.handlers),
        root.level,
        list(beats.handlers),
        list(beats.filters),
        beats.level,
        beats.propagate,
    )
    yield
    for logger in (root, beats):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            if getattr(handler, "_reach_handler", False):
                handler.close()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    beats.handlers[:] = saved[2]
    beats.filters[:] = saved[3]
    beats.setLevel(saved[4])
    beats.propagate = saved[5]


def record(message: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("reach.gateway", logging.INFO, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


# -- the JSON formatter ----------------------------------------------------------------------


def test_a_json_line_has_ts_level_logger_and_message() -> None:
    out = json.loads(JsonFormatter().format(record("hello %s", "world")))
    assert out["level"] == "INFO"
    assert out["logger"] == "reach.gateway"
    assert out["message"] == "hello world"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["ts"]), out["ts"]
    assert "request_id" not in out
    assert "trace_id" not in out


def test_the_request_id_comes_from_the_context_of_the_request() -> None:
    token = current_request_id.set("req-42")
    try:
        out = json.loads(JsonFormatter().format(record()))
    finally:
        current_request_id.reset(token)
    assert out["request_id"] == "req-42"


def test_temporal_workflow_and_activity_records_name_their_request() -> None:
    # Temporal's workflow and activity loggers put their context on the record; the workflow
    # id is the RequestID, a callback delivery's is `<request_id>/callback`.
    assert request_id_of(record(temporal_workflow={"workflow_id": "req-1"})) == "req-1"
    assert request_id_of(record(temporal_activity={"workflow_id": "req-2/callback"})) == "req-2"
    # The agent SDK's record factory: '-' outside a request.
    assert request_id_of(record(request_id="req-3")) == "req-3"
    assert request_id_of(record(request_id="-")) is None


def test_trace_and_span_ids_of_the_active_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        out = json.loads(JsonFormatter().format(record()))
        ctx = span.get_span_context()
    assert out["trace_id"] == format(ctx.trace_id, "032x")
    assert out["span_id"] == format(ctx.span_id, "016x")
    assert "trace_id" not in json.loads(JsonFormatter().format(record()))  # span ended


def test_an_exception_is_one_field_of_the_same_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "failed", None, exc_info=__import__("sys").exc_info()
        )
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_json_logs_through_setup_logging() -> None:
    stream = io.StringIO()
    setup_logging(TelemetrySettings(logs_format="json"), stream=stream)
    logging.getLogger("reach.gateway").info("ready on %s", "127.0.0.1:7600")
    logging.getLogger("reach.gateway").debug("not at INFO")
    (line,) = stream.getvalue().splitlines()
    assert json.loads(line)["message"] == "ready on 127.0.0.1:7600"


# -- sampling --------------------------------------------------------------------------------


def test_sampling_keeps_about_the_ratio() -> None:
    rng = random.Random(20240611)
    sample = SampleFilter(0.01, rng.random)
    kept = sum(sample.filter(record()) for _ in range(100_000))
    # Binomial(100000, 0.01): mean 1000, sd ~31.5; 5 sd either way.
    assert 840 <= kept <= 1160, kept
    again = SampleFilter(0.01, random.Random(20240611).random)
    assert sum(again.filter(record()) for _ in range(100_000)) == kept  # seeded: reproducible


def test_sampling_at_zero_and_one() -> None:
    assert not any(SampleFilter(0.0).filter(record()) for _ in range(10_000))
    assert all(SampleFilter(1.0).filter(record()) for _ in range(10_000))
    with pytest.raises(ValueError, match="between 0 and 1"):
        SampleFilter(1.5)


def test_the_heartbeat_log_is_apart_and_verbose_keeps_all(tmp_path: Path) -> None:
    main = io.StringIO()
    apart = tmp_path / "heartbeats.log"
    settings = TelemetrySettings(heartbeat_log_sample=0.0, heartbeat_log_file=str(apart))
    setup_logging(settings, stream=main)
    beats = logging.getLogger(HEARTBEAT_LOGGER)
    for i in range(100):
        beats.info("heartbeat instance=a-%d", i)
    assert not apart.read_text()
    assert not main.getvalue()
    setup_logging(settings, verbose=True, stream=main)  # `reach -v`: every heartbeat
    for i in range(100):
        beats.info("heartbeat instance=a-%d", i)
    assert len(apart.read_text().splitlines()) == 100
    assert "heartbeat" not in main.getvalue()
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_reach_handler", False)]
    assert len(ours) == 1  # configured twice: the second replaced the first


# -- the registry: state changes always, heartbeats sampled ----------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def join(instance_id: str, capability: str = "retriever") -> JoinRequest:
    return JoinRequest(
        capability=capability,
        instance_id=instance_id,
        protocol="http",
        service_address="127.0.0.1:9001",
        operations=["query"],
    )


async def test_state_changes_are_always_logged_while_heartbeats_are_sampled(
    tmp_path: Path,
) -> None:
    main = io.StringIO()
    apart = tmp_path / "heartbeats.log"
    rng = random.Random(7)
    setup_logging(
        TelemetrySettings(heartbeat_log_sample=0.01, heartbeat_log_file=str(apart)),
        stream=main,
        rng=rng.random,
    )
    clock = Clock()
    settings = RegistrySettings(heartbeat_timeout=3.0, heartbeat_interval=1.0)
    registry = Registry(MemoryStore(clock), settings)
    await registry.join(join("r-01"))
    await registry.join(join("r-02"))
    beats = 0
    for status in ["ok"] * 300 + ["degraded"] * 300 + ["unhealthy"] * 300 + ["ok"] * 300:
        await registry.heartbeat("r-01", HealthReport(status=status))  # type: ignore[arg-type]
        beats += 1
    await registry.join(join("r-01"))  # a re-join
    await registry.leave("r-01")
    clock.now += 10  # r-02 is silent past its heartbeat timeout
    await registry.sweep()
    with pytest.raises(Exception, match="not registered"):
        await registry.heartbeat("r-02", HealthReport())  # evicted: it must join again
    await registry.join(join("r-02"))

    log = main.getvalue()
    lines = log.splitlines()
    # Every state change, in the main log, each once.
    for expected in [
        "health instance=r-01 capability=retriever ok -> degraded",
        "health instance=r-01 capability=retriever degraded -> unhealthy",
        "health instance=r-01 capability=retriever unhealthy -> ok",
        "instance=r-01 protocol=http address=127.0.0.1:9001 (re-join)",
        "left capability=retriever instance=r-01",
        "evicted capability=retriever instance=r-02",
        "heartbeat from unknown instance=r-02: asked to join again",
    ]:
        assert sum(expected in line for line in lines) == 1, (expected, log)
    joins = [line for line in lines if "joined capability=retriever" in line]
    assert len(joins) == 4  # r-01, r-02, r-01 again (re-join), r-02 after its eviction
    # Heartbeats and handshakes never in the main log, and only a sample of them apart.
    assert "heartbeat instance=" not in log
    assert "handshake" not in log
    sampled = apart.read_text().splitlines()
    assert all(("heartbeat instance=" in s or "handshake instance=" in s) for s in sampled)
    assert 1 <= len(sampled) <= 40, len(sampled)  # ~1% of 1204 records
    assert beats == 1200
