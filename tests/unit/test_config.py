from __future__ import annotations

from pathlib import Path

import pytest

from reach.config import ConfigError, ReachSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("REACH_"):
            monkeypatch.delenv(key)


def test_shipped_reach_yaml_has_the_seed_schema() -> None:
    s = load_settings(ROOT / "reach.yaml")
    assert s.listen_port == 7600
    assert s.registry.type == "memory"
    assert (s.registry.heartbeat_timeout, s.registry.heartbeat_interval) == (30, 5)
    assert s.transport.default_protocol == "http"
    assert s.transport.ports == {"http": 7600, "grpc": 7601}
    assert (s.policy.default_retry, s.policy.default_timeout_ms) == (2, 5000)
    assert s.policy.circuit_breaker.error_threshold == 3
    assert s.policy.circuit_breaker.open_duration_ms == 10000
    assert s.policy.operations["knowledge-retriever:query"].timeout_ms == 3000


def test_defaults_without_a_file_equal_the_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    s = load_settings()
    assert s == ReachSettings()
    assert s.listen_port == 7600


def test_a_wrong_field_is_named_with_its_file(tmp_path: Path) -> None:
    bad = tmp_path / "reach.yaml"
    bad.write_text("reach:\n  registry:\n    type: etcd\n    heartbeat_timeuot: 3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(bad)
    text = str(err.value)
    assert str(bad) in text
    assert "reach.registry.type" in text
    assert "reach.registry.heartbeat_timeuot" in text


def test_wrong_shape_and_missing_file_are_clear(tmp_path: Path) -> None:
    flat = tmp_path / "flat.yaml"
    flat.write_text("listen_port: 7600\n")
    with pytest.raises(ConfigError, match="top-level mapping 'reach:'"):
        load_settings(flat)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("reach: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(broken)


def test_heartbeat_interval_must_be_below_timeout(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text("reach:\n  registry: {heartbeat_timeout: 5, heartbeat_interval: 5}\n")
    with pytest.raises(ConfigError, match="heartbeat_interval must be shorter"):
        load_settings(f)


def test_environment_overrides_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_REGISTRY__TYPE", "redis")
    monkeypatch.setenv("REACH_LISTEN_PORT", "7700")
    s = load_settings(ROOT / "reach.yaml")
    assert s.registry.type == "redis"
    assert s.listen_port == 7700
    assert s.registry.heartbeat_timeout == 30  # the rest of the section still comes from the file
    monkeypatch.setenv("REACH_LISTEN_PORT", "http")
    with pytest.raises(ConfigError, match=r"reach\.listen_port"):
        load_settings(ROOT / "reach.yaml")


def test_a_bad_environment_variable_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value from the environment is named by its variable, not only by its key: an operator
    looking at reach.yaml for `listen_port: http` would not find it there."""
    monkeypatch.setenv("REACH_LISTEN_PORT", "http")
    monkeypatch.setenv("REACH_POLICY__NO_SUCH_KEY", "1")
    with pytest.raises(ConfigError) as err:
        load_settings(ROOT / "reach.yaml")
    message = str(err.value)
    assert "reach.listen_port" in message
    assert "set by the environment variable REACH_LISTEN_PORT" in message
    assert "set by the environment variable REACH_POLICY__NO_SUCH_KEY" in message


def test_a_bad_file_value_names_no_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REACH_LISTEN_PORT", raising=False)
    config = tmp_path / "reach.yaml"
    config.write_text("reach:\n  listen_port: http\n")
    with pytest.raises(ConfigError) as err:
        load_settings(config)
    assert "reach.listen_port" in str(err.value)
    assert "environment variable" not in str(err.value)


def test_capability_mode_defaults_to_inline() -> None:
    s = ReachSettings(capabilities={"content-generator": {"mode": "queue"}})  # type: ignore[arg-type]
    assert s.capability_mode("content-generator") == "queue"
    assert s.capability_mode("anything-else") == "inline"


def test_a_message_limit_temporal_cannot_carry_is_a_start_up_error(tmp_path: Path) -> None:
    config = tmp_path / "reach.yaml"
    config.write_text("reach:\n  transport:\n    max_message_bytes: 4194304\n")
    with pytest.raises(ConfigError) as err:
        load_settings(config)
    message = str(err.value)
    assert "transport.max_message_bytes=4194304 cannot be carried" in message
    assert "temporal.payload_limit_bytes=2097152" in message
    # A cluster that raised its blob and gRPC limits may raise the message limit with them.
    config.write_text(
        "reach:\n  transport: {max_message_bytes: 4194304}\n"
        "  temporal: {payload_limit_bytes: 8388608, grpc_limit_bytes: 16777216}\n"
    )
    assert load_settings(config).transport.max_message_bytes == 4194304


def test_moving_the_dev_server_moves_the_temporal_address() -> None:
    """Issue 26: REACH_TEMPORAL__DEV_SERVER__PORT moved the embedded server while everything
    else (worker.py, the CLI) kept talking to 127.0.0.1:7233."""
    moved = ReachSettings.model_validate({"temporal": {"dev_server": {"port": 7300}}})
    assert moved.temporal.address == "127.0.0.1:7300"
    written = {"temporal": {"address": "temporal:7233", "dev_server": {"port": 7300}}}
    assert ReachSettings.model_validate(written).temporal.address == "temporal:7233"
    assert ReachSettings().temporal.address == "127.0.0.1:7233"


def test_a_loopback_gateway_without_an_allowlist_reaches_loopback_only() -> None:
    """Issue 26: the seed's reach.yaml names no allowlist, and its agents are local."""
    assert ReachSettings().security.allow_networks == ["127.0.0.0/8", "::1/128"]
    wide = ReachSettings.model_validate({"listen_host": "0.0.0.0"})
    assert wide.security.allow_networks == []
    strict = {"security": {"allow_networks": []}}
    assert ReachSettings.model_validate(strict).security.allow_networks == []


def test_ports_http_that_disagrees_with_listen_port_is_an_error_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "reach.yaml"
    config.write_text("reach:\n  listen_port: 7600\n  transport:\n    ports: { http: 7700 }\n")
    with pytest.raises(ConfigError) as exc:
        load_settings(config)
    said = str(exc.value)
    assert f"transport.ports.http in {config} says the HTTP port is 7700" in said
    assert f"listen_port: 7600 in {config}" in said
    # Only ports.http written: listen_port's default is what it disagrees with.
    config.write_text("reach:\n  transport:\n    ports: { http: 8000, grpc: 8001 }\n")
    with pytest.raises(ConfigError, match=r"but listen_port 7600 \(its default\)"):
        load_settings(config)
    # Agreeing keys, or the environment moving the port (both of the file's keys): no error.
    config.write_text("reach:\n  listen_port: 7700\n  transport:\n    ports: { http: 7700 }\n")
    assert load_settings(config).listen_port == 7700
    monkeypatch.setenv("REACH_LISTEN_PORT", "7800")
    assert load_settings(config).listen_port == 7800
    # The environment naming the other key disagrees with the port in force.
    monkeypatch.setenv("REACH_TRANSPORT__PORTS__HTTP", "7900")
    with pytest.raises(ConfigError, match="REACH_TRANSPORT__PORTS__HTTP says the HTTP port is"):
        load_settings(config)


def test_a_relative_tokens_file_in_the_config_is_relative_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "etc"
    home.mkdir()
    config = home / "reach.yaml"
    config.write_text("reach:\n  auth:\n    tokens_file: secrets/tokens.json\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_settings(config).auth.tokens_file == str(home / "secrets" / "tokens.json")
    # Given in the environment, it is the shell's path (its working directory's); the default
    # stays where it always was (the working directory's .reach/).
    monkeypatch.setenv("REACH_AUTH__TOKENS_FILE", "mine.json")
    assert load_settings(config).auth.tokens_file == "mine.json"
    monkeypatch.delenv("REACH_AUTH__TOKENS_FILE")
    config.write_text("reach: {}\n")
    assert load_settings(config).auth.tokens_file == ".reach/tokens.json"


@pytest.mark.parametrize("url", ["gateway:7600", "127.0.0.1:7600", "ftp://gateway", "http://"])
def test_a_public_url_that_is_not_one_is_a_start_up_error(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """public_url is handed to A2A agents for their push notifications: 'gateway:7600' was
    taken, and every push went nowhere (the tasks waited on the slow fallback poll)."""
    monkeypatch.setenv("REACH_PUBLIC_URL", url)
    with pytest.raises(ConfigError, match="http\\(s\\)://host"):
        load_settings(ROOT / "reach.yaml")


def test_a_public_url_is_the_gateway_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_PUBLIC_URL", "https://reach.example:8443/base/")
    assert load_settings(ROOT / "reach.yaml").gateway_url == "https://reach.example:8443/base"
