"""A DNS source's plumbing: a name's A, AAAA or SRV records (a headless Service, Consul,
Nomad), resolved every `interval` seconds. A name that resolves to nothing (NXDOMAIN, no
answer) has no engines now; a resolver that does not answer says nothing, and the last
answer stands, so a DNS outage never empties the fleet."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import dns.asyncresolver
import dns.exception
import dns.resolver

from control.discovery.settings import DnsSource

log = logging.getLogger("baton.control.discovery")

Found = Callable[[list[tuple[str, int]]], None]
EMPTY = (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer)


def resolver_for(source: DnsSource) -> dns.asyncresolver.Resolver:
    if not source.nameserver:
        return dns.asyncresolver.Resolver()  # /etc/resolv.conf, as the pod's own lookups
    r = dns.asyncresolver.Resolver(configure=False)
    host, _, port = source.nameserver.rpartition(":")
    r.nameservers = [host.strip("[]")]
    r.port = int(port)
    return r


async def resolve(source: DnsSource, r: dns.asyncresolver.Resolver) -> list[tuple[str, int]]:
    """(address, port) of every engine the name lists now."""
    lifetime = min(max(source.interval, 1.0), 5.0)
    try:
        if source.record != "SRV":
            answer = await r.resolve(source.name, source.record, lifetime=lifetime)
            return sorted((rr.address, source.port) for rr in answer)
        srv = await r.resolve(source.name, "SRV", lifetime=lifetime)
    except EMPTY:
        return []
    out: list[tuple[str, int]] = []
    for rr in srv:
        target = rr.target.to_text().rstrip(".")
        for kind in ("A", "AAAA"):
            try:
                answer = await r.resolve(target, kind, lifetime=lifetime)
            except EMPTY:
                continue
            out += [(a.address, rr.port) for a in answer]
    return sorted(set(out))


async def watch(source: DnsSource, found: Found) -> None:
    r = resolver_for(source)
    while True:
        try:
            found(await resolve(source, r))
        except (dns.exception.DNSException, OSError) as exc:
            log.warning("dns:%s: %s; keeping the last answer", source.name, exc)
        await asyncio.sleep(source.interval)
