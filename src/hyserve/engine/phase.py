"""What every phase of a step works on: the model, the prefix cache, the checkpoint policy, the metrics and
the scheduler's queues."""

from __future__ import annotations

from ..cache.manager import PrefixCache
from ..cache.policy import CheckpointPolicy
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from .scheduler import Scheduler


class Phase:
    def __init__(
        self,
        runtime: ModelRuntime,
        cache: PrefixCache,
        policy: CheckpointPolicy,
        metrics: Metrics,
        scheduler: Scheduler,
    ):
        self.runtime = runtime
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.scheduler = scheduler
