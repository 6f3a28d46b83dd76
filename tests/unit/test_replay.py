"""Committed histories must replay on today's workflow code: requests in flight survive deploys."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.callback import DeliverCallbackWorkflow
from workflows.invoke import InvokeWorkflow

HISTORIES = sorted((Path(__file__).parent.parent / "histories").glob("*.json"))


def test_there_are_histories_to_replay() -> None:
    names = {p.stem for p in HISTORIES}
    assert {"success", "retry", "timeout", "late-answer", "callback"} <= names
    # Today's paths, beside the ones requests accepted by older versions still take.
    assert {"late-answer-update", "callback-workflow"} <= names


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays_without_nondeterminism(path: Path) -> None:
    replayer = Replayer(
        workflows=[InvokeWorkflow, DeliverCallbackWorkflow], data_converter=pydantic_data_converter
    )
    history = WorkflowHistory.from_json(f"replay-{path.stem}", path.read_text())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
