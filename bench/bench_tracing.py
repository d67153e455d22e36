"""Tracing overhead: the same workload over the three services with tracing off vs on.

    .venv/bin/specserve bench tracing [--requests 8] [--tokens 64] [--rounds 10] [--json out.json]
    PYTHONPATH=. .venv/bin/python bench/bench_tracing.py ...   # the same (tests.e2e.otlp_sink)

Workload (as bench/bench_services.py): a tiny random Qwen3 target on CPU (fp32, one intra-op
thread per process), n-gram speculation with budget 8 on repetitive prompts, `--requests`
concurrent requests of `--tokens` new tokens streamed through the gateway. Two stacks run side
by side (the idle ones sleep):
  off    no OTEL_EXPORTER_OTLP_ENDPOINT, --trace-steps 0 (request spans made, not exported)
  on     every step traced (--trace-steps 1), all three services exporting over OTLP/gRPC to
         an in-process receiver (tests/e2e/otlp_sink.py) with the SDK's default batching
  every8 the same, exporting, with --trace-steps 8 (steps 0, 8, 16, … of each request)
Rounds rotate through them (off, on, every8, then on, every8, off, …) so that background load
hits all alike.
Per round: wall / engine steps (the verifier's Stats.steps) and the CPU time the three service
processes used per step (utime + stime from /proc, which load elsewhere does not inflate).
Reported: medians per mode, the median of the per-round ratios to `off`, spans per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench_services import ENV, make_model, over_grpc
from bench_services import start as start_service

from services.cli.usage import int_range
from tests.e2e.otlp_sink import OtlpSink

QUIET = {"SPECSERVE_GATEWAY_METRICS_PORT": "0", "SPECSERVE_VERIFIER_METRICS_PORT": "0",
         "SPECSERVE_DRAFTER_METRICS_PORT": "0"}
TICK = os.sysconf("SC_CLK_TCK")
MODES = {"off": 0, "on": 1, "every8": 8}  # mode -> --trace-steps (0: no exporter either)


def start(name: str, tmp: Path, flags: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    env = {**env, "OTEL_SERVICE_NAME": f"{name}.{env['MODE']}"}  # spans tell their stack
    return start_service(name, tmp, flags, env)


def cpu_s(procs) -> float:
    """user + system CPU seconds used so far by `procs`."""
    total = 0
    for p in procs:
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / TICK


class Stack:
    def __init__(self, mode: str, model: Path, tmp: Path, sink: OtlpSink) -> None:
        env = {k: v for k, v in ENV.items() if not k.startswith("OTEL_")}
        env.update(QUIET, MODE=mode)
        every = MODES[mode]
        env["SPECSERVE_TRACE_STEPS"] = str(every)
        if every:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
        tmp = tmp / mode
        tmp.mkdir()
        cpu = ["--device", "cpu", "--dtype", "float32"]
        self.procs = []
        d, daddr = start("drafter", tmp, ["--model", str(model), *cpu], env)
        self.procs.append(d)
        v, self.verifier = start("verifier", tmp, ["--model", str(model), "--drafter", daddr,
                                                   *cpu, "--max-draft-tokens", "8",
                                                   "--default-budget", "8"], env)
        self.procs.append(v)
        g, self.gateway = start("gateway", tmp, ["--verifier", self.verifier, "--model",
                                                 str(model)], env)
        self.procs.append(g)

    def close(self) -> None:
        for p in reversed(self.procs):  # SIGTERM: each service flushes its spans
            p.terminate()
            p.wait(30)


async def round_(stack: Stack, batch: int, tokens: int) -> dict:
    got = await over_grpc(stack.gateway, stack.verifier, batch, tokens,
                          cpu_s=lambda: cpu_s(stack.procs))
    steps = got["steps"]
    return {"wall_s": got["wall_s"], "steps": steps, "tokens": got["tokens"],
            "ms_per_step": 1e3 * got["wall_s"] / steps,
            "cpu_ms_per_step": 1e3 * got["cpu_s"] / steps}


async def total_steps(stack: Stack) -> int:
    from services.common.server import channel
    from specserve.v1 import verifier_pb2, verifier_pb2_grpc

    async with channel(stack.verifier) as v:
        reply = await verifier_pb2_grpc.VerifierStub(v).Stats(verifier_pb2.StatsRequest(),
                                                              timeout=10)
    return reply.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int_range(1, 4096), default=8)
    ap.add_argument("--tokens", type=int_range(1, 1 << 20), default=64)
    ap.add_argument("--rounds", type=int_range(1, 1 << 20), default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = make_model(tmp / "target")
    sink = OtlpSink().start()
    stacks: dict[str, Stack] = {}
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    order = list(MODES)
    try:
        for mode in runs:
            stacks[mode] = Stack(mode, model, tmp, sink)
        for r in range(args.rounds):
            for mode in order[r % 3:] + order[:r % 3]:
                runs[mode].append(asyncio.run(round_(stacks[mode], args.requests,
                                                     args.tokens)))
        steps = {m: asyncio.run(total_steps(s)) for m, s in stacks.items()}  # + warm-ups
    finally:
        for stack in stacks.values():
            stack.close()
        sink.close()
    spans = Counter(r.service.rsplit(".", 1)[1] for r in sink.spans())  # all flushed at stop
    rows = {}
    for mode, rs in runs.items():
        rows[mode] = {
            "rounds": len(rs), "requests": args.requests, "tokens": rs[0]["tokens"],
            "steps_median": statistics.median(r["steps"] for r in rs),
            "wall_s_median": statistics.median(r["wall_s"] for r in rs),
            "ms_per_step_median": statistics.median(r["ms_per_step"] for r in rs),
            "cpu_ms_per_step_median": statistics.median(r["cpu_ms_per_step"] for r in rs),
            "rounds_detail": rs,
        }
    for mode, r in rows.items():
        for k in ("ms_per_step", "cpu_ms_per_step"):
            r[f"{k}_vs_off"] = statistics.median(
                b[k] / a[k] - 1 for a, b in zip(runs["off"], runs[mode], strict=True))
        r["spans"], r["engine_steps_total"] = spans[mode], steps[mode]
    print(f"{args.requests} requests x {args.tokens} tokens, {args.rounds} rounds per mode, "
          f"rotating (n-gram, budget 8, CPU, {os.cpu_count()} cores)")
    print("| tracing | engine steps | wall s | ms/step | vs off | service CPU ms/step | vs off "
          "| spans / engine step |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['steps_median']:.0f} | {r['wall_s_median']:.2f} | "
              f"{r['ms_per_step_median']:.2f} | {100 * r['ms_per_step_vs_off']:+.1f}% | "
              f"{r['cpu_ms_per_step_median']:.2f} | {100 * r['cpu_ms_per_step_vs_off']:+.1f}% "
              f"| {r['spans'] / r['engine_steps_total']:.1f} |")
    print("(vs off: median over rounds of the round's value / the same round index's off - 1)")
    result = {"rows": rows, "argv": sys.argv[1:], "cpus": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
