"""The drafter service's core (no grpc): which drafters exist and one batched draft per step.

Owns the drafters by name ("ngram" always, "dflash" when a draft model is loaded), each
request's committed-token history (entries carry only the tokens committed since the last one;
the n-gram drafter needs the whole history), whose each request is (its state is keyed by the
connection — verifier stream or lane — and the id: two verifiers sharing this drafter may use
the same id, each drafts its own request, and a connection sees and releases only its own; a
connection may hold at most `max_share` of the context cache), the per-entry checks that keep
one bad entry from failing its batch, one `draft` call per drafter per batch, and error
isolation: a drafter that raises fails only its own entries. Every result is a `DraftTree` or
an error string (the verifier then verifies a root-only tree). Calls are serialised by a lock,
so worker threads of several streams may call in at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specserve.drafters import registry
from specserve.drafters.base import Drafter, DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from specserve.drafters.registry import CONTEXT_PAGES, DFLASH, NGRAM, NONE, DrafterSpec
from specserve.errors import CapacityExhausted
from specserve.spec.tree import DraftTree, check_budget

log = logging.getLogger(__name__)

Result = DraftTree | str  # a tree, or why this entry got none


@dataclass(frozen=True)
class Entry:
    """One request's part of a draft batch."""

    request: DraftRequest  # without history: the core supplies it
    kind: str | None = None  # "dflash" | "ngram" | "none"; None = the server's default
    new_history: tuple[int, ...] = ()  # committed tokens since the last entry, ending with the root


@dataclass(frozen=True)
class GroupTimes:
    """One drafter's call for its entries of a batch (wall clock start, for spans)."""

    kind: str  # "dflash" | "ngram"
    indices: tuple[int, ...]  # the entries it drafted (positions in the batch)
    start_ns: int
    forward_s: float = 0.0
    tree_build_s: float = 0.0


@dataclass(frozen=True)
class DraftTimes:
    """Where a batch's drafting time went (0 for parts that did not run)."""

    forward_s: float = 0.0  # DFlash context K/V + block forward + logits
    tree_build_s: float = 0.0  # DDTree building, plus the n-gram drafter's whole call
    groups: tuple[GroupTimes, ...] = ()  # per drafter, in the order they ran


def _entry_problem(entry: Entry, seen: set[str]) -> str | None:
    """What makes an entry undraftable whatever its drafter, or None."""
    r = entry.request
    if not r.request_id:
        return "request_id is empty"
    if r.request_id in seen:
        return f"request {r.request_id!r} appears twice in one batch"
    try:
        check_budget(r.budget)
    except ValueError as e:
        return f"request {r.request_id!r}: {e}"
    if r.max_depth < 0 or r.start < 0 or r.bonus_token < 0:
        return (f"request {r.request_id!r}: max_depth, start and bonus_token must be "
                f"non-negative, got {r.max_depth}, {r.start}, {r.bonus_token}")
    if entry.new_history and entry.new_history[-1] != r.bonus_token:
        return (f"request {r.request_id!r}: new_history must end with the root "
                f"{r.bonus_token}, ends with {entry.new_history[-1]}")
    return None


class DrafterCore:
    """The drafters of one drafter server and the per-request state they need."""

    def __init__(self, dflash: DFlashDrafter | None = None,
                 ngram: Drafter | None = None, max_share: float = 1.0) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.dflash, self.max_share = dflash, max_share
        self._owner: dict[str, object] = {}  # state key → the connection that drafts it
        # (connection, its request id) → the state key: the id itself for the first
        # connection that drafts it, "id#n" for another one's while that is held
        self._keys: dict[tuple[object, str], str] = {}
        self.drafters: dict[str, Drafter] = {
            NGRAM: ngram or registry.build(NGRAM, DrafterSpec())}
        if dflash is not None:
            self.drafters[DFLASH] = dflash
        self._history: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, draft_dir: str | Path | None, target_dir: str | Path | None, *,
             dtype: str = "float32", device: str = "cpu", num_pages: int = CONTEXT_PAGES,
             page_size: int = 16, graphs: bool | None = None,
             max_share: float = 1.0) -> DrafterCore:
        """N-gram always; DFlash too when `draft_dir` (and the target's `target_dir`) are given
        (`graphs`: its block forward from CUDA graphs; None = on for CUDA)."""
        if draft_dir is None:
            return cls(max_share=max_share)
        if target_dir is None:
            raise ValueError("the DFlash drafter needs the target checkpoint (embedding, LM head)")
        spec = DrafterSpec(draft_dir, target_dir, dtype, device, num_pages, page_size, graphs)
        return cls(registry.build(DFLASH, spec), max_share=max_share)

    @property
    def default_kind(self) -> str:
        """What DRAFTER_KIND_UNSPECIFIED means here."""
        return DFLASH if self.dflash is not None else NGRAM

    @property
    def context_device(self) -> torch.device:
        """Where context features should be put for the drafter that uses them."""
        return self.dflash.model.fc.weight.device if self.dflash else torch.device("cpu")

    @property
    def context_dtype(self) -> torch.dtype:
        return self.dflash.model.fc.weight.dtype if self.dflash else torch.float32

    def draft(self, entries: Sequence[Entry | str], owner: object = None) -> list[Result]:
        """One result per entry, in order (a str entry is an error passed through); `owner`:
        the connection the entries came on."""
        return self.draft_timed(entries, owner)[0]

    def draft_timed(self, entries: Sequence[Entry | str], owner: object = None
                    ) -> tuple[list[Result], DraftTimes]:
        """`draft` plus where the time went."""
        with self._lock:
            results: list[Result] = [DraftTree.empty()] * len(entries)
            groups: dict[str, list[tuple[int, DraftRequest]]] = {}
            seen: set[str] = set()
            for i, entry in enumerate(entries):
                admitted = self._admit(entry, seen, owner)
                if isinstance(admitted, str):
                    results[i] = admitted
                elif admitted[0] != NONE:
                    groups.setdefault(admitted[0], []).append((i, admitted[1]))
            times = [self._run(kind, items, results) for kind, items in groups.items()]
            return results, DraftTimes(sum(t.forward_s for t in times),
                                       sum(t.tree_build_s for t in times), tuple(times))

    def release(self, request_ids: Sequence[str], owner: object = None) -> None:
        """Forget the requests' histories and drafter state; ids `owner` does not own (or
        unknown ones) are a no-op."""
        with self._lock:
            for rid in request_ids:
                key = self._keys.pop((owner, rid), None)
                if key is None:
                    continue  # not one of this connection's requests
                self._owner.pop(key, None)
                self._history.pop(key, None)
                for drafter in self.drafters.values():
                    drafter.release(key)

    def cache_pages(self) -> dict[str, tuple[int, int]]:
        """The DFlash context cache's (used, free) pages per layer group ({}: no DFlash)."""
        with self._lock:
            return self.dflash.cache.pages() if self.dflash is not None else {}

    def history(self, key: str) -> list[int]:
        """Committed tokens known for the request of state key `key` (a copy; a request's key
        is its id for the first connection that drafts it)."""
        with self._lock:
            return list(self._history.get(key, ()))

    def _admit(self, entry: Entry | str, seen: set[str], owner: object
               ) -> tuple[str, DraftRequest] | str:
        """(drafter name, request ready for it), or why the entry cannot be drafted."""
        if isinstance(entry, str):
            return entry
        problem = _entry_problem(entry, seen) or self._share_problem(entry, owner)
        if problem:
            return problem
        seen.add(entry.request.request_id)
        r = replace(entry.request, request_id=self._key(entry.request.request_id, owner))
        self._owner[r.request_id] = owner
        history = self._history.setdefault(r.request_id, [])
        history.extend(entry.new_history)
        kind = entry.kind or self.default_kind
        if kind == NONE:
            return kind, r
        if kind not in self.drafters:
            return (f"request {r.request_id!r}: drafter {kind!r} is not loaded here "
                    f"(available: {', '.join(sorted(self.drafters))}, none)")
        if kind == DFLASH:
            problem = self.dflash.problem(r)
            return problem if problem else (kind, r)
        return kind, replace(r, history=history)

    def _key(self, request_id: str, owner: object) -> str:
        """The state key of `owner`'s `request_id` (made on its first entry)."""
        key = self._keys.get((owner, request_id))
        if key is None:
            key, n = request_id, 0
            while key in self._owner:  # another connection's request of the same id
                n += 1
                key = f"{request_id}#{n}"
            self._keys[owner, request_id] = key
        return key

    def _share_problem(self, entry: Entry, owner: object) -> str | None:
        """Why `owner` may not draft this entry (it holds its share of the context cache
        already), or None. Says nothing of other requests."""
        cache = self.dflash.cache if self.dflash is not None else None
        ctx = entry.request.context
        if cache is None or self.max_share >= 1 or ctx is None or not ctx.shape[0]:
            return None
        mine = sum(cache.pages_held(r) for r, o in self._owner.items() if o is owner)
        cap = int(self.max_share * cache.total_pages)
        if mine >= cap:
            return (f"RESOURCE_EXHAUSTED: this connection holds {mine} of the drafter's "
                    f"{cache.total_pages} context pages (its share: {cap})")
        return None

    def _run(self, kind: str, items: list[tuple[int, DraftRequest]],
             results: list[Result]) -> GroupTimes:
        """Draft one drafter's entries in one call; if it raises, all of them get the error."""
        drafter, requests = self.drafters[kind], [r for _, r in items]
        indices, start_ns = tuple(i for i, _ in items), time.time_ns()
        t0, failed = time.perf_counter(), False
        try:
            trees: list[Result] = list(drafter.draft(requests))
        except CapacityExhausted as e:  # a full context cache: expected, no traceback
            log.warning("%s drafter: %s (requests %s)", kind, e, [r.request_id for r in requests])
            failed, trees = True, [f"RESOURCE_EXHAUSTED: {kind} drafter: {e}"] * len(requests)
        except Exception as e:
            log.exception("%s drafter failed for requests %s", kind,
                          [r.request_id for r in requests])
            failed, error = True, f"{kind} drafter failed: {type(e).__name__}: {e}"
            trees = [error] * len(requests)
        for (i, _), tree in zip(items, trees, strict=True):
            results[i] = tree
        elapsed = time.perf_counter() - t0
        if kind != DFLASH:
            return GroupTimes(kind, indices, start_ns, tree_build_s=elapsed)
        stats = self.dflash.last_stats
        if failed or stats is None:
            return GroupTimes(kind, indices, start_ns, forward_s=elapsed)
        return GroupTimes(kind, indices, start_ns, stats.forward_s, stats.tree_s)
