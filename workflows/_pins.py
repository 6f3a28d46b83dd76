"""This run's pin claims of each attempt, so that resolve tells them from another run's (a lost
workflow task's, which may have sent the attempt: `Endpoint.pinned_before`), and whether a call
routed in this task may follow a send at all (`CallInput.routed_here`).

A run may pin the same attempt more than once: it resolves it again after waiting for the store
(its send-once claim could not be checked: nothing was sent) or to re-deliver it. The first
claim of an attempt holds its pin (`reach.resolve.pin_key`, the instance a re-run goes back
to); the run's claim number k > 0 is made on a key of its own (`pin_key(..., k)`), so a run
that finds claim k taken knows another run came after this run's last claim: a lost task's,
which starts from the same history and so makes the same claims. Each claim's token is made
from what the history holds when it is made (the run, the history's length, the attempt and
k): a lost task's re-run reaches a claim with a longer history than the lost task had, so the
lost task's token is never taken for this run's own.
"""

from __future__ import annotations

from temporalio import workflow

# Requests accepted before this run's pin claims were counted made every claim of an attempt on
# its first key, with a random token: a resolve again read the run's own pin as another run's.
PATCH_PIN_CLAIMS = "pin-claims-counted"
# Those accepted before an inline resolve's failure left its claim unsure made the run's next
# claim on a key of its own: a lost task's claim on the failed one's key was never read.
PATCH_PIN_UNSURE = "pin-claim-unsure-made-again"


class RunPins:
    def __init__(self) -> None:
        self._claims: dict[int, int] = {}  # attempt -> this run's claims of its pin so far
        self._counted: dict[int, bool] = {}  # attempt -> its claims are counted (PATCH_...)
        self._lost: set[int] = set()  # attempts a resolve found pinned by another run
        # Attempts whose door route was called after the first task: a lost task may have
        # called it too, and its pin there is only kept when the store took it.
        self._door_later: set[int] = set()

    def claim(self, attempt: int, *, door: bool = False) -> tuple[str | None, int]:
        """The token of a new pin claim of `attempt` and its number k in this run; (None, 0)
        for an attempt whose claims are not counted (its request predates the rule). `door`:
        the claim is the door route's, after the first task."""
        if door:
            self._door_later.add(attempt)
        if attempt not in self._counted:
            self._counted[attempt] = workflow.patched(PATCH_PIN_CLAIMS)
        if not self._counted[attempt]:
            return None, 0
        k = self._claims.get(attempt, 0)
        self._claims[attempt] = k + 1
        info = workflow.info()
        return f"{info.run_id[:12]}.{info.get_current_history_length()}.{attempt}.{k}", k

    def forget(self, attempt: int) -> None:
        """The claim `claim` just counted was never made (its step was never scheduled)."""
        self._claims[attempt] -= 1

    def failed(self, attempt: int, *, unrouted: bool, inline_resolve: bool) -> None:
        """The step of `claim`'s claim failed: never scheduled (`unrouted`: nothing claimed), or
        an inline resolve (`inline_resolve`) whose claim may or may not have reached the store.
        A lost task that sent the attempt made the same claim (the same number, on the same
        key) first, so the next claim goes on that key again: whatever holds it is read, and
        only its own new token is this run's (a claim written whose answer was lost then reads
        as another run's: an unknown outcome at worst, never a send hidden)."""
        if unrouted or (inline_resolve and workflow.patched(PATCH_PIN_UNSURE)):
            self.forget(attempt)

    def made(self, attempt: int) -> int:
        """How many pin claims of `attempt` this run has counted (a pin read looks past them)."""
        return self._claims.get(attempt, 0)

    def saw(self, attempt: int, pinned_before: bool) -> bool:
        """Whether another run pinned `attempt`, as any resolve of it in this run found: once
        found, it stays (a later claim of this run's own only sees its own claims)."""
        if pinned_before:
            self._lost.add(attempt)
        return attempt in self._lost

    def routed_here(self, attempt: int, resolved_at: int, *, settled: bool) -> bool:
        """Whether the call about to be made can follow no send of `attempt` by any run: its
        resolve (counted) ran in this very task (no replay, the history as it was then) and
        found no other run's pin, and `settled`: no earlier run or send of it is suspected."""
        counted = self._counted.get(attempt, False) and attempt not in self._lost
        counted = counted and attempt not in self._door_later
        live = not workflow.unsafe.is_replaying()
        return counted and live and settled and resolved_at == current_history()


def current_history() -> int:
    return workflow.info().get_current_history_length()
