"""Redaction (R20): no secret value and no long text survives, whatever the shape of the input."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr

from reach.config import SECRET_KEY_NAMES, AuditSettings
from reach.security.audit import AuditLog
from reach.security.redact import MASK, Redactor, digest, normalise_key, redact, safe_url

MARKER = f"SECRET{uuid.uuid4().hex}"  # appears nowhere but under secret keys
_DEFAULT = Redactor()


# -- strategies -------------------------------------------------------------------------------


@st.composite
def secret_keys(draw: st.DrawFn) -> str:
    """A secret name in random case and separators, alone or as the end of a longer key."""
    name = draw(st.sampled_from(SECRET_KEY_NAMES))
    words = name.split("_")
    sep = draw(st.sampled_from(["", "-", "_", " ", "."]))
    key = sep.join(words)
    key = "".join(c.upper() if draw(st.booleans()) else c for c in key)
    if draw(st.booleans()):
        prefix = draw(st.sampled_from(["x", "db", "client", "access", "Proxy", "my_app"]))
        key = prefix + draw(st.sampled_from(["", "-", "_"])) + key
    return key


plain_keys = st.text(min_size=1, max_size=12).filter(lambda k: not _DEFAULT.is_secret_key(k))
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
)


def secret_values(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just(MARKER),
        st.just(MARKER * 20),  # long: must be masked, not reduced to a digest
        st.just(MARKER.encode()),
        st.builds(lambda c: {"inner": MARKER, "other": c}, children),
        st.builds(lambda c: [c, MARKER, (MARKER,)], children),
        st.builds(lambda c: {"token": MARKER, "deeper": [c, {"x": MARKER}]}, children),
    )


def _tree(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    plain = st.dictionaries(plain_keys, children, max_size=4)
    planted = st.lists(st.tuples(secret_keys(), secret_values(children)), max_size=2)
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=3).map(tuple)
        | st.builds(lambda d, extra: {**d, **dict(extra)}, plain, planted)
    )


trees = st.recursive(scalars, _tree, max_leaves=40)
# Always at least one secret: a dict at the top holding one, next to a random tree.
trees_with_secrets = st.builds(
    lambda key, value, rest: {"payload": rest, key: value}, secret_keys(), st.just(MARKER), trees
)


def _containers(value: Any, seen: set[int] | None = None) -> set[int]:
    seen = set() if seen is None else seen
    if isinstance(value, dict | list | tuple) and id(value) not in seen:
        seen.add(id(value))
        for item in value.values() if isinstance(value, dict) else value:
            _containers(item, seen)
    return seen


# -- properties -------------------------------------------------------------------------------


@given(trees_with_secrets)
def test_no_secret_value_survives_redaction(value: Any) -> None:
    assert MARKER not in json.dumps(redact(value))


@settings(max_examples=50, deadline=None)
@given(trees_with_secrets)
def test_no_secret_value_reaches_the_audit_file(value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.jsonl"
        log = AuditLog(AuditSettings(sink="file", file=str(path)))
        log.record("invoke", request_id="r1", payload=value, nested={"value": value})
        log.record("join", **{k: v for k, v in value.items() if isinstance(k, str)})
        log.flush_now()
        text = path.read_text()
    assert len(text.splitlines()) == 2
    assert MARKER not in text
    for line in text.splitlines():
        json.loads(line)


@given(trees)
def test_the_input_is_never_changed_nor_shared(value: Any) -> None:
    before = copy.deepcopy(value)
    out = redact(value)
    assert value == before
    assert not (_containers(out) & _containers(value))


@given(st.text(min_size=257, max_size=2000))
def test_long_text_keeps_only_its_length_and_sha256(text: str) -> None:
    expected = {"len": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    out = redact({"note": text, "list": [text]})
    assert out == {"note": expected, "list": [expected]}
    assert text not in json.dumps(out, ensure_ascii=False)


@given(st.text(max_size=256))
def test_short_text_passes(text: str) -> None:
    assert redact({"note": text}) == {"note": text}


# -- key matching ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "password",
        "Password",
        "PASSWORD",
        "token",
        "secret",
        "api_key",
        "API-Key",
        "apiKey",
        "api key",
        "X_API_KEY",
        "x-api-key",
        "db_password",
        "access_token",
        "refreshToken",
        "client_secret",
        "Authorization",
        "Proxy-Authorization",
        "credentials",
        "aws.credentials",
    ],
)
def test_secret_keys_are_masked(key: str) -> None:
    assert redact({key: "s3cr3t", "other": 1}) == {key: MASK, "other": 1}


@pytest.mark.parametrize(
    "key",
    [
        "name",
        "caller",
        "tokens",
        "max_tokens",
        "token_type",
        "password_hash",
        "key",
        "api",
        "idempotency_key",
        "request_id",
        "secretary_name",
    ],
)
def test_other_keys_pass(key: str) -> None:
    assert redact({key: "visible"}) == {key: "visible"}


def test_a_masked_value_can_be_anything() -> None:
    value = {"token": {"a": [1, 2]}, "password": [MARKER], "secret": 42, "api_key": None}
    assert redact(value) == {"token": MASK, "password": MASK, "secret": MASK, "api_key": MASK}


def test_non_string_keys_are_matched_by_str_and_kept() -> None:
    class Name:
        def __str__(self) -> str:
            return "Password"

    key = Name()
    out = redact({1: "one", key: "hidden", (1, 2): "pair"})
    assert out == {1: "one", key: MASK, (1, 2): "pair"}
    assert list(out)[1] is key


def test_the_names_can_be_configured() -> None:
    value = {"pin": "1234", "password": "visible", "card_pin": "5678"}
    assert redact(value, keys=["PIN"]) == {"pin": MASK, "password": "visible", "card_pin": MASK}


def test_a_name_that_normalises_to_nothing_matches_nothing() -> None:
    assert redact({"a": 1, "b": "x"}, keys=["_", "-", ""]) == {"a": 1, "b": "x"}


def test_normalise_key() -> None:
    assert normalise_key("X-Api_Key .v") == "xapikeyv"
    assert normalise_key(12) == "12"


def test_the_verdict_cache_stays_bounded() -> None:
    redactor = Redactor()
    for i in range(10_000):
        redactor({f"key{i}": i})
    assert len(redactor._verdicts) <= 4096


# -- values -----------------------------------------------------------------------------------


def test_bytes_become_length_and_sha256() -> None:
    data = b"\x00\x01binary"
    expected = {"len": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert redact([data, bytearray(data), memoryview(data)]) == [expected] * 3


def test_max_string_is_a_parameter() -> None:
    assert redact("abcdefghi", max_string=8) == digest("abcdefghi")
    assert redact("abcdefgh", max_string=8) == "abcdefgh"


def test_lone_surrogates_are_hashed_not_an_error() -> None:
    text = "\ud800" * 300
    assert redact(text)["len"] == 300


def test_scalars_and_other_objects() -> None:
    class Thing:
        def __str__(self) -> str:
            return "a thing"

    class Long:
        def __str__(self) -> str:
            return "z" * 1000

    class Broken:
        def __str__(self) -> str:
            raise RuntimeError("no")

    out = redact([1, 2.5, True, None, float("inf"), Thing(), Long(), Broken(), {1, 2}])
    assert out[:6] == [1, 2.5, True, None, "inf", "a thing"]
    assert out[6] == digest("z" * 1000)
    assert out[7] == "<unprintable Broken>"
    assert sorted(out[8]) == [1, 2]


def test_models_and_dataclasses_are_walked_not_printed() -> None:
    """str() of a model or dataclass would print a secret field's value."""

    class Login(BaseModel, extra="allow"):
        user: str
        password: str
        key: SecretStr

    @dataclasses.dataclass
    class Call:
        login: Login
        api_key: str

    call = Call(Login(user="u", password=MARKER, key=SecretStr(MARKER), token=MARKER), MARKER)
    out = redact({"call": call})
    assert MARKER not in json.dumps(out)
    assert out == {
        "call": {
            "login": {"user": "u", "password": MASK, "key": "**********", "token": MASK},
            "api_key": MASK,
        }
    }


# -- termination ------------------------------------------------------------------------------


def test_deep_input_is_cut_not_a_recursion_error() -> None:
    value: Any = MARKER
    for _ in range(10_000):
        value = {"a": [value]}
    out = redact(value)
    text = json.dumps(out)
    assert "<too deep>" in text
    assert MARKER not in text
    depth = 0
    while isinstance(out, dict | list):
        out = out["a"] if isinstance(out, dict) else out[0]
        depth += 1
    assert depth == 64


def test_cycles_terminate() -> None:
    a: dict[str, Any] = {"name": "a"}
    b: list[Any] = [a]
    a["b"] = b
    a["self"] = a
    b.append(b)
    out = redact(a)
    assert out == {"name": "a", "b": ["<cycle>", "<cycle>"], "self": "<cycle>"}
    json.dumps(out)


def test_shared_references_cannot_explode() -> None:
    """Not a cycle, but 2**60 paths: the item budget stops the walk."""
    value: Any = ["leaf"]
    for _ in range(60):
        value = [value, value]
    started = time.perf_counter()
    out = redact(value)
    assert time.perf_counter() - started < 5
    assert "<truncated>" in json.dumps(out)


def test_the_same_object_twice_on_different_paths_is_not_a_cycle() -> None:
    shared = {"x": 1}
    assert redact([shared, shared]) == [{"x": 1}, {"x": 1}]


def test_digest_matches_hashlib() -> None:
    assert digest("é" * 3) == {"len": 3, "sha256": hashlib.sha256("ééé".encode()).hexdigest()}
    assert re.fullmatch(r"[0-9a-f]{64}", digest(b"")["sha256"])


def test_safe_url_drops_credentials_query_and_fragment() -> None:
    shown = safe_url("http://user:SECRET1@example.com:8080/cb?token=SECRET2#SECRET3")
    assert "SECRET" not in shown
    assert shown.startswith("http://example.com:8080/cb")
    assert safe_url("https://[::1]:9/x") == "https://[::1]:9/x"
    assert safe_url("http://plain.example/cb") == "http://plain.example/cb"
