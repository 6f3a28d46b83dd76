"""Schemathesis hooks for `make fuzz` (loaded through SCHEMATHESIS_HOOKS=tests.fuzz.hooks)."""

from __future__ import annotations

from typing import Any

import hypothesis.internal.lambda_sources as _lambda_sources
import schemathesis
from schemathesis import Case, CheckContext, Response

# CPython 3.11.7's ast.parse can raise "SystemError: AST constructor recursion depth mismatch"
# deep inside a generator chain (fixed in later CPython releases). Hypothesis calls it only to
# *describe* a filter lambda for reprs; a plain description is enough.
_describe = _lambda_sources.lambda_description


def _lambda_description(f: Any) -> str:
    try:
        return _describe(f)
    except SystemError:
        return "lambda"


_lambda_sources.lambda_description = _lambda_description  # type: ignore[assignment]


@schemathesis.check
def no_internal_error(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """A 500 is a bug in Reach. (502/503/504 are documented outcomes of calling agents that a
    fuzzer registers at addresses where nothing answers.)"""
    if response.status_code == 500:
        raise AssertionError(f"500 internal error: {response.text[:500]}")
    return None


@schemathesis.check
def the_envelope(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every error answer, whatever failed, is the one documented envelope."""
    if response.status_code >= 400:
        body = response.json()
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            raise AssertionError(f"not the error envelope: {response.text[:300]}")
        error = body["error"]
        if body.get("status") not in ("error", "timeout", "running"):
            raise AssertionError(f"an error answer with status {body.get('status')!r}")
        if not error.get("type") or not error.get("message"):
            raise AssertionError(f"error without type or message: {response.text[:300]}")
    return None
