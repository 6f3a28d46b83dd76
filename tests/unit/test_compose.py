"""docker-compose.temporal.yml can't run here (no Docker engine, so no `docker compose config`
either), so check it as far as a file can be: valid YAML in the Compose file's shape (the keys
the Compose specification defines), services that exist where they are depended on, pinned
images and none of them the deprecated temporalio/auto-setup, mounted files present, and
agreement with the settings: ports and the environment the gateway and workers read."""

from __future__ import annotations

import re
import subprocess
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
    assert {
        "postgresql",
        "temporal-schema",
        "temporal",
        "temporal-namespace",
        "temporal-ui",
        "redis",
        "gateway",
        "worker",
    } <= set(compose["services"])


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


# The Compose specification's top-level and service keys (those a file like this one may use):
# a misspelt key is an error here, as `docker compose config` would report it.
TOP_LEVEL_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets", "include"}
SERVICE_KEYS = {
    "build",
    "command",
    "container_name",
    "depends_on",
    "entrypoint",
    "environment",
    "env_file",
    "healthcheck",
    "image",
    "networks",
    "ports",
    "profiles",
    "restart",
    "stop_grace_period",
    "user",
    "volumes",
    "working_dir",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def _depends(service: dict[str, Any]) -> dict[str, str]:
    """depends_on in either form (a list of names, or names with a condition)."""
    spec = service.get("depends_on", {})
    if isinstance(spec, list):
        return dict.fromkeys(spec, "service_started")
    return {name: entry["condition"] for name, entry in spec.items()}


def test_the_file_has_the_compose_shape(compose: dict[str, Any]) -> None:
    assert {k for k in compose if not k.startswith("x-")} <= TOP_LEVEL_KEYS
    for name, service in compose["services"].items():
        assert set(service) <= SERVICE_KEYS, (name, set(service) - SERVICE_KEYS)
        assert ("image" in service) != ("build" in service), name  # one or the other
        assert set(service.get("healthcheck", {})) <= HEALTHCHECK_KEYS, name
        for key in ("command", "entrypoint"):
            assert isinstance(service.get(key, []), list), (name, key)  # exec form: no shell
        env = service.get("environment", {})
        assert isinstance(env, dict), name
        assert all(isinstance(v, str) for v in env.values()), (name, "quote numbers")


def test_images_are_pinned_and_none_is_auto_setup(compose: dict[str, Any]) -> None:
    images = {n: s["image"] for n, s in compose["services"].items() if "image" in s}
    for name, image in images.items():
        repository, _, tag = image.partition(":")
        # Deprecated upstream and no longer built: the schema and namespace steps replace it.
        assert repository != "temporalio/auto-setup", name
        assert re.fullmatch(r"\d+(\.\d+)*", tag), f"{name}: pin a version, not {image!r}"
    assert images["temporal"].startswith("temporalio/server:")
    tags = {
        images[n].partition(":")[2] for n in ("temporal", "temporal-schema", "temporal-namespace")
    }
    assert len(tags) == 1, "the schema files come from admin-tools: one version for all three"


def test_depends_on_names_services_that_can_satisfy_it(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for target, condition in _depends(service).items():
            assert target in services, (name, target)
            assert condition in CONDITIONS, (name, condition)
            if condition == "service_healthy":
                assert "healthcheck" in services[target], (name, target)
            if condition == "service_completed_successfully":
                # A one-shot step: it ends, and a restart policy of always would run it again.
                assert "ports" not in services[target], target
                assert services[target].get("restart", "no") not in ("always", "unless-stopped")
    # No cycle: every service can start once the ones it depends on have.
    started: set[str] = set()
    while len(started) < len(services):
        ready = {n for n, s in services.items() if n not in started and set(_depends(s)) <= started}
        assert ready, f"a depends_on cycle among {set(services) - started}"
        started |= ready


def test_temporal_starts_in_order_and_reach_waits_for_it(compose: dict[str, Any]) -> None:
    svc = compose["services"]
    assert _depends(svc["temporal-schema"]) == {"postgresql": "service_healthy"}
    assert _depends(svc["temporal"]) == {"temporal-schema": "service_completed_successfully"}
    assert _depends(svc["temporal-namespace"]) == {"temporal": "service_healthy"}
    for name in ("gateway", "worker"):
        assert _depends(svc[name])["temporal-namespace"] == "service_completed_successfully"


def test_no_host_port_twice(compose: dict[str, Any]) -> None:
    hosts = [host for s in compose["services"].values() for host in _ports(s).values()]
    assert len(hosts) == len(set(hosts))


def test_mounted_files_exist_and_scripts_parse(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes", {}))
    for name, service in compose["services"].items():
        mounts = {}
        for spec in service.get("volumes", []):
            source, container = spec.split(":")[:2]
            if source.startswith("."):
                assert (ROOT / source).is_file(), (name, source)
                mounts[container] = ROOT / source
            else:
                assert source in named, (name, source)
        entrypoint = service.get("entrypoint", [])
        if entrypoint[:1] == ["/bin/sh"]:
            script = mounts[entrypoint[1]]  # the script it runs is one mounted from the repo
            subprocess.run(["sh", "-n", str(script)], check=True, timeout=30)


def test_the_one_shot_steps_agree_with_the_server(compose: dict[str, Any]) -> None:
    svc = compose["services"]
    postgres, server = svc["postgresql"]["environment"], svc["temporal"]["environment"]
    schema = svc["temporal-schema"]["environment"]
    assert schema["SQL_PLUGIN"] == server["DB"]
    assert schema["SQL_HOST"] == server["POSTGRES_SEEDS"] == "postgresql"
    assert schema["SQL_PORT"] == server["DB_PORT"]
    assert schema["SQL_USER"] == server["POSTGRES_USER"] == postgres["POSTGRES_USER"]
    assert schema["SQL_PASSWORD"] == server["POSTGRES_PWD"] == postgres["POSTGRES_PASSWORD"]
    namespace = svc["temporal-namespace"]["environment"]
    reach_env = svc["gateway"]["environment"]
    assert namespace["TEMPORAL_ADDRESS"] == reach_env["TEMPORAL_ADDRESS"]
    assert namespace["NAMESPACE"] == reach_env["TEMPORAL_NAMESPACE"]
    # Closed requests kept as long as the dev server keeps them (RequestIDs deduplicated).
    hours = ReachSettings().temporal.dev_server.retention_hours
    assert namespace["RETENTION"] == f"{hours:g}h"
