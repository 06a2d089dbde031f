"""Sharded state survives a lost worker in memory (issue 18): TrainWorker actors on a real local Ray (gloo),
driven as the Controller drives them (form -> plan_peer_restore -> restore_from_peers -> train).

With strategy.replicas=2 at 4 workers every shard has two holders: after one is killed (inside a step, its
peers blocked in the step's collectives, or between steps) the 3 survivors (one copy each now: 2 cannot
split 3 ranks) rebuild the state from their kept shards and train on, and the run ends where an
undisturbed run does; no checkpoint is ever written or read. A new worker joining later receives its
shard from the peers the same way. Losing both holders of one shard leaves no plan (the Controller then
goes to a checkpoint).

    python -m pytest tests/test_peer_restore.py -q     # about 35 s on 2 cores
"""

from __future__ import annotations

import time

import pytest
import ray

from raylastic.jobconfig import FaultConfig
from raylastic.strategies.peer_restore import ShardCopy, plan_peer_restore
from tests.support.helpers import assert_states_close
from tests.support.worker_actors import Workers, wait_while, workers_of

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 8
KILLED = 1
"""Rank 1 of 4 holds shard 1, as rank 3 does."""
COLLECTIVE_TIMEOUT_S = 120.0
"""Long: the test checks that a survivor blocked in a collective did not wait it out (asserting well under it)."""


def undisturbed_then_from_seed(workers: Workers, actors: list) -> dict:
    """The undisturbed run's model (generation 0); then every actor starts over from the seed (generation 1)."""
    workers.join(0, actors)
    workers.train(actors, STEPS)
    undisturbed = workers.model(actors)
    workers.join(1, actors)  # a fresh start: sharded state is rebuilt from the seed at step 0
    return undisturbed


def test_zero3_with_two_copies_recovers_a_lost_worker_from_memory_and_a_new_one_joins_from_peers(tmp_path):
    workers = workers_of(tmp_path, STEPS, "strategy.name=zero3", "strategy.replicas=2",
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    actors = workers.start(4)
    undisturbed = undisturbed_then_from_seed(workers, actors)
    workers.train(actors, STEPS, faults={KILLED: FaultConfig(action="ray_kill", rank=KILLED, step=4)})
    with pytest.raises(ray.exceptions.RayActorError):  # Ray killed it inside step 4, its peers inside it too
        wait_while(actors[KILLED], "training")
    survivors = [actor for rank, actor in enumerate(actors) if rank != KILLED]
    started = time.monotonic()
    reports = workers.join(2, survivors)  # also the one blocked in a collective with a survivor, not the lost
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT_S / 3  # rank: released when that survivor left
    assert [r.shard_copies for r in reports] == [(ShardCopy(generation=1, world_size=4, replicas=2, rank=rank, step=3),)
                                                 for rank in (0, 2, 3)]
    assert plan_peer_restore([r.shard_copies for r in reports]).senders == (0, 2)  # shard 1 from old rank 3
    assert workers.restore_from_peers(survivors, reports) == 3
    workers.train(survivors, 5)

    grown = [*survivors, *workers.start(1)]  # a new worker receives its shard from the peers, not from disk
    reports = workers.join(3, grown)
    assert reports[-1].shard_copies == () and reports[0].shard_copies[0].world_size == 3
    assert workers.restore_from_peers(grown, reports) == 5
    workers.train(grown, STEPS)
    assert_states_close(workers.model(grown), undisturbed)
    assert not (tmp_path / "checkpoints").exists()  # nothing was written, so nothing was read

    for rank in (0, 2):  # both holders of shard 0 of generation 3's layout (4 ranks, 2 copies)
        ray.kill(grown[rank])
    left = [grown[1], grown[3]]
    reports = workers.join(4, left)
    assert {copy.rank for r in reports for copy in r.shard_copies} == {1, 3}
    assert plan_peer_restore([r.shard_copies for r in reports]) is None
    for actor in left:
        ray.kill(actor)


def test_zero1_with_two_copies_recovers_a_lost_worker_from_memory(tmp_path):
    workers = workers_of(tmp_path, STEPS, "strategy.name=zero1", "strategy.replicas=2")
    actors = workers.start(4)
    undisturbed = undisturbed_then_from_seed(workers, actors)
    workers.train(actors, 3)

    ray.kill(actors[0])
    survivors = actors[1:]
    reports = workers.join(2, survivors)
    assert workers.restore_from_peers(survivors, reports) == 3
    workers.train(survivors, STEPS)
    assert_states_close(workers.model(survivors), undisturbed)
    assert not (tmp_path / "checkpoints").exists()
    for actor in survivors:
        ray.kill(actor)
