"""What the CLI's flags accept: the `type=` parsers that turn a bad value into a one-line usage
error (`Parser`, exit 2) — numbers within the wire's ranges, so a request that parses also fits
its protobuf message —, the help formatter of every subcommand (defaults shown) and
`UsageError`, for the checks that can only run after parsing (`main` reports it the same way;
`read_text` raises it for a file that is not UTF-8 text).

Nothing heavy is imported at module level: torch only to check a CUDA device that was asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

# the wire's ranges, as SamplingParams checks them (a test checks each against the messages)
from specserve.types import FLOAT32_MAX, INT32_MAX, INT64_MAX, UINT64_MAX  # noqa: F401

MAX_DEADLINE_S = 365 * 86400  # gRPC's deadline overflows past ~1e9 s: the call fails at once
MAX_BUDGET = 1024  # = specserve.spec.tree.MAX_BUDGET (a test keeps them equal; tree.py is numpy)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


class UsageError(Exception):
    """A flag value found wrong after parsing: printed with the subcommand's usage, exit 2."""


class Parser(argparse.ArgumentParser):
    """Usage errors on one line (the usage itself is a `--help` away), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless it is None / False / empty or the help names one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        none = action.default is None or action.default is False or action.default in ("", [])
        if none or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def text(value: str) -> str:
    """A flag value that goes on the wire as a string: it must be UTF-8 (an argument that is not
    arrives with surrogate escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"must be UTF-8 text, got {value!r}") from None
    return value


def unescape(value: str) -> str:
    r"""C-style escapes \n, \t, \r and \\ in a flag value (the shell passes them literally)."""
    return text(re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], value))


def token_ids(value: str) -> list[int]:
    """'1,2 3' → [1, 2, 3] (comma- or space-separated, each in [0, 2**63)); an empty item
    ('1,,2', a trailing comma) is an error, not skipped."""
    items = re.split(r"\s*,\s*|\s+", value.strip())
    if not all(re.fullmatch(r"[+-]?\d+", t) for t in items):
        raise argparse.ArgumentTypeError(f"must be integers separated by commas (no empty "
                                         f"items), got {value!r}")
    ids = [int(t) for t in items]
    if not all(0 <= t <= INT64_MAX for t in ids):
        raise argparse.ArgumentTypeError(f"must be non-negative token ids (at most {INT64_MAX})"
                                         f", got {value!r}")
    return ids


def budget(value: str) -> int:
    """Draft nodes per step, in [0, MAX_BUDGET] (what every tree builder accepts)."""
    n = _int(value)
    if not 0 <= n <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_BUDGET}], got {n}")
    return n


def int_range(lo: int, hi: int):
    """A `type=` for an integer in [lo, hi] (a wire field's range, say)."""

    def parse(value: str) -> int:
        n = _int(value)
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {n}")
        return n

    parse.__name__ = "integer"
    return parse


def float_range(lo: float, hi: float = math.inf, *, lo_open: bool = False):
    """A `type=` for a finite number in [lo, hi] ((lo, hi] when `lo_open`)."""
    low = f"{'>' if lo_open else '>='} {_num(lo)}"
    want = f"a finite number {low}" if hi == math.inf else \
        f"a number in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
        if not (math.isfinite(x) and (x > lo if lo_open else x >= lo) and x <= hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {value!r}")
        return x

    parse.__name__ = "number"
    return parse


def _num(x: float) -> str:
    return f"{x:.0f}" if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else f"{x:g}"


deadline = float_range(0, MAX_DEADLINE_S, lo_open=True)  # a call's --timeout-s


def read_text(path: str, flag: str) -> str:
    """The UTF-8 text of the file `path` named by `flag` ('-': stdin); UsageError if it is not
    UTF-8 text (an unreadable file: its OSError)."""
    if path == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        if stdin is None:  # a text stream (already decoded)
            return sys.stdin.read()
        data, name = stdin.read(), "stdin"
    else:
        data, name = Path(path).read_bytes(), repr(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"argument {flag}: {name} is not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None


def model_config(path: str, flag: str) -> dict:
    """The parsed `config.json` of the model directory `path` named by `flag` (UsageError when
    it is not one), read before anything loads or starts."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"argument {flag}: {path!r} is not a model directory (no "
                         "config.json)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"argument {flag}: {path!r}: unreadable config.json ({e})") from None


def writable(path: str, flag: str) -> None:
    """UsageError unless a file can be written at `path` (checked before long work, whose
    results would otherwise be lost at the end)."""
    target = Path(path)
    if target.is_dir() or not target.parent.is_dir():
        why = "is a directory" if target.is_dir() else f"its folder {str(target.parent)!r} " \
            "does not exist"
        raise UsageError(f"argument {flag}: cannot write {path!r}: {why}")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise UsageError(f"argument {flag}: cannot write {path!r}: permission denied")


def port(value: str) -> int:
    """A TCP port, 1..65535."""
    n = _int(value)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {n}")
    return n


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None


def device(allowed: tuple[str, ...] = ("cpu", "cuda")):
    """A `type=` for a torch device among `allowed` (plus cuda:N); a CUDA one must exist here."""

    def parse(value: str) -> str:
        m = re.fullmatch(r"cuda(?::(\d+))?", value)
        if value not in allowed and not (m and "cuda" in allowed):
            raise argparse.ArgumentTypeError(f"must be {' | '.join(allowed)} or cuda:N, "
                                             f"got {value!r}")
        if m and (missing := cuda_missing(value)):
            raise argparse.ArgumentTypeError(f"{value!r}: {missing}")
        return value

    return parse


def cuda_missing(device: str) -> str | None:
    """"this machine has …" when `device` (cuda or cuda:N) names a CUDA device not here."""
    count, index = cuda_devices(), int(device.partition(":")[2] or 0)
    if index < count:
        return None
    return f"this machine has {count} CUDA device(s)" if count else \
        "this machine has no CUDA device"


def cuda_devices() -> int:
    """How many CUDA devices torch sees here (imports torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def names(allowed: tuple[str, ...]):
    """A `type=` for a comma-separated list of names from `allowed`: 'a,b' → ['a', 'b']."""

    def parse(value: str) -> list[str]:
        got = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in got if v not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of "
                                             f"{', '.join(allowed)}; got {value!r}")
        return got

    return parse
