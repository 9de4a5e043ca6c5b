"""A Kubernetes API for discovery's tests: kmock (a Kubernetes API mock, real HTTP) serving
one namespace's EndpointSlices and pods the way an apiserver does where Baton relies on it:
a list carries a resourceVersion, a watch from one replays the events after it and then
streams live, with BOOKMARKs while quiet, a label selector filters, and a version older than
the kept history is answered 410 Gone. It runs on a thread of its own (the test's thread
blocks on processes); the test pulls its levers from its own thread: change objects, expire
the history (the watches get 410), drop every open watch connection, hold new watches."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import kmock

SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
PODS = "/api/v1/namespaces/{ns}/pods"
SERVICE_LABEL = "kubernetes.io/service-name"
BOOKMARK_S = 0.5  # a quiet watch gets a bookmark this often


class Cluster:
    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.rv = 100
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}  # (resource, name) -> object
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (rv, resource, event)
        self.oldest = 0  # a watch from before this version is answered 410
        self.lists = 0  # list requests served
        self.watches = 0  # watch requests served
        self._open: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._held = asyncio.Event()
        self._held.set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- life -----------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self._thread.start()
        self.call(self._serve_start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._serve_stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve_start(self) -> None:
        self._handler = kmock.RawHandler()
        await self._handler.__aenter__()
        self._server = kmock.Server(self._handler)
        await self._server.__aenter__()
        ns = self.namespace
        self._handler["get " + SLICES.format(ns=ns)] << (lambda r: self._serve(r, "slices"))
        self._handler["get " + PODS.format(ns=ns)] << (lambda r: self._serve(r, "pods"))
        self.url = f"http://127.0.0.1:{self._server.port}"

    async def _serve_stop(self) -> None:
        self._drop_all()
        await self._server.__aexit__(None, None, None)
        await self._handler.__aexit__(None, None, None)

    # -- levers (from the test's thread) --------------------------------------------------

    def put(self, resource: str, obj: dict[str, Any], *, quietly: bool = False) -> None:
        """Create or replace an object; `quietly`: no watch hears of it (as if its event
        fell out of a compacted history; only a re-list finds it)."""
        self._loop.call_soon_threadsafe(self._change, resource, obj, False, quietly)

    def delete(self, resource: str, name: str, *, quietly: bool = False) -> None:
        obj = {"metadata": {"name": name}}
        self._loop.call_soon_threadsafe(self._change, resource, obj, True, quietly)

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        async def read() -> dict[str, Any] | None:
            return copy.deepcopy(self.objects.get((resource, name)))

        return self.call(read())  # type: ignore[no-any-return]

    def expire(self) -> None:
        """The history is compacted up to now: open watches end with a 410 ERROR event, and
        a watch from any version seen so far is answered 410."""

        def go() -> None:
            self.oldest = self.rv + 1
            gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                    "status": "Failure", "code": 410, "reason": "Expired",
                    "message": "too old resource version"}}  # fmt: skip
            for q in list(self._open):
                q.put_nowait(gone)
                q.put_nowait(None)

        self._loop.call_soon_threadsafe(go)

    def drop(self, *, hold: bool = False) -> None:
        """Every open watch connection is cut (no clean end of the stream); with `hold`,
        new watches wait until `release()`."""

        def go() -> None:
            if hold:
                self._held.clear()
            self._drop_all()

        self._loop.call_soon_threadsafe(go)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._held.set)

    @property
    def watching(self) -> int:
        async def count() -> int:
            return len(self._open)

        return self.call(count())  # type: ignore[no-any-return]

    # -- the API --------------------------------------------------------------------------

    def _change(self, resource: str, obj: dict[str, Any], deleted: bool, quietly: bool) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        key = (resource, obj["metadata"]["name"])
        kind = "DELETED" if deleted else "MODIFIED" if key in self.objects else "ADDED"
        if deleted:  # the event carries the object as it was, at the new version
            old = self.objects.pop(key, obj)
            obj = {**old, "metadata": {**old["metadata"], "resourceVersion": str(self.rv)}}
        else:
            self.objects[key] = obj
        event = {"type": kind, "object": obj}
        if quietly:
            self.oldest = self.rv + 1  # its event is lost to any watch
            return
        self.history.append((self.rv, resource, event))
        for q in list(self._open):
            if getattr(q, "resource", None) == resource:
                q.put_nowait(event)

    def _serve(self, req: kmock.Request, resource: str) -> object:
        selector = req.params.get("labelSelector", "")
        if req.params.get("watch") in ("true", "1", "True"):
            return self._watch(req, resource, selector)
        self.lists += 1
        items = [o for (r, _), o in self.objects.items() if r == resource and _selects(selector, o)]
        return {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                "items": items}  # fmt: skip

    async def _watch(self, req: kmock.Request, resource: str, selector: str) -> AsyncIterator[Any]:
        await self._held.wait()
        self.watches += 1
        yield b""  # the headers go out now, as an apiserver's do
        since = int(req.params.get("resourceVersion") or 0)
        if since < self.oldest:
            yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                               "message": "too old resource version"}}  # fmt: skip
            return
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        q.resource = resource  # type: ignore[attr-defined]
        q.request = req  # type: ignore[attr-defined]
        self._open.add(q)
        try:
            for rv, r, event in self.history:
                if rv > since and r == resource and _selects(selector, event["object"]):
                    yield event
            bookmarks = req.params.get("allowWatchBookmarks") in ("true", "1", "True")
            while True:
                try:
                    event = await asyncio.wait_for(q.get(), BOOKMARK_S)
                except TimeoutError:
                    if bookmarks:
                        mark = {"kind": "EndpointSlice",
                                "metadata": {"resourceVersion": str(self.rv)}}  # fmt: skip
                        yield {"type": "BOOKMARK", "object": mark}
                    continue
                if event is None:
                    return
                if _selects(selector, event["object"]):
                    yield event
        finally:
            self._open.discard(q)

    def _drop_all(self) -> None:
        for q in list(self._open):
            raw = getattr(q, "request")._raw_request  # noqa: B009 - kmock keeps it private
            if raw is not None and raw.transport is not None:
                raw.transport.abort()
            self._open.discard(q)


def _selects(selector: str, obj: dict[str, Any]) -> bool:
    """Equality-based label selectors (a=b,c=d), what discovery sends."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


# -- objects ------------------------------------------------------------------------------


def endpoint_slice(name: str, service: str, host: str, port: int, pod: str, *,
                   ready: bool = True, terminating: bool = False,
                   annotations: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One pod's endpoint in a slice of its own (pods whose named port resolves to different
    numbers get different slices, as here: every sim has its own port)."""
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "labels": {SERVICE_LABEL: service},
                     "annotations": annotations or {}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [host], "targetRef": {"kind": "Pod", "name": pod},
                       "conditions": {"ready": ready and not terminating, "serving": ready,
                                      "terminating": terminating}}],
    }  # fmt: skip


def pod(name: str, labels: dict[str, str], host: str, port: int, *, ready: bool = True,
        deleting: bool = False, annotations: dict[str, str] | None = None,
        ) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "labels": labels, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "kind": "Pod", "apiVersion": "v1", "metadata": meta,
        "spec": {"containers": [{"name": "engine",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": host,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


