"""Hierarchical all-reduce as a DDP comm hook: reduce inside each node, all-reduce among one
leader per node, broadcast inside each node.

The two-level scheme of Horovod's hierarchical all-reduce (Sergeev & Del Balso 2018, "Horovod:
fast and easy distributed deep learning in TensorFlow", ``HOROVOD_HIERARCHICAL_ALLREDUCE``) and
of Jia et al. 2018 ("Highly Scalable Deep Learning Training System with Mixed-Precision", 2D
all-reduce); NCCL's trees do the same inside one collective when they can see the topology.
Only the leaders' all-reduce crosses nodes: with G ranks per node, 1/G of the inter-node traffic
of a flat ring in which every rank talks across nodes.

Node assignment: ``node_ids[rank]`` is the Ray node id of each rank of the group, the same list
on every rank. It is re-derived at every process-group generation: each worker reports its Ray
node id and the Controller passes the list with the group assignment, so ranks that moved,
died or joined are placed on their current node. A node's leader is its lowest rank.

Example::

    state, hook = make_hierarchical_hook(["node-a", "node-a", "node-b", "node-b"])
    ddp_model.register_comm_hook(state, hook)
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects and rejects strings.

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raylastic.strategies.compression import CommHook
from raylastic.strategies.compression.accounting import HookState, resolves_to
from raylastic.strategies.sub_groups import sub_group


def ranks_by_node(node_ids: list[str]) -> list[list[int]]:
    """The group ranks of each node, nodes in order of their lowest rank: the same on every rank."""
    nodes: dict[str, list[int]] = {}
    for rank, node_id in enumerate(node_ids):
        nodes.setdefault(node_id, []).append(rank)
    return list(nodes.values())


class HierarchicalState(HookState):
    """The sub-groups this rank uses. ``flat``: no hierarchy to exploit, plain all-reduce.

    ``bytes_sent`` counts inter-node payload only (the leaders' all-reduce; the whole bucket on
    every rank when flat); ``uncompressed_bytes`` what a flat all-reduce contributes per rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, nodes: list[list[int]], *, flat: bool,
                 node_group: dist.ProcessGroup | None = None, leaders_group: dist.ProcessGroup | None = None,
                 leader: int = -1, is_leader: bool = False) -> None:
        super().__init__(process_group)
        self.nodes = nodes
        self.flat = flat
        self.node_group = node_group
        """This rank's node (None when it is alone on its node, or flat)."""
        self.leaders_group = leaders_group
        """The node leaders (None on other ranks, or flat)."""
        self.leader = leader
        """Global rank of this rank's node leader."""
        self.is_leader = is_leader


def make_hierarchical_hook(node_ids: list[str], process_group: dist.ProcessGroup | None = None) -> CommHook:
    """Build the sub-groups and return (state, hook); every rank of the default group must call it.

    ``dist.new_group`` is collective over the default group: every rank creates every node group
    (of two or more ranks) and then the leaders group, in the same order, member or not. They keep the default
    group's timeout (strategies/sub_groups.py).
    """
    world_size = dist.get_world_size(process_group)
    if len(node_ids) != world_size:
        raise ValueError(f"node_ids must name the node of each of the {world_size} ranks, got {len(node_ids)}")
    nodes = ranks_by_node(list(node_ids))
    if len(nodes) == 1 or all(len(ranks) == 1 for ranks in nodes):
        return CommHook(HierarchicalState(process_group, nodes, flat=True), hierarchical_hook)

    def global_rank(group_rank: int) -> int:
        return group_rank if process_group is None else dist.get_global_rank(process_group, group_rank)

    my_rank = dist.get_rank(process_group)
    node_group = None
    for ranks in nodes:
        if len(ranks) > 1:
            group = sub_group([global_rank(r) for r in ranks])
            if my_rank in ranks:
                node_group = group
    leaders = [ranks[0] for ranks in nodes]
    leaders_group = sub_group([global_rank(r) for r in leaders])
    my_node = next(ranks for ranks in nodes if my_rank in ranks)
    state = HierarchicalState(process_group, nodes, flat=False, node_group=node_group,
                              leaders_group=leaders_group if my_rank in leaders else None,
                              leader=global_rank(my_node[0]), is_leader=my_rank in leaders)
    return CommHook(state, hierarchical_hook)


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean over all ranks of the bucket, by node-reduce, leaders' all-reduce, node-broadcast.

    The three collectives are issued from this thread, each after waiting for the previous one,
    never from a future's callback: every rank then issues its collectives on each group in the
    same order. On NCCL ``Work.wait()`` only makes the stream wait, so the CPU goes on; on gloo it
    blocks the backward pass for the bucket's communication.
    """
    buffer = bucket.buffer()
    state.end_bucket(bucket)
    if state.flat:
        state.record(bucket, buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(state.process_group, bucket)
    buffer.div_(state.world_size)  # first, as torch's allreduce_hook does: no overflow in low precision
    work = None
    if state.node_group is not None:
        work = dist.reduce(buffer, dst=state.leader, group=state.node_group, async_op=True)
    if state.is_leader:
        if work is not None:
            work.wait()
        work = dist.all_reduce(buffer, group=state.leaders_group, async_op=True)
        state.record(bucket, buffer.numel() * buffer.element_size())
    else:
        state.record(bucket, 0)
    if state.node_group is not None:
        work.wait()
        work = dist.broadcast(buffer, src=state.leader, group=state.node_group, async_op=True)
    return resolves_to(work.get_future(), buffer)


def reference_hierarchical_mean(per_rank_grads: list[torch.Tensor], node_ids: list[str]) -> torch.Tensor:
    """Naive reference: sum inside each node, sum the node sums, divide by the world size."""
    node_sums = [sum(per_rank_grads[r] for r in ranks) for ranks in ranks_by_node(node_ids)]
    return sum(node_sums) / len(per_rank_grads)
