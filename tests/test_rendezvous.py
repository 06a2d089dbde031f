"""The run's rendezvous store (actors/rendezvous/store.py): a TCPStore's answers over Ray calls, every wait bounded,
and generation groups formed through it under the run's random key prefix (real Ray actors, real gloo)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import ray
import torch
import torch.distributed as dist

from raylastic.actors.rendezvous.keys import RendezvousKeys, beside_this_process
from raylastic.actors.rendezvous.store import RPC_MARGIN_S, RayStore
from raylastic.actors.worker_group.group import WorkerGroup
from raylastic.strategies.checkpoint_catalogue import CheckpointSettings
from raylastic.strategies.group_assignment import GroupAssignment, new_store_prefix
from raylastic.strategies.process_group import join_group, leave_group
from tests.support.helpers import job
from tests.support.process_imports import training_imports

pytestmark = pytest.mark.usefixtures("ray_local")

TIMEOUT = timedelta(seconds=2)


@pytest.fixture
def keys():
    actor = RendezvousKeys.options(**beside_this_process()).remote()
    yield actor
    ray.kill(actor)


def test_the_keys_process_skips_the_training_imports(keys):
    """It starts with every run: the job's setup hook (torch._dynamo and our training modules) is skipped there."""
    assert ray.get(keys.__ray_call__.remote(training_imports), timeout=120) == {"imported": False, "torch": False,
                                                                                "dynamo": False}


def _operations(store: dist.Store) -> list:
    """What a sequence of every operation answers: the same for a TCPStore and a RayStore."""
    store.set("a", "1")
    answers = [store.get("a"), store.add("n", 2), store.add("n", 3), store.get("n")]
    answers += [store.compare_set("c", "", "x"), store.compare_set("c", "y", "z"), store.compare_set("c", "x", "z"),
                store.get("c"), store.compare_set("missing", "e", "d"), store.check(["a", "n"]),
                store.check(["a", "nope"]), store.num_keys()]
    answers += [store.delete_key("a"), store.delete_key("a"), store.check(["a"]), store.num_keys()]
    store.wait(["n", "c"])
    return answers


def test_every_operation_answers_as_a_tcpstore_does(keys):
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    assert _operations(RayStore(keys, timeout=TIMEOUT)) == _operations(tcp)


def test_a_key_never_set_raises_at_the_timeout_naming_it(keys):
    store = RayStore(keys, timeout=TIMEOUT)
    for wait in (lambda: store.get("never"), lambda: store.wait(["set", "never"]),
                 lambda: store.wait(["never"], timedelta(seconds=1))):
        store.set("set", "1")
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="never"):
            wait()
        assert time.monotonic() - started < TIMEOUT.total_seconds() + RPC_MARGIN_S / 3


def test_a_get_answers_once_another_process_sets_the_key(keys):
    @ray.remote(num_cpus=0)
    def set_later(actor) -> None:
        time.sleep(0.5)
        RayStore(actor, timeout=TIMEOUT).set("late", b"here")

    store = RayStore(keys, timeout=timedelta(seconds=60))
    done = set_later.remote(keys)
    assert store.get("late") == b"here"
    ray.get(done, timeout=60)


def test_a_wait_brings_the_peers_addresses_set_so_far_and_later_waits_for_them_make_no_call(keys):
    """gloo waits for each peer's address in turn: O(N) calls per rank unless the first wait brings them along."""
    writer = RayStore(keys, timeout=TIMEOUT)
    for rank in range(4):
        writer.set(f"g/0/{rank}", f"address {rank}")
    writer.add("g/0/joined", 1)  # not a rank's key: a counter, never brought along (it would go stale)
    store = RayStore(keys, timeout=TIMEOUT)
    addresses = []
    for rank in range(4):
        store.wait([f"g/0/{rank}"])
        addresses.append(store.get(f"g/0/{rank}"))
    assert addresses == [f"address {rank}".encode() for rank in range(4)] and store.calls == 1
    writer.add("g/0/joined", 1)
    store.wait(["g/0/joined"])
    assert store.get("g/0/joined") == b"2" and store.calls == 2
    writer.set("g/0/4", "address 4")  # set after the first wait: asked for
    store.wait(["g/0/4"])
    assert store.get("g/0/4") == b"address 4" and store.calls == 3


def test_a_store_whose_actor_is_gone_raises_without_waiting_out_its_timeout(keys):
    store = RayStore(keys, timeout=timedelta(seconds=120))
    ray.kill(keys)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"get\('k'\) failed"):
        store.get("k")
    assert time.monotonic() - started < 120 / 3


def test_a_called_off_generation_ends_its_waits_at_once_and_leaves_the_others_alone(keys):
    store = RayStore(keys, timeout=timedelta(seconds=120))
    waiting = store_wait.remote(keys, "run/generation/1/0")
    time.sleep(0.5)
    ray.get(keys.abort.remote("run/generation/1"), timeout=60)
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="called off"):
        ray.get(waiting, timeout=60)
    with pytest.raises(dist.DistStoreError, match="called off"):  # a rank that comes late does not wait either
        store.get("run/generation/1/1")
    assert time.monotonic() - started < 60
    store.set("run/generation/10/0", "x")  # a later generation's keys are its own
    assert store.get("run/generation/10/0") == b"x"


def test_forgetting_the_generations_before_one_keeps_it_the_later_ones_and_other_keys(keys):
    for key in ("run/generation/1/0", "run/generation/1/1", "run/generation/2/0", "run/generation/10/0",
                "other/generation/1/0", "run/x"):
        ray.get(keys.set.remote(key, b"v"), timeout=60)
    ray.get(keys.abort.remote("run/generation/1"), timeout=60)
    assert ray.get(keys.forget_generations_before.remote("run", 10), timeout=60) == 3
    assert ray.get(keys.list_keys.remote(), timeout=60) == ["other/generation/1/0", "run/generation/10/0", "run/x"]
    # a late rank of a generation gone neither waits out its timeout nor puts its keys back
    with pytest.raises(ray.exceptions.RayTaskError, match="called off"):
        ray.get(keys.get.remote("run/generation/2/0", timeout_s=600), timeout=60)
    ray.get(keys.set.remote("run/generation/9/1", b"late"), timeout=60)
    assert ray.get(keys.list_keys.remote(), timeout=60) == ["other/generation/1/0", "run/generation/10/0", "run/x"]


@ray.remote(num_cpus=0)
def store_wait(actor, key: str) -> None:
    RayStore(actor, timeout=timedelta(seconds=120)).wait([key])


@ray.remote(num_cpus=0.5)
class Rank:
    def __init__(self) -> None:
        self.stores: list[RayStore] = []

    def join_and_all_reduce(self, assignment: GroupAssignment) -> float:
        store = RayStore(assignment.store, timeout=timedelta(seconds=assignment.timeout_s))
        self.stores.append(store)
        join_group(assignment, "gloo", store)
        subgroup = dist.new_group(backend="gloo")  # as the workers' checkpoint group: its keys under the prefix too
        total = torch.ones(1)
        dist.all_reduce(total)
        dist.all_reduce(total, group=subgroup)
        return total.item()

    def leave(self) -> None:
        leave_group()


def test_generations_form_through_the_store_only_under_the_runs_random_prefix(keys):
    ranks = [Rank.remote() for _ in range(2)]
    prefix = new_store_prefix()
    for generation in (3, 4):  # the same processes leave one group and join the next
        joined = [rank.join_and_all_reduce.remote(GroupAssignment(
            generation=generation, rank=index, world_size=2, store=keys, store_prefix=prefix, timeout_s=60))
            for index, rank in enumerate(ranks)]
        assert ray.get(joined, timeout=120) == [4.0, 4.0]
    ray.get([r.leave.remote() for r in ranks], timeout=60)
    listed = ray.get(keys.list_keys.remote())
    assert listed and all(key.startswith((f"{prefix}/generation/3/", f"{prefix}/generation/4/")) for key in listed)
    assert len(prefix) == 32 and new_store_prefix() != prefix


def test_a_run_stores_one_generations_keys_however_many_generations_it_formed(tmp_path):
    """A WorkerGroup forms generation after generation in the same processes (as recoveries do): once one has
    formed, the keys of those before it are gone, so the store stays at one generation's keys."""
    config = job("scaling.min_workers=2", "scaling.max_workers=2", "scaling.warm_processes=false", name="keys")
    group = WorkerGroup.for_job(config, CheckpointSettings(
        root=str(tmp_path), every_steps=0, num_to_keep=1, config_hash=config.math_hash(),
        global_batch_size=config.training.global_batch_size))
    try:
        assert group.place(max_workers=2, min_workers=2, timeout_s=120) == []
        counts = []
        for _ in range(4):
            group.form(run_step=0)
            counts.append(len(keys_once_older_ones_are_gone(group.store, f"{group.store_prefix}/generation/",
                                                            group.generation)))
        assert counts[0] > 0 and counts == counts[:1] * 4, counts
    finally:
        group.shutdown()


def keys_once_older_ones_are_gone(keys, generations: str, newest: int, timeout_s: float = 30.0) -> list[str]:
    """The store's keys once every one is of generation ``newest`` (``<generations><newest>/...``); the ones there
    at ``timeout_s`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = ray.get(keys.list_keys.remote(), timeout=60)
        if all(key.startswith(f"{generations}{newest}/") for key in listed) or time.monotonic() > deadline:
            return listed
        time.sleep(0.2)
