"""What the authenticated rendezvous costs a generation's formation, against the TCPStore it replaced.

N Ray actors (the ranks) form a gloo group the way a worker's ``join`` does (``join_group``, then the
checkpoint group with ``dist.new_group``), leave it, and form the next generation, alternately through:

- tcp: a ``torch.distributed.TCPStore`` hosted by the driver (as the Controller hosted it), one port, no
  authentication;
- ray: a ``RayStore`` over the run's ``RendezvousKeys`` actor (actors/rendezvous/store.py), every operation a Ray
  call over Ray's authenticated channel.

A formation's time is the driver's, from sending every rank its assignment to the last rank's return;
rounds alternate which store goes first; medians. The goal (issue 30): within 50 ms of TCPStore at 4
ranks.

Then the same again with every core busy (one spinning process per core, at the ranks' priority, as two
training ranks keep a 2-core machine), and how long a rank waits for each store's answer under that load: a
``set`` then a ``get`` of a fresh key, one after the other (the store is what a failure's survivors need
first). Run from the repository root (~2 minutes on 2 cores)::

    .venv/bin/python -m benchmarks.rendezvous                 # 4 ranks, 20 rounds
    .venv/bin/python -m benchmarks.rendezvous --ranks 2 --rounds 5

Writes benchmarks/results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import ray
import torch.distributed as dist

from benchmarks.common import RESULTS, alternated, machine_info
from raylastic.actors.rendezvous.keys import RendezvousKeys
from raylastic.actors.rendezvous.store import RayStore
from raylastic.cluster.connect import ray_session
from raylastic.strategies.group_assignment import GroupAssignment, new_store_prefix
from raylastic.strategies.process_group import join_group, leave_group

GOAL_EXTRA_S = 0.050
TIMEOUT_S = 60.0
STORES = ("tcp", "ray")
PROBES = 200
"""Store answers timed per store under load."""


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self) -> None:
        self.stores: list[dist.Store] = []

    def form(self, assignment: GroupAssignment, tcp_port: int | None) -> None:
        timeout = timedelta(seconds=assignment.timeout_s)
        store = (dist.TCPStore("127.0.0.1", tcp_port, is_master=False, timeout=timeout) if tcp_port is not None
                 else RayStore(assignment.store, timeout=timeout))
        self.stores.append(store)
        join_group(assignment, "gloo", store)
        dist.new_group(backend="gloo", timeout=timeout)  # the worker's checkpoint group

    def leave(self) -> None:
        leave_group()

    def answer_times_s(self, keys: object, tcp_port: int | None, count: int) -> list[float]:
        """Seconds for each of ``count`` set-then-get pairs of fresh keys through one store."""
        timeout = timedelta(seconds=TIMEOUT_S)
        store = (dist.TCPStore("127.0.0.1", tcp_port, is_master=False, timeout=timeout) if tcp_port is not None
                 else RayStore(keys, timeout=timeout))
        times = []
        for index in range(count):
            started = time.perf_counter()
            store.set(f"probe/{os.getpid()}/{index}", b"x")
            store.get(f"probe/{os.getpid()}/{index}")
            times.append(time.perf_counter() - started)
        return times


@contextlib.contextmanager
def every_core_busy():
    """One spinning process per core while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def formation_s(ranks: list, generation: int, kind: str, keys: object, tcp: dist.TCPStore, prefix: str) -> float:
    started = time.perf_counter()
    ray.get([rank.form.remote(GroupAssignment(generation=generation, rank=index, world_size=len(ranks), store=keys,
                                              store_prefix=prefix, timeout_s=TIMEOUT_S),
                              tcp.port if kind == "tcp" else None) for index, rank in enumerate(ranks)],
            timeout=2 * TIMEOUT_S)
    elapsed = time.perf_counter() - started
    ray.get([rank.leave.remote() for rank in ranks], timeout=TIMEOUT_S)
    return elapsed


def formations(ranks: list, keys: object, tcp: dist.TCPStore, prefix: str, generation: int, rounds: int,
               load: str) -> tuple[dict, int]:
    """``rounds`` formations through each store, alternating which goes first: their figures, and the next
    generation number."""
    times: dict[str, list[float]] = {kind: [] for kind in STORES}
    for round_index in range(rounds):
        for kind in alternated(STORES, round_index):
            times[kind].append(formation_s(ranks, generation, kind, keys, tcp, prefix))
            generation += 1
        print(f"{load}, round {round_index + 1}/{rounds}: "
              + ", ".join(f"{k} {times[k][-1] * 1000:.1f} ms" for k in STORES), flush=True)
    return {"formation_s": {kind: [round(v, 5) for v in values] for kind, values in times.items()},
            "median_formation_ms": {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()},
            "max_formation_ms": {k: round(max(v) * 1000, 1) for k, v in times.items()}}, generation


def measure(num_ranks: int, rounds: int) -> dict:
    ranks = [Rank.remote() for _ in range(num_ranks)]
    keys = RendezvousKeys.remote()
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    prefix = new_store_prefix()
    generation = 0
    for kind in STORES:  # warm-up: imports, first connections
        formation_s(ranks, generation, kind, keys, tcp, prefix)
        generation += 1
    idle, generation = formations(ranks, keys, tcp, prefix, generation, rounds, "idle")
    with every_core_busy():
        loaded, _ = formations(ranks, keys, tcp, prefix, generation, rounds, "every core busy")
        answers = {kind: ray.get(ranks[0].answer_times_s.remote(keys, tcp.port if kind == "tcp" else None, PROBES),
                                 timeout=PROBES * TIMEOUT_S) for kind in STORES}
    loaded["store_answer_ms"] = {kind: {"median": round(statistics.median(v) * 1000, 2),
                                        "p99": round(sorted(v)[int(0.99 * len(v))] * 1000, 2),
                                        "max": round(max(v) * 1000, 2)} for kind, v in answers.items()}
    extra_ms = idle["median_formation_ms"]["ray"] - idle["median_formation_ms"]["tcp"]
    return {"ranks": num_ranks, "rounds": rounds, **idle, "extra_ms": round(extra_ms, 1),
            "goal_extra_ms": GOAL_EXTRA_S * 1000, "meets_goal": extra_ms <= GOAL_EXTRA_S * 1000,
            "under_load": loaded | {"spinning_processes": os.cpu_count(), "probes": PROBES}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks in the group (default 4)")
    parser.add_argument("--rounds", type=int, default=20, help="formations per store (default 20)")
    args = parser.parse_args(argv)
    with ray_session(min_cpus=args.ranks):
        result = measure(args.ranks, args.rounds)
    result["command"] = "python -m benchmarks.rendezvous " + " ".join(sys.argv[1:] if argv is None else argv)
    result["machine"] = machine_info()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rendezvous.json").write_text(json.dumps(result, indent=2) + "\n")
    medians = result["median_formation_ms"]
    print(f"formation at {args.ranks} ranks: TCPStore {medians['tcp']} ms, RayStore {medians['ray']} ms: "
          f"+{result['extra_ms']} ms (goal: within {GOAL_EXTRA_S * 1000:.0f})")
    loaded = result["under_load"]
    print(f"every core busy: formation TCPStore {loaded['median_formation_ms']['tcp']} ms, RayStore "
          f"{loaded['median_formation_ms']['ray']} ms; a set and a get, median / max: "
          + ", ".join(f"{kind} {a['median']} / {a['max']} ms" for kind, a in loaded["store_answer_ms"].items()))


if __name__ == "__main__":
    main()
