"""A node leaves: a simulated two-node Ray cluster (ray.cluster_utils.Cluster) whose second node runs
half of the workers. Lost without notice, its workers fail and the run carries on with the other
half; drained first (by the Controller, or by Ray on a preemption notice), they leave at a step boundary
and nothing fails when the node goes. Either way the result is the undisturbed run's, every step applied
exactly once.

On the same two nodes, hierarchical all-reduce (``strategy.hierarchical=true``: reduce inside each node,
all-reduce between the two node leaders, broadcast inside each node) averages the same gradients as one
process training on the whole batch, so its final parameters are allclose to that run's. The hook's node
layout comes from the workers' Ray node ids, so the test also checks that the workers really sat on two
nodes, 2 + 2, and that the run took its two-level path: a non-leader rank sends nothing across nodes (a
step's traffic is half a flat all-reduce's, where every rank sends its whole gradient)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import NAMESPACE, controller_name, slot_name
from raylastic.workloads.digits import Digits
from tests.conftest import REPO_ROOT
from tests.support.helpers import applied_samples, assert_states_close, job, load_model, wait_until_cpus_free
from tests.support.ray_head import START_ATTEMPTS, START_TIMEOUT_S, wait_until_up
from tests.support.strategy_runs import (
    TINY_GPT_OPTIONS,
    assert_trained_as_undisturbed,
    undisturbed_alongside,
    undisturbed_run,
)

PLACEMENT_TIMEOUT_S = 300
"""How long a run waits for its first workers to be built: long, since a worker that is not built in time leaves
the run with fewer than the four the tests need (a loaded 2-core machine took over 60 s to build some)."""
STEPS = 60  # ~4 s: progress (every second) sees step 10-15 at world size 4 well before the end
BASE = (f"training.steps={STEPS}", "training.record_samples=true", "scaling.min_workers=2",
        "scaling.max_workers=4", "scaling.cpus_per_worker=1", "workload.name=tests.support.user_workload:SlowDigits",
        "workload.options={pause_s: 0.05}", f"scaling.placement_timeout_s={PLACEMENT_TIMEOUT_S}")
NUM_TRAIN_SAMPLES = len(Digits().train_dataset())
DRAIN_DEADLINE_S = 600
"""How long the nodes' drains may take: long, so that a drain waited out fails the tests that check it was not."""


@pytest.fixture(scope="module")
def head(local_ray):
    local_ray.stop()
    os.chdir(REPO_ROOT)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, namespace=NAMESPACE,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def second_node(head):
    """A second node of 2 CPUs: with the head's 2, four workers of 1 CPU are two on each. Yielded once all four CPUs
    are free: a run starts with the slots ready then, and the tests need it to start with four."""
    node = head.add_node(num_cpus=2)
    head.wait_for_nodes()
    wait_until_cpus_free()
    yield node
    if node in head.list_all_nodes():
        head.remove_node(node)


@pytest.fixture(scope="module")
def reference() -> tuple[dict[int, list[int]], dict]:
    """The job undisturbed, computed: each step's samples (its global batch, in the sample order) and the
    parameters that training on them on one rank ends with (its pause changes no math)."""
    return undisturbed_run(job(*BASE, name="nodes-reference"), NUM_TRAIN_SAMPLES, {"pause_s": 0.0})


def world_sizes(result) -> list[tuple[int, int]]:
    """(first step, world size) of each stretch of the run at one size, for a failure's message."""
    stretches = []
    for row in result.history:
        if not stretches or stretches[-1][1] != row["world_size"]:
            stretches.append((row["step"], row["world_size"]))
    return stretches


def assert_same_as_reference(result, run_dir, reference):
    samples, state = reference
    assert result.final_step == STEPS
    assert_states_close(load_model(run_dir), state)
    assert applied_samples(result.ledger, STEPS, NUM_TRAIN_SAMPLES) == samples


def test_run_continues_on_the_remaining_node(tmp_path, head, second_node, reference):
    removed = {}

    def remove_second_node(progress):
        if progress.step >= 15 and progress.world_size == 4 and not removed:
            removed["step"] = progress.step
            head.remove_node(second_node)

    result = train(job(*BASE, name="nodes"), run_dir=tmp_path / "nodes", on_progress=remove_second_node)
    assert removed, f"the run never had 4 workers on two nodes: {world_sizes(result)}"
    failed = [e for e in result.events if e.type == "worker_failed"]
    assert len(failed) == 2
    sizes = [row["world_size"] for row in result.history]
    assert sizes[0] == 4 and sizes[-1] == 2
    assert_same_as_reference(result, tmp_path / "nodes", reference)


def test_draining_a_node_moves_its_workers_out_at_a_step_boundary(tmp_path, head, second_node, reference):
    """``Controller.drain(node_id=...)``: every worker on the node leaves at the next step boundary, nothing
    is discarded, and the node can then go without a single failure."""
    actions = {}

    def drain_then_remove_second_node(progress):
        if progress.step >= 10 and progress.world_size == 4 and "drained" not in actions:
            controller = ray.get_actor(controller_name("drain"))
            actions["drained"] = ray.get(controller.drain.remote(node_id=second_node.node_id))
        elif "drained" in actions and progress.world_size == 2 and "removed" not in actions:
            head.remove_node(second_node)  # the spot instance goes: none of the run's workers is on it
            actions["removed"] = progress.step

    result = train(job(*BASE, name="drain"), run_dir=tmp_path / "drain", on_progress=drain_then_remove_second_node)
    assert len(actions.get("drained", [])) == 2, (actions, world_sizes(result))
    assert "removed" in actions and actions["removed"] < STEPS, "the run ended before the node was removed"
    left = [e for e in result.events if e.type == "worker_left"]
    assert sorted(e.details["worker"] for e in left) == actions["drained"]
    assert {e.details["reason"] for e in left} == {"drained"}
    assert not [e for e in result.events if e.type == "worker_failed"]
    assert all(e.details["steps_lost"] == 0 for e in result.events if e.type == "generation_formed")
    sizes = [row["world_size"] for row in result.history]
    assert sizes[0] == 4 and sizes[-1] == 2 and sorted(sizes) == sizes[::-1]  # 4, then 2 for good
    assert_same_as_reference(result, tmp_path / "drain", reference)


def give_preemption_notice(head, node) -> None:
    """What a spot notice becomes: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``."""
    subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", head.address,
                    "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                    "spot instance reclaimed", "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)],
                   check=True, capture_output=True, timeout=60)


def test_a_preemption_notice_moves_the_workers_out_before_the_node_goes(tmp_path, head, second_node, reference):
    """``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` (what a spot notice becomes): the workers on the
    node leave at the next step boundary on their own, replacements are asked for elsewhere (none is placed on
    the draining node), and the node then goes without a failure."""
    actions = {}

    def notice_then_remove_second_node(progress):
        if progress.step >= 10 and progress.world_size == 4 and "noticed" not in actions:
            actions["noticed"] = progress.step
            give_preemption_notice(head, second_node)
        elif "noticed" in actions and progress.world_size == 2 and "removed" not in actions:
            if progress.step >= actions.setdefault("two_at", progress.step) + 5:  # no replacement lands on it
                head.remove_node(second_node)
                actions["removed"] = progress.step

    run_dir = tmp_path / "notice"
    # 0.25 s a step: on a busy machine the drain took ~40 steps of 0.15 s to land (the `ray drain-node` CLI is a
    # Python process importing Ray, then the Controller's next read of the notices), too few left to remove the node
    result = train(job(*BASE, "workload.options={pause_s: 0.25}", name="notice"), run_dir=run_dir,
                   on_progress=notice_then_remove_second_node)
    assert "removed" in actions and actions["removed"] < STEPS, f"the run ended before the node was removed: {actions}"
    draining = [e for e in result.events if e.type == "node_draining"]
    assert len(draining) == 1 and draining[0].details["node_id"] == second_node.node_id
    assert DRAIN_DEADLINE_S / 2 < draining[0].details["deadline_s"] <= DRAIN_DEADLINE_S  # the time left, in s
    assert len(draining[0].details["workers"]) == 2
    drained = [e for e in result.events if e.type == "drained"]
    assert [(e.details["node_id"], e.details["steps_lost"]) for e in drained] == [(second_node.node_id, 0)]
    assert not [e for e in result.events if e.type == "worker_failed"]
    sizes = [row["world_size"] for row in result.history]
    assert sizes[0] == 4 and sizes[-1] == 2 and sorted(sizes) == sizes[::-1]  # 4, then 2 for good
    assert_same_as_reference(result, run_dir, reference)


def test_a_preemption_notice_on_a_node_holding_pipeline_stages_re_plans_in_place_and_grows_back_on_a_new_node(
        tmp_path, head, second_node):
    """Two copies of a two-stage pipeline on four workers, two on each node; the second node's preemption notice
    moves its two workers out at a step boundary (whichever parts they hold: a stage of each copy or a whole copy),
    and the two left form one pipeline, taking what they lack from the leaving workers' memory: no step lost, no
    failure, no checkpoint. The node goes; when a new node appears, the replacements are placed on it and the run
    grows back to two copies from the members' memory. It ends with an undisturbed run's parameters."""
    steps, actions = 56, {}
    # 0.3 s a step at full size, for the notice to land mid-run; 1.6 s a step on two workers, for the new node and
    # its workers to start within the steps left even on a busy machine (the growth, not the steps, sets the time)
    options = TINY_GPT_OPTIONS[:-1] + ", pause_s: 0.4, full_pause_s: 0.15}"
    disturbed = job("workload.name=tests.support.user_workload:CharGPTSlowWhileSmall", options, "parallel.pp=2",
                    "strategy.name=ddp", "scaling.min_workers=2", "scaling.max_workers=4", "scaling.cpus_per_worker=1",
                    f"scaling.placement_timeout_s={PLACEMENT_TIMEOUT_S}", f"training.steps={steps}",
                    "training.global_batch_size=8", "training.record_samples=true", "checkpoint.every_steps=0",
                    name="pp-notice")

    def notice_then_replace_the_node(progress):
        if progress.step >= 3 and progress.world_size == 4 and "noticed" not in actions:
            actions["noticed"] = progress.step
            give_preemption_notice(head, second_node)
        elif "noticed" in actions and progress.layout == "pp2" and progress.state == "running" \
                and "replaced" not in actions:  # formed: the leavers have handed their parts over
            head.remove_node(second_node)
            actions["new_node"] = head.add_node(num_cpus=2)
            actions["replaced"] = progress.step

    undisturbed = undisturbed_alongside(disturbed)
    try:
        result = train(disturbed, run_dir=tmp_path / "run", on_progress=notice_then_replace_the_node)
    finally:
        if "new_node" in actions:
            head.remove_node(actions["new_node"])
    formed = [e.details | {"step": e.step} for e in result.events if e.type == "generation_formed"]
    keys = ("layout", "microbatches", "state_source", "steps_lost")
    assert [tuple(f[key] for key in keys) for f in formed] == [
        ("pp2 x dp2 (2 copies)", 2, "initialisation", 0), ("pp2", 4, "peers", 0),
        ("pp2 x dp2 (2 copies)", 2, "peers", 0)], (actions, [e.to_dict() for e in result.events])
    assert formed[1]["previous_layout"] == "pp2 x dp2 (2 copies)", formed
    assert actions["replaced"] < formed[2]["step"] < steps, (formed, actions)  # grown on the new node, mid-run
    drained = [e for e in result.events if e.type == "drained"]
    assert [(e.details["node_id"], e.details["steps_lost"]) for e in drained] == [(second_node.node_id, 0)]
    assert set(formed[1]["handed_over_by"]) <= set(drained[0].details["workers"]), formed  # their parts, if needed
    assert not [e for e in result.events if e.type in ("worker_failed", "checkpointed") and e.step < steps]
    assert_trained_as_undisturbed(result, disturbed, tmp_path / "run", steps, undisturbed.result(timeout=600))


@pytest.fixture
def block_node(head, tmp_path):
    """A second node started as a cloud image starts it, ``ray start --address ... --block`` (2 CPUs); on SIGTERM
    it drains itself (Ray's RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s by default, DRAIN_DEADLINE_S here) before
    it shuts down: at once when it is idle."""
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_DEADLINE_S)}
    log_path = tmp_path / "ray_start.log"
    for _ in range(START_ATTEMPTS):
        with open(log_path, "w") as log:
            process = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--address", head.address,
                                        "--num-cpus=2", "--block", "--disable-usage-stats"], env=env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started = psutil.Process(process.pid)
        try:
            if wait_until_up(process, lambda: {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before,
                             START_TIMEOUT_S):
                break
        except RuntimeError:
            process.kill()
            raise
    else:
        pytest.fail(f"ray start exited {START_ATTEMPTS} times before it joined:\n{log_path.read_text()[-3000:]}")
    new = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
    wait_until_cpus_free()
    children = started.children(recursive=True)
    yield process, new.pop()
    if process.poll() is None:
        process.kill()
    for child in children:  # what this node started, and only that
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def test_sigterm_to_a_ray_start_block_node_moves_the_workers_out_before_it_goes(tmp_path, head, block_node,
                                                                                 reference):
    process, node_id = block_node
    signalled = {}

    def sigterm_the_node(progress):
        if progress.step >= 10 and progress.world_size == 4 and not signalled:
            signalled["step"] = progress.step
            process.send_signal(signal.SIGTERM)  # as Kubernetes or a spot reclaim stops the node

    run_dir = tmp_path / "sigterm"
    result = train(job(*BASE, "workload.options={pause_s: 0.15}", name="sigterm"), run_dir=run_dir,
                   on_progress=sigterm_the_node)
    assert signalled, f"the run never had 4 workers on two nodes: {world_sizes(result)}"
    drained = [e for e in result.events if e.type == "drained"]
    assert [(e.details["node_id"], e.details["steps_lost"]) for e in drained] == [(node_id, 0)]
    assert not [e for e in result.events if e.type == "worker_failed"]
    # The node went once idle, without waiting out its drain (TimeoutExpired if it does).
    assert process.wait(timeout=DRAIN_DEADLINE_S / 3) is not None
    sizes = [row["world_size"] for row in result.history]
    assert sizes[0] == 4 and sizes[-1] == 2 and sorted(sizes) == sizes[::-1]
    assert_same_as_reference(result, run_dir, reference)


# -- hierarchical all-reduce on the two nodes -------------------------------------------------------------------

HIERARCHICAL = ("training.steps=30", "scaling.min_workers=4", "scaling.max_workers=4", "scaling.cpus_per_worker=1",
                f"scaling.placement_timeout_s={PLACEMENT_TIMEOUT_S}", "strategy.hierarchical=true")


def workers_per_node(run_name: str) -> Counter:
    """Node id -> number of this run's placed worker slots (one single-bundle placement group each)."""
    prefix = slot_name(run_name, 0).removesuffix("0")
    return Counter(group["bundles_to_node_id"][0] for group in placement_group_table().values()
                   if group["name"].startswith(prefix) and group["state"] == "CREATED")


def test_hierarchical_all_reduce_on_two_nodes_trains_as_one_process(tmp_path, head, second_node):
    placement: dict[str, int] = {}

    def record_placement(progress: RunStatus) -> None:
        if progress.world_size == 4 and not placement:
            placement.update(workers_per_node("hier"))

    config = job(*HIERARCHICAL, name="hier")
    one_process = undisturbed_alongside(config)
    result = train(config, run_dir=tmp_path, on_progress=record_placement)
    node_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert sorted(placement.values()) == [2, 2] and set(placement) == node_ids, placement
    assert result.final_step == 30 and {row["world_size"] for row in result.history} == {4}
    assert_states_close(load_model(tmp_path), one_process.result(timeout=600)[1])
    # bytes_sent is a step's traffic summed over ranks, uncompressed_bytes a flat all-reduce's (every rank
    # sends its whole gradient): here only the two node leaders take part in the inter-node all-reduce.
    final = result.history[-1]
    assert final["bytes_sent"] * 2 == final["uncompressed_bytes"] > 0, final
