"""`baton shim --control HOST:PORT[,HOST:PORT...] --listen HOST:PORT [--workers N]`"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from baton import aio
from baton.model import SeamMode
from baton.replicas import split_targets
from baton.tokens import SHIM_ENV, SHIM_FILE_ENV, TokenError, shim_token
from dataplane.edge import workers
from dataplane.edge.app import make_app
from dataplane.edge.frontdoor import Door
from dataplane.edge.handlers import HEALTH
from dataplane.edge.lifecycle import INFLIGHT, Stopping
from dataplane.edge.limits import API_KEYS_ENV, load_keys
from dataplane.exceptions import ControlRefused
from dataplane.settings import (
    Limits,
    ProxySettings,
    ResumeSettings,
    RetryBudget,
    ShimSettings,
    SpecSettings,
    Timeouts,
)

log = logging.getLogger("baton.shim")


DEFAULTS = Limits()
CONTROL_TLS_CA_ENV = "BATON_CONTROL_TLS_CA"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control",
        default="127.0.0.1:50051",
        help="control plane HOST:PORT; control replicas as HOST:PORT,HOST:PORT,... (the shim "
        "routes through the one that leads, and follows the lead when it moves)",
    )
    parser.add_argument(
        "--control-tls-ca",
        default=os.environ.get(CONTROL_TLS_CA_ENV) or None,
        metavar="PEM",
        help=f"CA of control's certificate: talk TLS to control (env {CONTROL_TLS_CA_ENV})",
    )
    parser.add_argument(
        "--shim-token-file",
        default=os.environ.get(SHIM_FILE_ENV) or None,
        metavar="FILE",
        help=f"control's shim token, presented on every routing call (or env {SHIM_ENV}; "
        f"env {SHIM_FILE_ENV}); needed when control has one",
    )
    parser.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT for the OpenAI API")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="shim processes sharing the listen port (SO_REUSEPORT), each with its own "
        "stream to control; use up to one per core",
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="listen with SO_REUSEPORT (set by --workers for its processes)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM: stop accepting, let requests in flight finish for up to S seconds, "
        "then end the rest with an explicit error event (a second SIGTERM: at once)",
    )
    parser.add_argument(
        "--route-timeout",
        type=float,
        default=0.5,
        metavar="S",
        help="how long to wait for control's routing answer before routing from the last "
        "snapshot (degraded mode); an unreachable control is detected at once",
    )
    _add_limits(parser)
    parser.add_argument("--connect-timeout", type=float, default=3.0)
    parser.add_argument("--read-timeout", type=float, default=600.0)
    parser.add_argument(
        "--stream-buffer",
        type=int,
        default=64 * 1024,
        metavar="BYTES",
        help="what the kernel may buffer for one stream on each side (the client connection's "
        "send buffer, the engine connection's receive buffer) and aiohttp's read-ahead: "
        "how far an engine runs ahead of a client that stops reading; 0 = the kernel's "
        "autotuning (megabytes)",
    )
    parser.add_argument(
        "--client-write-timeout",
        type=float,
        default=60.0,
        help="seconds a write may wait for a client that reads nothing before its stream is "
        "ended (the engine then aborts the request); 0 = wait forever",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="backends tried per request before the first byte",
    )
    _add_resume(parser)
    spec = parser.add_argument_group("speculative pairs (docs/speculative.md)")
    spec.add_argument(
        "--spec-lookahead",
        action="store_true",
        help="the draft proposes a pair's next round while the target verifies this one "
        "(pays where the draft has its own device and the host's CPU to spare)",
    )
    spec.add_argument(
        "--spec-adaptive-k",
        action="store_true",
        help="each round drafts 1 .. 2 x the pair's k: two more after a proposal the target "
        "took whole, one fewer after one it cut",
    )
    parser.add_argument("--log-level", default="WARNING")


def _add_limits(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group("limits (each refusal is an OpenAI-shaped error)")
    limits.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger bodies get a 413"
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        default=DEFAULTS.max_header_bytes,
        help="request line + headers; larger heads get a 431",
    )
    limits.add_argument(
        "--max-messages",
        type=int,
        default=DEFAULTS.max_messages,
        help="chat messages per request; more get a 400",
    )
    limits.add_argument(
        "--max-streams",
        type=int,
        default=DEFAULTS.max_streams,
        help="generation requests in flight per shim (streamed or not); more get a 429 with "
        "Retry-After before their body is read, and /health/ready says 503",
    )
    limits.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="require `Authorization: Bearer <key>` with one of these keys (one a line; "
        f"default: ${API_KEYS_ENV}, comma-separated; neither = no keys required)",
    )


def _add_resume(parser: argparse.ArgumentParser) -> None:
    resume = parser.add_argument_group("mid-stream failover")
    resume.add_argument(
        "--seam-tokens",
        type=int,
        default=4,
        help="resume this many tokens early and check them (0 = off)",
    )
    resume.add_argument(
        "--seam-mode",
        choices=[m.value for m in SeamMode],
        default=SeamMode.PARALLEL.value,
        help="parallel: resume from the exact prefix and verify the overlap "
        "in a side request (no added gap); inline: resume m tokens early",
    )
    resume.add_argument(
        "--standby-connections",
        type=int,
        default=4,
        metavar="N",
        help="connections kept open to every routable backend for resumes, so a failover "
        "does not wait for a handshake (0 = none)",
    )
    resume.add_argument("--max-resumes", type=int, default=3, help="failovers per request")
    resume.add_argument("--max-resume-seconds", type=float, default=30.0)
    resume.add_argument(
        "--first-token-timeout",
        type=float,
        default=120.0,
        help="seconds without a first token before a stream counts as stalled",
    )
    resume.add_argument(
        "--inter-token-timeout",
        type=float,
        default=30.0,
        help="seconds between chunks before a stream counts as stalled",
    )


def _read_ca(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as pem:
            return pem.read()
    except OSError as exc:
        raise SystemExit(f"--control-tls-ca: {exc}") from None


def _shim_token(args: argparse.Namespace) -> str | None:
    try:
        return shim_token(args.shim_token_file)
    except TokenError as exc:
        raise SystemExit(str(exc)) from None


def settings_from(args: argparse.Namespace) -> ShimSettings:
    for flag in ("max_body_bytes", "max_header_bytes", "max_messages", "max_streams"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        keys = load_keys(args.api_keys_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--api-keys-file: {exc}") from None
    if args.standby_connections < 0:
        raise SystemExit("--standby-connections must not be negative")
    if args.stream_buffer < 0:
        raise SystemExit("--stream-buffer must not be negative")
    if args.route_timeout <= 0 or args.shutdown_grace < 0:
        raise SystemExit("--route-timeout must be positive and --shutdown-grace not negative")
    try:
        split_targets(args.control)
    except ValueError as exc:
        raise SystemExit(f"--control: {exc}") from None
    return ShimSettings(
        control=args.control,
        route_timeout=args.route_timeout,
        control_token=_shim_token(args),
        control_tls_ca=_read_ca(args.control_tls_ca),
        max_body_bytes=args.max_body_bytes,
        limits=Limits(
            max_header_bytes=args.max_header_bytes,
            max_messages=args.max_messages,
            max_streams=args.max_streams,
            key_digests=keys,
        ),
        proxy=ProxySettings(
            timeouts=Timeouts(connect=args.connect_timeout, read=args.read_timeout),
            budget=RetryBudget(max_attempts=args.max_attempts),
            client_write_timeout=args.client_write_timeout,
            spec=SpecSettings(lookahead=args.spec_lookahead, adaptive_k=args.spec_adaptive_k),
            resume=ResumeSettings(
                seam_tokens=args.seam_tokens,
                seam_mode=SeamMode(args.seam_mode),
                standby_connections=args.standby_connections,
                stream_buffer=args.stream_buffer,
                max_resumes=args.max_resumes,
                max_resume_seconds=args.max_resume_seconds,
                first_token_timeout=args.first_token_timeout,
                inter_token_timeout=args.inter_token_timeout,
            ),
        ),
    )


async def _serve(args: argparse.Namespace) -> int:
    host, _, port = args.listen.rpartition(":")
    settings = settings_from(args)
    app = make_app(settings)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream request and so frees the engine's slot at once. The parser's own limits are
    # a backstop above --max-header-bytes, so ordinary oversized heads get our JSON 431.
    line_limit = settings.limits.parser_line_limit
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        max_line_size=line_limit,
        max_field_size=line_limit,
        max_headers=max(128, settings.limits.max_header_bytes // 32),
    )
    listener = _listen(host or "127.0.0.1", int(port), args.reuse_port)
    bound = listener.getsockname()[1]
    stopping = Stopping()
    door = Door(listener, app[HEALTH].view, on_lost=stopping.signalled)
    await door.spawn()  # before runner.setup() opens the control channel (gRPC): see spawn
    try:
        await runner.setup()
    except ControlRefused as exc:
        log.error("%s", exc)
        await door.close()
        raise SystemExit(f"baton shim: {exc}") from None
    door.serve(runner.server)
    print(f"SHIM READY http://{host or '127.0.0.1'}:{bound}", flush=True)
    loop = asyncio.get_running_loop()
    if os.environ.get(workers.WORKER_ENV):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor forwards a SIGTERM
    else:
        loop.add_signal_handler(signal.SIGINT, stopping.signalled)
    loop.add_signal_handler(signal.SIGTERM, stopping.signalled)
    await stopping.stop.wait()
    try:
        await _drain(runner, app, args.shutdown_grace, stopping.hurry, door)
    finally:
        await door.close()  # new connections are refused from here on
    await runner.cleanup()
    return 0


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The shim's listening socket, as aiohttp's TCPSite would make it (the front door owns
    it rather than the event loop)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server(
        (host, port), family=family, backlog=1024, reuse_port=reuse_port
    )


async def _drain(
    runner: web.AppRunner, app: web.Application, grace: float, hurry: asyncio.Event, door: Door
) -> None:
    """Readiness says 503 at once (a load balancer stops sending work) while liveness stays
    200; a new request gets a 503 (handlers.request_limits); the requests in flight finish
    within `grace`, then the rest are ended explicitly (dataplane/edge/lifecycle.py)."""
    app[HEALTH].draining = True
    door.write()
    if runner.server is not None:
        runner.server.pre_shutdown()  # idle keep-alive connections close; busy ones after
    inflight = app[INFLIGHT]
    if len(inflight):
        log.warning("shutting down: %d requests in flight, grace %gs", len(inflight), grace)
    if not await inflight.wait_idle(grace, hurry):
        ended = await inflight.end_all()
        log.warning("shutdown grace over: ended %d requests with an error event", ended)


def run(args: argparse.Namespace) -> int:
    if args.control_tls_ca and not os.access(args.control_tls_ca, os.R_OK):
        raise SystemExit(f"--control-tls-ca: cannot read {args.control_tls_ca}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    if args.workers > 1:
        return workers.supervise(args.listen, args.workers, worker_argv(args), args.shutdown_grace)
    return aio.run(_serve(args))


def worker_argv(args: argparse.Namespace) -> list[str]:
    """This shim's flags for one of its worker processes: every flag that differs from its
    default, rebuilt from the parser, so a new flag needs no change here."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("workers", "listen", "reuse_port"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton shim")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
