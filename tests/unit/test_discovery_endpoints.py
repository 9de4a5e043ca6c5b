"""What a discovery source sees, as endpoints (control/discovery/endpoints.py), and its
[discovery] table checked at load (control/discovery/settings.py)."""

from __future__ import annotations

from typing import Any

import pytest

from baton.model import BackendKind
from control.config import parse
from control.discovery.endpoints import Phase, backend_for, from_pods, from_records, from_slices
from control.discovery.settings import DnsSource, Engine, KubeSource
from control.exceptions import ConfigError

SVC = KubeSource("llm", service="vllm", port="http")


def endpoint(pod: str, ip: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": conditions,
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "llm"}}  # fmt: skip


def eslice(name: str, *endpoints: dict[str, Any],
           notes: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    return {"metadata": {"name": name, "annotations": notes or {}}, "addressType": "IPv4",
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
            "endpoints": list(endpoints)}  # fmt: skip


def test_slices_give_each_pod_once_at_its_phase() -> None:
    seen = from_slices([
        eslice("a", endpoint("p0", "10.0.0.1", ready=True), endpoint("p1", "10.0.0.2"),
               endpoint("p2", "10.0.0.3", ready=False)),
        # During a rollout a pod may be listed in two slices: the later phase wins.
        eslice("b", endpoint("p3", "10.0.0.4", ready=False, serving=True, terminating=True),
               endpoint("p0", "10.0.0.1", ready=False, terminating=True)),
    ], SVC)  # fmt: skip
    assert {k: (e.url, e.phase) for k, e in seen.items()} == {
        "llm/p0": ("http://10.0.0.1:8000", Phase.TERMINATING),
        "llm/p1": ("http://10.0.0.2:8000", Phase.READY),  # an unset `ready` means ready
        "llm/p2": ("http://10.0.0.3:8000", Phase.NOT_READY),
        "llm/p3": ("http://10.0.0.4:8000", Phase.TERMINATING),
    }


def test_a_slice_without_the_named_port_names_no_endpoint() -> None:
    s = eslice("a", endpoint("p0", "10.0.0.1"))
    s["ports"] = [{"name": "grpc", "port": 50051}]
    assert from_slices([s], SVC) == {}
    assert from_slices([s], KubeSource("llm", service="vllm", port=8001))["llm/p0"].port == 8001


def pod(name: str, ip: str | None, ready: bool = True, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **meta},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": str(ready)}]}}  # fmt: skip


def test_pods_by_selector() -> None:
    src = KubeSource("llm", selector="app=vllm", port="http")
    seen = from_pods([
        pod("a", "10.0.0.1", annotations={"baton.dev/model": "llama", "other": "x"}),
        pod("b", "10.0.0.2", ready=False),
        pod("c", "10.0.0.3", deletionTimestamp="2026-01-01T00:00:00Z"),
        pod("d", None),  # not scheduled yet
    ], src)  # fmt: skip
    assert {k: e.phase for k, e in seen.items()} == {
        "llm/a": Phase.READY, "llm/b": Phase.NOT_READY, "llm/c": Phase.TERMINATING}  # fmt: skip
    assert seen["llm/a"].annotations == (("baton.dev/model", "llama"),)


def test_annotations_make_the_backend_over_the_sources_defaults() -> None:
    notes = {"baton.dev/kind": "sglang", "baton.dev/kv-events-port": "5557",
             "baton.dev/tool-parser": "hermes"}  # fmt: skip
    e = from_slices([eslice("a", endpoint("p0", "10.0.0.1"), notes=notes)], SVC)["llm/p0"]
    b = backend_for(e, "m", Engine(reasoning_parser="deepseek_r1"))
    assert (b.id, b.url, b.kind, b.kv_events, b.tool_parser, b.reasoning_parser) == (
        "llm/p0", "http://10.0.0.1:8000", BackendKind.SGLANG, "tcp://10.0.0.1:5557", "hermes",
        "deepseek_r1")  # fmt: skip
    bad = from_slices([eslice("a", endpoint("p0", "10.0.0.1"),
                              notes={"baton.dev/kind": "tgi"})], SVC)["llm/p0"]  # fmt: skip
    with pytest.raises(ConfigError, match="kind must be one of"):
        backend_for(bad, "m", Engine())


def test_dns_records_are_ready_endpoints() -> None:
    seen = from_records("e.local", [("10.0.0.1", 8000), ("fd00::1", 8000)])
    assert sorted(e.url for e in seen.values()) == ["http://10.0.0.1:8000", "http://[fd00::1]:8000"]
    assert "e.local/[fd00::1]:8000" in seen


def test_discovery_config() -> None:
    cfg = parse({"discovery": {
        "kubernetes": [{"namespace": "llm", "service": "vllm", "port": "http",
                        "api": "http://127.0.0.1:1/", "model": "llama"}],
        "dns": [{"name": "_http._tcp.vllm.llm.svc.", "record": "SRV", "interval": 2,
                 "nameserver": "127.0.0.1:5353"}],
    }})  # fmt: skip
    kube, dns = cfg.discovery.sources
    assert kube == KubeSource("llm", "vllm", "", "http", "http://127.0.0.1:1", Engine("llama"))
    assert isinstance(dns, DnsSource) and dns.name == "_http._tcp.vllm.llm.svc"
    assert (kube.name, dns.source) == ("k8s:llm/vllm", "dns:_http._tcp.vllm.llm.svc")


@pytest.mark.parametrize(("table", "error"), [
    ({"kubernetes": {"namespace": "llm"}}, "array of tables"),
    ({"kubernetes": [{"namespace": "llm"}]}, "give service .* or selector"),
    ({"kubernetes": [{"namespace": "llm", "service": "a", "selector": "b=c"}]}, "one of the two"),
    ({"kubernetes": [{"namespace": "LLM", "service": "a"}]}, "namespace must be"),
    ({"kubernetes": [{"namespace": "llm", "service": "a", "port": 0}]}, "port must be"),
    ({"kubernetes": [{"namespace": "llm", "service": "a", "api": "127.0.0.1"}]}, "api must"),
    ({"kubernetes": [{"namespace": "llm", "service": "a", "kind": "tgi"}]}, "kind must"),
    ({"kubernetes": [{"namespace": "llm", "service": "a", "colour": 1}]}, "unknown keys"),
    ({"dns": [{"name": "e.local"}]}, "port .* is needed"),
    ({"dns": [{"name": "e.local", "record": "SRV", "port": 80}]}, "carries its port"),
    ({"dns": [{"name": "e.local", "record": "MX", "port": 80}]}, "A, AAAA or SRV"),
    ({"dns": [{"name": "e.local", "port": 80, "interval": 0}]}, "interval"),
    ({"dns": [{"name": "e.local", "port": 80, "nameserver": "localhost"}]}, "HOST:PORT"),
    ({"dns": [{"name": "e local", "port": 80}]}, "DNS name"),
    ({"dns": [{"name": "e.local", "port": 80}, {"name": "e.local", "port": 80}]}, "twice"),
    ({"consul": []}, "unknown keys"),
])  # fmt: skip
def test_bad_discovery_config_is_refused_by_name(table: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse({"discovery": table})
