"""A run's pin claims of one attempt (`workflows._pins`, `reach.resolve`): its own claim again
(a resolve after a wait) is not another run's, a lost task's claim is, whether it came before
this run's first claim or after its last; and a pin read looks past this run's own claims."""

from __future__ import annotations

from temporalio.testing import ActivityEnvironment

from activities import ReachActivities
from reach.invocation import Endpoint, PinQuery, ResolveInput
from tests.unit.test_activities import make_acts

WRITE = {"capability": "cap", "request_id": "w1", "attempt": 1, "deadline_ms": 2**42}


async def routed(acts: ReachActivities, **kw: object) -> Endpoint:
    inp = ResolveInput.model_validate({**WRITE, **kw})
    endpoint: Endpoint = await ActivityEnvironment().run(acts.resolve, inp)
    return endpoint


async def pinned(acts: ReachActivities, made: int) -> str:
    query = PinQuery(request_id="w1", attempt=1, made=made)
    found: str = await ActivityEnvironment().run(acts.pinned_attempt, query)
    return found


async def test_a_runs_own_claim_again_is_not_another_runs() -> None:
    acts = await make_acts(refresh_s=0)
    first = await routed(acts, token="run.3.1.0")
    assert not first.pinned_before
    assert await pinned(acts, 0) == first.instance_id  # a run that made none reads it
    assert await pinned(acts, 1) == ""  # this run made it: no other run's
    again = await routed(acts, token="run.9.1.1", again=1)
    assert not again.pinned_before  # before, its own pin read as a lost run's
    assert again.instance_id == first.instance_id  # still goes back where the first went


async def test_a_lost_tasks_claim_after_this_runs_last_one_is_another_runs() -> None:
    acts = await make_acts(refresh_s=0)
    first = await routed(acts, token="run.3.1.0")
    lost = await routed(acts, token="run.9.1.1", again=1)  # a task lost after it ran
    assert not lost.pinned_before
    assert await pinned(acts, 1) == first.instance_id  # the lost task's claim is named
    rerun = await routed(acts, token="run.12.1.1", again=1)  # its re-run: a longer history
    assert rerun.pinned_before


async def test_a_claim_before_this_runs_first_is_another_runs() -> None:
    acts = await make_acts(refresh_s=0)
    await routed(acts, token="run.3.1.0")  # a lost task's
    assert (await routed(acts, token="run.6.1.0")).pinned_before
    # Without the workflow's token (a request from before), every claim again reads so.
    assert (await routed(acts)).pinned_before
