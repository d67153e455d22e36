"""Every Prometheus metric of the three services, in the `specserve_` namespace.

Each running service owns one instance (with its own `CollectorRegistry`, so several services
in one test process never collide); `telemetry.start_metrics_server` serves its registry.
Vocabulary: a *step* is one draft → verify → commit round for one
request; an *engine step* is one batched round over all running requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.telemetry import SECONDS_BUCKETS
from specserve.spec.metrics import FALLBACK_KINDS, fallback_kind, reason_kind

__all__ = ["FALLBACK_KINDS", "fallback_kind", "VerifierMetrics", "DrafterMetrics",
           "GatewayMetrics"]

COMMIT_LEN_BUCKETS = tuple(range(1, 18))  # commit_len 1..17 (budget 16: 16 accepted + bonus)


class VerifierMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("specserve_steps", "Speculative steps (one per request per engine "
                             "step that decoded it)", registry=r)
        self.engine_steps = Counter("specserve_engine_steps", "Batched engine steps", registry=r)
        self.draft_tokens = Counter("specserve_draft_tokens", "Draft tree nodes verified "
                                    "(sum of tree_size)", registry=r)
        self.accepted_tokens = Counter("specserve_accepted_tokens", "Draft tokens accepted "
                                       "(sum of accepted_depth)", registry=r)
        self.accepted_per_position = Counter(
            "specserve_accepted_per_position", "Steps whose accepted path reached this depth",
            ["position"], registry=r)
        self.committed_tokens = Counter("specserve_committed_tokens", "Tokens committed by "
                                        "steps (sum of commit_len)", registry=r)
        self.commit_len = Histogram("specserve_commit_len", "Tokens committed per step",
                                    buckets=COMMIT_LEN_BUCKETS, registry=r)
        self.phase = Histogram(
            "specserve_phase_seconds", "prefill: a request's prefill forwards; draft, verify, "
            "commit: one engine step's phase", ["phase"], buckets=SECONDS_BUCKETS, registry=r)
        self.ttft = Histogram("specserve_ttft_seconds", "Verifier time to first token",
                              buckets=SECONDS_BUCKETS, registry=r)
        self.tpot = Histogram("specserve_tpot_seconds", "Verifier time per output token after "
                              "the first", buckets=SECONDS_BUCKETS, registry=r)
        self.requests = Counter("specserve_requests", "Requests finished, by gRPC status",
                                ["code"], registry=r)
        self._add_gauges(r)
        self.preemptions = Counter("specserve_preemptions", "Requests preempted when the KV "
                                   "pool ran out (recomputed later)", registry=r)
        self.fallbacks = Counter("specserve_drafter_fallbacks", "Steps verified as a root-only "
                                 "tree, by reason", ["reason"], registry=r)
        self.shapes = Counter("specserve_adaptive_choices", "Steps by adaptive speculation's "
                              "choice (tree, chain, off = plain decoding)", ["shape"], registry=r)
        self.reasons = Counter("specserve_adaptive_reasons", "Steps by why adaptive "
                               "speculation chose its shape (decided, held, explore, plain, …)",
                               ["reason"], registry=r)
        self.chosen_nodes = Histogram("specserve_adaptive_nodes", "Draft nodes adaptive "
                                      "speculation chose per step",
                                      buckets=(0, 1, 3, 7, 15, 31, 63, 127, 255, 1023),
                                      registry=r)

    def _add_gauges(self, r: CollectorRegistry) -> None:
        """The KV pool's pages and the requests in the engine, set after each engine step."""
        self.kv_pages_used = Gauge("specserve_kv_pages_used", "KV cache pages in use",
                                   registry=r)
        self.kv_pages_free = Gauge("specserve_kv_pages_free", "KV cache pages free", registry=r)
        self.kv_pages_reserved = Gauge("specserve_kv_pages_reserved", "KV cache pages promised "
                                       "to running requests (what admission counts; used ≤ "
                                       "reserved)", registry=r)
        self.running = Gauge("specserve_running_requests", "Requests in the engine",
                             registry=r)
        self.waiting = Gauge("specserve_waiting_requests", "Requests in the engine waiting "
                             "for a running slot or KV pages (part of running_requests)",
                             registry=r)

    def record_step(self, step) -> None:
        """One request's StepRecord."""
        self.steps.inc()
        self.draft_tokens.inc(step.tree_size)
        self.accepted_tokens.inc(step.accepted_depth)
        self.committed_tokens.inc(step.commit_len)
        self.commit_len.observe(step.commit_len)
        for depth in range(1, step.accepted_depth + 1):
            self.accepted_per_position.labels(position=str(depth)).inc()
        if step.shape:
            self.shapes.labels(shape=step.shape).inc()
            self.reasons.labels(reason=reason_kind(step.why or "")).inc()
            self.chosen_nodes.observe(step.tree_size)

    def record_engine_step(self, times, decoded: bool) -> None:
        """One engine step's phases (StepTimes); draft/verify/commit only if it decoded."""
        self.engine_steps.inc()
        if decoded:
            self.phase.labels(phase="draft").observe(times.draft_s)
            self.phase.labels(phase="verify").observe(times.verify_s)
            self.phase.labels(phase="commit").observe(times.commit_s)

    def record_fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason=fallback_kind(reason)).inc()

    def set_pages(self, used: int, free: int, running: int, reserved: int = 0,
                  preempted: int = 0, waiting: int = 0) -> None:
        """Gauges now; `preempted`: the total so far (the counter catches up to it)."""
        self.kv_pages_used.set(used)
        self.kv_pages_free.set(free)
        self.kv_pages_reserved.set(reserved)
        if preempted > self.preemptions._value.get():
            self.preemptions.inc(preempted - self.preemptions._value.get())
        self.running.set(running)
        self.waiting.set(waiting)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specserve_gateway_requests", "Generations finished, by gRPC "
                                "status and front (grpc | openai)", ["code", "api"], registry=r)
        self.ttft = Histogram("specserve_gateway_ttft_seconds", "Client-visible time to first "
                              "chunk", buckets=SECONDS_BUCKETS, registry=r)
        self.duration = Histogram("specserve_gateway_request_seconds", "Generate call wall "
                                  "time", buckets=SECONDS_BUCKETS, registry=r)
        self.completion_tokens = Counter("specserve_gateway_completion_tokens", "Tokens "
                                         "streamed to clients", registry=r)


class DrafterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.batches = Counter("specserve_drafter_batches", "Draft batches served", registry=r)
        self.feeds = Counter("specserve_drafter_feeds", "Prefill context feeds: budget-0 entries "
                             "that only extend a request's context (not in batches / entries)",
                             registry=r)
        self.entries = Counter("specserve_drafter_entries", "Draft entries, by drafter and "
                               "result", ["drafter", "result"], registry=r)
        self.batch_seconds = Histogram("specserve_drafter_batch_seconds", "One batch: decode, "
                                       "draft, encode", buckets=SECONDS_BUCKETS, registry=r)
        self.phase = Histogram("specserve_drafter_phase_seconds", "forward: DFlash forward; "
                               "tree_build: DDTree / n-gram", ["phase"],
                               buckets=SECONDS_BUCKETS, registry=r)
        self.cache_pages = Gauge("specserve_drafter_cache_pages", "DFlash context-cache pages, "
                                 "by layer group (full / sliding) and state (used / free)",
                                 ["group", "state"], registry=r)

    def set_cache_pages(self, pages: dict[str, tuple[int, int]]) -> None:
        for group, (used, free) in pages.items():
            self.cache_pages.labels(group=group, state="used").set(used)
            self.cache_pages.labels(group=group, state="free").set(free)
