"""deploy/kubernetes: every manifest validates against the Kubernetes schemas, the pieces fit
together, and the router.toml of the ConfigMap is one the router accepts.

No cluster runs here. ``kubernetes-validate`` (the dev extra) checks every resource file and
every resource of the rendered kustomizations against the OpenAPI schemas of a pinned
Kubernetes version, strictly (an unknown or misspelt field fails). Rendering needs kustomize:
``kubectl kustomize`` (kubectl is on these machines); without it the render tests skip, and
fail in CI. The ServiceMonitor is a Prometheus Operator CRD with no schema here: it is checked
structurally against the Service it selects. What only a real cluster shows (RBAC really
allowing the watch, probes passing, the pods reaching each other) is listed in docs/deploy.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import kubernetes_validate as kv
    import yaml
except ImportError as exc:  # the dev extra has both; CI must not pass by skipping
    if os.environ.get("CI"):
        raise
    pytest.skip(f"{exc.name} not installed: pip install -e '.[dev]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
KUSTOMIZATIONS = [BASE, OVERLAY, K8S / "examples" / "vllm"]
K8S_VERSIONS = ("1.30.0", "1.32.0")
"""Pinned: the oldest Kubernetes the manifests promise, and kubectl's version here."""
CRD_KINDS = {"ServiceMonitor"}
CONFIG_PATH = "/etc/kvrouter/router.toml"


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _resource_files() -> list[Path]:
    """Every YAML file that is a Kubernetes resource (not a kustomization)."""
    out = [p for p in sorted(K8S.rglob("*.yaml")) if p.name not in ("kustomization.yaml",)]
    assert len(out) >= 10, out
    return out


def _kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        msg = "kubectl not on PATH: cannot render the kustomizations (kubectl kustomize)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return _docs(proc.stdout)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {p.relative_to(K8S).as_posix(): _kustomize(p) for p in KUSTOMIZATIONS}


def _validate(doc: dict[str, Any], where: str) -> None:
    if doc["kind"] in CRD_KINDS:
        return  # checked by test_servicemonitor_selects_the_router_service
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(
                f"{where}: {doc['kind']}/{doc['metadata']['name']} {version}: {path}: {exc.message}"
            )


@pytest.mark.parametrize("path", _resource_files(), ids=lambda p: p.relative_to(K8S).as_posix())
def test_every_resource_file_validates(path: Path) -> None:
    docs = _docs(path.read_text())
    assert docs
    for doc in docs:
        _validate(doc, str(path.relative_to(ROOT)))


def test_rendered_kustomizations_validate(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for where, docs in rendered.items():
        assert docs, where
        for doc in docs:
            _validate(doc, f"kubectl kustomize {where}")


def test_validation_does_reject_a_broken_manifest() -> None:
    """The validator bites: a misspelt field and a wrong type both fail."""
    (doc,) = _docs((BASE / "deployment.yaml").read_text())
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[-1], strict=True)
    (doc,) = _docs((BASE / "deployment.yaml").read_text())
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[-1], strict=True)


# --------------------------------------------------------------------------- how they fit


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _router_container(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = _one(docs, "Deployment", "kvrouter")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


@pytest.fixture(scope="module")
def overlay(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["overlays/example"]


def test_router_deployment_is_locked_down_and_probed(overlay: list[dict[str, Any]]) -> None:
    dep = _one(overlay, "Deployment", "kvrouter")
    assert dep["spec"]["replicas"] == 3  # the overlay's count
    assert (
        dep["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )
    spec, c = _router_container(overlay)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["image"] == "registry.example.com/kvrouter:0.1.0"
    # The admin token comes from the Secret, not from the ConfigMap.
    (token,) = [e for e in c["env"] if e["name"] == "KVROUTER_ADMIN_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    (secret,) = _docs((BASE / "admin-secret.example.yaml").read_text())
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert not [d for d in overlay if d["kind"] == "Secret"]  # never rendered from git


def test_config_map_is_mounted_where_the_command_reads_it(overlay: list[dict[str, Any]]) -> None:
    spec, c = _router_container(overlay)
    assert c["args"] == ["serve", "--config", CONFIG_PATH]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_vol = next(n for n, v in volumes.items() if "configMap" in v)
    assert mounts[config_vol] == str(Path(CONFIG_PATH).parent)
    cm = _one(overlay, "ConfigMap", volumes[config_vol]["configMap"]["name"])
    assert Path(CONFIG_PATH).name in cm["data"]
    assert "/tmp" in mounts.values()  # writable scratch beside the read-only root


def test_rbac_lets_the_service_account_watch_pods(overlay: list[dict[str, Any]]) -> None:
    spec, _ = _router_container(overlay)
    sa = _one(overlay, "ServiceAccount", spec["serviceAccountName"])
    assert spec["automountServiceAccountToken"] is True
    binding = _one(overlay, "RoleBinding")
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount",
        "name": sa["metadata"]["name"],
        "namespace": sa["metadata"]["namespace"],
    }
    role = _one(overlay, "Role", binding["roleRef"]["name"])
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}  # read only


def test_service_and_servicemonitor_select_the_routers(overlay: list[dict[str, Any]]) -> None:
    pod_labels = _one(overlay, "Deployment", "kvrouter")["spec"]["template"]["metadata"]["labels"]
    svc = _one(overlay, "Service", "kvrouter")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    _, c = _router_container(overlay)
    container_ports = {p["name"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    pdb = _one(overlay, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # ServiceMonitor (a CRD: no schema here): the fields the operator reads, and that they
    # point at this Service's named port.
    sm = _one(overlay, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}


def test_servicemonitor_stays_optional(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The base applies to a cluster without the Prometheus Operator."""
    assert not [d for d in rendered["base"] if d["kind"] in CRD_KINDS]


# --------------------------------------------------------------------------- router.toml


def _router_toml(overlay: list[dict[str, Any]]) -> str:
    spec, _ = _router_container(overlay)
    name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    return _one(overlay, "ConfigMap", name)["data"][Path(CONFIG_PATH).name]


def test_config_map_toml_matches_the_deployment(overlay: list[dict[str, Any]]) -> None:
    import tomllib

    data = tomllib.loads(_router_toml(overlay))
    _, c = _router_container(overlay)
    assert data["server"]["host"] == "0.0.0.0"  # a pod serves on its own address
    assert data["server"]["port"] == next(p["containerPort"] for p in c["ports"])
    assert "admin_token" not in data["server"]  # the Secret's job
    (pool,) = data["pools"]
    assert pool["discovery"] == "kubernetes" and pool["replicas"] == []
    assert set(pool["kubernetes"]) == {
        "namespace",
        "label_selector",
        "http_port",
        "events_port",
        "replay_port",
        "drain_timeout_s",
        "api_server",
    }  # the discovery config of the issue-15 contract, every field spelt out


def test_config_map_toml_parses_with_the_router_loader(overlay: list[dict[str, Any]]) -> None:
    from router.config import parse_config
    from router.server.app import check_startup

    text = _router_toml(overlay)
    config = parse_config(text, source="ConfigMap router.toml", overrides={"server": {}})
    assert config.pools[0].model == "Qwen/Qwen3-8B"
    with pytest.raises(Exception, match="without a token"):
        check_startup(config)  # 0.0.0.0 and no token: refused, as the Secret must supply it
    check_startup(parse_config(text, overrides={"server": {"admin_token": "from-the-secret"}}))


# --------------------------------------------------------------------------- vLLM example


def _vllm(overlay: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = _one(overlay, "Deployment", "vllm-qwen3-8b")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, c


def _flags(args: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in args:
        if a.startswith("--"):
            key, _, value = a.partition("=")
            out[key] = value
    return out


def test_vllm_example_has_the_flags_and_annotations_the_router_needs(
    overlay: list[dict[str, Any]],
) -> None:
    import tomllib

    data = tomllib.loads(_router_toml(overlay))
    (pool,) = data["pools"]
    k8s = pool["kubernetes"]
    dep, c = _vllm(overlay)
    pod = dep["spec"]["template"]["metadata"]
    # The router's label selector picks these pods.
    selector = dict(pair.split("=", 1) for pair in k8s["label_selector"].split(","))
    assert selector.items() <= pod["labels"].items()
    # Same namespace as the routers: discovery watches its own namespace ("").
    assert k8s["namespace"] == ""
    assert (
        dep["metadata"]["namespace"]
        == _one(overlay, "Deployment", "kvrouter")["metadata"]["namespace"]
    )
    ann = pod["annotations"]
    flags = _flags(c["args"])
    assert int(ann["kvrouter.io/http-port"]) == k8s["http_port"] == int(flags["--port"])
    events = json.loads(flags["--kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # "*" in the endpoint makes vLLM bind, so every router connects to it.
    assert events["endpoint"] == f"tcp://*:{k8s['events_port']}"
    assert events["replay_endpoint"] == f"tcp://*:{k8s['replay_port']}"
    assert int(ann["kvrouter.io/events-port"]) == k8s["events_port"]
    assert int(ann["kvrouter.io/replay-port"]) == k8s["replay_port"]
    assert [int(r) for r in ann["kvrouter.io/dp-ranks"].split(",")] == [0]
    assert "--enable-prompt-tokens-details" in flags
    assert "--enable-prefix-caching" in flags
    assert flags["--prefix-caching-hash-algo"] == pool["layout"]["hash"]["algo"]
    assert flags["--served-model-name"] == pool["model"]
    seed = pool["layout"]["hash"].get("pythonhashseed")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    assert env.get("PYTHONHASHSEED") == seed  # both unset, or the same value
    ports = {p["containerPort"] for p in c["ports"]}
    assert {k8s["http_port"], k8s["events_port"], k8s["replay_port"]} <= ports


@pytest.fixture
def _no_kubectl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    yield


def test_render_without_kubectl_skips_locally(
    _no_kubectl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without kubectl the render step says why (and fails in CI instead of passing)."""
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="kubectl kustomize"):
        _kustomize(BASE)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="kubectl"):
        _kustomize(BASE)
