"""The `specserve` console script: serve, up, generate, probe, bench, train-demo (all `--help`).

`serve NAME` runs one service; `up` runs drafter, verifier and gateway locally as subprocesses;
`generate` streams a generation from the gateway (or, with `--in-process`, from an engine built
in this process); `probe` is the commit probe; `bench` runs a benchmark script; `train-demo`
trains the bundled demo pair. Service, gRPC and torch modules are imported lazily, so
`specserve --help` stays fast and importing this package pulls in no grpc. Every usage error
(argparse's own and `usage.UsageError`) and every expected failure (`SpecServeError`, an
`OSError`) exits 2 with one message line, no traceback.
"""

from __future__ import annotations

import sys

from services.cli import bench, generate, probe, services, train, usage


def build_parser() -> tuple[usage.Parser, dict[str, usage.Parser]]:
    """(the `specserve` parser, its subcommands' parsers by name)."""
    parser = usage.Parser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=usage.Parser)
    services.add_serve(sub)
    services.add_up(sub)
    generate.add(sub)
    probe.add(sub)
    bench.add(sub)
    train.add(sub)
    return parser, sub.choices


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    from specserve.errors import SpecServeError

    try:
        return args.func(args)
    except usage.UsageError as e:  # like argparse's own: one line, exit 2
        commands[args.command].error(str(e))
    except (SpecServeError, OSError) as e:
        print(f"specserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's code for SIGINT
        print(f"specserve {args.command}: interrupted", file=sys.stderr)
        return 130
