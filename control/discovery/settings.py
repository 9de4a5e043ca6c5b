"""[discovery]: where control finds engines by itself, checked at load (a bad table is a
ConfigError that names it).

    [[discovery.kubernetes]]
    namespace = "llm"
    service = "vllm"            # its EndpointSlices; or selector = "app=vllm" for pods
    port = "http"               # a port's name on the endpoints or pods, or a number
    api = ""                    # the apiserver; "" = in-cluster, else ~/.kube/config

    [[discovery.dns]]
    name = "vllm.llm.svc.cluster.local"
    record = "A"                # A, AAAA or SRV
    port = 8000                 # A and AAAA only: SRV records carry their port
    interval = 5.0              # seconds between resolutions
    nameserver = ""             # "HOST:PORT"; "" = the system's resolver

Either kind may also set what every engine it finds has unless its annotations say
otherwise: model (else the engine's /v1/models), kind, reasoning_parser, tool_parser."""

# baton: pure

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from baton.model import BackendKind
from control.exceptions import ConfigError

# A DNS-1123 label, as Kubernetes names namespaces and Services.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # IANA_SVC_NAME, 15 chars
_HOSTPORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})")
_DNS_NAME = re.compile(r"(_?[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?\.)*"
                       r"_?[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?\.?")  # fmt: skip
ENGINE_KEYS = ("model", "kind", "reasoning_parser", "tool_parser")


@dataclass(frozen=True, slots=True)
class Engine:
    """What a source's engines have unless their annotations say otherwise ("" = unsaid)."""

    model: str = ""  # "": ask the engine (/v1/models)
    kind: str = BackendKind.VLLM.value
    reasoning_parser: str = ""
    tool_parser: str = ""


@dataclass(frozen=True, slots=True)
class KubeSource:
    namespace: str
    service: str = ""  # watch its EndpointSlices (label kubernetes.io/service-name)...
    selector: str = ""  # ...or pods by this label selector
    port: int | str = 8000  # the engine's HTTP port: a number or a port's name
    api: str = ""  # the apiserver's URL; "" = in-cluster config, else the kubeconfig
    engine: Engine = field(default_factory=Engine)

    @property
    def name(self) -> str:
        """The backends' `source`: k8s:NAMESPACE/SERVICE or k8s:NAMESPACE/SELECTOR."""
        return f"k8s:{self.namespace}/{self.service or self.selector}"


@dataclass(frozen=True, slots=True)
class DnsSource:
    name: str
    record: str = "A"  # A, AAAA or SRV
    port: int = 0  # A and AAAA: the engines' port
    interval: float = 5.0
    nameserver: str = ""  # HOST:PORT; "" = the system's resolver
    engine: Engine = field(default_factory=Engine)

    @property
    def source(self) -> str:
        return f"dns:{self.name}"


Source = KubeSource | DnsSource


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    sources: tuple[Source, ...] = ()
    model_timeout: float = 2.0  # seconds to wait for an engine's /v1/models


def source_name(source: Source) -> str:
    return source.name if isinstance(source, KubeSource) else source.source


def parse(raw: object) -> DiscoverySettings:
    if not isinstance(raw, dict):
        raise ConfigError("[discovery] must be a table")
    unknown = set(raw) - {"kubernetes", "dns", "model_timeout"}
    if unknown:
        raise ConfigError(f"[discovery]: unknown keys {sorted(unknown)} (sources go in "
                          "[[discovery.kubernetes]] and [[discovery.dns]])")  # fmt: skip
    timeout = raw.get("model_timeout", 2.0)
    if not _number(timeout) or timeout <= 0:
        raise ConfigError("[discovery] model_timeout must be a number of seconds > 0")
    sources: list[Source] = []
    for key, one in (("kubernetes", _kube), ("dns", _dns)):
        tables = raw.get(key, [])
        if not isinstance(tables, list):
            raise ConfigError(f"discovery.{key} must be an array of tables ([[discovery.{key}]])")
        for i, t in enumerate(tables):
            where = f"discovery.{key}[{i}]"
            if not isinstance(t, dict):
                raise ConfigError(f"{where} must be a table")
            sources.append(one(t, where))
    names = [source_name(s) for s in sources]
    if len(names) != len(set(names)):
        raise ConfigError("[discovery]: a source is listed twice")
    return DiscoverySettings(tuple(sources), float(timeout))


def _kube(t: dict[str, Any], where: str) -> KubeSource:
    _known(t, {"namespace", "service", "selector", "port", "api", *ENGINE_KEYS}, where)
    ns = t.get("namespace")
    if not isinstance(ns, str) or not _NAME.fullmatch(ns):
        raise ConfigError(f"{where}: namespace must be a Kubernetes namespace name, got {ns!r}")
    service, selector = t.get("service", ""), t.get("selector", "")
    if not isinstance(service, str) or not isinstance(selector, str):
        raise ConfigError(f"{where}: service and selector are strings")
    if bool(service) == bool(selector):
        raise ConfigError(f"{where}: give service (its EndpointSlices are watched) or "
                          "selector (pods are watched), one of the two")  # fmt: skip
    if service and not _NAME.fullmatch(service):
        raise ConfigError(f"{where}: service must be a Service's name, got {service!r}")
    port = t.get("port", 8000)
    if isinstance(port, str):
        if not _PORT_NAME.fullmatch(port):
            raise ConfigError(f"{where}: port must be a number or a port's name, got {port!r}")
    elif not _port(port):
        raise ConfigError(f"{where}: port must be in 1..65535 or a port's name, got {port!r}")
    api = t.get("api", "")
    if not isinstance(api, str) or (api and not re.fullmatch(r"https?://\S+", api)):
        raise ConfigError(f"{where}: api must be the apiserver's http(s):// URL, got {api!r}")
    return KubeSource(ns, service, selector, port, api.rstrip("/"), _engine(t, where))


def _dns(t: dict[str, Any], where: str) -> DnsSource:
    _known(t, {"name", "record", "port", "interval", "nameserver", *ENGINE_KEYS}, where)
    name = t.get("name")
    if not isinstance(name, str) or not _DNS_NAME.fullmatch(name):
        raise ConfigError(f"{where}: name must be a DNS name, got {name!r}")
    record = t.get("record", "A")
    if record not in ("A", "AAAA", "SRV"):
        raise ConfigError(f"{where}: record must be A, AAAA or SRV, got {record!r}")
    port = t.get("port", 0)
    if record == "SRV" and port:
        raise ConfigError(f"{where}: an SRV record carries its port; leave port out")
    if record != "SRV" and not _port(port):
        raise ConfigError(f"{where}: port (1..65535) is needed with {record} records")
    interval = t.get("interval", 5.0)
    if not _number(interval) or interval < 0.1:
        raise ConfigError(f"{where}: interval must be a number of seconds >= 0.1")
    ns = t.get("nameserver", "")
    hp = _HOSTPORT.fullmatch(ns) if isinstance(ns, str) else None
    if ns and (hp is None or not _port(int(hp[2]))):
        raise ConfigError(f"{where}: nameserver must be HOST:PORT, got {ns!r}")
    return DnsSource(name.rstrip("."), record, port, float(interval), ns, _engine(t, where))


def _engine(t: dict[str, Any], where: str) -> Engine:
    values = {k: t[k] for k in ENGINE_KEYS if k in t}
    for k, v in values.items():
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{where}: {k} must be a non-empty string")
    kind = values.get("kind", BackendKind.VLLM.value)
    if kind not in BackendKind._value2member_map_:
        raise ConfigError(f"{where}: kind must be one of {', '.join(BackendKind)}, got {kind!r}")
    return Engine(**values)


def _known(t: dict[str, Any], keys: set[str], where: str) -> None:
    unknown = set(t) - keys
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _port(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536
