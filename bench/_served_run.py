"""bench/bench_served.py: the same requests in process and through the three services.

`in_process` runs them on an `Engine` with an in-process `DFlashDrafter`, configured from the
very `VerifierConfig` the verifier process gets; `Services` starts drafter, verifier and
gateway as subprocesses (port files, logs under the run's directory) and `served` streams the
requests through the gateway. Both record, per request, when it was sent and when each of its
tokens arrived (`Timing`); `summary` turns that into TTFT, first step, steady steps and tok/s
the same way for both. Benchmark-only code.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Timing:
    """One request: when it was sent and (time, tokens) of each arrival (a step's tokens)."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)  # each arrival's step: `step_label`
    whys: list[str] = field(default_factory=list)  # and adaptive's reason for it ("": none)
    phases: dict = field(default_factory=dict)  # the request's own stats: steps, draft_s, ...


def _p(xs, q: float) -> float:
    return float(sorted(xs)[int(q * (len(xs) - 1))]) if xs else float("nan")


def summary(timings: list[Timing]) -> dict:
    """Medians over the requests of TTFT and first step; steady steps pooled (p50 / p90, and
    mean / p99 / max for the tail); how far apart the requests' first and last tokens came;
    tok/s = decode tokens of all requests / the decode wall time."""
    ttft = [(t.arrivals[0][0] - t.sent) * 1e3 for t in timings if t.arrivals]
    first = [(t.arrivals[1][0] - t.arrivals[0][0]) * 1e3 for t in timings if len(t.arrivals) > 2]
    steady = steady_steps(timings)
    tokens = sum(n for t in timings for _, n in t.arrivals[1:])
    firsts = [t.arrivals[0][0] for t in timings if t.arrivals]
    lasts = [t.arrivals[-1][0] for t in timings if t.arrivals]
    start, end = min(firsts), max(lasts)
    steps = sum(t.phases.get("steps", 0) for t in timings)
    per_step = {f"{k}_ms": 1e3 * sum(t.phases.get(f"{k}_s", 0.0) for t in timings) / steps
                for k in ("draft", "verify", "commit")} if steps else {}
    return dict(ttft_ms=statistics.median(ttft), ttft_each_ms=sorted(round(x, 1) for x in ttft),
                first_step_ms=statistics.median(first) if first else float("nan"),
                steady_p50_ms=_p(steady, 0.5), steady_p90_ms=_p(steady, 0.9),
                steady_mean_ms=statistics.fmean(steady) if steady else float("nan"),
                steady_p99_ms=_p(steady, 0.99), steady_max_ms=max(steady, default=float("nan")),
                first_token_spread_ms=(max(firsts) - min(firsts)) * 1e3,
                last_token_spread_ms=(max(lasts) - min(lasts)) * 1e3,
                tok_s=tokens / (end - start) if end > start else float("nan"),
                steps=len(steady) + len(first), requests=len(timings),
                phases_per_step=per_step, steady_by_shape=steady_by_shape(timings))


def step_label(shape: str | None, tree_size: int) -> str:
    """What a step verified: adaptive's shape (tree / chain / off), else tree or off."""
    return shape or ("tree" if tree_size else "off")


def steady_by_shape(timings: list[Timing]) -> dict:
    """The steady steps by what they verified (`step_label`): count, p50 and p90 (ms)."""
    by: dict[str, list[float]] = {}
    for t in timings:
        pairs = zip(t.arrivals[1:], t.arrivals[2:], t.shapes[2:], strict=False)
        for a, b, label in pairs:
            by.setdefault(label, []).append((b[0] - a[0]) * 1e3)
    return {k: dict(n=len(v), p50_ms=_p(v, 0.5), p90_ms=_p(v, 0.9)) for k, v in sorted(by.items())}


def steady_steps(timings: list[Timing]) -> list[float]:
    """Every request's steps after its first one (ms between its arrivals from the second on)."""
    return [(b[0] - a[0]) * 1e3 for t in timings
            for a, b in zip(t.arrivals[1:], t.arrivals[2:], strict=False)]


def interference(timings: list[Timing], late: int) -> dict:
    """The last `late` requests arrived while the others decoded: their TTFT (median), and the
    others' steps that overlapped the late prefill (from the first late send to the last late
    first token): how many, their median, p90 and longest, and the first one's in order."""
    early, later = timings[: len(timings) - late], timings[len(timings) - late:]
    t0 = min(t.sent for t in later)
    t1 = max(t.arrivals[0][0] for t in later if t.arrivals)

    def meanwhile(t: Timing) -> list[float]:
        return [(b[0] - a[0]) * 1e3 for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)
                if b[0] > t0 and a[0] < t1]

    each = [meanwhile(t) for t in early]
    steps = [ms for got in each for ms in got]
    return dict(late_ttft_ms=statistics.median((t.arrivals[0][0] - t.sent) * 1e3
                                               for t in later if t.arrivals),
                steps_meanwhile=len(steps), step_meanwhile_p50_ms=_p(steps, 0.5),
                step_meanwhile_p90_ms=_p(steps, 0.9),
                step_meanwhile_max_ms=max(steps, default=float("nan")),
                step_meanwhile_series_ms=[round(ms, 2) for ms in each[0]])


def _phases(stats) -> dict:
    """steps and phase seconds of a RequestSpecStats or a SpecStats message."""
    phases = getattr(stats, "phases", stats)
    return dict(steps=stats.steps, draft_s=phases.draft_s, verify_s=phases.verify_s,
                commit_s=phases.commit_s)


# ---- in process ------------------------------------------------------------------------------
def build_engine(vcfg, draft_dir: str, drafter_pages: int, warmup: bool):
    """The verifier's engine, with the drafter service's DFlash drafter, in this process."""
    from specserve.drafters.dflash import DFlashDrafter
    from specserve.engine.engine import Engine
    from specserve.engine.warmup import warm_up_drafter, warm_up_engine
    from specserve.models.dflash import load_dflash

    ecfg = vcfg.engine_config()
    engine = Engine(ecfg)
    model = load_dflash(draft_dir, vcfg.model, ecfg.dtype, ecfg.device)
    drafter = DFlashDrafter(model, num_pages=drafter_pages)
    engine.set_drafter(drafter)
    if warmup:
        warm_up_drafter(drafter)
        warm_up_engine(engine, (1, vcfg.default_budget + 1))  # as the verifier does
    return engine


def in_process(engine, prompts: list[list[int]], new: int, budget: int,
               drafter_ms: list[float] | None = None, late: int = 0) -> list[Timing]:
    """`drafter_ms` gets the drafter's own forward + tree time of each drafting step; the last
    `late` prompts are added once every other one has its first token."""
    from specserve.types import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    timings, waiting = {}, list(enumerate(prompts))[len(prompts) - late:]

    def add(batch) -> None:
        for i, prompt in batch:
            rid = f"inproc-{time.monotonic_ns()}-{i}"
            timings[rid] = Timing(time.perf_counter())
            engine.add_request(rid, prompt, params, budget)

    add(list(enumerate(prompts))[: len(prompts) - late])
    while engine.has_unfinished or waiting:
        if waiting and all(t.arrivals for t in timings.values()):
            add(waiting)
            waiting = []
        engine.drafter.last_stats = None
        outs = engine.step()
        now = time.perf_counter()
        stats = engine.drafter.last_stats
        if drafter_ms is not None and stats is not None and stats.block_rows:
            drafter_ms.append((stats.forward_s + stats.tree_s) * 1e3)
        for out in outs:
            if out.new_token_ids:
                t = timings[out.request_id]
                t.arrivals.append((now, len(out.new_token_ids)))
                step = out.stats.step if out.stats is not None else None
                t.shapes.append(step_label(step.shape, step.tree_size) if step else "off")
                t.whys.append(step.why or "" if step else "")
            if out.finished and out.stats is not None:
                timings[out.request_id].phases = _phases(out.stats.request)
    return list(timings.values())


# ---- through the services --------------------------------------------------------------------
class Services:
    """drafter → verifier → gateway as subprocesses of this benchmark."""

    def __init__(self, tmp: Path, env: dict | None = None) -> None:
        self.tmp, self.procs, self.ports = tmp, {}, {}
        self._names: list[str] = []  # started, not waited for yet
        self._files: dict[str, Path] = {}  # their port files
        self.env = {**os.environ, "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.env.pop("TRITON_INTERPRET", None)
        self.env["PYTHONPATH"] = f"{ROOT}:{self.env.get('PYTHONPATH', '')}"

    def start(self, name: str, flags: list[str], env: dict | None = None) -> None:
        port_file = self.tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        with open(self.tmp / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}", "--host", "127.0.0.1", "--port", "0",
                 "--port-file", str(port_file), "--metrics-port", "0", *flags],
                stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})}, cwd=ROOT)
        self._names.append(name)
        self._files[name] = port_file

    def wait(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for name in self._names:
            while not self._files[name].exists():
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{self.log(name)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not up in {timeout_s} s:\n{self.log(name)}")
                time.sleep(0.2)
            self.ports[name] = int(self._files[name].read_text())
        self._names = []

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)


async def _one(stub, prompt: list[int], new: int, budget: int, t: Timing) -> Timing:
    from services.gateway import convert
    from specserve.types import SamplingParams

    req = convert.generate_request_to_pb(prompt, SamplingParams(max_tokens=new, ignore_eos=True),
                                         "dflash", budget)
    t.sent = time.perf_counter()
    async for msg in stub.Generate(req, timeout=600):
        if msg.WhichOneof("event") == "chunk" and msg.chunk.token_ids:
            t.arrivals.append((time.perf_counter(), len(msg.chunk.token_ids)))
            t.shapes.append(step_label(msg.chunk.shape, msg.chunk.tree_size))
            t.whys.append(msg.chunk.why)
        elif msg.WhichOneof("event") == "final":
            t.phases = _phases(msg.final.stats)
    return t


async def _served(address: str, prompts, new: int, budget: int, late: int) -> list[Timing]:
    from services.common.server import channel
    from specserve.v1 import gateway_pb2_grpc

    timings = [Timing(0.0) for _ in prompts]
    async with channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        early = len(prompts) - late
        tasks = [asyncio.create_task(_one(stub, p, new, budget, t))
                 for p, t in zip(prompts[:early], timings, strict=False)]
        while late and not all(t.arrivals for t in timings[:early]):
            await asyncio.sleep(0.001)
        tasks += [asyncio.create_task(_one(stub, p, new, budget, t))
                  for p, t in zip(prompts[early:], timings[early:], strict=True)]
        await asyncio.gather(*tasks)
    return timings


def served(address: str, prompts: list[list[int]], new: int, budget: int, late: int = 0
           ) -> list[Timing]:
    """Each prompt streamed through the gateway; the last `late` sent once every other one has
    its first token."""
    return asyncio.run(_served(address, prompts, new, budget, late))


async def _verifier_stats(address: str) -> dict:
    from services.common.server import channel
    from specserve.v1 import verifier_pb2, verifier_pb2_grpc

    async with channel(address) as ch:
        s = await verifier_pb2_grpc.VerifierStub(ch).Stats(verifier_pb2.StatsRequest(),
                                                           timeout=10)
    return dict(transport=s.drafter_transport, context_rows=dict(s.context_rows),
                fallbacks=dict(s.fallbacks), steps=s.steps, profile=dict(s.profile),
                cost_ms=dict(s.cost_ms))


def choices(timings: list[Timing]) -> list[str]:
    """The first request's steps as "shape: why" (adaptive's choices; empty without)."""
    t = timings[0]
    return [f"{s}: {w}" for s, w in zip(t.shapes, t.whys, strict=False)] if any(t.whys) else []


def profile_per_step(before: dict, after: dict) -> dict:
    """ms per engine step in each profiled part between two `verifier_stats`."""
    steps = after["steps"] - before["steps"]
    return {k: 1e3 * (v - before["profile"].get(k, 0.0)) / steps
            for k, v in after["profile"].items()} if steps else {}


def verifier_stats(address: str) -> dict:
    return asyncio.run(_verifier_stats(address))
