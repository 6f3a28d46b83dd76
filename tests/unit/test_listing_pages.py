"""Page tokens of a request list (reach.listing): a token pages only the list that handed it
out, and anything else is a ValueError naming pageToken; the status filters an A2A agent's
final states need (input_required, canceled) become their own query terms."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from reach.listing import (
    LIST_STATUSES,
    PageToken,
    page_token_of,
    page_token_text,
    visibility_query,
)

QUERY = visibility_query("InvokeWorkflow", owner="alice")


def test_a_token_reads_back_as_it_was_handed_out() -> None:
    after = datetime(2026, 12, 2, 13, 0, tzinfo=UTC)
    for token in (PageToken(0, None), PageToken(1, b"\x00\xffcursor", after)):
        assert page_token_of(page_token_text(token, QUERY), QUERY) == token


def test_a_token_of_another_list_is_refused() -> None:
    text = page_token_text(PageToken(1, b"cursor"), QUERY)
    bob = visibility_query("InvokeWorkflow", owner="bob")
    with pytest.raises(ValueError, match="pageToken: handed out by a list with other filters"):
        page_token_of(text, bob)


@pytest.mark.parametrize(
    "text",
    [
        "not base64 at all!",
        base64.urlsafe_b64encode(b"[1, 2]").decode(),
        base64.urlsafe_b64encode(b'{"p": 7, "t": "", "q": "x", "s": null}').decode(),
        base64.urlsafe_b64encode(b'{"p": 0, "t": 3, "q": "x", "s": null}').decode(),
        base64.urlsafe_b64encode(b'{"p": 0, "t": "", "q": "x", "s": "soon"}').decode(),
        base64.urlsafe_b64encode(b'{"p": 0, "t": "", "q": "x", "s": 1e300}').decode(),
        "x" * 5000,
    ],
)
def test_a_forged_token_is_refused_naming_page_token(text: str) -> None:
    with pytest.raises(ValueError, match="pageToken"):
        page_token_of(text, QUERY)


@pytest.mark.parametrize("status", ["input_required", "canceled"])
def test_the_a2a_final_states_are_filters(status: str) -> None:
    assert status in LIST_STATUSES
    query = visibility_query("InvokeWorkflow", status=status)  # type: ignore[arg-type]
    assert f"ExecutionStatus = 'Completed' AND ReachStatus = '{status}'" in query


def test_the_cli_offers_every_status() -> None:
    from gateway_api.cli_ops import STATUSES

    assert STATUSES == LIST_STATUSES
