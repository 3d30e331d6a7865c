"""Tests of the Kubernetes manifests in examples/kubernetes/.

They are checked against the Kubernetes API schemas (kubernetes-validate ships them, so this
runs offline), and against this project: every ``DYN_*`` variable they set is one the process
reads, the settings they give parse with the real command-line parsers, and the timings and
probes fit what the processes do.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from frontend_shim import _cli as frontend_cli
from worker_ingress import _cli as worker_cli

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "examples" / "kubernetes"

#: The tokens of docs/configuration.md's section "Access: tokens and TLS": the worker planes'
#: token (read by the worker and the frontend) and the admin token (read by the frontend). A token
#: comes from the environment only, so no flag declares it and the flag scan cannot see it: they
#: are named here, so that the manifests may set them.
ACCESS_TOKEN_VARIABLES = frozenset({"DYN_WORKER_TOKEN", "DYN_ADMIN_TOKEN"})


def _documents() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                documents.append(document)
    return documents


DOCUMENTS = _documents()


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def _container(deployment: str, name: str) -> dict[str, Any]:
    spec = _one("Deployment", deployment)["spec"]["template"]["spec"]
    found: list[dict[str, Any]] = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"{deployment}/{name}"
    return found[0]


def _environment(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The environment a container starts with, resolved from the ConfigMaps and the Secret."""
    environment: dict[str, str] = {}
    for source in container.get("envFrom", ()):
        environment.update(_one("ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container.get("env", ()):
        if "value" in variable:
            value = variable["value"]
        else:
            ref = variable["valueFrom"]
            if "secretKeyRef" in ref:
                key = ref["secretKeyRef"]
                value = _one("Secret", key["name"])["stringData"][key["key"]]
            else:
                assert ref["fieldRef"]["fieldPath"] == "metadata.name", variable
                value = pod_name
        environment[variable["name"]] = value
    return environment


WORKER_ENV = _environment(_container("dynamo-worker", "worker-ingress"), "dynamo-worker-7d4f-x2")
FRONTEND_ENV = _environment(_container("dynamo-frontend", "frontend-shim"), "dynamo-frontend-1")
#: The worker Deployment of each role: the aggregated workers (worker.yaml) and the two pools of
#: disaggregated.yaml.
WORKER_DEPLOYMENTS = {
    "agg": "dynamo-worker",
    "prefill": "dynamo-prefill-worker",
    "decode": "dynamo-decode-worker",
}
ROLE_ENV = {
    role: _environment(_container(deployment, "worker-ingress"), f"{deployment}-5c9b-q7")
    for role, deployment in WORKER_DEPLOYMENTS.items()
}


@pytest.fixture
def dyn_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """``monkeypatch``, with every ``DYN_*`` variable of the test run's own environment removed."""
    for name in [name for name in os.environ if name.startswith("DYN_")]:
        monkeypatch.delenv(name)
    return monkeypatch


# ----------------------------------------------------------------------------- schemas


def test_every_manifest_file_holds_resources() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in DOCUMENTS}
    assert {
        ("Deployment", "dynamo-worker"),
        ("Deployment", "dynamo-prefill-worker"),
        ("Deployment", "dynamo-decode-worker"),
        ("Service", "dynamo-worker"),
        ("Deployment", "dynamo-frontend"),
        ("Service", "dynamo-frontend"),
        ("ConfigMap", "dynamo-worker-config"),
        ("ConfigMap", "dynamo-disagg-worker-config"),
        ("ConfigMap", "dynamo-frontend-config"),
        ("Secret", "dynamo-shim-tokens"),
    } <= kinds


@pytest.mark.parametrize(
    "document", DOCUMENTS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCUMENTS]
)
def test_manifest_matches_the_kubernetes_schema(document: dict[str, Any]) -> None:
    version = kubernetes_validate.latest_version()
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{document['kind']}/{document['metadata']['name']}: {exc.message}")


# ----------------------------------------------------------------------------- variables


def _variables_in_sources(exclude: str | None) -> set[str]:
    """``DYN_*`` names quoted in the project's packages (where env-only variables are read)."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {name.split(".")[0] for name in packages["packages"]} - {exclude}
    names: set[str] = set()
    for root in roots:
        for path in (ROOT / root).rglob("*.py"):
            names.update(re.findall(r"[\"'](DYN_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def _flag_variables(app: Any) -> set[str]:
    return {
        name
        for argument in app.assemble_argument_collection()
        for name in argument.parameter.env_var or ()
    }


def test_worker_variables_are_read_by_the_worker() -> None:
    known = (
        _flag_variables(worker_cli.app)
        | _variables_in_sources(exclude="frontend_shim")
        | ACCESS_TOKEN_VARIABLES
    )
    assert {"DYN_ENGINE_REQUEST_LIMIT", "DYN_DYNAMO_REQUEST_QUEUE_LIMIT", "DYN_LOG"} <= known
    for role, environment in ROLE_ENV.items():
        unknown = {name for name in environment if name.startswith("DYN_")} - known
        assert not unknown, f"the {role} worker does not read {sorted(unknown)}"
        assert "DYN_ADMIN_TOKEN" not in environment  # the admin token stays with the frontends


def test_frontend_variables_are_read_by_the_frontend() -> None:
    known = _flag_variables(frontend_cli.app) | _variables_in_sources(exclude=None)
    known |= ACCESS_TOKEN_VARIABLES
    assert {"DYN_WORKERS", "DYN_HTTP_OVERLOAD_STATUS_CODE", "DYN_LOG"} <= known
    unknown = {name for name in FRONTEND_ENV if name.startswith("DYN_")} - known
    assert not unknown, f"the frontend does not read {sorted(unknown)}"


def test_only_dyn_variables_are_configured() -> None:
    for config in ("dynamo-worker-config", "dynamo-disagg-worker-config"):
        for name in _one("ConfigMap", config)["data"]:
            assert name.startswith("DYN_"), name
    for name in _one("ConfigMap", "dynamo-frontend-config")["data"]:
        assert name.startswith("DYN_"), name


# ----------------------------------------------------------------------------- settings


def test_worker_settings_parse_and_listen_beyond_loopback(
    dyn_environment: pytest.MonkeyPatch,
) -> None:
    container = _container("dynamo-worker", "worker-ingress")
    assert container["command"][0] == "worker-ingress"
    for name, value in WORKER_ENV.items():
        dyn_environment.setenv(name, value)
    settings, _ = worker_cli.parse_args(container["command"][1:])
    assert settings.host == "0.0.0.0"
    assert settings.engine == "openai"
    assert settings.upstream_url == "http://127.0.0.1:8001"
    assert settings.worker_id == "dynamo-worker-7d4f-x2"
    assert settings.engine_request_limit is not None
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["ws"], ports["system"]) == (settings.port, settings.system_port)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_prefill_and_decode_pools_parse_as_their_roles_of_a_model_of_their_own(
    dyn_environment: pytest.MonkeyPatch, role: str
) -> None:
    deployment = WORKER_DEPLOYMENTS[role]
    container = _container(deployment, "worker-ingress")
    for name, value in ROLE_ENV[role].items():
        dyn_environment.setenv(name, value)
    settings, _ = worker_cli.parse_args(container["command"][1:])
    assert settings.disaggregation_mode == role
    # The mocker, the one engine that hands KV off; a model no aggregated (real) worker serves.
    assert settings.engine == "mocker"
    assert settings.model != WORKER_ENV["DYN_MODEL_NAME"]
    assert settings.host == "0.0.0.0"
    assert settings.worker_id == f"{deployment}-5c9b-q7"
    assert settings.engine_request_limit is not None
    assert settings.mocker.kv_transfer_bandwidth > 0
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["ws"], ports["system"]) == (settings.port, settings.system_port)
    assert "GPU" not in str(container["resources"]).upper()  # simulated: no GPU asked for


def test_the_pools_have_disjoint_selectors_and_the_frontends_service_finds_every_role() -> None:
    labels = {
        role: _one("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        for role, name in WORKER_DEPLOYMENTS.items()
    }
    for role, name in WORKER_DEPLOYMENTS.items():
        selector = _one("Deployment", name)["spec"]["selector"]["matchLabels"]
        owned = {other for other, pod in labels.items() if selector.items() <= pod.items()}
        assert owned == {role}, f"{name} selects the pods of {sorted(owned)}"
    service = _one("Service", "dynamo-worker")["spec"]["selector"]
    assert all(service.items() <= pod.items() for pod in labels.values())


def test_engine_sidecar_serves_the_model_on_loopback_at_the_upstream_port() -> None:
    engine = _container("dynamo-worker", "engine")
    args = engine["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert f"http://127.0.0.1:{args[args.index('--port') + 1]}" == "http://127.0.0.1:8001"
    assert args[args.index("--served-model-name") + 1] == WORKER_ENV["DYN_MODEL_NAME"]
    assert "ports" not in engine  # nothing outside the pod may bypass the gate


def test_frontend_settings_parse_and_find_workers_through_the_headless_service(
    dyn_environment: pytest.MonkeyPatch,
) -> None:
    container = _container("dynamo-frontend", "frontend-shim")
    for name, value in FRONTEND_ENV.items():
        dyn_environment.setenv(name, value)
    settings, _ = frontend_cli.parse_args(container["command"][1:])
    assert settings.http_host == "0.0.0.0"
    assert settings.local_workers == 0
    assert len(settings.workers) == 1
    match = re.fullmatch(r"ws://([a-z0-9-]+):(\d+)", settings.workers[0])
    assert match is not None
    service = _one("Service", match.group(1))["spec"]
    assert service["clusterIP"] == "None"
    assert int(match.group(2)) in {p["port"] for p in service["ports"]}
    # It selects the aggregated workers' pods (and the pools', checked above).
    pods = _one("Deployment", "dynamo-worker")["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pods.items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == settings.http_port


# ----------------------------------------------------------------------------- pods


@pytest.mark.parametrize(
    ("deployment", "container", "environment"),
    [
        *((WORKER_DEPLOYMENTS[role], "worker-ingress", ROLE_ENV[role]) for role in ROLE_ENV),
        ("dynamo-frontend", "frontend-shim", FRONTEND_ENV),
    ],
)
def test_pods_outlast_the_drain_are_probed_and_scraped(
    deployment: str, container: str, environment: dict[str, str]
) -> None:
    pod = _one("Deployment", deployment)["spec"]["template"]
    drain = float(environment["DYN_GRACEFUL_SHUTDOWN_TIMEOUT"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    spec = _container(deployment, container)
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health"
    assert spec["livenessProbe"]["httpGet"]["path"] == "/live"
    probed = {spec[probe]["httpGet"]["port"] for probe in ("readinessProbe", "livenessProbe")}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    # Metrics, /health and /live share one HTTP port: the system port or the frontend's port.
    assert {ports[name] for name in probed} == {int(annotations["prometheus.io/port"])}


def test_engine_stops_only_after_the_worker_has_drained() -> None:
    pod = _one("Deployment", "dynamo-worker")["spec"]["template"]["spec"]
    command = _container("dynamo-worker", "engine")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    wait = float(command[1])
    assert float(WORKER_ENV["DYN_GRACEFUL_SHUTDOWN_TIMEOUT"]) < wait
    assert wait < pod["terminationGracePeriodSeconds"]


def test_pods_carry_the_job_names_the_alert_rules_use() -> None:
    names = {
        _one("Deployment", name)["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for name in (*WORKER_DEPLOYMENTS.values(), "dynamo-frontend")
    }
    alerts = (ROOT / "examples" / "prometheus" / "alerts.yml").read_text()
    assert names == set(re.findall(r'job="([^"]+)"', alerts))
