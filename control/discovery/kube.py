"""A Kubernetes source's plumbing: the EndpointSlices of a Service, or pods by selector, kept
current as client-go's reflector keeps them.

List, then watch from the list's resourceVersion with bookmarks (so a quiet watch still
moves its resourceVersion on). A watch the server ends (its timeoutSeconds) is resumed from
the last resourceVersion seen; a 410 Gone (that version is compacted away) lists again; a
connection lost or refused is retried from the last resourceVersion after a jittered
exponential backoff, and a version the server no longer has answers 410, so lists again.
After every change the whole current set goes to `seen`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from random import Random
from typing import Any, cast

import aiohttp
from kubernetes_asyncio import client, config

from control.discovery.settings import KubeSource

log = logging.getLogger("baton.control.discovery")

Seen = Callable[[list[Mapping[str, Any]]], None]
SERVICE_LABEL = "kubernetes.io/service-name"
# client-go's reflector: a watch asks the server to end it after 5 to 10 minutes (spread,
# so that many clients do not re-watch at once); its backoff runs from 0.8 s to 30 s.
WATCH_MIN_S = 300
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.8, 30.0


class Gone(Exception):
    """410: the resourceVersion asked for is older than the server keeps. List again."""


class ApiError(Exception):
    """The apiserver answered an error, or something that is not its API."""


def retry_delay(failures: int, rng: Random) -> float:
    """Seconds before the next try after `failures` failures in a row (jittered, capped)."""
    base = min(BACKOFF_FIRST_S * 2 ** max(failures - 1, 0), BACKOFF_MAX_S)
    return float(base * rng.uniform(0.5, 1.0))


async def api_client(api: str) -> client.ApiClient:
    """`api` when given (a test's mock, `kubectl proxy`); else the pod's service account;
    else the kubeconfig (KUBECONFIG, ~/.kube/config), as kubectl finds it."""
    cfg = client.Configuration()
    if api:
        cfg.host = api
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(configuration=cfg)


class Reflector:
    def __init__(self, source: KubeSource, seen: Seen, rng: Random) -> None:
        self._source = source
        self._seen = seen
        self._rng = rng
        self._objects: dict[str, Mapping[str, Any]] = {}
        self.lists = 0  # how many times it listed (a test waits on a re-list)

    async def run(self) -> None:
        api = await api_client(self._source.api)
        rv, failures = "", 0
        try:
            while True:
                try:
                    if not rv:
                        rv = await self._list(api)
                    rv = await self._watch(api, rv)
                    failures = 0
                except Gone:
                    log.info("%s: resourceVersion %s is gone; listing again", self.name, rv)
                    rv = ""
                except (aiohttp.ClientError, TimeoutError, ApiError, ValueError) as exc:
                    failures += 1
                    delay = retry_delay(failures, self._rng)
                    what = "watch" if rv else "list"
                    log.warning("%s: %s: %s; again in %.1f s", self.name, what,
                                exc or type(exc).__name__, delay)  # fmt: skip
                    await asyncio.sleep(delay)
        finally:
            await api.close()

    @property
    def name(self) -> str:
        return self._source.name

    async def _call(self, api: client.ApiClient, **kwargs: Any) -> aiohttp.ClientResponse:
        s = self._source
        call: Callable[..., Awaitable[Any]]
        if s.service:
            call = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice
            selector = f"{SERVICE_LABEL}={s.service}"
        else:
            call = client.CoreV1Api(api).list_namespaced_pod
            selector = s.selector
        # The raw response: the objects are read as the API's JSON, not as generated models.
        raw = await call(s.namespace, label_selector=selector, _preload_content=False, **kwargs)
        resp = cast(aiohttp.ClientResponse, raw)
        if resp.status == 410:
            resp.release()
            raise Gone
        if resp.status != 200:
            text = (await resp.text())[:300]
            resp.release()
            raise ApiError(f"HTTP {resp.status}: {text}")
        return resp

    async def _list(self, api: client.ApiClient) -> str:
        resp = await self._call(api, _request_timeout=aiohttp.ClientTimeout(total=60))
        try:
            body = json.loads(await resp.read())
        finally:
            resp.release()
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            raise ApiError("a list without a resourceVersion")
        self._objects = {_name(o): o for o in body.get("items") or []}
        self.lists += 1
        self._seen(list(self._objects.values()))
        return rv

    async def _watch(self, api: client.ApiClient, rv: str) -> str:
        """Until the server ends the watch; returns the last resourceVersion seen."""
        seconds = self._rng.randint(WATCH_MIN_S, 2 * WATCH_MIN_S)
        # A connection that goes silent (a node gone, no FIN) is noticed as no byte for longer
        # than the server would have let the watch run.
        timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=seconds + 30)
        resp = await self._call(api, watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                timeout_seconds=seconds, _request_timeout=timeout)  # fmt: skip
        try:
            async for line in resp.content:
                if line.strip():
                    rv = self._event(json.loads(line), rv)
        finally:
            resp.release()
        return rv

    def _event(self, event: Mapping[str, Any], rv: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone
            raise ApiError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
        if kind in ("ADDED", "MODIFIED"):
            self._objects[_name(obj)] = obj
        elif kind == "DELETED":
            self._objects.pop(_name(obj), None)
        elif kind != "BOOKMARK":
            raise ApiError(f"a watch event of unknown type {kind!r}")
        new = (obj.get("metadata") or {}).get("resourceVersion")
        if kind != "BOOKMARK":
            self._seen(list(self._objects.values()))
        return new if isinstance(new, str) and new else rv


def _name(obj: Mapping[str, Any]) -> str:
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str):
        raise ApiError("an object without metadata.name")
    return name
