"""docker-compose.temporal.yml can't run here (no Docker engine), so check it agrees with the
settings: services, ports and the environment the gateway and workers are configured by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from reach.config import ReachSettings

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.temporal.yml").read_text())
    return data


def _ports(service: dict[str, Any]) -> dict[int, int]:
    out = {}
    for spec in service.get("ports", []):
        host, container = str(spec).split(":")
        out[int(container)] = int(host)
    return out


def test_services_present(compose: dict[str, Any]) -> None:
    assert {"postgresql", "temporal", "temporal-ui", "redis", "gateway", "worker"} <= set(
        compose["services"]
    )


def test_ports_match_the_embedded_defaults(compose: dict[str, Any]) -> None:
    s = ReachSettings()
    svc = compose["services"]
    grpc = s.transport.ports["grpc"]
    assert _ports(svc["gateway"]) == {s.listen_port: s.listen_port, grpc: grpc}
    temporal_port = int(s.temporal.address.rsplit(":", 1)[1])
    assert _ports(svc["temporal"]) == {temporal_port: temporal_port}
    assert _ports(svc["temporal-ui"])[8080] == s.temporal.dev_server.ui_port
    assert _ports(svc["redis"]) == {6379: 6379}


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_gateway_and_worker_environment_is_valid_settings(
    compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = compose["services"][name]
    env = {k: str(v) for k, v in svc["environment"].items()}
    host, port = env["TEMPORAL_ADDRESS"].split(":")
    assert host == "temporal"
    assert _ports(compose["services"]["temporal"]).get(int(port))
    assert env["REACH_REGISTRY__TYPE"] == "redis"  # several processes share one registry
    assert env["REACH_REGISTRY__REDIS_URL"].startswith("redis://redis:6379")
    for key, value in env.items():
        if key.startswith("REACH_"):
            monkeypatch.setenv(key, value)
    settings = ReachSettings()  # every REACH_* variable is a real, valid setting
    assert settings.registry.type == "redis"
    if name == "gateway":
        assert settings.listen_host == "0.0.0.0"
        assert settings.listen_port in _ports(svc)
    assert {"temporal", "redis"} <= set(svc["depends_on"])


def test_worker_runs_worker_py_and_the_image_builds_from_the_repo(compose: dict[str, Any]) -> None:
    assert compose["services"]["worker"]["command"][-1] == "worker.py"
    assert compose["services"]["gateway"]["command"] == ["reach", "gateway"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for path in ("reach", "workflows", "activities", "connectors", "gateway_api", "worker.py"):
        assert path in dockerfile


def test_the_cluster_bounds_late_answers_in_flight_as_the_dev_server_does(
    compose: dict[str, Any],
) -> None:
    from reach.limits import UPDATE_PAYLOADS_LIMIT_BYTES

    temporal = compose["services"]["temporal"]
    mount = next(v for v in temporal["volumes"] if "temporal-dynamicconfig.yaml" in v)
    host_path, container_path = mount.split(":")[:2]
    assert container_path.endswith("/" + temporal["environment"]["DYNAMIC_CONFIG_FILE_PATH"])
    dynamic = yaml.safe_load((ROOT / host_path).read_text())
    assert dynamic["history.maxInFlightUpdatePayloads"] == [{"value": UPDATE_PAYLOADS_LIMIT_BYTES}]


def test_the_image_holds_every_package_the_project_installs() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in packages:
        assert f"COPY {package} ./{package}" in dockerfile, package
    assert "EXPOSE 7600 7601" in dockerfile
