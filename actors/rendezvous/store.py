"""``RayStore``: a ``torch.distributed.Store`` whose every operation is a call to the run's ``RendezvousKeys``.

A TCPStore answers whoever reaches its port, and lists its keys to them. A RayStore opens no port: its
operations travel over Ray's authenticated channel to the actor that holds the run's keys
(actors/rendezvous/keys.py). gloo and NCCL call it from C++ while a group forms (a ``set``, then a blocking
``wait`` and ``get`` per peer, most of them answered from what an earlier wait brought), never inside a
collective.

Every call is bounded: a blocking ``get`` or ``wait`` by the store's timeout (the group's), any other by
that timeout too, plus ``RPC_MARGIN_S`` for the call itself; past it, if the actor is gone, or if the
Controller called the generation's rendezvous off, it raises ``torch.distributed.DistStoreError`` naming
the key, as TCPStore does.

Keep the object referenced until the group built on it is destroyed: the group holds only the C++ side.

Example::

    store = RayStore(keys, timeout=timedelta(seconds=30))    # keys: the run's RendezvousKeys actor
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=n)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist

from raylastic.actors.rendezvous.keys import RendezvousAborted

RPC_MARGIN_S = 30.0
"""How much longer than the store's timeout a call may take before the actor is taken as unreachable."""


class RayStore(dist.Store):
    def __init__(self, keys: Any, *, timeout: timedelta) -> None:
        super().__init__()
        self.keys = keys
        self.set_timeout(timeout)
        self.calls = 0
        """Calls made to the actor: forming a group over gloo's full mesh costs a rank a few (its address, then a
        wait that brings every peer's address set by then), not one per peer."""
        self._waited: dict[str, bytes] = {}
        """Values a ``wait`` brought along, each served once to the ``get`` that follows it (gloo and NCCL wait
        for a peer's key, then get it; their keys are set once per group)."""
        self._peers: dict[str, bytes] = {}
        """Other ranks' keys a ``wait`` brought along (``RendezvousKeysStore.wait``): a later wait for one of them
        is answered here, without a call."""

    def set(self, key: str, value: str | bytes) -> None:
        self._forget(key)
        self._call("set", key, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        if key in self._waited:
            return self._waited.pop(key)
        value = self._call("get", key, key, self._timeout_s())
        if value is None:
            raise dist.DistStoreError(f"rendezvous store: key {key!r} was not set within {self._timeout_s():.0f} s")
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if all(key in self._peers or key in self._waited for key in keys):
            self._waited.update({key: self._peers.pop(key) for key in keys if key in self._peers})
            return
        timeout_s = self._timeout_s() if timeout is None else timeout.total_seconds()
        values = self._call("wait", keys, keys, timeout_s, timeout_s=timeout_s)
        if values is None:
            raise dist.DistStoreError(f"rendezvous store: keys {keys} were not all set within {timeout_s:.0f} s")
        for key, value in values.items():
            (self._waited if key in keys else self._peers)[key] = value

    def add(self, key: str, amount: int) -> int:
        self._forget(key)
        return self._call("add", key, key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._forget(key)
        return self._call("compare_set", key, key, _as_bytes(expected), _as_bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys, keys)

    def delete_key(self, key: str) -> bool:
        self._forget(key)
        return self._call("delete_key", key, key)

    def num_keys(self) -> int:
        return self._call("num_keys", "")

    deleteKey = delete_key  # noqa: N815 - the names torch's C++ store calls
    getNumKeys = num_keys  # noqa: N815

    def _forget(self, key: str) -> None:
        self._waited.pop(key, None)
        self._peers.pop(key, None)

    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def _call(self, method: str, about: str | list[str], *args: Any, timeout_s: float | None = None) -> Any:
        bound_s = (self._timeout_s() if timeout_s is None else timeout_s) + RPC_MARGIN_S
        self.calls += 1
        try:
            return ray.get(getattr(self.keys, method).remote(*args), timeout=bound_s)
        except ray.exceptions.GetTimeoutError:
            raise dist.DistStoreError(f"rendezvous store: {method}({about!r}) had no answer within {bound_s:.0f} s"
                                      ) from None
        except ray.exceptions.RayError as error:
            if isinstance(getattr(error, "cause", None), RendezvousAborted):
                raise dist.DistStoreError(f"rendezvous store: {error.cause}") from None
            raise dist.DistStoreError(f"rendezvous store: {method}({about!r}) failed: {type(error).__name__}: "
                                      f"{error}") from None


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
