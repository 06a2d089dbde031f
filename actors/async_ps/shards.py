"""Which parameter server holds which parameter (largest first onto the least loaded server), and the model their
shares make.

Example::

    assign_parameters({"w": 1000, "b": 10, "v": 600}, num_servers=2)   # [["w"], ["v", "b"]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from raylastic.workloads.protocol import Workload


def assign_parameters(sizes: dict[str, int], num_servers: int) -> list[list[str]]:
    """The names each server holds (every name exactly once), balancing element counts greedily."""
    shards: list[list[str]] = [[] for _ in range(num_servers)]
    loads = [0] * num_servers
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = min(range(num_servers), key=lambda i: (loads[i], i))
        shards[least].append(name)
        loads[least] += sizes[name]
    return shards


def merged_shares(shares: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The servers' shares as one dict by the model's names (a server sends its buffers as ``buffer.<name>``)."""
    return {name.removeprefix("buffer."): tensor for share in shares for name, tensor in share.items()}


def model_from_shares(workload: Workload, shares: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model built by ``workload`` holding ``shares``, the servers' parameters and buffers by the names
    ``named_parameters`` and ``named_buffers`` give: once each, so a weight tied under two names (an lm head sharing
    the token embedding's) arrives under its first and reaches the other through the tie."""
    model = workload.build_model()
    with torch.no_grad():
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            tensor.copy_(shares[name])
    return model


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each ``state_dict`` name of a tensor that ``named_parameters`` or ``named_buffers`` gives under another name (a
    tied lm head), with that name: what a model file needs besides the servers' shares."""
    first: dict[int, str] = {}
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        first.setdefault(id(tensor), name)
    return {name: first[id(tensor)] for name, tensor in model.state_dict(keep_vars=True).items()
            if first.get(id(tensor), name) != name}
