"""The autoscaling example (examples/kubernetes/autoscaling.yaml) and the frontend's cores.

The autoscaler must act before the rejection thresholds do: it reads series the workers
really export, scales the worker Deployment, and its targets sit under the frontend's busy
threshold and the worker's queue limit of the same manifests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from frontend_shim._processes import usable_cores

yaml = pytest.importorskip("yaml")

MANIFESTS = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d is not None]


def _config(name: str) -> dict[str, str]:
    (found,) = [d for d in _documents("config.yaml") if d["metadata"]["name"] == name]
    data: dict[str, str] = found["data"]
    return data


def test_the_autoscaler_scales_the_workers_before_the_thresholds_shed() -> None:
    (hpa,) = [d for d in _documents("autoscaling.yaml") if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "dynamo-worker"
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    worker, frontend = _config("dynamo-worker-config"), _config("dynamo-frontend-config")
    queue_limit = float(worker["DYN_DYNAMO_REQUEST_QUEUE_LIMIT"])
    assert float(targets["dynamo_request_queue"]["averageValue"]) < queue_limit
    kv_target = targets["dynamo_kv_used_ratio"]["averageValue"]
    ratio = float(kv_target[:-1]) / 1000 if kv_target.endswith("m") else float(kv_target)
    assert ratio < float(frontend["DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"])


def test_the_adapter_rules_read_series_the_workers_export() -> None:
    (rules,) = [d for d in _documents("autoscaling.yaml") if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(rules["data"]["config.yaml"])
    metrics_doc = (MANIFESTS.parent.parent / "docs" / "metrics.md").read_text()
    for rule in config["rules"]:
        series = rule["seriesQuery"].split("{")[0]
        assert f"`{series}`" in metrics_doc, series
    hpa_names = {
        m["pods"]["metric"]["name"]
        for d in _documents("autoscaling.yaml")
        if d["kind"] == "HorizontalPodAutoscaler"
        for m in d["spec"]["metrics"]
    }
    assert hpa_names == {rule["name"]["as"] for rule in config["rules"]}


def test_auto_processes_follow_the_cpu_limit(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a limit of 1.5 CPUs
    assert usable_cores(tmp_path) == min(2, usable_cores(tmp_path / "none"))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == usable_cores(tmp_path / "none")
