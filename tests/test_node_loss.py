"""A whole node leaves: a simulated two-node Ray cluster (ray.cluster_utils.Cluster) loses the node
that runs half of the workers; the run carries on with the other half, with the same result."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.job import train
from tests.conftest import REPO_ROOT
from tests.helpers import assert_states_close, job, load_model

STEPS = 60  # ~4 s: progress (every second) sees step 15 at world size 4 well before the end
BASE = (f"training.steps={STEPS}", "scaling.min_workers=2", "scaling.max_workers=4", "scaling.cpus_per_worker=1",
        "workload.name=tests.user_workload:SlowDigits", "workload.options={pause_s: 0.05}",
        "scaling.placement_timeout_s=60")


@pytest.fixture(scope="module")
def two_nodes():
    os.chdir(REPO_ROOT)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    second = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="raylastic",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        yield cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_run_continues_on_the_remaining_node(tmp_path, two_nodes):
    cluster, second = two_nodes
    reference = train(job(*BASE, "scaling.max_workers=2", name="nodes-reference"), run_dir=tmp_path / "reference")
    removed = {}

    def remove_second_node(progress):
        if progress["step"] >= 15 and progress["world_size"] == 4 and not removed:
            removed["step"] = progress["step"]
            cluster.remove_node(second)

    result = train(job(*BASE, name="nodes"), run_dir=tmp_path / "nodes", on_progress=remove_second_node)
    assert removed, "the run never had 4 workers on two nodes"
    assert result.final_step == STEPS
    failed = [e for e in result.events if e["type"] == "worker_failed"]
    assert len(failed) == 2
    sizes = [row["world_size"] for row in result.history]
    assert sizes[0] == 4 and sizes[-1] == 2
    assert_states_close(load_model(tmp_path / "nodes"), load_model(tmp_path / "reference"))
    assert reference.final_step == STEPS
