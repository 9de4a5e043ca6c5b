"""bench/profile_stages.py: py-spy's raw stacks attributed to a request's stages."""

from __future__ import annotations

import pytest

from bench.profile_stages import CONTROL, LOOP, SHIM, attribute, per_request

TOP = "<module> (dataplane/__main__.py:1);run (baton/aio.py:17);Runner.run (asyncio/runners.py:118)"
HANDLER = f"{TOP};_completion (dataplane/edge/handlers.py:50);_route_and_serve (dataplane/edge/handlers.py:89)"  # noqa: E501


def test_each_sample_goes_to_the_most_specific_stage_of_its_stack() -> None:
    lines = [
        f"{HANDLER};Proxy._open (dataplane/edge/proxy.py:1);open_attempt (dataplane/upstream/engine.py:53);ClientSession._request (aiohttp/client.py:900);StreamWriter._writelines (aiohttp/http_writer.py:106) 7",  # noqa: E501
        f"{HANDLER};ControlLink.route (dataplane/link/control_link.py:166) 5",
        f"{TOP};RouteStream._writer (dataplane/link/routestream.py:111);_StreamRequestMixin.write (grpc/aio/_call.py:525) 3",  # noqa: E501
        f"{TOP};RequestHandler.start (aiohttp/web_protocol.py:610) 4",
        f"{TOP} 11",  # the loop in C
        "<module> (dataplane/__main__.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 50",
        "Thread.run (threading.py:1) 9",  # not the loop's thread
        "",
    ]
    assert attribute(lines, SHIM) == {
        "upstream client": 7,
        "route RPC, shim side": 8,
        "HTTP server + middleware": 4,
        LOOP: 11,
    }


def test_controls_decision_is_apart_from_its_grpc() -> None:
    top = "<module> (control/__main__.py:1);Runner.run (asyncio/runners.py:118)"
    lines = [
        f"{top};RoutingServicer.RouteStream (control/api/routing.py:77);RoutingServicer._route (control/api/routing.py:44);Router.route (control/routing/router.py:80) 6",  # noqa: E501
        f"{top};RoutingServicer.RouteStream (control/api/routing.py:77);route_response (baton/wire.py:210) 2",  # noqa: E501
        f"{top};RoutingServicer._route (control/api/routing.py:44);EventLog.record (control/audit/log.py:1);Router.route (control/routing/router.py:80) 1",  # noqa: E501
    ]
    assert attribute(lines, CONTROL) == {"decision (router, policy)": 6, "wire conversion": 2,
                                         "audit row": 1}  # fmt: skip


def test_the_measured_cpu_is_split_in_the_samples_proportions() -> None:
    split = per_request(attribute([f"{TOP} 3", f"{HANDLER} 1"], SHIM), 400.0)
    assert split == {LOOP: pytest.approx(300.0), "HTTP server + middleware": pytest.approx(100.0)}
    assert per_request(attribute([], SHIM), 400.0) == {}
