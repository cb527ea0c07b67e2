"""Checkpoint-aware routing policy, as plain code (no Ray): which replica gets a request.

A hybrid model's replica only saves prefill where it holds an *exact* recurrent checkpoint of a prefix of
the prompt, so the policy looks for exact keys (`publish.prefix_keys`), not text overlap: the request goes to
the replica with the deepest one, unless that replica is overloaded (its in-flight requests exceed the
least-loaded replica's by `imbalance`), then to the deepest holder that is not, else the least loaded.
No checkpoint anywhere: the least loaded, and among equally loaded replicas the one sent a request least
recently, so new conversations arriving one at a time take turns across replicas.

Replicas publish their checkpoints periodically, so turn N+1 often arrives before turn N's checkpoints
are published. The policy therefore also remembers where it sent each prompt (its key at its full
length): the replica that ran turn N holds a checkpoint inside turn N's prompt (its history boundary)
and after it, and turn N's prompt is a prefix of turn N+1's."""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from .publish import prefix_keys

_DEPTH_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class Route:
    """A routing decision: `replica`, why ("checkpoint" or "load"), the tokens of its deepest exact
    checkpoint of the prompt (`depth`), and every replica's depth (for the event)."""

    replica: str
    reason: str
    depth: int
    depths: dict[str, int] = field(default_factory=dict)
    overloaded: str | None = None  # the deeper holder passed over for load
    loads: dict[str, int] = field(default_factory=dict)  # requests in flight on each replica, as seen


class CheckpointRouting:
    def __init__(self, imbalance: int = 4, remember: int = 65536):
        self.imbalance = imbalance
        self.published: dict[str, dict[str, int]] = {}  # replica -> {key: length}
        self.remembered: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key -> (replica, length), LRU
        self.remember_max = remember
        self._lengths: Tally[int] = Tally()  # how many published or remembered keys have each length
        self._sent: dict[str, int] = {}  # replica -> number of the last request sent to it
        self._sends = 0
        self._lock = threading.Lock()

    # -- what replicas hold --------------------------------------------------------------------------
    def update(self, replica: str, checkpoints: Iterable[tuple[str, int]]) -> None:
        """Replace `replica`'s published checkpoints ((key, length) pairs)."""
        new = dict(checkpoints)
        with self._lock:
            old = self.published.get(replica, {})
            self._lengths.subtract(old.values())
            self._lengths.update(new.values())
            self.published[replica] = new
            self._compact()

    def drop(self, replica: str) -> None:
        """A replica that is gone: none of its checkpoints or remembered routes count any more."""
        with self._lock:
            self._lengths.subtract(self.published.pop(replica, {}).values())
            self._sent.pop(replica, None)
            for key in [k for k, (r, _) in self.remembered.items() if r == replica]:
                self._lengths[self.remembered.pop(key)[1]] -= 1
            self._compact()

    def sent(self, replica: str) -> None:
        """A request went to `replica`: among equally loaded replicas, it comes last for the next one."""
        with self._lock:
            self._sends += 1
            self._sent[replica] = self._sends

    def remember(self, replica: str, salt: str, tokens: Sequence[int]) -> None:
        """`replica` was sent this prompt: it will hold checkpoints of it before they are published."""
        if not tokens:
            return
        key = prefix_keys(salt, tokens, [len(tokens)])[len(tokens)]
        with self._lock:
            old = self.remembered.pop(key, None)
            if old is not None:
                self._lengths[old[1]] -= 1
            self.remembered[key] = (replica, len(tokens))
            self._lengths[len(tokens)] += 1
            while len(self.remembered) > self.remember_max:
                self._lengths[self.remembered.popitem(last=False)[1][1]] -= 1

    def _compact(self) -> None:
        for n in [n for n, c in self._lengths.items() if c <= 0]:
            del self._lengths[n]

    # -- the decision --------------------------------------------------------------------------------
    def depths(self, salt: str, tokens: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Each replica's deepest exact checkpoint of `tokens` (0: none). A replica restores at most all but
        the last prompt token, so only lengths below len(tokens) count."""
        replicas = list(replicas)
        with self._lock:
            lengths = [n for n in self._lengths if n < len(tokens)]
        keys = prefix_keys(salt, tokens, lengths)
        out = dict.fromkeys(replicas, 0)
        with self._lock:
            for n in sorted(keys, reverse=True):
                key = keys[n]
                for r in replicas:
                    if not out[r] and self.published.get(r, {}).get(key) == n:
                        out[r] = n
                held = self.remembered.get(key)
                if held is not None and held[0] in out and not out[held[0]]:
                    out[held[0]] = n
                if all(out.values()):
                    break
        return out

    def choose(self, salt: str, tokens: Sequence[int] | None, loads: dict[str, int]) -> Route:
        """The replica for a prompt (`tokens` None: unknown, by load) among `loads` (replica -> requests in
        flight)."""
        if not loads:
            raise ValueError("no replica to route to")
        least = min(loads.values())
        with self._lock:
            by_load = min((r for r, n in loads.items() if n == least), key=lambda r: (self._sent.get(r, 0), r))
        depths = self.depths(salt, tokens, loads) if tokens else dict.fromkeys(loads, 0)
        holders = sorted((r for r in loads if depths[r]), key=lambda r: (-depths[r], loads[r], r))
        fit = [r for r in holders if loads[r] - least < self.imbalance]
        if not holders:
            route = Route(by_load, "load", 0, depths, None, dict(loads))
        elif fit:
            route = Route(
                fit[0], "checkpoint", depths[fit[0]], depths, holders[0] if fit[0] != holders[0] else None, dict(loads)
            )
        else:
            route = Route(by_load, "load", depths[by_load], depths, holders[0], dict(loads))
        self.sent(route.replica)  # at once: requests chosen together, before Ray reports any as sent, take turns too
        return route


class RoutingTelemetry:
    """Every routing decision as a Prometheus metric and an event (ring buffer), in the routing process."""

    def __init__(self, keep: int = 2000):
        r = self.registry = CollectorRegistry()
        self.routed = Counter(
            "hyserve_route_requests",
            "Requests routed to a replica, by why: checkpoint (the "
            "deepest exact checkpoint of the prompt), load (none anywhere, or its holder "
            "overloaded), or retry (sent again after its replica died)",
            ["reason"],
            registry=r,
        )
        self.depth = Histogram(
            "hyserve_route_checkpoint_tokens",
            "Tokens of the exact checkpoint the chosen replica holds of the prompt",
            buckets=_DEPTH_BUCKETS,
            registry=r,
        )
        self.overloaded = Counter(
            "hyserve_route_holder_overloaded",
            "Requests sent away from the replica that holds their deepest checkpoint because it was overloaded",
            registry=r,
        )
        self.replica_failures = Counter(
            "hyserve_route_replica_failures",
            "Requests whose replica died while they ran, by outcome (retried, failed)",
            ["outcome"],
            registry=r,
        )
        self.recent: deque[dict] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def decided(
        self, route: Route, replica: str, request_id: str = "", prompt_tokens: int = 0, retry: bool = False
    ) -> dict:
        """Record that a request went to `replica` (the policy chose `route`; Ray may have sent it elsewhere
        when the chosen one's queue was full)."""
        depth = route.depths.get(replica, 0)
        reason = "retry" if retry else ("checkpoint" if depth else "load")
        self.routed.labels(reason).inc()
        self.depth.observe(depth)
        if route.overloaded is not None and route.overloaded != replica:
            self.overloaded.inc()
        event = {
            "ts": round(time.time(), 6),
            "event": "routed",
            "reason": reason,
            "replica": replica,
            "checkpoint_tokens": depth,
            "prompt_tokens": prompt_tokens,
            "request_id": request_id,
            "deepest_elsewhere": max((d for r, d in route.depths.items() if r != replica), default=0),
            "loads": route.loads,
        }
        if route.overloaded is not None and route.overloaded != replica:
            event["overloaded"] = route.overloaded
        with self._lock:
            self.recent.append(event)
        return event

    def failed(self, replica: str, outcome: str, request_id: str = "") -> None:
        self.replica_failures.labels(outcome).inc()
        with self._lock:
            self.recent.append(
                {
                    "ts": round(time.time(), 6),
                    "event": "replica_failed",
                    "reason": outcome,
                    "replica": replica,
                    "request_id": request_id,
                }
            )

    def events(self, limit: int = 100) -> list[dict]:
        with self._lock:
            recent = list(self.recent)
        return recent[-limit:] if limit > 0 else []
