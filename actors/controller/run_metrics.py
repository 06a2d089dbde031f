"""Per-run metrics exported through ``ray.util.metrics``, so Ray's Prometheus endpoint carries them.

The Controller records them; each node's metrics agent serves them on its metrics export port
(``ray start --metrics-export-port``, or ``ray.nodes()[i]["MetricsExportPort"]``) with Ray's
``ray_`` prefix and a ``run`` label::

    ray_raylastic_step{run="digits",...} 120.0
    ray_raylastic_loss{run="digits",...} 0.41
    ray_raylastic_samples_per_s{run="digits",...} 5210.3
    ray_raylastic_world_size{run="digits",...} 2.0
    ray_raylastic_failures_total{run="digits",...} 1.0       # counters appear after their first event
    ray_raylastic_recoveries_total{run="digits",...} 1.0

Example::

    metrics = RunMetrics("digits")
    metrics.step_committed(step=1, loss=2.3, samples_per_s=4000.0, world_size=2)
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

PREFIX = "raylastic_"
TAG_KEYS = ("run",)


class RunMetrics:
    """The metrics of one run, every series tagged ``run=<run name>``."""

    def __init__(self, run_name: str) -> None:
        tags = {"run": run_name}

        def gauge(name: str, description: str) -> Gauge:
            metric = Gauge(PREFIX + name, description=description, tag_keys=TAG_KEYS)
            metric.set_default_tags(tags)
            return metric

        def counter(name: str, description: str) -> Counter:
            metric = Counter(PREFIX + name, description=description, tag_keys=TAG_KEYS)
            metric.set_default_tags(tags)
            return metric

        self.step = gauge("step", "Last committed optimizer step of the run.")
        self.loss = gauge("loss", "Training loss of the last committed step (mean over the global batch).")
        self.samples_per_s = gauge("samples_per_s", "Training throughput of the last committed step.")
        self.world_size = gauge("world_size", "Workers in the run's current generation.")
        self.failures = counter("failures", "Worker failures the run has seen (died, hung or raised).")
        self.recoveries = counter("recoveries", "Recoveries completed: a step committed after a failure.")

    def step_committed(self, *, step: int, loss: float, samples_per_s: float, world_size: int) -> None:
        self.step.set(step)
        self.loss.set(loss)
        self.samples_per_s.set(samples_per_s)
        self.world_size.set(world_size)

    def failed(self, count: int = 1) -> None:
        if count > 0:
            self.failures.inc(count)

    def recovered(self) -> None:
        self.recoveries.inc()
