"""The Grafana dashboard and the Prometheus config ask only for series the mesh exports,
and docker-compose.yml provisions both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "mesh" / "grafana" / "dashboards" / "llm-mesh.json"
DEFINED = re.compile(r'(?:Counter|Gauge|Histogram)\(\s*"([a-z_]+)"', re.S)
ENGINE = re.compile(r'"(llm_engine_[a-z_]+)"')  # the engine's metric families
USED = re.compile(r"\b((?:llm|gen_ai)_[a-z_]+)")


def exported() -> set[str]:
    names: set[str] = set()
    for path in [*REPO.glob("services/**/*.py"), *REPO.glob("llmmesh/**/*.py")]:
        names |= set(DEFINED.findall(path.read_text()))
    names |= set(ENGINE.findall((REPO / "model_repository/llm/1/model.py").read_text()))
    # Prometheus client names: counters gain _total; histograms _bucket, _sum, _count.
    return names | {f"{n}_total" for n in names} | {f"{n}_bucket" for n in names}


def test_every_panel_queries_series_the_mesh_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    titles = [p["title"] for p in dashboard["panels"]]
    for wanted in ("TTFT", "TPOT", "tokens/s", "Shed", "Canary", "replica", "KV"):
        assert any(wanted in t for t in titles), wanted
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used = set(USED.findall(target["expr"]))
            assert used and used <= names, (panel["title"], used - names)


def test_compose_provisions_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    mounts = " ".join(compose["grafana"]["volumes"])
    assert "mesh/grafana/provisioning" in mounts and "mesh/grafana/dashboards" in mounts
    scrape = yaml.safe_load((REPO / "mesh" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    assert jobs == {"router", "policy", "context", "inference", "triton", "canary-controller"}
