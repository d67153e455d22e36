"""Drafting overlapped with the verifier's own work: the next drafts asked for early, or two
groups of decoding requests taking turns.

`Ahead` (the default with an asynchronous drafter): a step's drafts for the next step are sent
as soon as its acceptance is known and its GPU work launched, before the step records,
streaming the tokens and scheduling the next step, so that host work runs while the drafter
drafts. The draft asked for is exactly the serial loop's (nothing it depends on changes before
the next step), so it is lossless by construction; a request whose state changed meanwhile
(aborted, preempted, or not scheduled) drops its tree, and one that was not in the batch is
drafted then.

`Alternation` (`overlap`): speculating requests are split into two sticky groups (a new one
joins the smaller). Each step verifies one group with the trees drafted for it during the
previous step, and first sends the other group's draft, so the drafter (another process, or
another GPU stream) works on it while the target verifies: the step costs about
max(verify, draft) instead of their sum — when the drafter's work overlaps the verify without
slowing it. Lossless by construction too: a request's draft is made from exactly the state it
has when its trees are used (it is not verified in between), so each request sees the same
drafts, trees and acceptance as in the serial loop; only which requests share a forward
changes. A request whose group's draft was sent before it started decoding waits one step for
its group's next turn; with only one group (one speculating request) every step is serial.
Both need a drafter with `submit(requests) -> collect`
(services/verifier/drafter_client.RemoteDrafter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specserve.drafters.base import DraftRequest
from specserve.engine import speculative
from specserve.engine.sequence import Sequence
from specserve.spec.tree import DraftTree


@dataclass(eq=False)
class _InFlight:
    group: int
    seqs: list[Sequence]
    reqs: list[DraftRequest]
    wanted: list[DraftRequest]
    collect: Callable[[], list[DraftTree]] | Exception  # or what `submit` raised


class Alternation:
    """The two groups and the draft in flight (engine thread only)."""

    def __init__(self) -> None:
        self.group: dict[str, int] = {}
        self.in_flight: _InFlight | None = None

    def plan(self, seqs: Seq[Sequence], drafter, max_len: int, vocab: int
             ) -> tuple[list[speculative.Planned], float, list[Sequence]]:
        """This step's plans, the drafting time (s) and the decoding requests that sit it out
        (the other group, whose draft goes out now)."""
        t0 = time.perf_counter()
        plain = [s for s in seqs if not s.budget]  # no drafting: every step
        groups = self._groups([s for s in seqs if s.budget])
        flight, self.in_flight = self.in_flight, None
        turn = flight.group if flight is not None else (0 if groups[0] else 1)
        now, other = groups[turn], groups[1 - turn]
        if other:  # out first: the drafter works on it while this group is verified (its
            # next step's draft: `ahead`, so traces open that step's spans, not this one's)
            self.in_flight = _submit(1 - turn, other, drafter, max_len, ahead=True)
        plans, _ = speculative.plan(plain, drafter, max_len, vocab)
        if flight is not None and flight.group == turn:
            sent = {s.request_id for s in flight.seqs}
            ready = [s for s in now if s.request_id in sent]
            plans += _collect(flight, ready, drafter, vocab)
            waiting = [s for s in now if s.request_id not in sent]
        else:  # nothing drafted ahead for this group: now, serially
            plans += speculative.plan(now, drafter, max_len, vocab)[0]
            waiting = []
        return plans, time.perf_counter() - t0, waiting + other

    def _groups(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        live = {s.request_id for s in seqs}
        self.group = {rid: g for rid, g in self.group.items() if rid in live}
        for s in seqs:
            if s.request_id not in self.group:
                sizes = [sum(1 for g in self.group.values() if g == k) for k in (0, 1)]
                self.group[s.request_id] = 0 if sizes[0] <= sizes[1] else 1
        return ([s for s in seqs if self.group[s.request_id] == 0],
                [s for s in seqs if self.group[s.request_id] == 1])


class Ahead:
    """The next step's drafts, sent when this step's acceptance is known (engine thread)."""

    def __init__(self) -> None:
        self.in_flight: _InFlight | None = None

    def send(self, running: Seq[Sequence], drafter, max_len: int, policy=None) -> None:
        """Ask now for the next drafts of the speculating decoding requests of `running` (the
        scheduler's, after this step's commit). With adaptive speculation (`policy`): only
        while its decision to draft holds for them, each for the tree its shape needs."""
        seqs = [s for s in running if s.budget and not s.in_prefill]
        if not seqs:
            return
        budgets = None if policy is None else policy.ahead(seqs)
        if policy is None or budgets is not None:  # None from the policy: it decides afresh
            self.in_flight = _submit(0, seqs, drafter, max_len, ahead=True, budgets=budgets)

    def sent(self) -> set[str]:
        """The requests whose next drafts are in flight."""
        return set() if self.in_flight is None else {s.request_id for s in self.in_flight.seqs}

    def plan(self, seqs: Seq[Sequence], drafter, max_len: int, vocab: int,
             budgets: dict[str, speculative.Ask] | None = None
             ) -> tuple[list[speculative.Planned], float]:
        """This step's plans (the trees sent ahead where they still hold, the others drafted
        now, with `budgets` where given) and the time spent here (s)."""
        t0 = time.perf_counter()
        flight, self.in_flight = self.in_flight, None
        sent = {} if flight is None else {
            s.request_id: r.start for s, r in zip(flight.seqs, flight.reqs, strict=True)}
        held = {s.request_id for s in seqs if s.budget and sent.get(s.request_id) == s.num_computed}
        ready = [s for s in seqs if s.request_id in held]
        rest = [s for s in seqs if s.request_id not in held]
        plans = speculative.plan(rest, drafter, max_len, vocab, budgets)[0] if rest else []
        if flight is not None:  # collected even when none is ready: nothing left unread
            plans += _collect(flight, ready, drafter, vocab)
        return plans, time.perf_counter() - t0


def _submit(group: int, seqs: list[Sequence], drafter, max_len: int, ahead: bool = False,
            budgets: dict[str, speculative.Ask] | None = None) -> _InFlight:
    """Send the drafts of `seqs` (group `group`); what submit raised is kept for the collect."""
    reqs = speculative.draft_requests(seqs, max_len, budgets)
    wanted = [r for r in reqs if r.budget > 0]
    try:
        collect = drafter.submit(wanted, ahead=ahead)
    except Exception as e:  # noqa: BLE001 — the group verifies root-only trees
        collect = e
    return _InFlight(group, list(seqs), reqs, wanted, collect)


def _collect(flight: _InFlight, ready: list[Sequence], drafter,
             vocab: int) -> list[speculative.Planned]:
    """The plans of `ready` (those of the flight still decoding) from the flight's trees."""
    got = flight.collect
    if not isinstance(got, Exception):
        try:
            got = got()
        except Exception as e:  # noqa: BLE001
            got = e
    if not isinstance(got, Exception) and len(got) != len(flight.wanted):
        got = ValueError(f"drafter returned {len(got)} trees for {len(flight.wanted)} "
                         "requests")
    keep = {s.request_id for s in ready}  # a request aborted meanwhile is dropped
    if not isinstance(got, Exception):
        got = [t for r, t in zip(flight.wanted, got, strict=False) if r.request_id in keep]
    reqs = [r for r in flight.reqs if r.request_id in keep]
    wanted = [r for r in flight.wanted if r.request_id in keep]
    by_id = {r.request_id: r for r in reqs}
    ready = [s for s in ready if s.request_id in by_id]
    reqs = [by_id[s.request_id] for s in ready]
    return speculative.planned(ready, reqs, wanted, got, drafter, vocab)
