"""The command line starts light (issue 26): building its parser loads no heavy package, what
it copied to stay light still equals the original, the gateway's URL read without the settings
model is the one the model gives (or its very error), and the standard-library client talks
to a real HTTP server as the httpx one did. How fast it starts is bench/cli_start.py's job,
not a timed test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway_api import cli_address, cli_certs, cli_ops
from gateway_api.cli_address import configured_gateway_url
from gateway_api.cli_api import EXIT_UNREACHABLE, Api, Failed
from reach.config import CONFIG_ENV_VAR, DEFAULT_CONFIG_FILE, ConfigError
from reach.listing import MAX_LIMIT
from reach.security.certs import DEFAULT_AGENT_HOURS, DEFAULT_CA_DAYS
from reach.settings_checks import load_checked_settings

HEAVY = {
    "pydantic",
    "pydantic_settings",
    "temporalio",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "httpcore",
    "redis",
    "rich",
    "cryptography",
    "opentelemetry",
    "yaml",
    "worker",
}
ROOT = Path(__file__).resolve().parents[2]


def modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (its last line printed)."""
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return set(done.stdout.splitlines()[-1].split())


def heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in HEAVY or m.startswith("reach.")}


def test_importing_the_cli_loads_no_heavy_package() -> None:
    loaded = modules_after("import gateway_api.cli")
    assert "gateway_api.cli" in loaded
    assert heavy(loaded) == set()


def test_building_the_parser_and_parsing_loads_no_heavy_package() -> None:
    loaded = modules_after(
        "from gateway_api.cli import build_parser\n"
        "parser = build_parser()\n"
        "for argv in (['agents'], ['trace', 'req-1'], ['requests', '--limit', '5'],"
        " ['tokens', 'issue', '--principal', 'p', '--ttl', '12h'], ['certs', 'init'],"
        " ['invoke', 'c', 'o'], ['config', 'check'], ['up']):\n"
        "    parser.parse_args(argv)\n"
        "parser.format_help()"
    )
    assert heavy(loaded) == set()


def test_the_configured_gateway_is_read_without_the_settings_model() -> None:
    env = {CONFIG_ENV_VAR: str(ROOT / "reach.yaml"), "REACH_LISTEN_PORT": "7799"}
    loaded = modules_after(
        "from gateway_api.cli_address import configured_gateway_url\n"
        "print(configured_gateway_url())",
        env,
    )
    # PyYAML reads the file; nothing else heavy (the settings model would be pydantic's).
    assert "yaml" in loaded
    assert {m for m in heavy(loaded) if m.split(".")[0] != "yaml"} == set()


def test_what_the_parser_copied_equals_the_original() -> None:
    # Copied so that the parser needs neither pydantic (reach.listing, reach.config) nor the
    # cryptography stack (reach.security.certs).
    assert cli_ops.MAX_LIMIT == MAX_LIMIT
    assert (cli_certs.DEFAULT_CA_DAYS, cli_certs.DEFAULT_AGENT_HOURS) == (
        DEFAULT_CA_DAYS,
        DEFAULT_AGENT_HOURS,
    )
    assert (cli_address.CONFIG_ENV_VAR, cli_address.DEFAULT_CONFIG_FILE) == (
        CONFIG_ENV_VAR,
        DEFAULT_CONFIG_FILE,
    )


# -- the configured gateway, without the settings model ----------------------------------------


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory and no REACH_* variables."""
    for key in list(os.environ):
        if key.lower().startswith("reach_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path


CASES: list[tuple[str | None, dict[str, str]]] = [
    (None, {}),  # no file: the defaults
    ("", {}),  # an empty file
    ("reach:\n  listen_port: 7711\n", {}),
    ("reach:\n  listen_host: 0.0.0.0\n  listen_port: '7712'\n", {}),
    ("reach:\n  listen_host: '::'\n", {}),
    ("reach:\n  listen_host: 10.1.2.3\n", {"REACH_LISTEN_PORT": "7713"}),
    ("reach:\n  public_url: https://reach.example.com/\n", {}),
    ("reach:\n  public_url: ''\n  listen_port: 7714\n", {}),
    ("reach:\n  listen_port: 7715\n", {"reach_listen_port": "7716"}),  # case-insensitive
    (None, {"REACH_PUBLIC_URL": "http://gw.example:80/", "REACH_LISTEN_HOST": "::"}),
    (None, {"REACH_LISTEN_PORT": "07717"}),
    ("reach:\n  listen_port: 7718.0\n", {}),  # the model's lax int: loaded by it
    ("reach:\n  policy:\n    default_retry: 2\n", {}),
]


@pytest.mark.parametrize(("text", "env"), CASES)
def test_the_configured_gateway_is_the_settings_one(
    here: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, env: dict[str, str]
) -> None:
    if text is not None:
        (here / "reach.yaml").write_text(text)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert configured_gateway_url() == load_checked_settings().gateway_url


BAD: list[tuple[str | None, dict[str, str]]] = [
    (None, {"REACH_LISTEN_PORT": "http"}),
    (None, {"REACH_LISTEN_PORT": "70000"}),
    ("reach:\n  listen_port: [1]\n", {}),
    ("reach:\n  listen_host: 127\n", {}),
    ("reach:\n  public_url: 5\n", {"REACH_LISTEN_PORT": "0"}),
    ("reach: [\n", {}),  # not YAML
    ("gateway:\n  listen_port: 1\n", {}),  # no reach: mapping
]


@pytest.mark.parametrize(("text", "env"), BAD)
def test_a_bad_gateway_setting_is_the_settings_error(
    here: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, env: dict[str, str]
) -> None:
    if text is not None:
        (here / "reach.yaml").write_text(text)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as expected:
        load_checked_settings()
    with pytest.raises(ConfigError) as got:
        configured_gateway_url()
    assert str(got.value) == str(expected.value)


def test_a_named_file_is_read_and_must_exist(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = here / "elsewhere.yaml"
    named.write_text("reach:\n  listen_port: 7720\n")
    (here / "reach.yaml").write_text("reach:\n  listen_port: 7721\n")
    assert configured_gateway_url(str(named)) == "http://127.0.0.1:7720"
    monkeypatch.setenv(CONFIG_ENV_VAR, str(named))
    assert configured_gateway_url() == "http://127.0.0.1:7720"
    with pytest.raises(ConfigError, match="does not exist"):
        configured_gateway_url(str(here / "missing.yaml"))


# -- the standard-library client against a real server -----------------------------------------


class Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn answers
    seen: list[dict[str, Any]]
    close_after: set[int]  # the request numbers after which the server drops the connection

    def do_GET(self) -> None:
        self.answer()

    def do_POST(self) -> None:
        self.answer()

    def answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append(
            {
                "method": self.command,
                "path": self.path,
                "auth": self.headers.get("Authorization"),
                "type": self.headers.get("Content-Type"),
                "body": json.loads(body) if body else None,
                "peer": self.client_address[1],
            }
        )
        data = json.dumps({"n": len(self.seen)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if len(self.seen) in self.close_after:
            self.close_connection = True  # as a gateway closing an idle connection

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    handler = type("Handler", (Recorder,), {"seen": [], "close_after": set()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_requests_keep_one_connection_under_the_url_s_path(server: ThreadingHTTPServer) -> None:
    handler: Any = server.RequestHandlerClass
    port = server.server_address[1]
    with Api(f"http://127.0.0.1:{port}/prefix/", "tok") as api:
        assert api.request("GET", "/reach/capabilities/a b") == (200, {"n": 1})
        assert api.request("POST", "/reach/invoke", body={"text": "ünï"}) == (200, {"n": 2})
        assert api.request("GET", "/reach/requests?limit=5") == (200, {"n": 3})
    seen = handler.seen
    assert [s["path"] for s in seen] == [
        "/prefix/reach/capabilities/a%20b",
        "/prefix/reach/invoke",
        "/prefix/reach/requests?limit=5",
    ]
    assert {s["auth"] for s in seen} == {"Bearer tok"}
    assert seen[1]["type"] == "application/json"
    assert seen[1]["body"] == {"text": "ünï"}
    assert len({s["peer"] for s in seen}) == 1  # one connection for all three


def test_a_connection_the_server_closed_is_replaced(server: ThreadingHTTPServer) -> None:
    handler: Any = server.RequestHandlerClass
    handler.close_after = {1}
    with Api(f"http://127.0.0.1:{server.server_address[1]}", None) as api:
        assert api.request("GET", "/one") == (200, {"n": 1})
        assert api.request("GET", "/two") == (200, {"n": 2})
    assert len({s["peer"] for s in handler.seen}) == 2


def test_nothing_listening_is_exit_3_with_the_fix() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Api(f"http://127.0.0.1:{port}", None) as api, pytest.raises(Failed) as failed:
        api.request("GET", "/reach/capabilities")
    assert failed.value.code == EXIT_UNREACHABLE
    assert str(failed.value).startswith(
        f"cannot reach the gateway at http://127.0.0.1:{port}: connection refused — start it"
    )
