"""Hierarchical all-reduce in a real job on a simulated two-node Ray cluster (ray.cluster_utils.Cluster).

Two nodes of 2 CPUs, 4 workers of 1 CPU each: Ray places two workers on each node. The same job
runs with flat DDP and with ``strategy.hierarchical=true`` (reduce inside each node, all-reduce
between the two node leaders, broadcast inside each node); both average the same gradients, so
their final parameters are allclose. The hook's node layout comes from the workers' Ray node ids,
so the test also checks that the workers really sat on two nodes, 2 + 2, and that the hierarchical
run took its two-level path: there a non-leader rank sends nothing across nodes (its step rows
send nothing between nodes), while in a flat all-reduce every rank sends its whole gradient.

Run: ``python -m pytest tests/test_hierarchical_cluster.py -q`` (about a minute on 2 cores).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import NAMESPACE
from tests.conftest import REPO_ROOT
from tests.support.helpers import assert_states_close, job, load_model

STEPS = 30
BASE = (f"training.steps={STEPS}", "scaling.min_workers=4", "scaling.max_workers=4", "scaling.cpus_per_worker=1",
        "scaling.placement_timeout_s=60")


@pytest.fixture(scope="module")
def two_nodes(local_ray):
    """A head and one more node, 2 CPUs each, on this machine; shut down at the end of the module."""
    local_ray.stop()
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.chdir(cwd)


def run(tmp_path, name: str, *overrides: str) -> tuple:
    """Train the job; also return how many of its workers each node held while all 4 were placed."""
    placement: dict[str, int] = {}

    def record_placement(progress: RunStatus) -> None:
        if progress.world_size == 4 and not placement:
            placement.update(workers_per_node(name))

    result = train(job(*BASE, *overrides, name=name), run_dir=tmp_path / name, on_progress=record_placement)
    return result, load_model(tmp_path / name), placement


def workers_per_node(run_name: str) -> Counter:
    """Node id -> number of this run's placed worker slots (one single-bundle placement group each)."""
    prefix = f"raylastic:{run_name}:slot"
    return Counter(group["bundles_to_node_id"][0] for group in placement_group_table().values()
                   if group["name"].startswith(prefix) and group["state"] == "CREATED")


def test_hierarchical_all_reduce_on_two_nodes_matches_flat(tmp_path, two_nodes):
    flat, flat_state, flat_placement = run(tmp_path, "flat")
    hierarchical, hierarchical_state, placement = run(tmp_path, "hier", "strategy.hierarchical=true")

    node_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    for used in (flat_placement, placement):
        assert sorted(used.values()) == [2, 2] and set(used) == node_ids, used
    assert flat.final_step == hierarchical.final_step == STEPS
    assert {row["world_size"] for row in flat.history + hierarchical.history} == {4}

    assert_states_close(hierarchical_state, flat_state)

    # bytes_sent is a step's traffic summed over ranks: flat, every rank all-reduces its whole gradient;
    # hierarchical, only the two node leaders take part in the inter-node all-reduce.
    assert all(row["bytes_sent"] == row["uncompressed_bytes"] > 0 for row in flat.history)
    final = hierarchical.history[-1]
    assert final["bytes_sent"] * 2 == final["uncompressed_bytes"], final
