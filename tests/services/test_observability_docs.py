"""docs/observability.md names every metric the services register, with its labels, in its
service's row (collected from services/common/metrics.py's registries, not a list kept here), and
quotes every commit-probe verdict as specserve.probe prints it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from services.common.metrics import DrafterMetrics, GatewayMetrics, VerifierMetrics
from specserve import probe

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "observability.md").read_text()
SERVICES = {"verifier": VerifierMetrics, "gateway": GatewayMetrics, "drafter": DrafterMetrics}


def _metrics(service: str) -> list[MetricWrapperBase]:
    instance = SERVICES[service]()
    return [m for m in vars(instance).values() if isinstance(m, MetricWrapperBase)]


def _row(service: str) -> str:
    match = re.search(rf"^\| {service} \| (.+) \|$", DOC, re.M)
    assert match, f"observability.md: no metrics row for the {service}"
    return match.group(1)


def _documented_labels(row: str, name: str) -> set[str] | None:
    """The labels the row gives `name` (`name{a,b=x\\|y}`), None when it is not named."""
    match = re.search(rf"`{re.escape(name)}(?:\{{([^}}`]*)\}})?`", row)
    if match is None:
        return None
    return {part.split("=")[0] for part in (match.group(1) or "").split(",") if part}


@pytest.mark.parametrize("service", SERVICES)
def test_every_registered_metric_is_in_its_service_s_row(service):
    row, metrics = _row(service), _metrics(service)
    assert len(metrics) == len(list(SERVICES[service]().registry.collect()))  # none missed
    for metric in metrics:
        name = metric._name + ("_total" if metric._type == "counter" else "")
        labels = _documented_labels(row, name)
        assert labels is not None, f"observability.md: {service} metric {name} missing"
        assert labels == set(metric._labelnames), f"{name}: labels {sorted(labels)}"


@pytest.mark.parametrize("verdict", [probe.HEALTHY, probe.HARD, probe.TARGET, probe.BROKEN,
                                     probe.NO_DRAFTER, probe.UNFIT])
def test_the_probe_verdicts_are_quoted_as_printed(verdict):
    assert f'"{verdict}"' in " ".join(DOC.split()), verdict
