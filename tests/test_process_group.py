"""Generation groups rendezvous under the run's random key prefix of the Controller's store (real gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from strategies.process_group import GroupAssignment, host_store, join_group, leave_group, new_store_prefix
from tests.distributed_harness import run_distributed

GENERATION = 3


def _join_and_all_reduce(port: int, prefix: str) -> float:
    join_group(GroupAssignment(generation=GENERATION, rank=dist.get_rank(), world_size=dist.get_world_size(),
                               store_host="127.0.0.1", store_port=port, store_prefix=prefix, timeout_s=30), "gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    leave_group()
    return total.item()


def test_a_generation_rendezvous_only_under_the_runs_random_prefix():
    store = host_store("127.0.0.1")
    prefix = new_store_prefix()
    assert run_distributed(_join_and_all_reduce, 2, store.port, prefix) == [2.0, 2.0]
    keys = store.list_keys()
    assert keys and all(key.startswith(f"{prefix}/generation/{GENERATION}/") for key in keys)
    assert len(prefix) == 32 and new_store_prefix() != prefix
