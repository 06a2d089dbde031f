"""The run's rendezvous keys: a key-value store in an actor, reached only through Ray.

torch.distributed sets a group up (gloo's pairs, NCCL's unique id, ``new_group``'s barriers) through a
key-value store. ``RendezvousKeys`` holds the run's keys beside the Controller; every rank reaches them
with ``RayStore`` (actors/rendezvous/store.py), a ``torch.distributed.Store`` whose every operation is a call
to this actor, so Ray's own authentication (its token) decides who may read or write them. Nothing
here listens on a port of its own.

The semantics are TCPStore's: values are bytes, ``add`` keeps a decimal counter, ``compare_set`` on a
missing key sets it only when ``expected`` is empty. Waits end at their timeout with None, never
later; the caller turns that into torch's ``DistStoreError``. ``abort`` ends every wait on a generation's
keys at once (RendezvousAborted), which the caller turns into ``DistStoreError`` too. Once a generation has
formed, the keys of those before it are dropped (``forget_generations_before``). The actor is
asynchronous, so any number of ranks may wait at once. It imports no torch: its process starts in about a second.

Example::

    keys = RendezvousKeys.options(**beside_this_process()).remote()     # once per run (WorkerGroup)
    ray.get(keys.set.remote("a", b"1")); ray.get(keys.get.remote("a", timeout_s=5.0))   # b"1"
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylastic.actors.processes.priority import run_at_normal_priority
from raylastic.actors.processes.setup_hook import TRAINS_NOTHING
from raylastic.strategies.group_assignment import generation_prefix

logger = logging.getLogger(__name__)


class RendezvousAborted(Exception):
    """A wait on a key of a generation whose forming was called off (a member was lost while it formed)."""


class RendezvousKeysStore:
    def __init__(self) -> None:
        warning = run_at_normal_priority("run's rendezvous store")  # answers a failure's survivors first
        if warning:
            logger.warning(warning)
        self._values: dict[str, bytes] = {}
        self._aborted: set[str] = set()
        """Key prefixes whose waits end at once, raising RendezvousAborted."""
        self._forgotten: dict[str, int] = {}
        """``<store prefix>/generation/`` -> the generation below which every key was dropped: a late rank's wait on
        one of them ends at once, as a called-off one does, and what it sets is not kept."""
        self._changed = asyncio.Condition()
        self._rank_keys: dict[str, dict[str, bytes]] = {}
        """The keys that are a rank's (``rank_key_parent``), by their parent."""

    async def set(self, key: str, value: bytes) -> None:
        await self._store(key, value)

    async def abort(self, prefix: str) -> None:
        """Every wait on a key under ``prefix`` (``<prefix>/...``), now or later, raises RendezvousAborted: the
        Controller gave up on that generation, and its other ranks must not wait out their timeout for a lost
        member's key (the member's death does not end a wait on the store)."""
        async with self._changed:
            self._aborted.add(prefix + "/")
            self._changed.notify_all()

    async def get(self, key: str, timeout_s: float) -> bytes | None:
        """``key``'s value once it is set; None if it is not within ``timeout_s``."""
        if await self._until([key], lambda: key in self._values, timeout_s):
            return self._values[key]
        return None

    async def wait(self, keys: list[str], timeout_s: float) -> dict[str, bytes] | None:
        """The values of ``keys`` once every one is set (a rank's ``get`` of them usually follows: it saves
        those calls), and of the peers' keys set so far beside any that is a rank's (``rank_key_parent``: gloo
        waits for every peer's address in turn, so the first wait brings most of them; O(N) calls to form a group
        of N, not O(N^2)); None if they are not all set within ``timeout_s``."""
        if not await self._until(keys, lambda: all(key in self._values for key in keys), timeout_s):
            return None
        values: dict[str, bytes] = {}
        for parent in {rank_key_parent(key) for key in keys} - {None}:
            values.update(self._rank_keys.get(parent, {}))
        return values | {key: self._values[key] for key in keys}

    async def add(self, key: str, amount: int) -> int:
        value = int(self._values.get(key, b"0")) + amount
        await self._store(key, str(value).encode())
        return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` if it was set (``key`` held ``expected``, or was missing and ``expected`` is empty),
        else what ``key`` holds (``expected`` if it is missing)."""
        current = self._values.get(key)
        if current == expected or (current is None and expected == b""):
            await self._store(key, desired)
            return desired
        return expected if current is None else current

    async def forget_generations_before(self, store_prefix: str, generation: int) -> int:
        """Drop every key, and every called-off mark, of ``store_prefix``'s generations before ``generation`` (it
        formed: their groups are gone), so a run's store holds about one generation's keys however many times it
        recovers. Returns how many keys went."""
        base = f"{store_prefix}/generation/"
        async with self._changed:
            self._forgotten[base] = max(generation, self._forgotten.get(base, 0))
            gone = [key for key in self._values if self._is_forgotten(key)]
            for key in gone:
                del self._values[key]
            self._rank_keys = {parent: keys for parent, keys in self._rank_keys.items()
                               if not self._is_forgotten(parent)}
            self._aborted = {prefix for prefix in self._aborted if not self._is_forgotten(prefix)}
            self._changed.notify_all()
        return len(gone)

    def _is_forgotten(self, key: str) -> bool:
        """Whether ``key`` is of a generation ``forget_generations_before`` dropped."""
        for base, below in self._forgotten.items():
            if key.startswith(base):
                number = key[len(base):].split("/", 1)[0]
                return number.isdecimal() and int(number) < below
        return False

    def check(self, keys: list[str]) -> bool:
        return all(key in self._values for key in keys)

    def delete_key(self, key: str) -> bool:
        self._rank_keys.get(rank_key_parent(key) or "", {}).pop(key, None)
        return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._values)

    def list_keys(self) -> list[str]:
        return sorted(self._values)

    async def _store(self, key: str, value: bytes) -> None:
        if self._is_forgotten(key):  # a late rank of a generation gone: nobody reads it
            return
        async with self._changed:
            self._values[key] = value
            if (parent := rank_key_parent(key)) is not None:
                self._rank_keys.setdefault(parent, {})[key] = value
            self._changed.notify_all()

    async def _until(self, keys: list[str], ready: Callable[[], bool], timeout_s: float) -> bool:
        def aborted() -> bool:
            return any(self._is_forgotten(key) or any(key.startswith(prefix) for prefix in self._aborted)
                       for key in keys)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: aborted() or ready()),
                                       timeout=max(0.0, timeout_s))
            except asyncio.TimeoutError:  # noqa: UP041 - not TimeoutError itself on Python 3.10
                return False
            if aborted():
                raise RendezvousAborted(f"the rendezvous of {keys} was called off: a member was lost while the "
                                        "group formed, or a later generation formed")
        return True


def rank_key_parent(key: str) -> str | None:
    """``<parent>`` of a key ``<parent>/<n>`` that is one rank's in a group forming: gloo's address of rank n
    (``<group prefix>/<device>/<n>``), NCCL's n-th unique id. Each is set once, by one rank, so a copy fetched
    early is never stale. None for any other key (counters, barriers)."""
    parent, _, last = key.rpartition("/")
    return parent if parent and last.isdecimal() else None


def call_off_generation(keys: Any, store_prefix: str, generation: int) -> None:
    """A member of the forming ``generation`` was lost: every wait on its keys in ``keys`` (the actor) ends now."""
    keys.abort.remote(generation_prefix(store_prefix, generation))


def forget_generations_before(keys: Any, store_prefix: str, generation: int) -> None:
    """``generation`` formed: the keys of the ones before it in ``keys`` (the actor) go."""
    keys.forget_generations_before.remote(store_prefix, generation)


RendezvousKeys = ray.remote(num_cpus=0, max_restarts=0)(RendezvousKeysStore)
"""The actor; it lives as long as the actor that created it (the Controller)."""


def beside_this_process() -> dict:
    """Actor options: on this process's node (the Controller's, which goes only with the Controller), in a
    process that skips the training modules' imports (it needs none of them)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=False),
            "runtime_env": TRAINS_NOTHING}
