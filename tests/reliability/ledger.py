"""The verdicts: every request's reported outcome checked against the agents' ledgers, and the
Markdown table `make reliability` prints.

Invariants (each broken one is listed and makes the run fail):
- lost: accepted and, after the drain, no final status (or Reach no longer knows it): 0.
- executed twice without a key: a keyless write the ledgers show run more than once: 0.
- succeeded: run at least once (exactly once for a keyless write).
- outcome unknown: a keyless write run 0 or 1 times (any count is possible for the rest).
- failed, not run (an error without outcome_unknown, a refusal): run 0 times. But an
  agent_error in which the SDK agent says the request may have run (a re-delivery of a run cut
  off mid-handler, `MAY_HAVE_RUN`) is counted apart: the agent's word, 0 or 1 runs.
- never accepted (Reach has no such request): run 0 times.
- a sync answer and the status read back agree; every async request accepted has its callback
  delivered, counted once per webhook-id, and the callback says what the read back says.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.load import Call

# The SDK's answer to a re-delivery of a run that was cut off mid-handler (agent_reach_sdk
# `CUT_OFF`): an agent_error in which the agent says it may have run, without outcome_unknown.
MAY_HAVE_RUN = "it may have run"


def verdict(envelope: dict[str, Any]) -> str:
    if envelope.get("status") == "success":
        return "succeeded"
    error = envelope.get("error") or {}
    if error.get("outcome_unknown") is True:
        return "unknown"
    if error.get("type") == "agent_error" and MAY_HAVE_RUN in json.dumps(error):
        return "agent says may have run"
    return "failed"


def brief(envelope: dict[str, Any] | None) -> str:
    """An envelope in a line: status, error type, outcome_unknown, each attempt's outcome."""
    if envelope is None:
        return "-"
    error = envelope.get("error") or {}
    attempts = [
        f"{a.get('instance_id')}:{a.get('outcome')}" for a in envelope.get("attempts") or []
    ]
    unknown = " outcome_unknown" if error.get("outcome_unknown") else ""
    return f"{envelope.get('status')} {error.get('type', '')}{unknown} [{', '.join(attempts)}]"


@dataclass
class Fault:
    name: str
    at: float  # monotonic, when it was done
    back: float = 0.0  # when what it broke was back (restarted, resumed)
    recovered_s: float | None = None


@dataclass
class Report:
    calls: list[Call]
    runs: Counter[str]  # executions per request id, from the ledgers
    deliveries: list[tuple[str, dict[str, Any], float]]
    faults: list[Fault]
    wall_s: float
    client_seen: Counter[str] = field(default_factory=Counter)  # what made the client repeat
    violations: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    not_succeeded: list[str] = field(default_factory=list)  # what each one was told, in a line
    notes: list[str] = field(default_factory=list)  # printed under the faults' table

    def check(self) -> Report:
        by_id = {c.request_id: c for c in self.calls}
        for rid in self.runs:
            if rid not in by_id and not rid.startswith("max-"):  # the soak's measured calls
                self.violations.append(f"{rid}: in a ledger but never sent by this run")
        callbacks: dict[str, dict[str, Any]] = {}
        for webhook_id, envelope, _ in self.deliveries:
            self.counts["callback deliveries (raw)"] += 1
            callbacks.setdefault(webhook_id, envelope)
        for call in self.calls:
            self._one(call, self.runs[call.request_id], callbacks)
        return self

    def _bad(self, call: Call, what: str, runs: int) -> None:
        self.violations.append(
            f"{call.request_id} ({call.mode} {call.op} key={call.key is not None} "
            f"{call.protocol}): {what}; ran {runs}x; answered {brief(call.answer)}, "
            f"read back {brief(call.final)}"
        )

    def _one(self, call: Call, runs: int, callbacks: dict[str, dict[str, Any]]) -> None:
        c = self.counts
        c["sent"] += 1
        if call.never_accepted:
            c["never accepted"] += 1
            if call.accepted:
                self._bad(call, "LOST: was accepted, Reach no longer knows it", runs)
                c["lost"] += 1
            if runs:
                self._bad(call, "never accepted, yet executed", runs)
            return
        if call.final is None:
            c["no verdict"] += 1
            if call.accepted:
                c["lost"] += 1
                self._bad(call, "LOST: accepted, no final status after the drain", runs)
            return
        c["accepted"] += 1
        v = verdict(call.final)
        c[v] += 1
        if call.keyless_write and runs > 1:
            c["executed twice without a key"] += 1
            self._bad(call, "executed more than once without a key", runs)
        if call.op == "write" and call.key is not None and runs > 1:
            c["keyed writes run more than once (allowed)"] += 1
        if v == "succeeded" and runs < 1:
            self._bad(call, "reported success, never executed", runs)
        if v == "failed" and runs > 0:
            c["wrong outcome"] += 1
            self._bad(call, "reported failed-not-run, but executed", runs)
        if v != "succeeded":
            self.not_succeeded.append(
                f"{call.request_id} ({call.mode} {call.op} key={call.key is not None} "
                f"{call.protocol}): {brief(call.final)}; ran {runs}x"
            )
        if v == "unknown":
            c[f"unknown, ran {min(runs, 2)}{'+' if runs >= 2 else ''}x"] += 1
        if call.answer is not None and verdict(call.answer) != v:
            c["wrong outcome"] += 1
            self._bad(call, f"answered {verdict(call.answer)}, read back {v}", runs)
        if call.mode == "async":
            c["callbacks expected"] += 1
            delivered = callbacks.get(f"msg_{call.request_id}")
            if delivered is None:
                c["callbacks missing"] += 1
                self._bad(call, "its callback was never delivered", runs)
            else:
                c["callbacks delivered (by webhook-id)"] += 1
                if verdict(delivered) != v:
                    c["wrong outcome"] += 1
                    self._bad(call, f"callback says {verdict(delivered)}, read back {v}", runs)

    def table(self) -> str:
        c = self.counts
        rows = [
            ("requests sent", c["sent"], ""),
            ("accepted", c["accepted"], ""),
            ("refused at the door (never accepted)", c["never accepted"], "each ran 0x"),
            ("succeeded", c["succeeded"], "each ran >= 1x, keyless writes exactly 1x"),
            ("failed, not run", c["failed"], "each ran 0x"),
            ("outcome unknown", c["unknown"], "ran 0x: "
             f"{c['unknown, ran 0x']}, 1x: {c['unknown, ran 1x']}, 2+x: {c['unknown, ran 2+x']}"),
            ("agent says it may have run (agent_error)", c["agent says may have run"],
             "the SDK's answer to a re-delivery of a run cut off mid-handler: ran 0 or 1x; "
             "Reach does not flag it outcome_unknown"),
            ("**lost**", c["lost"], "must be 0"),
            ("**executed twice without a key**", c["executed twice without a key"], "must be 0"),
            ("**wrong outcome**", c["wrong outcome"], "must be 0"),
            ("keyed writes run more than once", c["keyed writes run more than once (allowed)"],
             "allowed: the agent sees the same Idempotency-Key"),
            ("callbacks delivered / expected", f"{c['callbacks delivered (by webhook-id)']} / "
             f"{c['callbacks expected']}", f"{c['callback deliveries (raw)']} POSTs in all"),
            ("client repeats (same RequestID)", sum(x.repeats for x in self.calls),
             ", ".join(f"{k}: {v}" for k, v in self.client_seen.most_common())),
            ("executions in the ledgers", sum(self.runs.values()), ""),
            ("wall time", f"{self.wall_s:.0f} s", ""),
        ]  # fmt: skip
        out = ["| | count | note |", "|---|---:|---|"]
        out += [f"| {a} | {b} | {n} |" for a, b, n in rows]
        out += ["", "| fault | at (s) | back after (s) | recovery (s) |", "|---|---:|---:|---:|"]
        start = min((x.sent_at for x in self.calls if x.sent_at), default=0.0)
        for f in self.faults:
            rec = "n/a" if f.recovered_s is None else f"{f.recovered_s:.2f}"
            back = f"{f.back - f.at:.1f}" if f.back else ""
            out.append(f"| {f.name} | {f.at - start:.1f} | {back} | {rec} |")
        if self.notes:
            out += ["", *(f"- {note}" for note in self.notes)]
        if self.not_succeeded:
            out += ["", "Not succeeded (status, error, attempts; the ledgers' count):", ""]
            out += [f"- {line}" for line in self.not_succeeded[:30]]
        return "\n".join(out)


def recovery(
    faults: list[Fault], successes: list[tuple[float, float]], deliveries: list[float]
) -> None:
    """Each fault's recovery: from the fault to the first success of a sync request sent after
    it; for the callback receiver, to the first callback delivered once it was back."""
    for fault in faults:
        if fault.name.startswith("callback receiver"):
            after = [t for t in deliveries if t >= fault.back]
        else:
            after = [done for sent, done in successes if sent >= fault.at]
        fault.recovered_s = min(after) - fault.at if after else None
