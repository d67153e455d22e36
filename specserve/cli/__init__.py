"""The `specserve` console script: serve, up, generate, probe, bench, train-demo (all `--help`).

`serve NAME` runs one service; `up` runs drafter, verifier and gateway locally as subprocesses;
`generate` streams a generation from the gateway (or, with `--in-process`, from an engine built
in this process); `probe` is the commit probe; `bench` runs a benchmark script; `train-demo`
trains the bundled demo pair. Service, gRPC and torch modules are imported lazily, so
`specserve --help` stays fast and importing this package pulls in no grpc.
"""

from __future__ import annotations

import argparse
import sys

from specserve.cli import bench, generate, probe, services, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    services.add_serve(sub)
    services.add_up(sub)
    generate.add(sub)
    probe.add(sub)
    bench.add(sub)
    train.add(sub)
    args = parser.parse_args(argv)
    from specserve.errors import SpecServeError

    try:
        return args.func(args)
    except (SpecServeError, OSError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
