"""Which parameter server holds which parameter: largest first onto the least loaded server.

Example::

    assign_parameters({"w": 1000, "b": 10, "v": 600}, num_servers=2)   # [["w"], ["v", "b"]]
"""

from __future__ import annotations


def assign_parameters(sizes: dict[str, int], num_servers: int) -> list[list[str]]:
    """The names each server holds (every name exactly once), balancing element counts greedily."""
    shards: list[list[str]] = [[] for _ in range(num_servers)]
    loads = [0] * num_servers
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = min(range(num_servers), key=lambda i: (loads[i], i))
        shards[least].append(name)
        loads[least] += sizes[name]
    return shards
