"""The commit probe's gateway calls: one probe row from a speculative request, its losslessness
spot check (the same request, speculation off, must give the same tokens), the row's verdict, and
which failures mean the row can never run on this server (`refusal`).

grpc is imported lazily (this module is part of the grpc-free core's namespace); the messages are
built and read by `services.cli.wire` (no torch).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from specserve import probe

CHECK_TOKENS = 16  # tokens compared by the losslessness spot check
HEAD_CHARS = 80


class _Waiting:
    """A live 'prefilling N tokens … t s' line on stderr until the first token arrives: redrawn
    in place every `TTY_EVERY_S` on a terminal; elsewhere (a log file, CI) a line every
    `LOG_EVERY_S`, then the last one."""

    TTY_EVERY_S, LOG_EVERY_S = 0.5, 10.0

    def __init__(self, label: str, stream=None) -> None:
        self.label, self.done = label, threading.Event()
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _line(self) -> str:
        return f"  {self.label} … {time.perf_counter() - self.t0:6.1f} s"

    def _run(self) -> None:
        while not self.done.wait(self.TTY_EVERY_S if self.tty else self.LOG_EVERY_S):
            if self.tty:
                print(f"\r{self._line()}", end="", file=self.stream, flush=True)
            else:
                print(self._line(), file=self.stream, flush=True)

    def stop(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.thread.join()  # no redraw after the last line
            print(f"\r{self._line()}" if self.tty else self._line(), file=self.stream,
                  flush=True)


@dataclass
class Generation:
    """One streamed request: its tokens, text, per-step records, final stats, arrival times."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    steps: list = field(default_factory=list)  # the wire.Chunks that carried tokens
    arrivals: list[float] = field(default_factory=list)  # client clock, one per chunk
    final: object = None
    trace_id: str | None = None


def generate(stub, ids: list[int], new_tokens: int, drafter: str | None, budget: int | None,
             timeout_s: float, metadata=(), label: str = "") -> Generation:
    from services.cli import wire
    from specserve.types import SamplingParams

    req = wire.generate_request(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                                drafter, budget)
    out, waiting = Generation(), _Waiting(label) if label else None
    call = stub.Generate(req, timeout=timeout_s, metadata=metadata)
    try:
        for msg in call:
            event = wire.event(msg)
            if waiting is not None:
                waiting.stop()
            if isinstance(event, wire.Final):
                out.final = event
            elif event.token_ids:
                out.text += event.text
                out.ids += event.token_ids
                out.steps.append(event)
                out.arrivals.append(time.perf_counter())
    finally:
        if waiting is not None:
            waiting.stop()
    out.trace_id = wire.trace_id(call.initial_metadata())
    return out


def probe_row(stub, ids: list[int], expected: list[int] | None, text: str, new_tokens: int,
              drafter: str | None, budget: int | None, timeout_s: float, metadata=(),
              check: bool = True) -> probe.ProbeRow:
    """The row of `ids` (the continuation `expected`, if known), spot-checked when `check`."""
    g = generate(stub, ids, new_tokens, drafter, budget, timeout_s, metadata,
                 label=f"{text}: prefilling {len(ids):,} tokens")
    lossless = None
    if check:
        n = min(CHECK_TOKENS, len(g.ids))
        plain = generate(stub, ids, n, "none", 0, timeout_s, metadata)
        lossless = plain.ids == g.ids[:n]
    row = _row(g, text, len(ids), expected, lossless)
    return replace(row, verdict=probe.verdict(row))


def refusal(error) -> dict | None:
    """A request the server can never run (`probe.unfit`: INVALID_ARGUMENT naming its KV pool),
    from the gateway's error; None for any other failure."""
    import grpc

    if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    return probe.unfit(error.details() or "")


def _row(g: Generation, text: str, context: int, expected, lossless) -> probe.ProbeRow:
    s, final = g.final.stats, g.final
    n = max(s.steps, 1)
    gaps = [1e3 * (b - a) for a, b in zip(g.arrivals, g.arrivals[1:], strict=False)]
    rates, fail = probe.acceptance(s.accepted_per_position, s.steps)
    spec_steps = g.steps[1:]  # the first chunk is prefill's token, not a speculative step
    return probe.ProbeRow(
        text=text, context=context, new_tokens=final.completion_tokens, steps=s.steps,
        commit_len=s.mean_commit_len, depth=s.accepted_tokens / n, drafts=s.draft_tokens / n,
        wall_s=final.wall_s, prefill_s=s.prefill_s, ttft_s=final.ttft_s,
        step_ms=1e3 * (final.wall_s - final.ttft_s) / n,
        first_step_ms=gaps[0] if gaps else float("nan"),
        steady_step_ms=statistics.median(gaps[1:]) if len(gaps) > 1 else float("nan"),
        fallbacks=sum(s.fallbacks.values()),
        stream_commit_len=sum(x.commit_len for x in spec_steps) / max(len(spec_steps), 1),
        text_head=g.text[:HEAD_CHARS], followed=probe.followed(g.ids, expected),
        lossless=lossless, accepted_per_position=rates, fail_position=fail,
        trace_id=g.trace_id, device=s.device, verifier=final.verifier,
        plain=s.shapes.get("off", 0) / sum(s.shapes.values()) if s.shapes else None)
