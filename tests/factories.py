"""Builders the tests share: one definition each, so a change to a type (a new Backend field,
a renamed module) is made here once instead of in every file that used to copy it.

Heavy or unrelated libraries (the OpenAI SDK, the sim's flag parser) are imported inside the
builder that needs them, so a unit test that only builds snapshots does not pay for them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from baton.model import Backend, BackendId, BackendStatus, Health, HealthState, Role
from control.backend_spec import make_backend
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.router import Router
from dataplane.request import ClientRequest, Endpoint

if TYPE_CHECKING:
    import openai

    from sim.config import SimConfig
    from sim.model import ToyModel

MODEL = "m"  # the model every hand-made fleet here serves

# -- control's fleet ------------------------------------------------------------------------


def backend(bid: str, role: Role = Role.SERVE, model: str = MODEL) -> Backend:
    """A backend no test ever connects to (port 1), named by its id."""
    return Backend(BackendId(bid), f"http://127.0.0.1:1/{bid}", model, role=role)


def status(
    bid: str, state: HealthState = HealthState.HEALTHY, model: str = MODEL, role: Role = Role.SERVE
) -> BackendStatus:
    """A backend as a snapshot shows it: `state` since time 0, no reason."""
    return BackendStatus(backend(bid, role, model), Health(state, "", 0.0))


def registry(ids: Iterable[str]) -> Registry:
    """A registry of healthy backends of model "m", one port each (127.0.0.1:1, :2...), whose
    clock stands still at 1.0."""
    return Registry(
        [make_backend(b, f"http://127.0.0.1:{i + 1}", MODEL) for i, b in enumerate(ids)],
        clock=lambda: 1.0,
    )


def router(ids: Iterable[str], policy: str = "adaptive") -> tuple[Router, Registry]:
    """A router over registry(ids): seeded, its clock standing still at 1.0."""
    reg = registry(ids)
    return Router(reg, make_policy(policy), clock=lambda: 1.0), reg


# -- the shim ---------------------------------------------------------------------------------


def client_request(endpoint: Endpoint = Endpoint.CHAT, **extra: object) -> ClientRequest:
    """A validated streaming, greedy request of model "m": one user message "x" (chat) or the
    prompt "x" (completions), unless `extra` gives its own; `extra` joins the body."""
    body: dict[str, object] = {"model": MODEL, "stream": True, **extra}
    body.setdefault(
        "messages" if endpoint is Endpoint.CHAT else "prompt",
        [{"role": "user", "content": "x"}] if endpoint is Endpoint.CHAT else "x",
    )
    return ClientRequest(endpoint, body, MODEL, True, True)


def sdk(base_url: str, timeout: float = 60) -> openai.OpenAI:
    """An OpenAI client that never retries on its own: a test sees every failure."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)


# -- the simulated engine ------------------------------------------------------------------


def sim_config(*argv: str) -> SimConfig:
    """The sim's config as `python -m sim ARGV` builds it."""
    import argparse

    from sim.__main__ import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def greedy(
    model: ToyModel, prompt: list[int], n: int, *, ignore_eos: bool = False, min_tokens: int = 0
) -> list[int]:
    """The sim's greedy generation of up to n tokens after `prompt` (Sequence.run_to_end)."""
    from sim.generation import Sequence
    from sim.protocol import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=ignore_eos, min_tokens=min_tokens)
    seq = Sequence(model, prompt, params)
    seq.run_to_end()
    return seq.token_ids
