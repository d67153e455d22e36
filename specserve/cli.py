"""The `specserve` console script: serve, up, generate (each has `--help`).

`serve NAME` runs one service; `up` runs drafter, verifier and gateway locally as subprocesses;
`generate` streams a generation from the gateway (or, with `--in-process`, from an engine built
in this process). Service and gRPC modules are imported lazily, so `specserve --help` stays fast
and importing this module pulls in no grpc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SERVICES = ("drafter", "verifier", "gateway")  # the start order of `up`


# ---- serve ---------------------------------------------------------------------------------
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run one service (gateway, verifier or drafter)",
                       description="Run one service; the remaining arguments are its own flags "
                                   "(see `specserve serve gateway --help`).")
    p.add_argument("service", choices=SERVICES)
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's flags")
    p.set_defaults(func=lambda args: _serve(args.service, args.args))


def _serve(service: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(f"services.{service}.__main__").main(argv) or 0


# ---- up ------------------------------------------------------------------------------------
def _add_up(sub) -> None:
    p = sub.add_parser("up", help="run drafter, verifier and gateway locally",
                       description="Start drafter, verifier and gateway as subprocesses, wait "
                                   "until each is SERVING, stream their logs; Ctrl-C stops all.")
    p.add_argument("--model", default=os.environ.get("SPECSERVE_MODEL"),
                   help="target model directory [env SPECSERVE_MODEL]")
    p.add_argument("--draft-model", default=os.environ.get("SPECSERVE_DRAFT_MODEL"),
                   help="DFlash drafter directory [env SPECSERVE_DRAFT_MODEL]")
    p.add_argument("--device", default=None, help="torch device of verifier and drafter")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--ports", type=int, default=50051,
                   help="base port: gateway BASE, verifier BASE+1, drafter BASE+2")
    for name in SERVICES:
        p.add_argument(f"--{name}-port", type=int, default=None, help=f"{name} port override")
    p.add_argument("--no-drafter", action="store_true",
                   help="no drafter service (the verifier decodes without the DFlash drafter)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.set_defaults(func=_up)


def _up_plan(args) -> list[tuple[str, str, list[str]]]:
    """(service, address to health-check, flags) in start order."""
    if not args.model:
        raise SystemExit("specserve up: --model (or SPECSERVE_MODEL) is required")
    base = {"gateway": 0, "verifier": 1, "drafter": 2}
    port = {n: getattr(args, f"{n}_port") or args.ports + base[n] for n in SERVICES}
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    addr = {n: f"{local}:{port[n]}" for n in SERVICES}
    flags = {n: ["--host", args.host, "--port", str(port[n]), "--model", args.model]
             for n in SERVICES}
    device = ["--device", args.device] if args.device else []
    draft = ["--draft-model", args.draft_model] if args.draft_model else []
    flags["drafter"] += draft + device
    flags["verifier"] += draft + device + ([] if args.no_drafter else
                                           ["--drafter", addr["drafter"]])
    flags["gateway"] += ["--verifier", addr["verifier"]]
    names = [n for n in SERVICES if not (n == "drafter" and args.no_drafter)]
    return [(n, addr[n], flags[n]) for n in names]


async def _pump(name: str, stream) -> None:
    width = max(map(len, SERVICES))
    async for line in stream:
        print(f"[{name:<{width}}] {line.decode(errors='replace').rstrip()}", flush=True)


async def _start(name: str, addr: str, flags: list[str], timeout_s: float, procs: dict,
                 pumps: list) -> None:
    """Spawn `specserve serve NAME` into `procs`; wait for SERVING (fail fast if it exits)."""
    import asyncio

    from services.common.server import wait_serving

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specserve.cli", "serve", name, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    procs[name] = proc
    pumps.append(asyncio.ensure_future(_pump(name, proc.stdout)))
    # the named service: a server reports "" SERVING as soon as it starts, before models load
    service = f"specserve.v1.{name.capitalize()}"
    ready = asyncio.ensure_future(wait_serving(addr, service, timeout_s))
    died = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ready.cancel()
        died.cancel()
    if proc.returncode is not None:
        raise RuntimeError(f"{name} exited with code {proc.returncode} during startup")
    ready.result()  # TimeoutError if it never became SERVING


async def _stop_all(procs: dict, grace_s: float = 15.0) -> None:
    import asyncio

    for name in reversed(list(procs)):  # gateway first: it drains, then the verifier, drafter
        proc = procs[name]
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                print(f"specserve up: {name} did not stop in {grace_s} s; killing", flush=True)
                proc.kill()
                await proc.wait()


async def _up_run(args) -> int:
    import asyncio
    import signal

    plan, procs, pumps = _up_plan(args), {}, []
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        for name, addr, flags in plan:
            await _start(name, addr, flags, args.startup_timeout_s, procs, pumps)
            print(f"specserve up: {name} SERVING on {addr} (pid {procs[name].pid})", flush=True)
        print("specserve up: ready — " + ", ".join(f"{n} {a}" for n, a, _ in plan), flush=True)
        waits = {asyncio.ensure_future(p.wait()): n for n, p in procs.items()}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        name = waits[next(iter(done))]
        print(f"specserve up: {name} exited with code {procs[name].returncode}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        print("specserve up: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"specserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: [p.kill() for p in procs.values()
                                                  if p.returncode is None])
        await _stop_all(procs)
        await asyncio.gather(*pumps, return_exceptions=True)


def _up(args) -> int:
    import asyncio

    return asyncio.run(_up_run(args))


# ---- generate ------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a generation from the gateway",
                       description="Stream text from the gateway (gRPC); the stats line goes "
                                   "to stderr. --in-process runs an engine here instead.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt text from this file ('-': stdin)")
    src.add_argument("--token-ids", help="prompt token ids, comma-separated")
    p.add_argument("--gateway", default=os.environ.get("SPECSERVE_GATEWAY_ADDR",
                                                       "127.0.0.1:50051"),
                   help="gateway HOST:PORT [env SPECSERVE_GATEWAY_ADDR]")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--drafter", choices=["dflash", "ngram", "none"], default=None,
                   help="drafter for this request (default: the verifier's)")
    p.add_argument("--budget", type=int, default=None, help="draft nodes per step")
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of the call")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--in-process", action="store_true", help="run an engine in this process")
    p.add_argument("--model", help="HF checkpoint directory (--in-process)")
    p.add_argument("--device", default="cpu", help="(--in-process)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="(--in-process)")
    p.set_defaults(func=_generate)


def _prompt(args) -> str | list[int]:
    if args.token_ids is not None:
        try:
            return [int(t) for t in args.token_ids.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"specserve: --token-ids must be integers: {args.token_ids!r}") \
                from None
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return sys.stdin.read()
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt


def _generate(args) -> int:
    from specserve.types import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos)
    if args.in_process:
        return _generate_in_process(args, params)
    return _generate_remote(args, params)


def _generate_remote(args, params) -> int:
    import grpc

    from services.common.server import CHANNEL_OPTIONS
    from services.gateway import convert
    from specserve.v1 import gateway_pb2_grpc

    req = convert.generate_request_to_pb(_prompt(args), params, args.drafter, args.budget,
                                         args.request_id)
    text, ids, final = [], [], None
    with grpc.insecure_channel(args.gateway, options=CHANNEL_OPTIONS) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=args.timeout_s)
        try:
            for msg in call:
                event = convert.response_from_pb(msg)
                if isinstance(event, convert.GatewayFinal):
                    final = event
                    continue
                text.append(event[0])
                ids += event[1].token_ids
                if not args.json:
                    print(event[0], end="", flush=True)
        except KeyboardInterrupt:
            call.cancel()
            return 130
        except grpc.RpcError as e:
            sep = "\n" if text and not args.json else ""
            print(f"{sep}specserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    if final is None:
        print("\nspecserve: error: the gateway stream ended without a final message",
              file=sys.stderr)
        return 2
    _report("".join(text), ids, final, args.json)
    return 0


def _report(text: str, ids: list[int], final, as_json: bool) -> None:
    stats = final.stats
    if as_json:
        print(json.dumps({
            "text": text, "token_ids": ids, "request_id": final.request_id,
            "finish_reason": final.finish_reason.value if final.finish_reason else None,
            "usage": {"prompt_tokens": final.prompt_tokens,
                      "completion_tokens": final.completion_tokens},
            "stats": {**stats.as_dict(), "other_s": final.other_s},
            "ttft_s": final.ttft_s, "wall_s": final.wall_s}))
        return
    reason = final.finish_reason.value if final.finish_reason else "?"
    print(f"\n[{len(ids)} tokens in {final.wall_s:.2f} s, TTFT {final.ttft_s * 1e3:.0f} ms, "
          f"mean commit_len {stats.mean_commit_len:.2f} over {stats.steps} steps, "
          f"{sum(stats.fallbacks.values())} fallbacks, finish: {reason}]", file=sys.stderr)


def _generate_in_process(args, params) -> int:
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    if not args.model:
        raise SystemExit("specserve generate: --in-process needs --model DIR")
    engine = Engine(EngineConfig(args.model, dtype=args.dtype, device=args.device))
    engine.add_request("cli", _prompt(args), params)
    t0, text, ids, reason = time.perf_counter(), [], [], None
    while engine.has_unfinished:
        for out in engine.step():
            ids += out.new_token_ids
            text.append(out.text_delta)
            reason = out.finish_reason or reason
            if not args.json:
                print(out.text_delta, end="", flush=True)
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids, "finish_reason": reason.value,
                          "wall_s": round(wall, 4)}))
    else:
        print(f"\n[{len(ids)} tokens in {wall:.2f} s, finish: {reason.value}]", file=sys.stderr)
    return 0


# ---- probe ---------------------------------------------------------------------------------
def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="the commit probe: predictable vs novel text by context",
                       description="Send predictable text ('The cat sat on the mat.' repeated) "
                                   "and novel text at several context lengths through the "
                                   "gateway; print commit_len, depth, drafts and timings.")
    p.add_argument("--gateway", default=os.environ.get("SPECSERVE_GATEWAY_ADDR",
                                                       "127.0.0.1:50051"),
                   help="gateway HOST:PORT [env SPECSERVE_GATEWAY_ADDR]")
    p.add_argument("--model", default=os.environ.get("SPECSERVE_MODEL"),
                   help="target checkpoint dir (its tokenizer.json sizes the prompts) "
                        "[env SPECSERVE_MODEL]")
    p.add_argument("--contexts", default="1k,16k,64k,128k", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--drafter", choices=["dflash", "ngram", "none"], default=None)
    p.add_argument("--budget", type=int, default=16, help="DDTree budget (draft nodes)")
    p.add_argument("--texts", default="predictable,novel", help="which texts to probe")
    p.add_argument("--text-file", help="novel text to use instead of the built-in one")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline per request")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (commit_len, step time)")
    p.set_defaults(func=_probe)


def _probe(args) -> int:
    import grpc

    from services.common.server import CHANNEL_OPTIONS
    from specserve import probe
    from specserve.engine.tokenizer import Tokenizer
    from specserve.v1 import gateway_pb2_grpc

    if not args.model:
        raise SystemExit("specserve probe: --model (or SPECSERVE_MODEL) is required")
    contexts, texts = probe.parse_contexts(args.contexts), args.texts.split(",")
    tok = Tokenizer.from_dir(args.model)
    source = {"predictable": lambda n: probe.PREDICTABLE * (n // 4 + 8),
              "novel": (lambda n: Path(args.text_file).read_text(encoding="utf-8"))
              if args.text_file else (lambda n: probe.novel_corpus(6 * n))}
    rows = []
    with grpc.insecure_channel(args.gateway, options=CHANNEL_OPTIONS) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for text in texts:
            corpus = source[text](max(contexts))
            for n in contexts:
                ids = probe.prompt_ids(tok, corpus, n)
                try:
                    row = probe.run_one(stub, ids, text, args.new_tokens, args.drafter,
                                        args.budget, args.timeout_s)
                except grpc.RpcError as e:
                    print(f"specserve probe: {text} @ {n}: {e.code().name}: {e.details()}",
                          file=sys.stderr)
                    return 2
                rows.append(row)
                print(f"  {text} @ {n:,}: commit_len {row.commit_len:.2f}, "
                      f"step {row.step_ms:.1f} ms, wall {row.wall_s:.1f} s", file=sys.stderr)
    print(probe.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(probe.rows_as_json(rows), indent=2))
    if args.plot:
        probe.plot(rows, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


# ---- bench ---------------------------------------------------------------------------------
BENCHES = {
    "kernel": "bench_kernel.py",  # tree-verify kernel vs baselines and the floor (GPU)
    "e2e": "bench_e2e.py",  # issue-9 end-to-end: verify, prefill, decode vs floors/peers (GPU)
    "services": "bench_services.py",  # in process vs over gRPC, per step (CPU)
    "tracing": "bench_tracing.py",  # tracing overhead (CPU)
    "correctness": "correctness_report.py",  # logit error vs transformers (CPU)
}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script (from a source checkout)",
                       description="Run one of the benchmarks in bench/ with this Python; "
                                   "arguments after the name go to the script (e.g. --out).")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / BENCHES[args.name]
    if not script.exists():
        raise SystemExit(f"specserve bench: {script} not found (benchmarks live in a source "
                         "checkout of specserve)")
    return subprocess.call([sys.executable, str(script), *args.args])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_up(sub)
    _add_generate(sub)
    _add_probe(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    from specserve.errors import SpecServeError

    try:
        return args.func(args)
    except SpecServeError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
