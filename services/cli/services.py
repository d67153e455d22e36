"""`specserve serve NAME` (one service in this process) and `specserve up` (all three as
subprocesses, health-checked, logs prefixed, a service that exits started again
(services/cli/supervise.py), stopped together; their gRPC, metrics and HTTP ports all follow
`--ports`: services/cli/up_ports.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys

from services.cli import usage
from services.cli.supervise import stop_all, supervise
from services.cli.up_ports import (
    SERVICES,
    all_ports,
    base_port,
    http_port,
    http_port_of,
    metrics_ports,
    service_ports,
)
from services.common.settings import HOST, add_flags


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run one service (gateway, verifier or drafter)",
                       formatter_class=usage.HelpFormatter,
                       description="Run one service; the remaining arguments are its own flags "
                                   "(see `specserve serve gateway --help`).")
    p.add_argument("service", choices=SERVICES, help="which service")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's flags")
    p.set_defaults(func=lambda args: _serve(args.service, args.args))


def _serve(service: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(f"services.{service}.__main__").main(argv) or 0


def add_up(sub) -> None:
    p = sub.add_parser("up", help="run drafter, verifier and gateway locally",
                       formatter_class=usage.HelpFormatter,
                       description="Start drafter, verifier and gateway as subprocesses, wait "
                                   "until each is SERVING, stream their logs; Ctrl-C stops all.")
    p.add_argument("--model", default=os.environ.get("SPECSERVE_MODEL"),
                   help="target model directory [env SPECSERVE_MODEL; default: the demo "
                        "pair in checkpoints/, target and drafter]")
    p.add_argument("--draft-model", default=os.environ.get("SPECSERVE_DRAFT_MODEL"),
                   help="DFlash drafter directory [env SPECSERVE_DRAFT_MODEL]")
    p.add_argument("--device", default=None, type=usage.device(("auto", "cpu", "cuda")),
                   help="torch device of verifier and drafter: auto, cpu, cuda or cuda:N "
                        "(default: the services' own, auto)")
    add_flags(p, [dataclasses.replace(HOST, help="address every service binds")])
    p.add_argument("--ports", type=base_port, default=None,
                   help="base port: gateway BASE, verifier BASE+1, drafter BASE+2 (default: "
                        "each service's SPECSERVE_*_PORT, else 50051..)")
    for name in SERVICES:
        p.add_argument(f"--{name}-port", type=usage.port, default=None,
                       help=f"{name} port override")
    p.add_argument("--metrics-ports", type=int, default=None, metavar="BASE",
                   help="Prometheus ports: gateway BASE, verifier BASE+1, drafter BASE+2; 0 = "
                        "none (default: each service's SPECSERVE_*_METRICS_PORT, else 9101.. "
                        "moved by as much as --ports is from 50051)")
    p.add_argument("--http-port", type=http_port, default=None,
                   help="the gateway's OpenAI HTTP API port (0 = any free, off = none) [env "
                        "SPECSERVE_GATEWAY_HTTP_PORT; default: 8000 moved by as much as --ports "
                        "is from 50051]")
    p.add_argument("--adaptive", choices=("on", "off"), default=None,
                   help="the verifier's adaptive speculation (default: the verifier's own, "
                        "SPECSERVE_ADAPTIVE, else off)")
    p.add_argument("--no-drafter", action="store_true",
                   help="no drafter service (the verifier decodes without the DFlash drafter)")
    p.add_argument("--startup-timeout-s", type=usage.float_range(0, lo_open=True), default=600.0,
                   help="how long each service may take to report SERVING")
    p.add_argument("--restart", choices=("on-failure", "no"), default="on-failure",
                   help="a service that exits once all are SERVING: start it again (after 1, "
                        "2, 4 … 30 s; the others keep serving; 5 restarts in a row that never "
                        "reach SERVING stop everything) or stop everything at once (no)")
    p.set_defaults(func=_up)


def _up_plan(args) -> list[tuple[str, str, list[str]]]:
    """(service, address to health-check, flags) in start order."""
    if args.no_drafter and args.draft_model:
        raise usage.UsageError("--no-drafter starts no drafter to run --draft-model (or "
                               "SPECSERVE_DRAFT_MODEL): drop one of them")
    if not args.model:
        from specserve.demo import default_pair

        args.model, demo_drafter = default_pair()
        args.draft_model = args.draft_model or demo_drafter
    if not args.model:
        raise usage.UsageError("--model (or SPECSERVE_MODEL) is required (no demo pair under "
                               "checkpoints/)")
    port = service_ports(args)
    metrics = metrics_ports(args)
    args.http_port = http_port_of(args)
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    addr = {n: f"{local}:{port[n]}" for n in SERVICES}
    flags = {n: ["--host", args.host, "--port", str(port[n]), "--model", args.model,
                 "--metrics-port", str(metrics[n])] for n in SERVICES}
    device = ["--device", args.device] if args.device else []
    draft = ["--draft-model", args.draft_model] if args.draft_model else []
    flags["drafter"] += draft + device
    flags["verifier"] += device + (["--drafter", ""] if args.no_drafter else  # not the env's
                                   draft + ["--drafter", addr["drafter"]])
    flags["verifier"] += ["--adaptive", args.adaptive] if args.adaptive else []
    flags["gateway"] += ["--verifier", addr["verifier"], "--http-port", str(args.http_port)]
    args.http_port_file = _http_port_file(str(args.http_port))
    if args.http_port_file:
        flags["gateway"] += ["--http-port-file", args.http_port_file]
    names = [n for n in SERVICES if not (n == "drafter" and args.no_drafter)]
    return [(n, addr[n], flags[n]) for n in names]


def _http_port_file(http_port: str) -> str | None:
    """Where the gateway writes its HTTP API's port (None: the API is off)."""
    if http_port.lower() == "off":
        return None
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="specserve-up-"), "http.port")


async def _pump(name: str, stream) -> None:
    width = max(map(len, SERVICES))
    async for line in stream:
        print(f"[{name:<{width}}] {line.decode(errors='replace').rstrip()}", flush=True)


async def _start(name: str, addr: str, flags: list[str], timeout_s: float, procs: dict,
                 pumps: list) -> None:
    """Spawn `specserve serve NAME` into `procs`; wait for SERVING (fail fast if it exits)."""
    import asyncio

    from services.common.security import Security
    from services.common.server import wait_serving

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "serve", name, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    procs[name] = proc
    pumps.append(asyncio.ensure_future(_pump(name, proc.stdout)))
    # the named service: a server reports "" SERVING as soon as it starts, before models load
    service = f"specserve.v1.{name.capitalize()}"
    # the children read SPECSERVE_TLS_* as we do: under TLS they are dialed over TLS
    ready = asyncio.ensure_future(wait_serving(addr, service, timeout_s, Security.from_env()))
    died = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ready.cancel()
        died.cancel()
    if proc.returncode is not None:
        raise RuntimeError(f"{name} exited with code {proc.returncode} during startup")
    try:
        ready.result()  # TimeoutError if it never became SERVING
    except BaseException:
        proc.kill()  # not SERVING in time: it must not hold its ports for the next try
        await proc.wait()
        raise


async def _up_run(args, plan) -> int:
    import asyncio
    import signal

    procs, pumps = {}, []
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        for name, addr, flags in plan:
            await _start(name, addr, flags, args.startup_timeout_s, procs, pumps)
            print(f"specserve up: {name} SERVING on {addr} (pid {procs[name].pid})", flush=True)
        ready = ", ".join(f"{n} {a}" for n, a, _ in plan)
        if args.http_port_file:
            with open(args.http_port_file) as f:
                host = next(a for n, a, _f in plan if n == "gateway").rsplit(":", 1)[0]
                ready += f", OpenAI API http://{host}:{int(f.read())}/v1"
        print(f"specserve up: ready — {ready}", flush=True)
        steps = {n: (a, f) for n, a, f in plan}
        return await supervise(procs, lambda n: _start(n, *steps[n], args.startup_timeout_s,
                                                       procs, pumps),
                               restart=args.restart == "on-failure")
    except asyncio.CancelledError:
        print("specserve up: stopping", flush=True)
        return 0
    except (RuntimeError, OSError) as e:  # OSError: a port in use; TimeoutError: not SERVING
        print(f"specserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: [p.kill() for p in procs.values()
                                                  if p.returncode is None])
        await stop_all(procs)
        await asyncio.gather(*pumps, return_exceptions=True)
        _drop_port_dir(args)


def _up(args) -> int:
    import asyncio

    plan = _up_plan(args)
    try:
        _check_up(args, plan)
    except BaseException:
        _drop_port_dir(args)
        raise
    return asyncio.run(_up_run(args, plan))


def _drop_port_dir(args) -> None:
    """Remove the directory `_up_plan` made for the gateway's HTTP port file."""
    if args.http_port_file:
        shutil.rmtree(os.path.dirname(args.http_port_file), ignore_errors=True)


def _check_up(args, plan) -> None:
    """Usage errors found before anything starts: model directories, two listeners on one
    port, a port another process holds, a TLS setting that names no file."""
    from services.common.security import Security
    from services.common.server import check_bindable

    try:
        Security.from_env()
    except ValueError as e:
        raise usage.UsageError(f"SPECSERVE_* security settings: {e}") from None

    for flag, path in (("--model", args.model), ("--draft-model", args.draft_model)):
        if path:
            usage.model_config(path, flag)
    ports = all_ports(args, plan)
    if dup := sorted({p for p in ports if ports.count(p) > 1}):
        raise usage.UsageError(f"two of the stack's listeners would share port {dup[0]} (its "
                               "gRPC, metrics and HTTP ports must all differ)")
    for port in ports:
        try:
            check_bindable(args.host, port)
        except OSError as e:
            raise usage.UsageError(str(e)) from None
