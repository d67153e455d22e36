"""Flags with `SPECSERVE_*` environment defaults, generated from each service's config dataclass.

A config field made by `flag_field` (or `flags_field`, for a group such as the security flags)
carries its flag: name, environment variable, help, the flag's default (the field's own unless
`cli_default` says otherwise) and how the parsed value becomes the field's (`parse`). So a
service's flag table is `config_flags(Config)` and `config_from_args(Config, args)` builds the
config: the two cannot drift. Fields without a flag keep their defaults.

A flag given on the command line wins over its environment variable, which wins over the
default. docker-compose.yml sets exactly these variables. A malformed value fails loudly: a
variable that does not parse leaves a `BadEnv` as its flag's default, which `config_from_args`
raises as a ValueError (so the service ends with `specserve NAME: error: …`, exit code 2, like a
bad flag value) unless the flag itself was given.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    name: str  # "--port"
    env: str | None  # "SPECSERVE_GATEWAY_PORT"; None: no environment variable
    default: Any
    type: Callable[[str], Any] = str
    help: str = ""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class FieldFlags:
    """A config field's flags and how their parsed values make the field's value."""

    flags: tuple[Flag, ...]
    value: Callable[[argparse.Namespace], Any]


FLAGS = "specserve.flags"  # the metadata key of a field's FieldFlags
_SAME = object()

DEFAULT_HOST = "127.0.0.1"
GATEWAY_PORT, VERIFIER_PORT, DRAFTER_PORT = 50051, 50052, 50053
HTTP_PORT = 8000  # the gateway's OpenAI-compatible HTTP API (vLLM's default too)
# Prometheus /metrics (0 disables); bound on the --host address like the gRPC port
GATEWAY_METRICS_PORT, VERIFIER_METRICS_PORT, DRAFTER_METRICS_PORT = 9101, 9102, 9103
LOG_LEVEL = Flag("--log-level", "SPECSERVE_LOG_LEVEL", "INFO", str, "logging level")
HOST = Flag("--host", "SPECSERVE_HOST", DEFAULT_HOST, str, "address to bind")  # `up`'s too


def flag_field(name: str, env: str | None, help: str, *, default: Any = dataclasses.MISSING,
               type: Callable[[str], Any] = str, cli_default: Any = _SAME,
               parse: Callable[[Any], Any] | None = None) -> Any:
    """A config field set by the flag `name`. Its default is the flag's unless `cli_default`
    is given (say a metrics port: 0 in the library, a fixed port on the command line);
    `parse(value)` turns the parsed flag into the field's value (raises ValueError)."""
    if default is dataclasses.MISSING and cli_default is _SAME:
        raise TypeError(f"{name}: a required field needs the flag's cli_default")
    flag = Flag(name, env, default if cli_default is _SAME else cli_default, type, help)
    convert = parse or (lambda value: value)
    return flags_field((flag,), lambda args: convert(getattr(args, flag.dest)), default)


def flags_field(flags: Sequence[Flag], value: Callable[[argparse.Namespace], Any],
                default: Any = dataclasses.MISSING) -> Any:
    """A config field set by a group of flags: `value(args)` makes it (raises ValueError)."""
    meta = {FLAGS: FieldFlags(tuple(flags), value)}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def config_flags(cls: type) -> list[Flag]:
    """The flags of a config dataclass, in field order."""
    return [flag for f in dataclasses.fields(cls) if FLAGS in f.metadata
            for flag in f.metadata[FLAGS].flags]


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """`cls` of the parsed flags (raises ValueError for bad values, an environment variable's
    that does not parse among them)."""
    for flag in config_flags(cls):
        value = getattr(args, flag.dest, None)
        if isinstance(value, BadEnv):
            raise value.error()
    return cls(**{f.name: f.metadata[FLAGS].value(args) for f in dataclasses.fields(cls)
                  if FLAGS in f.metadata})


# ---- fields every service has ----------------------------------------------------------------
def host_field() -> Any:
    return flags_field((HOST,), lambda args: args.host, DEFAULT_HOST)


def port_field(env: str, port: int) -> Any:
    return flag_field("--port", env, "port to bind (0 = any free)", default=port, type=int)


def port_file_field() -> Any:
    return flag_field("--port-file", None, "write the bound port here (useful with --port "
                      "0): once SERVING; the gateway's once bound", default=None)


def grace_field(help: str) -> Any:
    return flag_field("--grace-s", "SPECSERVE_GRACE_S", help, default=5.0, type=float)


def metrics_port_field(env: str, port: int) -> Any:
    """0 (none) in the library, `port` on the command line."""
    return flag_field("--metrics-port", env, "Prometheus /metrics port (0 = none)", default=0,
                      type=int, cli_default=port)


def generation_config_field() -> Any:
    """The gateway's and the verifier's: whether generation_config.json's sampling is used."""
    return flag_field("--generation-config", "SPECSERVE_GENERATION_CONFIG",
                      "auto: requests that leave sampling unset get generation_config.json's "
                      "temperature / top_k / top_p (a setting of it specserve does not "
                      "implement is an error at start); none: greedy, the file's sampling "
                      "unused", default="auto")


def check_port(name: str, port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535], got {port}")


# ---- argparse ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadEnv:
    """The default of a flag whose environment variable does not parse (`config_from_args`
    raises its `error()`)."""

    flag: Flag
    raw: str
    reason: str

    def error(self) -> ValueError:
        kind = getattr(self.flag.type, "__name__", "value")
        return ValueError(f"{self.flag.env}={self.raw!r} is not a valid {kind} (the default of "
                          f"{self.flag.name}{': ' + self.reason if self.reason else ''})")


def _env_default(flag: Flag) -> Any:
    """The flag's default: its environment variable's value when set (a `BadEnv` when that
    does not parse), else its own."""
    raw = os.environ.get(flag.env) if flag.env else None
    if raw is None:
        return flag.default
    try:
        return flag.type(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        reason = str(e) if isinstance(e, argparse.ArgumentTypeError) else ""
        return BadEnv(flag, raw, reason)


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for flag in flags:
        help = f"{flag.help} [env {flag.env}, default {flag.default!r}]" if flag.env else \
            flag.help
        parser.add_argument(flag.name, type=flag.type, default=_env_default(flag), help=help)
