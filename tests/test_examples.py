"""Tests of the files the examples ship: the Grafana dashboard, the Prometheus configuration and
alert rules (checked by promtool where it is installed), and the scripts' ``--help``.

The scripts' own behaviour is tested in ``test_retrying_client.py`` and
``test_load_generator.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import typing
from typing import Any

import pytest
from example_scripts import EXAMPLES, load_example

from frontend_shim._kv_routing import KvMetrics
from frontend_shim._metrics import FrontendMetrics, LinkSample, RankLoadSample
from shim_common.wire import WorkerType
from worker_ingress._admission import AdmissionGate
from worker_ingress._metrics import WorkerMetrics
from worker_ingress.engines._cache_stats import PrefixCacheStats

retrying = load_example("retrying_client")
loadgen = load_example("load_generator")


DASHBOARD = EXAMPLES / "grafana" / "dynamo-shim-dashboard.json"
PROMETHEUS = EXAMPLES / "prometheus" / "prometheus.yml"
ALERTS = EXAMPLES / "prometheus" / "alerts.yml"
ALERTS_TEST = EXAMPLES / "prometheus" / "alerts_test.yml"

#: Stable metric names of docs/metrics.md (from the first table of its worker and frontend
#: sections, the names dashboards and alerts rely on); the dashboard must show them all.
STABLE_METRICS = frozenset(
    {
        "dynamo_rejection_request_total",
        "dynamo_engine_request",
        "dynamo_request_queue",
        "dynamo_engine_request_limit",
        "dynamo_request_queue_limit",
        "dynamo_component_total_blocks",
        "dynamo_component_kv_used_blocks",
        "dynamo_frontend_model_rejection_total",
        "dynamo_frontend_worker_active_decode_blocks",
        "dynamo_frontend_worker_active_prefill_tokens",
        "dynamo_frontend_worker_kv_total_blocks",
        "dynamo_frontend_requests_total",
        "dynamo_frontend_inflight_requests",
        "dynamo_frontend_time_to_first_token_seconds",
        "dynamo_frontend_request_duration_seconds",
    }
)


# ----------------------------------------------------------------------------- dashboards


def _exposed_metric_names() -> set[str]:
    """Every sample name both processes expose, read from real registries."""
    gate = AdmissionGate(engine_slots=2, queue_limit=2)
    cache = [PrefixCacheStats(dp_rank=0, queried_tokens=32, hit_tokens=16, hit_rate=0.5)]
    worker_text, _ = WorkerMetrics(
        gate, kv_blocks=lambda: (10, 1), prefix_cache=lambda: cache
    ).render(None)
    frontend = FrontendMetrics(lambda: [RankLoadSample("w", 0, 1, 2, 10)])
    frontend.watch_links(lambda: [LinkSample("w", True, False, 0.001, 0.002, 5, 0)])
    frontend.count_rejection("m", "chat_completions")
    frontend.count_rejection_reason("m", "busy")
    frontend.count_request("m", "chat_completions", 200)
    frontend.inflight("m").inc()
    frontend.observe_ttft("m", 0.1)
    frontend.observe_duration("m", 0.2)
    KvMetrics(frontend.registry).observe("m", 16, 32)
    frontend_text, _ = frontend.render(None)
    names: set[str] = set()
    for text in (worker_text, frontend_text):
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            exprs.append(target["expr"])
    return exprs


def test_dashboard_references_only_metrics_that_exist() -> None:
    exposed = _exposed_metric_names()
    assert (
        STABLE_METRICS
        - {
            "dynamo_frontend_time_to_first_token_seconds",
            "dynamo_frontend_request_duration_seconds",
        }
        <= exposed
    )
    referenced = {
        name for expr in _dashboard_exprs() for name in re.findall(r"\bdynamo_[a-z_]+", expr)
    }
    assert referenced, "the dashboard queries no metric"
    unknown = referenced - exposed
    assert not unknown, f"the dashboard queries metrics nobody exposes: {sorted(unknown)}"


def test_dashboard_shows_every_stable_metric() -> None:
    text = " ".join(_dashboard_exprs())
    missing = {name for name in STABLE_METRICS if name not in text}
    assert not missing


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"]
    assert dashboard["title"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_prometheus_config_scrapes_the_frontend_and_workers() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets["frontend-shim"] == ["127.0.0.1:8000"]
    assert "127.0.0.1:9101" in targets["worker-ingress"]
    assert all(
        job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"]
    )


# ----------------------------------------------------------------------------- alert rules

#: Series Prometheus makes itself for every target, which the rules may use too.
PROMETHEUS_SERIES = frozenset({"up"})
#: PromQL words that are neither functions nor metrics.
_PROMQL_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan"}
)


def _promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (a small scanner, enough for these rules)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    # Grouping and vector matching with their label lists: `by (a, b)`, `on ()`, `group_left (c)`,
    # so that `sum by (a) (x)` reads as a call of `sum`.
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", expr):
        word = match.group()
        is_call = re.match(r"\s*\(", expr[match.end() :]) is not None
        if not is_call and word not in _PROMQL_KEYWORDS:
            names.add(word)
    return names


def _alert_rules() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promql_scanner_finds_metrics_not_functions_or_labels() -> None:
    expr = (
        'sum by (job, model) (rate(a_total{x="y,z"}[5m])) / on () group_left (m) '
        "count(up == 1) unless b > 0.05 and histogram_quantile(0.9, c_bucket)"
    )
    assert _promql_metric_names(expr) == {"a_total", "up", "b", "c_bucket"}


def test_alert_rules_query_only_metrics_that_exist() -> None:
    exposed = _exposed_metric_names()
    rules = _alert_rules()
    assert rules
    for rule in rules:
        names = _promql_metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = names - exposed - PROMETHEUS_SERIES
        assert not unknown, f"{rule['alert']} queries metrics nobody exposes: {sorted(unknown)}"


def test_alert_rules_cover_rejections_queues_and_lost_workers() -> None:
    used = set().union(*(_promql_metric_names(rule["expr"]) for rule in _alert_rules()))
    assert {
        "dynamo_rejection_request_total",
        "dynamo_frontend_model_rejection_total",
        "dynamo_frontend_requests_total",
        "dynamo_request_queue",
        "dynamo_request_queue_limit",
        "up",
    } <= used


def test_alert_rules_name_the_scrape_jobs_of_the_prometheus_config() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["rule_files"] == [ALERTS.name]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    named = {job for rule in _alert_rules() for job in re.findall(r'job="([^"]*)"', rule["expr"])}
    assert named == jobs


def test_every_alert_is_shown_firing_by_the_rule_tests() -> None:
    yaml = pytest.importorskip("yaml")
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    fired = {
        check["alertname"]
        for case in tests["tests"]
        for check in case["alert_rule_test"]
        if check["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in _alert_rules()}
    for rule in _alert_rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_the_pool_panels_and_alerts_name_the_protocols_roles() -> None:
    # The frontends' per-worker gauges label a worker by its hello's worker_type: a matcher on
    # any other value would select nothing, silently.
    roles = set(typing.get_args(WorkerType))
    exprs = [*_dashboard_exprs(), *(rule["expr"] for rule in _alert_rules())]
    matched = {role for expr in exprs for role in re.findall(r'worker_type="([^"]*)"', expr)}
    assert matched == {"prefill", "decode"}
    assert matched <= roles
    reasons = {reason for expr in exprs for reason in re.findall(r"\b\w+_busy\b", expr)}
    assert reasons == {"prefill_busy", "decode_busy"}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (Debian package `prometheus`; .ci/run installs it)")
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_alert_rules_pass_promtool_check() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_and_its_rule_file_pass_promtool_check() -> None:
    result = _promtool("check", "config", str(PROMETHEUS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_alert_rules_fire_as_their_unit_tests_expect() -> None:
    result = _promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ["retrying_client", "load_generator"])
def test_scripts_show_help(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = retrying if script == "retrying_client" else loadgen
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "--url" in capsys.readouterr().out
