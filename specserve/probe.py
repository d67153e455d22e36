"""The commit probe (SEED_CASE.md): predictable vs novel text across context lengths.

A gRPC client of the gateway. For each text ("predictable": "The cat sat on the mat." repeated;
"novel": non-repetitive prose) and each context length it sends exactly that many prompt tokens,
generates N tokens greedily with speculation, and collects per-step stats from the stream. The
table answers "is commit_len low because the text is hard, or because the system is broken?":
a healthy system keeps a high commit_len on predictable text at every context length. The first
decode step and the steady ones are separate columns: a first step that waits (for the prompt's
context feed, say) is not folded into the cost of every step.

grpc is imported lazily (this module is part of the grpc-free core's namespace).
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PREDICTABLE = "The cat sat on the mat. "


@dataclass(frozen=True)
class ProbeRow:
    text: str  # "predictable" | "novel"
    context: int  # prompt tokens
    new_tokens: int
    steps: int
    commit_len: float  # mean tokens committed per step
    depth: float  # mean accepted_depth
    drafts: float  # mean draft nodes per step (tree size)
    wall_s: float  # gateway-measured request time
    prefill_s: float  # verifier-measured prefill time
    ttft_s: float
    step_ms: float  # mean decode step time: (wall − ttft) / steps (the first step included)
    first_step_ms: float  # the first decode step (a feed stall or a cold path shows here)
    steady_step_ms: float  # median of the later steps (what a step costs once running)
    fallbacks: int
    stream_commit_len: float  # the same mean recomputed from the streamed chunks
    trace_id: str | None = None  # the request's trace (when the services export spans)


def parse_contexts(spec: str) -> list[int]:
    """'1k,16k,64k,128k' → [1024, 16384, 65536, 131072]."""
    out = []
    for part in spec.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * scale))
    if not out or any(c <= 0 for c in out):
        raise ValueError(f"--contexts must be positive token counts, got {spec!r}")
    return out


def novel_corpus(min_chars: int, seed: int = 0) -> str:
    """Non-repetitive prose every machine has: stdlib docstring sentences, shuffled."""
    import ast
    import sysconfig

    sentences: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(
                node, ast.FunctionDef | ast.ClassDef | ast.Module) else None
            if doc:
                sentences += [s.strip() + "." for s in doc.replace("\n", " ").split(". ")
                              if len(s.split()) > 3]
        if sum(map(len, sentences)) > 4 * min_chars:
            break
    random.Random(seed).shuffle(sentences)
    text = " ".join(dict.fromkeys(sentences))  # no sentence twice
    if len(text) < min_chars:
        text = (text + " ") * (min_chars // max(len(text), 1) + 1)
    return text


def prompt_ids(tokenizer, text: str, n: int) -> list[int]:
    """Exactly n token ids of `text` (repeated if it is too short)."""
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


class _Waiting:
    """A live 'prefilling N tokens … t s' line on stderr until the first token arrives."""

    def __init__(self, label: str) -> None:
        self.label, self.done = label, threading.Event()
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.5):
            print(f"\r  {self.label} … {time.perf_counter() - self.t0:6.1f} s", end="",
                  file=sys.stderr, flush=True)

    def stop(self) -> None:
        if not self.done.is_set():
            self.done.set()
            print(f"\r  {self.label} … {time.perf_counter() - self.t0:6.1f} s", file=sys.stderr,
                  flush=True)


def run_one(stub, ids: list[int], text: str, new_tokens: int, drafter: str | None,
            budget: int | None, timeout_s: float, metadata=()) -> ProbeRow:
    from services.gateway import convert
    from specserve.types import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    req = convert.generate_request_to_pb(ids, params, drafter, budget)
    waiting, steps, final = _Waiting(f"{text}: prefilling {len(ids):,} tokens"), [], None
    arrivals: list[float] = []  # when each chunk with tokens came (client clock)
    call = stub.Generate(req, timeout=timeout_s, metadata=metadata)
    try:
        for msg in call:
            event = convert.response_from_pb(msg)
            waiting.stop()
            if isinstance(event, convert.GatewayFinal):
                final = event
            elif event[1].token_ids:
                steps.append(event[1])
                arrivals.append(time.perf_counter())
    finally:
        waiting.stop()
    s = final.stats
    spec_steps = steps[1:]  # the first chunk is prefill's token, not a speculative step
    n = max(s.steps, 1)
    gaps = [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return ProbeRow(
        text=text, context=len(ids), new_tokens=final.completion_tokens, steps=s.steps,
        commit_len=s.mean_commit_len, depth=s.accepted_tokens / n, drafts=s.draft_tokens / n,
        wall_s=final.wall_s, prefill_s=s.prefill_s, ttft_s=final.ttft_s,
        step_ms=1e3 * (final.wall_s - final.ttft_s) / n,
        first_step_ms=gaps[0] if gaps else float("nan"),
        steady_step_ms=statistics.median(gaps[1:]) if len(gaps) > 1 else float("nan"),
        fallbacks=sum(s.fallbacks.values()),
        stream_commit_len=sum(x.commit_len for x in spec_steps) / max(len(spec_steps), 1),
        trace_id=convert.trace_id_from_metadata(call.initial_metadata()),
    )


def table(rows: list[ProbeRow]) -> str:
    head = ("| text | context | commit len | depth | drafts | wall s | prefill s | "
            "1st step ms | steady step ms | fallbacks |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r.text} | {r.context:,} | {r.commit_len:.2f} | {r.depth:.2f} | "
             f"{r.drafts:.2f} | {r.wall_s:.2f} | {r.prefill_s:.2f} | {r.first_step_ms:.1f} | "
             f"{r.steady_step_ms:.1f} | {r.fallbacks} |" for r in rows]
    return "\n".join([head, *lines])


def plot(rows: list[ProbeRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for text in sorted({r.text for r in rows}):
        mine = sorted((r for r in rows if r.text == text), key=lambda r: r.context)
        xs = [r.context for r in mine]
        a.plot(xs, [r.commit_len for r in mine], marker="o", label=text)
        b.plot(xs, [r.steady_step_ms for r in mine], marker="o", label=text)
    for ax, label in ((a, "mean commit_len"), (b, "steady decode step (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    a.set_ylim(bottom=0)
    fig.suptitle("specserve commit probe")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rows_as_json(rows: list[ProbeRow]) -> list[dict]:
    return [asdict(r) for r in rows]
