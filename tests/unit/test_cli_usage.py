"""The console script's flags (issue 28, item 8): every option has help and shows its default; bad
values are one-line usage errors with exit 2, found at parse time where they can be; --stop
unescapes, --gateway HOST means port 50051, `up` moves its metrics ports with --ports and binds
SPECSERVE_HOST unless --host is given."""

from __future__ import annotations

import argparse
import tempfile

import pytest

from services.cli import build_parser, main, usage
from services.cli.client import gateway_address
from services.cli.services import _up_plan


@pytest.fixture(autouse=True)
def _no_metrics_env(monkeypatch, tmp_path):
    for name in ("GATEWAY", "VERIFIER", "DRAFTER"):
        monkeypatch.delenv(f"SPECSERVE_{name}_METRICS_PORT", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # up's port-file directories


def test_an_up_refused_before_it_starts_leaves_no_directory(tmp_path, capsys):
    """`up` makes a directory for the gateway's HTTP port file; a usage error found before
    anything starts (two listeners on one port) removes it again."""
    with pytest.raises(SystemExit) as e:
        main(["up", "--ports", "64260", "--gateway-port", "64261"])
    assert e.value.code == 2 and "share port" in capsys.readouterr().err
    assert list(tmp_path.glob("specserve-up-*")) == []


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser()[0].parse_args(list(argv))


def test_every_option_of_every_subcommand_has_help_and_shows_its_default():
    commands = build_parser()[1]
    assert set(commands) == {"serve", "up", "generate", "probe", "bench", "train-demo"}
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in commands.items()
               for a in p._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert missing == []  # options and positionals alike
    for name, p in commands.items():
        assert p.formatter_class is usage.HelpFormatter, name
    text = " ".join(commands["generate"].format_help().split())
    assert "(default: 64)" in text and "(default: 127.0.0.1:50051)" in text
    assert "(default: None)" not in text and "(default: [])" not in text
    assert "(default: 600.0)" in " ".join(commands["up"].format_help().split())


def test_stop_strings_are_unescaped():
    args = _parse("generate", "--prompt", "x", "--stop", r"\n\n", "--stop", r"a\tb\\n\x")
    assert args.stop == ["\n\n", "a\tb\\n\\x"]
    assert usage.unescape(r"\r\n") == "\r\n" and usage.unescape("trailing\\") == "trailing\\"


@pytest.mark.parametrize("argv, says", [
    (["probe", "--texts", "bogus"], "argument --texts: must be a comma-separated list of "
                                    "predictable, novel"),
    (["probe", "--contexts", "1x"], "argument --contexts: '1x' is not a token count"),
    (["probe", "--contexts", "1k,-2"], "must be positive token counts"),
    (["probe", "--budget", "5000"], "argument --budget: must be in [0, 1024], got 5000"),
    (["generate", "--prompt", "x", "--budget", "5000"], "must be in [0, 1024], got 5000"),
    (["generate", "--token-ids", "9707,..."], "argument --token-ids: must be integers"),
    (["generate", "--prompt", "x", "--timeout-s", "1e10"], "must be a number in (0, 31536000]"),
    (["generate", "--token-ids", "1,-3"], "must be non-negative token ids"),
    (["generate", "--prompt", "x", "--gateway", "host:abc"], "argument --gateway: must be "
                                                             "HOST[:PORT]"),
    (["generate", "--prompt", "x", "--in-process"], "--in-process needs --model DIR"),
    (["generate", "--prompt", "x", "--in-process", "--model", "m", "--budget", "0",
      "--request-id", "r"], "--budget, --request-id: through the gateway only"),
    (["generate", "--prompt", "x", "--model", "m"], "--model: with --in-process only"),
    (["generate", "--prompt", "x", "--device", "tpu"], "argument --device: must be cpu | cuda"),
    (["train-demo", "--threads", "0"], "argument --threads: must be an integer in [1, 4096]"),
    (["train-demo", "--drafter-steps", "-3"], "argument --drafter-steps: must be an integer"),
    (["train-demo", "--drafter-lr", "-1"], "argument --drafter-lr: must be a finite number > 0"),
    (["train-demo", "--drafter-copy-frac", "2"], "must be a number in [0, 1]"),
    (["train-demo", "--seed", "-1"], "argument --seed: must be an integer in [0, 4294967295]"),
    (["train-demo", "--out", "README.md"], "--out README.md is a file, not a directory"),
    (["train-demo", "--out", "/proc/specserve-demo"], "--out /proc/specserve-demo: cannot write "
                                                      "there"),
    (["up", "--ports", "70000"], "argument --ports: must be a port in [1, 65535]"),
    (["up", "--model", "/nonexistent"], "argument --model: '/nonexistent' is not a model "
                                        "directory (no config.json)"),
    (["up", "--ports", "62051", "--gateway-port", "62052", "--http-port", "off"],
     "two of the stack's listeners would share port 62052"),
    (["up", "--ports", "62051", "--http-port", "62051"], "would share port 62051"),
    (["up", "--no-drafter", "--draft-model", "checkpoints/demo-drafter"],
     "--no-drafter starts no drafter to run --draft-model"),
    (["up", "--startup-timeout-s", "nan"], "argument --startup-timeout-s: must be a finite"),
    (["up", "--http-port", "nope"], "argument --http-port: must be a port number or off"),
    (["up", "--model", "m", "--ports", "2000", "--http-port", "off"],
     "--ports 2000 moves the metrics ports (-38950..-38948) out of range; give "
     "--metrics-ports BASE"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"specserve {argv[0]}: error: "), err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize("service", ["gateway", "verifier", "drafter"])
def test_a_service_flag_of_the_wrong_type_is_one_line(service, capsys):
    """argparse's own errors (a flag's type) too: one line naming the flag, not the usage."""
    with pytest.raises(SystemExit) as e:
        main(["serve", service, "--grace-s", "abc"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"specserve serve {service}: error: argument --grace-s: invalid ")


def test_a_cuda_device_must_exist_here(monkeypatch, capsys):
    monkeypatch.setattr(usage, "cuda_devices", lambda: 0)
    with pytest.raises(SystemExit) as e:
        main(["up", "--device", "cuda"])
    assert e.value.code == 2
    assert "argument --device: 'cuda': this machine has no CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(usage, "cuda_devices", lambda: 1)
    parse = usage.device(("auto", "cpu", "cuda"))
    assert parse("cuda:0") == "cuda:0" and parse("auto") == "auto" and parse("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match="has 1 CUDA device"):
        parse("cuda:1")


def test_the_budget_bound_is_the_tree_builders():
    from specserve.spec.tree import MAX_BUDGET

    assert usage.MAX_BUDGET == MAX_BUDGET
    assert _parse("probe", "--budget", str(MAX_BUDGET)).budget == MAX_BUDGET


@pytest.mark.parametrize("given, address", [
    ("myhost", "myhost:50051"), ("myhost:1234", "myhost:1234"), ("[::1]", "[::1]:50051"),
    ("[::1]:7", "[::1]:7"), ("::1", "[::1]:50051"), ("dns:///h:9", "dns:///h:9"),
    ("unix:/tmp/gw.sock", "unix:/tmp/gw.sock"),
])
def test_a_gateway_without_a_port_is_on_50051(given, address):
    assert gateway_address(given) == address
    assert _parse("generate", "--prompt", "x", "--gateway", given).gateway == address


@pytest.mark.parametrize("bad", ["", "host:", "host:0", "host:99999", ":80", "[::1]x"])
def test_a_bad_gateway_address_is_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        gateway_address(bad)


def _ports(*argv: str) -> dict[str, tuple[int, int]]:
    """service → (gRPC port, metrics port) of an `up` plan."""
    plan = _up_plan(_parse("up", "--model", "m", "--http-port", "off", *argv))
    return {n: (int(a.rsplit(":", 1)[1]), int(f[f.index("--metrics-port") + 1]))
            for n, a, f in plan}


def test_up_moves_the_metrics_ports_with_ports(monkeypatch):
    assert _ports() == {"gateway": (50051, 9101), "verifier": (50052, 9102),
                        "drafter": (50053, 9103)}
    moved = _ports("--ports", "60051")
    assert moved == {"gateway": (60051, 19101), "verifier": (60052, 19102),
                     "drafter": (60053, 19103)}
    every = [p for ports in (_ports(), moved) for pair in ports.values() for p in pair]
    assert len(set(every)) == len(every)  # two `up`s with different --ports share no port
    assert {m for _, m in _ports("--metrics-ports", "0").values()} == {0}
    assert _ports("--ports", "2000", "--metrics-ports", "3000")["drafter"] == (2002, 3002)
    monkeypatch.setenv("SPECSERVE_VERIFIER_METRICS_PORT", "0")  # a service's own setting wins
    assert _ports("--ports", "60051")["verifier"] == (60052, 0)
    assert _ports("--ports", "60051", "--metrics-ports", "7000")["verifier"] == (60052, 7001)


def test_up_moves_the_http_port_with_ports(monkeypatch):
    def http(*argv: str) -> str:
        plan = {n: f for n, _a, f in _up_plan(_parse("up", "--model", "m", *argv))}
        return plan["gateway"][plan["gateway"].index("--http-port") + 1]

    monkeypatch.delenv("SPECSERVE_GATEWAY_HTTP_PORT", raising=False)
    assert (http(), http("--ports", "60051"), http("--ports", "60051", "--http-port", "off")) \
        == ("8000", "18000", "off")  # two `up`s with different --ports: two HTTP ports
    with pytest.raises(usage.UsageError, match="moves the HTTP API's port .-40051. out of range"):
        http("--ports", "2000", "--metrics-ports", "0")
    monkeypatch.setenv("SPECSERVE_GATEWAY_HTTP_PORT", "8123")  # the gateway's own setting wins
    assert http("--ports", "60051") == "8123" and http("--http-port", "0") == "0"
    monkeypatch.setenv("SPECSERVE_GATEWAY_HTTP_PORT", "x")
    with pytest.raises(usage.UsageError, match="SPECSERVE_GATEWAY_HTTP_PORT: must be a port"):
        http()


def test_up_takes_each_services_port_variable_unless_ports_are_given(monkeypatch):
    for n in ("GATEWAY", "VERIFIER", "DRAFTER"):
        monkeypatch.delenv(f"SPECSERVE_{n}_PORT", raising=False)
    monkeypatch.setenv("SPECSERVE_VERIFIER_PORT", "61000")
    def grpc_ports(*argv: str) -> dict[str, int]:
        return {n: g for n, (g, _m) in _ports(*argv).items()}

    assert grpc_ports() == {"gateway": 50051, "verifier": 61000, "drafter": 50053}
    assert grpc_ports("--ports", "60051") == {"gateway": 60051, "verifier": 60052,
                                              "drafter": 60053}
    assert _ports("--verifier-port", "62000")["verifier"][0] == 62000  # the flag wins
    monkeypatch.setenv("SPECSERVE_VERIFIER_PORT", "70000")
    with pytest.raises(usage.UsageError, match="SPECSERVE_VERIFIER_PORT"):
        _ports()


def test_up_binds_specserve_host_unless_host_is_given(monkeypatch):
    def hosts(*argv: str) -> set[str]:
        plan = _up_plan(_parse("up", "--model", "m", "--http-port", "off", *argv))
        return {f[f.index("--host") + 1] for _n, _a, f in plan}

    monkeypatch.delenv("SPECSERVE_HOST", raising=False)
    assert hosts() == {"127.0.0.1"}
    monkeypatch.setenv("SPECSERVE_HOST", "0.0.0.0")  # the parser reads it when built
    assert hosts() == {"0.0.0.0"}
    assert hosts("--host", "127.0.0.2") == {"127.0.0.2"}


def test_up_passes_adaptive_to_the_verifier_only():
    def flags(*argv: str) -> dict[str, list[str]]:
        plan = _up_plan(_parse("up", "--model", "m", "--http-port", "off", *argv))
        return {n: f for n, _a, f in plan}

    assert all("--adaptive" not in f for f in flags().values())  # the verifier's own default
    on = flags("--adaptive", "on")
    assert on["verifier"][on["verifier"].index("--adaptive") + 1] == "on"
    assert "--adaptive" not in on["gateway"] and "--adaptive" not in on["drafter"]
    with pytest.raises(SystemExit):
        _parse("up", "--adaptive", "maybe")


def test_ctrl_c_ends_a_command_without_a_traceback(monkeypatch, capsys):
    from services.cli import train

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_train", interrupted)
    assert main(["train-demo", "--quick"]) == 130
    err = capsys.readouterr().err
    assert err == "specserve train-demo: interrupted\n"


def test_up_without_a_drafter_keeps_the_verifier_off_the_environments(monkeypatch):
    """--no-drafter: the verifier is told "no drafter", not left to SPECSERVE_DRAFTER_ADDR."""
    monkeypatch.setenv("SPECSERVE_DRAFTER_ADDR", "127.0.0.1:9")
    plan = {n: f for n, _a, f in _up_plan(_parse("up", "--model", "m", "--http-port", "off",
                                                 "--no-drafter"))}
    assert "drafter" not in plan
    flags = plan["verifier"]
    assert flags[flags.index("--drafter") + 1] == "" and "--draft-model" not in flags
