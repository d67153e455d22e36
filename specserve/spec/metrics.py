"""Speculation metrics in the shared vocabulary, per step and per request.

commit_len = accepted_depth + 1 (the bonus) unless the step was cut by a stop token or
max_tokens — then `cut` is set and commit_len counts what was really committed. The invariant
is checked when a step is recorded, so the numbers cannot contradict each other.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepRecord:
    budget: int  # draft nodes asked for
    tree_size: int  # draft nodes received (root excluded)
    accepted_depth: int
    commit_len: int
    cut: bool  # commit_len < accepted_depth + 1 because a stop / max_tokens ended the request
    fallback: str | None = None  # why the step verified a root-only tree, if it did
    shape: str | None = None  # adaptive choice: "tree" | "chain" | "off" (None: not adaptive)
    why: str | None = None  # the adaptive choice's reason (expected tokens/s it weighed)

    def __post_init__(self) -> None:
        if self.cut:
            if not 1 <= self.commit_len <= self.accepted_depth + 1:
                raise AssertionError(f"cut step commits {self.commit_len} of "
                                     f"{self.accepted_depth + 1}")
        elif self.commit_len != self.accepted_depth + 1:
            raise AssertionError(f"commit_len {self.commit_len} != accepted_depth "
                                 f"{self.accepted_depth} + 1")
        if self.accepted_depth > self.tree_size:
            raise AssertionError("accepted more nodes than the tree has")


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Wall-clock marks of one engine step (`time.time_ns()`), for traces: the step began, the
    drafts were in, the batched forward ended, the commit ended. `prefill` lists the prompt
    chunks that rode in the forward as (request id, first position, tokens)."""

    start_ns: int
    draft_end_ns: int
    verify_end_ns: int
    end_ns: int
    prefill: tuple[tuple[str, int, int], ...] = ()

    @property
    def draft_s(self) -> float:
        return (self.draft_end_ns - self.start_ns) / 1e9

    @property
    def verify_s(self) -> float:
        return (self.verify_end_ns - self.draft_end_ns) / 1e9

    @property
    def commit_s(self) -> float:
        return (self.end_ns - self.verify_end_ns) / 1e9


# adaptive speculation's reasons by kind, from the why's opening words (engine/adaptive.py)
REASON_KINDS = {"step rows": "decided", "held": "held", "explore": "explore",
                "plain decoding expected faster": "plain", "unmeasured": "unmeasured",
                "as drafted": "as_drafted", "budget 0": "budget_0",
                "drafter fallback": "fallback", "no draft this step": "no_draft"}


def reason_kind(why: str) -> str:
    """An adaptive choice's reason by kind, one of REASON_KINDS' values or "other" (a metric's
    label value: no figures): "held: step rows 16: 3.52 tok/step …" → "held"."""
    for opening, kind in REASON_KINDS.items():
        if why.startswith(opening):
            return kind
    return "other"


FALLBACK_KINDS = ("drafter_timeout", "drafter_unavailable", "drafter_error",
                  "drafter_entry_error", "drafter_context_lost", "invalid_tree", "other")
_ERROR_KINDS = {"DrafterTimeout": "drafter_timeout", "DrafterUnavailable": "drafter_unavailable"}


def fallback_kind(reason: str) -> str:
    """A fallback reason's kind, one of FALLBACK_KINDS (the key of a request's `fallbacks`, a
    metric's label value and the server-wide counter's key: no request ids, counts or
    messages; the whole reason is the step's `fallback`): "drafter_error: DrafterTimeout: no
    reply…" → "drafter_timeout"; "invalid_tree: too deep" → "invalid_tree"."""
    parts = [p.strip() for p in reason.split(":")]
    if parts[0] == "drafter_error" and len(parts) > 1 and parts[1] in _ERROR_KINDS:
        return _ERROR_KINDS[parts[1]]
    return parts[0] if parts[0] in FALLBACK_KINDS else "other"


@dataclass
class RequestSpecStats:
    """Accumulated over a request's speculative steps."""

    steps: int = 0
    draft_tokens: int = 0  # Σ tree_size
    accepted_tokens: int = 0  # Σ accepted_depth
    committed_tokens: int = 0  # Σ commit_len
    commit_len_hist: Counter = field(default_factory=Counter)
    accepted_per_position: Counter = field(default_factory=Counter)  # depth -> times accepted
    fallbacks: Counter = field(default_factory=Counter)  # fallback_kind(reason) -> steps
    shapes: Counter = field(default_factory=Counter)  # adaptive choice -> steps
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    device: str = ""  # where the target ran, e.g. "cuda (NVIDIA H200)" or "cpu"

    def record(self, step: StepRecord) -> None:
        """Count one step (a StepRecord, or the gateway's Step: the same fields)."""
        self.steps += 1
        self.draft_tokens += step.tree_size
        self.accepted_tokens += step.accepted_depth
        self.committed_tokens += step.commit_len
        self.commit_len_hist[step.commit_len] += 1
        for depth in range(1, step.accepted_depth + 1):
            self.accepted_per_position[depth] += 1
        if step.fallback:
            self.fallbacks[fallback_kind(step.fallback)] += 1
        if step.shape:
            self.shapes[step.shape] += 1

    @property
    def mean_commit_len(self) -> float:
        return self.committed_tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens, "committed_tokens": self.committed_tokens,
            "mean_commit_len": self.mean_commit_len,
            "commit_len_hist": dict(sorted(self.commit_len_hist.items())),
            "accepted_per_position": dict(sorted(self.accepted_per_position.items())),
            "fallbacks": dict(self.fallbacks), "shapes": dict(self.shapes),
            "phase_s": {"prefill": self.prefill_s, "draft": self.draft_s,
                        "verify": self.verify_s, "commit": self.commit_s},
        }


@dataclass(slots=True)
class StepOutcome:
    """What a decode step records for one request (`RequestOutput.stats`; None after the token
    sampled at the end of prefill)."""

    step: StepRecord
    request: RequestSpecStats  # the request's running totals, this step included
    context_len: int  # committed tokens before the step's root
    times: StepTimes | None = None  # the engine step's wall-clock marks, set after it
