"""Connect to Ray: a running cluster by address, or a local instance this process starts and stops.

Laptop mode: ``ray start --head`` then ``--address auto``; or no address at all, and a local
instance is started for the run (dashboard on 127.0.0.1 only) and shut down after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import ray

NAMESPACE = "raylastic"


@contextlib.contextmanager
def ray_session(address: str | None = None, *, min_cpus: float = 0.0) -> Iterator[None]:
    """Use the Ray this process is already connected to, or connect/start one for the block.

    A local instance gets ``max(os.cpu_count(), min_cpus)`` logical CPUs, so a job asking for
    more workers than there are cores still places them (they then share the cores).
    """
    if ray.is_initialized():
        yield
        return
    # Workers import user workloads ("mypkg.model:Name") from where the user ran the command.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}}
    options = dict(namespace=NAMESPACE, runtime_env=runtime_env, log_to_driver=True,
                   logging_level=logging.WARNING, configure_logging=True)
    if address:
        ray.init(address=address, **options)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)), include_dashboard=False,
                 dashboard_host="127.0.0.1", **options)
    try:
        yield
    finally:
        ray.shutdown()
