"""The services' flag tables come from their config dataclasses (services/common/settings.py),
and one lifecycle runs the three (services/common/bootstrap.py).

Every config field but the library-only ones has a flag with help, every flag's default is its
field's (the metrics ports excepted: 0 in the library), the flags parse into the config, an
environment variable sits between the default and the command line, docs/configuration.md has a
row for each variable and names every long flag of every `specserve` command; `run_service`
writes the port file, drains for grace_s on stop and flushes spans; `service_main` answers a bad
value with `specserve NAME: error: …` and exit 2, a bad environment value too (naming the
variable), unless the flag itself is given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from services.common import bootstrap, settings
from services.common.security import PEER_FLAGS, SECURITY_FLAGS
from services.common.settings import FLAGS, Flag, config_flags, flag_field
from services.drafter.config import DrafterConfig
from services.gateway.config import GatewayConfig
from services.verifier.config import VerifierConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"gateway": GatewayConfig, "verifier": VerifierConfig, "drafter": DrafterConfig}
LIBRARY_ONLY = {"gateway": {"health_period_s"}, "verifier": set(), "drafter": set()}
METRICS_PORTS = {"gateway": settings.GATEWAY_METRICS_PORT,
                 "verifier": settings.VERIFIER_METRICS_PORT,
                 "drafter": settings.DRAFTER_METRICS_PORT}


@pytest.fixture(autouse=True)
def _no_specserve_env(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("SPECSERVE_")]:
        monkeypatch.delenv(key)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_field_has_its_flag_and_the_same_default(name):
    cls = CONFIGS[name]
    for f in dataclasses.fields(cls):
        if f.name in LIBRARY_ONLY[name]:
            assert FLAGS not in f.metadata
            continue
        assert FLAGS in f.metadata, f"{name}.{f.name} has no flag"
        flags = f.metadata[FLAGS].flags
        for flag in flags:
            assert flag.name.startswith("--") and flag.help, flag
            assert flag.env is None or flag.env.startswith("SPECSERVE_"), flag
        if len(flags) != 1 or f.default is dataclasses.MISSING:
            continue  # a group (security), or required (model)
        made = f.metadata[FLAGS].value(_namespace(flags[0].dest, flags[0].default))
        want = METRICS_PORTS[name] if f.name == "metrics_port" else f.default
        assert made == want, f"{name}.{f.name}: the flag makes {made!r}, the field has {want!r}"
    names = [flag.name for flag in config_flags(cls)]
    assert len(names) == len(set(names)), names


def _namespace(dest, value):
    import argparse

    return argparse.Namespace(**{dest: value})


@pytest.mark.parametrize("name", CONFIGS)
def test_the_parsed_flags_are_the_config(name, tmp_path):
    main = __import__(f"services.{name}.__main__", fromlist=["main"])
    config = main.config_from_args(main.build_parser().parse_args(["--model", str(tmp_path)]))
    assert config == CONFIGS[name](model=str(tmp_path), metrics_port=METRICS_PORTS[name])


@dataclasses.dataclass(frozen=True)
class Toy:
    size: int = flag_field("--size", "SPECSERVE_TOY_SIZE", "a size", default=3, type=int)
    mib: int = flag_field("--mib", None, "MiB", default=2 << 20, type=int, cli_default=2,
                          parse=lambda mb: mb << 20)
    port_file: str | None = None
    grace_s: float = 0.0
    host: str = "127.0.0.1"


def test_flag_then_environment_then_default(monkeypatch):
    parser = bootstrap.build_parser("toy", "", Toy)
    assert settings.config_from_args(Toy, parser.parse_args([])) == Toy()
    monkeypatch.setenv("SPECSERVE_TOY_SIZE", "5")
    parser = bootstrap.build_parser("toy", "", Toy)  # env defaults are read when built
    assert settings.config_from_args(Toy, parser.parse_args(["--mib", "1"])) == Toy(5, 1 << 20)
    assert settings.config_from_args(Toy, parser.parse_args(["--size", "7"])).size == 7
    assert "[env SPECSERVE_TOY_SIZE, default 3]" in parser.format_help()
    with pytest.raises(TypeError, match="cli_default"):
        flag_field("--need", None, "a required field with no flag default")


def test_security_flags_are_every_service_s_but_the_peer_ones_the_drafter_s():
    for name, cls in CONFIGS.items():
        peer = {f for f in SECURITY_FLAGS if f.name in PEER_FLAGS}
        assert len(peer) == 2
        assert set(SECURITY_FLAGS) - peer <= set(config_flags(cls))
        assert (peer <= set(config_flags(cls))) is (name != "drafter")
        assert not peer & set(config_flags(cls)) or name != "drafter"


def _doc_section(command: str) -> str:
    """configuration.md's text for `specserve COMMAND` (a service's: its section and "Every
    service"'s); '' when no heading names the command."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    sections = {m.group(1): m.group(2) for m in
                re.finditer(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.M | re.S)}
    every = sections["Every service"] if command.startswith("serve ") else ""
    return every + "".join(body for head, body in sections.items()
                           if f"`specserve {command}`" in head)


@pytest.mark.parametrize("name", CONFIGS)
def test_configuration_md_has_a_row_for_every_variable(name):
    docs = _doc_section(f"serve {name}")
    for flag in config_flags(CONFIGS[name]):
        if flag.env is None:  # --port-file, --http-port-file: a paragraph
            continue
        assert f"| `{flag.env}` | `{flag.name}` |" in docs, f"{name}: no row for {flag.env}"


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every `specserve` subcommand's parser, built by the CLI; `serve NAME`'s are the
    services' own parsers."""
    from services.cli import build_parser

    commands = dict(build_parser()[1])
    for name in CONFIGS:
        main = importlib.import_module(f"services.{name}.__main__")
        commands[f"serve {name}"] = main.build_parser()
    return commands


@pytest.mark.parametrize("command", [*CONFIGS, "up", "generate", "probe", "bench",
                                     "train-demo"])
def test_configuration_md_names_every_flag_of_every_command(command):
    """Each long flag of the command is in its section of configuration.md; a client flag's row
    (`| `--flag` | `VAR` |`) names a variable exactly when its help does (`[env VAR`)."""
    command = f"serve {command}" if command in CONFIGS else command
    parser, docs = _command_parsers()[command], _doc_section(command)
    envs = {}
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
        for flag in flags:
            assert f"`{flag}`" in docs, f"configuration.md: `specserve {command} {flag}` missing"
        env = re.search(r"\[env (SPECSERVE_\w+)", action.help or "")
        envs.update({flag: env.group(1) for flag in flags if env})
    if not command.startswith("serve "):  # the services' rows: the test above
        rows = dict(re.findall(r"^\| `(--[\w-]+)` \| `(SPECSERVE_\w+)` \|", docs, re.M))
        assert rows == envs, command


class FakeService:
    def __init__(self) -> None:
        self.port, self.stopped = 4321, []

    async def stop(self, grace: float) -> None:
        self.stopped.append(grace)


@pytest.mark.asyncio
async def test_run_service_writes_the_port_drains_and_flushes(tmp_path, monkeypatch, capsys):
    flushed, service, stop = [], FakeService(), asyncio.Event()

    async def shutdown_tracing():
        flushed.append(True)

    monkeypatch.setattr(bootstrap.telemetry, "shutdown_tracing", shutdown_tracing)
    config = Toy(port_file=str(tmp_path / "toy.port"), grace_s=0.25)

    async def start():
        return service

    task = asyncio.create_task(bootstrap.run_service("toy", start, config, stop))
    while not (tmp_path / "toy.port").exists():
        await asyncio.sleep(0.01)
    assert (tmp_path / "toy.port").read_text() == "4321\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.port"]  # no temporary left
    assert service.stopped == []
    stop.set()
    await task
    assert service.stopped == [0.25] and flushed == [True]
    assert capsys.readouterr().out == "specserve toy listening on 127.0.0.1:4321\n"


@pytest.mark.parametrize("env, frozen", [(None, 1), ("0", 0), ("1", 1)])
def test_the_heap_is_frozen_once_started_unless_switched_off(env, frozen, monkeypatch):
    calls = []
    monkeypatch.setattr(bootstrap.gc, "freeze", lambda: calls.append("freeze"))
    if env is not None:
        monkeypatch.setenv("SPECSERVE_GC_FREEZE", env)
    bootstrap.settle_interpreter()
    assert calls == ["freeze"] * frozen


@dataclasses.dataclass(frozen=True)
class Refusing:
    size: int = flag_field("--size", None, "a size", default=0, type=int)

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")


@pytest.mark.parametrize("error", [None, OSError("could not bind 127.0.0.1:9 (in use?)")])
def test_service_main_exits_2_with_the_reason(error, capsys, monkeypatch):
    monkeypatch.setattr(bootstrap.telemetry, "setup_tracing", lambda name: None)

    async def run(config):
        raise error

    argv = ["--size", "-1"] if error is None else []
    parser = bootstrap.build_parser("toy", "", Refusing)
    assert bootstrap.service_main("toy", parser, Refusing, run, argv) == 2
    want = "size must be >= 0, got -1" if error is None else str(error)
    assert capsys.readouterr().err == f"specserve toy: error: {want}\n"


def test_flag_dest():
    assert Flag("--max-num-seqs", None, 1).dest == "max_num_seqs"


def _port_or_nothing(raw: str) -> int:
    if not raw.isdigit():
        raise argparse.ArgumentTypeError(f"must be digits, got {raw!r}")
    return int(raw)


@dataclasses.dataclass(frozen=True)
class EnvToy:
    size: int = flag_field("--size", "SPECSERVE_TOY_SIZE", "a size", default=3, type=int)
    slot: int = flag_field("--slot", "SPECSERVE_TOY_SLOT", "a slot", default=1,
                           type=_port_or_nothing)


@pytest.mark.parametrize("env, value, want", [
    ("SPECSERVE_TOY_SIZE", "abc", "SPECSERVE_TOY_SIZE='abc' is not a valid int (the default of "
                                  "--size)"),
    ("SPECSERVE_TOY_SLOT", "x1", "SPECSERVE_TOY_SLOT='x1' is not a valid _port_or_nothing (the "
                                 "default of --slot: must be digits, got 'x1')"),
])
def test_a_bad_environment_value_exits_2_naming_the_variable(env, value, want, capsys,
                                                             monkeypatch):
    monkeypatch.setattr(bootstrap.telemetry, "setup_tracing", lambda name: None)
    monkeypatch.setenv(env, value)
    ran = []

    async def run(config):
        ran.append(config)

    parser = bootstrap.build_parser("toy", "", EnvToy)  # building it does not exit
    assert bootstrap.service_main("toy", parser, EnvToy, run, []) == 2
    assert capsys.readouterr().err == f"specserve toy: error: {want}\n" and ran == []
    flag = "--size" if env.endswith("SIZE") else "--slot"  # the flag given: the variable unused
    assert bootstrap.service_main("toy", parser, EnvToy, run, [flag, "7"]) == 0
    assert ran == [EnvToy(**{flag[2:]: 7})]


@pytest.mark.parametrize("env, value", [("SPECSERVE_MAX_STOP_STRINGS", "abc"),
                                        ("SPECSERVE_GATEWAY_HTTP_PORT", "banana")])
def test_the_gateway_refuses_a_bad_environment_value_with_exit_2(env, value, tmp_path, capsys,
                                                                 monkeypatch):
    from services.gateway.__main__ import main

    monkeypatch.setattr(bootstrap.telemetry, "setup_tracing", lambda name: None)
    monkeypatch.setenv(env, value)
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specserve gateway: error: {env}={value!r} is not a valid ") and \
        err.count("\n") == 1, err
