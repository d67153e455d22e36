"""deploy/k8s: schema-valid Kubernetes manifests that agree with the services' own flags.

Every resource is validated offline by `kubernetes-validate` (PyPI; it bundles the Kubernetes
JSON schemas) in strict mode (unknown fields are errors), against the oldest release with GA gRPC
probes and the newest bundled one; broken copies must fail. The consistency checks resolve each
container's environment (plain values and ConfigMap keys) and feed it to that service's own flag
parser: every SPECSERVE_* variable must be one of its flags, the container ports the ones it
binds, the probes gRPC health on its port, the addresses the peers' Service names and ports.
Not applied to a cluster.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
ROLES = ("gateway", "verifier", "drafter")
GPU_ROLES = ("verifier", "drafter")
MIN_K8S = "1.27"  # gRPC probes are GA from 1.27
HEALTH_SERVICE = {"gateway": "services.gateway.server:SERVICE_NAME",
                  "verifier": "services.verifier.server:SERVICE",
                  "drafter": "services.drafter.server:SERVICE_NAME"}


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _resources() -> list[dict]:
    return [d for p in _manifest_files() for d in _docs(p)]


def _one(kind: str, name: str) -> dict:
    found = [d for d in _resources() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"want one {kind} {name}, found {len(found)}"
    return found[0]


def _deployment(role: str) -> dict:
    return _one("Deployment", f"specserve-{role}")


def _container(role: str) -> dict:
    (container,) = _deployment(role)["spec"]["template"]["spec"]["containers"]
    return container


def _env(role: str) -> dict[str, str]:
    """The container's environment as the pod sees it (ConfigMap keys resolved)."""
    data = _one("ConfigMap", "specserve")["data"]
    env = {}
    for var in _container(role)["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == "specserve", var
        if ref["key"] in data:
            env[var["name"]] = data[ref["key"]]
        else:
            assert ref.get("optional"), f"{role}: {var['name']} names a missing key {ref['key']}"
    return env


def _args(role: str, monkeypatch):
    """The service's own parser, built with exactly the container's SPECSERVE_* environment."""
    for key in list(os.environ):
        if key.startswith("SPECSERVE_"):
            monkeypatch.delenv(key)
    for key, value in _env(role).items():
        if key.startswith("SPECSERVE_"):
            monkeypatch.setenv(key, value)
    return importlib.import_module(f"services.{role}.__main__").build_parser().parse_args([])


def _attr(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# --- the schema tool --------------------------------------------------------------------------

def _kv():
    return pytest.importorskip("kubernetes_validate",
                               reason="kubernetes-validate is not installed (in [dev])")


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == [p.name for p in _manifest_files()]
    assert [i["name"] for i in kust["images"]] == ["specserve"]


@pytest.mark.parametrize("version", ["min", "latest"])
def test_every_resource_is_schema_valid(version):
    kv = _kv()
    k8s = MIN_K8S if version == "min" else kv.latest_version()
    resources = _resources()
    assert len(resources) == 8  # ConfigMap, PVC, and a Deployment + Service per role
    for resource in resources:  # SchemaNotFoundError (an unknown kind) fails too
        kv.validate(resource, k8s, strict=True)


def _set(path: tuple, value):
    def mutate(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return mutate


_DELETE = object()
_CONTAINER = ("spec", "template", "spec", "containers", 0)


def _rename(old: str, new: str):
    def mutate(doc):
        container = doc["spec"]["template"]["spec"]["containers"][0]
        container[new] = container.pop(old)
    return mutate


@pytest.mark.parametrize("mutate", [
    _set(("spec", "replicas"), "two"),
    _set((*_CONTAINER, "readinessProbe", "grpc", "port"), "grpc"),  # named ports: not for grpc
    _set((*_CONTAINER, "name"), _DELETE),
    _set(("spec", "selector"), _DELETE),
    _rename("readinessProbe", "readinesProbe"),  # strict: unknown fields are errors
], ids=["replicas-string", "grpc-probe-named-port", "container-without-name",
        "no-selector", "misspelt-field"])
def test_the_validator_rejects_broken_copies(mutate):
    kv = _kv()
    broken = copy.deepcopy(_deployment("verifier"))
    mutate(broken)
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)


def test_validator_pin_is_in_dev_and_named_in_the_docs():
    kv = _kv()
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert f"kubernetes-validate=={kv.__version__}" in dev
    docs = " ".join((ROOT / "docs/deploy.md").read_text().split())
    assert f"kubernetes-validate {kv.__version__}" in docs


# --- consistency with the services ------------------------------------------------------------

def _read_by_telemetry() -> set[str]:
    text = (ROOT / "services/common/telemetry.py").read_text()
    return set(re.findall(r"environ(?:\.get\(|\[)\"(OTEL_\w+)\"", text))


@pytest.mark.parametrize("role", ROLES)
def test_role_env_ports_probes(role, monkeypatch):
    container = _container(role)
    assert container["args"] == ["serve", role] and container["image"] == "specserve"
    names = [v["name"] for v in container["env"]]
    assert len(names) == len(set(names)), names
    flags = {f.env for f in importlib.import_module(f"services.{role}.__main__").FLAGS}
    unknown = {n for n in names if n.startswith("SPECSERVE_")} - flags
    assert not unknown, f"{sorted(unknown)} are not flags of `specserve serve {role}`"
    others = {n for n in names if not n.startswith("SPECSERVE_")}
    assert others <= _read_by_telemetry(), others - _read_by_telemetry()

    args = _args(role, monkeypatch)
    assert args.host == "0.0.0.0"
    want = {"grpc": args.port, "metrics": args.metrics_port}
    if role == "gateway":
        want["http"] = args.http_port
    assert _ports(container) == want
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert set(ready) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}
    assert ready["grpc"] == {"port": args.port, "service": _attr(HEALTH_SERVICE[role])}
    assert set(live) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}
    assert live["grpc"] == {"port": args.port}  # "": the server is up (models may still load)


@pytest.mark.parametrize("role", ROLES)
def test_service_selects_its_pods_on_their_ports(role):
    deployment, service = _deployment(role), _one("Service", f"specserve-{role}")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert labels["app.kubernetes.io/component"] == role
    assert service["spec"]["selector"] == labels
    ports = _ports(_container(role))
    for port in service["spec"]["ports"]:
        assert port["port"] == ports[port["targetPort"]], port
    assert {p["name"] for p in service["spec"]["ports"]} == set(ports)


def _service_address(role: str) -> str:
    service = _one("Service", f"specserve-{role}")
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return f"{service['metadata']['name']}:{grpc['port']}"


def test_peers_dial_the_services(monkeypatch):
    gateway, verifier, drafter = (_args(r, monkeypatch) for r in ROLES)
    assert gateway.verifier == _service_address("verifier")
    assert verifier.drafter == _service_address("drafter")
    assert gateway.model == verifier.model == drafter.model  # one tokenizer, one target
    assert verifier.draft_model == drafter.draft_model
    # separate pods: no shared IPC namespace or lane socket, everything on the gRPC stream
    assert verifier.drafter_transport == "grpc" and drafter.lane == "off"


def test_gpu_requests(monkeypatch):
    for role in ROLES:
        resources = _container(role)["resources"]
        tolerations = _deployment(role)["spec"]["template"]["spec"].get("tolerations", [])
        if role in GPU_ROLES:
            assert resources["limits"]["nvidia.com/gpu"] == 1, role
            assert resources["requests"].get("nvidia.com/gpu", 1) == 1, role
            assert _args(role, monkeypatch).device == "cuda", role
            assert {t["key"] for t in tolerations} == {"nvidia.com/gpu"}, role
        else:
            assert "nvidia.com/gpu" not in str(resources) and not tolerations, role
            assert "SPECSERVE_DEVICE" not in _env(role)


def test_models_volume(monkeypatch):
    claim = _one("PersistentVolumeClaim", "specserve-models")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for role in ROLES:
        pod = _deployment(role)["spec"]["template"]["spec"]
        (volume,) = pod["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        (mount,) = _container(role)["volumeMounts"]
        assert mount["name"] == volume["name"] and mount["readOnly"] is True
        args = _args(role, monkeypatch)
        dirs = [args.model] + ([args.draft_model] if role in GPU_ROLES else [])
        for d in dirs:  # the defaults are the demo pair, as in docker-compose.yml
            assert d.startswith(mount["mountPath"] + "/"), (role, d)
            assert (ROOT / "checkpoints" / d.removeprefix(mount["mountPath"] + "/")).is_dir()
