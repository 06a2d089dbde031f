"""``raylastic status [RUN]``: what a running job is doing - its state, members, generation, step, recent events.

Examples::

    raylastic status                      # the runs on the cluster (and the details when there is one)
    raylastic status digits               # one run: state, members (worker, node), generation, step, events
    raylastic status digits --address 10.0.0.5:6379

It finds each run by its Controller actor, ``raylastic:<run>:controller`` in namespace
``raylastic``, and asks it for ``progress()``. Exit 0 when shown, 1 when the run is not found or
the cluster cannot be reached.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console
from rich.markup import escape

from raylastic.actors.status.run import RunStatus
from raylastic.jobconfig.naming import NAMESPACE, controller_name, run_of_controller, run_prefix

RECENT_EVENTS = 10
ANSWER_TIMEOUT_S = 10.0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "status", help="show a running job's members, generation, step and recent events",
        description="Show the runs on a Ray cluster, or one run's members (worker names and node ids), "
        "generation, step, world size, failures and its last events.")
    parser.add_argument("run_name", nargs="?", metavar="RUN",
                        help="run name (the job's `name`); default: list the runs")
    parser.add_argument("--address", default="auto", help="Ray cluster (default: auto, the one `ray start` started "
                        "on this machine, or RAY_ADDRESS)")
    parser.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    out = Console(soft_wrap=True, highlight=False, markup=False)  # events may hold brackets: print them as they are
    errors = Console(stderr=True, soft_wrap=True, highlight=False)
    from raylastic.cluster.connect import ray_session

    try:
        with ray_session(args.address):
            return _show(args.run_name, out, errors)
    except ConnectionError as error:
        errors.print(f"[bold red]error:[/] {escape(str(error))}")
        return 1


def run_names() -> list[str]:
    """Names of the runs whose Controller is alive on the connected cluster, sorted."""
    import ray

    runs = (run_of_controller(a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE)
    return sorted(run for run in runs if run is not None)


@dataclass(frozen=True)
class StatusReport:
    """What ``raylastic status RUN`` shows."""

    status: RunStatus
    """The run's ``progress()``, without its history and with only the recent events."""
    last_row: dict[str, Any] | None
    """The newest step's history row."""
    nodes: dict[str, str]
    """Worker actor name -> node id (empty without Ray's dashboard)."""


def fetch_status(run: str) -> StatusReport:
    import ray

    controller = ray.get_actor(controller_name(run), namespace=NAMESPACE)
    status = _progress_without_history(controller)
    # History rows are in commit order, one per step from the first step this run committed: the
    # latest is at position step-1, or earlier when the run resumed from a checkpoint.
    rows: list[dict[str, Any]] = []
    for since in (max(0, status.step - 1), 0):
        rows = ray.get(controller.progress.remote(history_since=since, events_since=len(status.events)),
                       timeout=ANSWER_TIMEOUT_S).history
        if rows or status.step == 0:
            break
    return StatusReport(replace(status, events=status.events[-RECENT_EVENTS:]), rows[-1] if rows else None,
                        _worker_nodes(run))


def _progress_without_history(controller: Any) -> RunStatus:
    import ray

    past_the_end = 2**62  # no history rows, just the state and the events
    return ray.get(controller.progress.remote(history_since=past_the_end), timeout=ANSWER_TIMEOUT_S)


def summary_line(run: str) -> str:
    import ray

    try:
        controller = ray.get_actor(controller_name(run), namespace=NAMESPACE)
        status = _progress_without_history(controller)
    except (ValueError, ray.exceptions.RayError):
        return f"{run}: ended"
    return (f"{run}: {status.state}, step {status.step}, generation {status.generation}, "
            f"world size {status.world_size}, failures {status.failures}")


def _worker_nodes(run: str) -> dict[str, str]:
    """Worker actor name -> node id, from Ray's state API (needs the dashboard; empty without it)."""
    try:
        from ray.util.state import list_actors

        actors = list_actors(filters=[("ray_namespace", "=", NAMESPACE), ("state", "=", "ALIVE")], limit=10_000,
                             raise_on_missing_output=False)
    except Exception:  # no dashboard (e.g. a local instance): names without nodes
        return {}
    return {a.name: a.node_id for a in actors if a.name and a.name.startswith(run_prefix(run))}


def _show(run: str | None, out: Console, errors: Console) -> int:
    import ray

    runs = run_names()
    if run is None:
        if not runs:
            out.print("no Raylastic runs on this cluster")
            return 0
        for name in runs:
            out.print(summary_line(name))
        if len(runs) > 1:
            return 0
        run = runs[0]
    if run not in runs:
        running = ", ".join(runs) if runs else "none"
        errors.print("[bold red]error:[/] " + escape(
            f"no run named {run!r} is running on this cluster (running: {running}); runs are found by their "
            f"actor {controller_name('<run>')!r} in namespace {NAMESPACE!r}"))
        return 1
    try:
        status = fetch_status(run)
    except (ValueError, ray.exceptions.RayError) as error:  # it ended between listing and asking
        errors.print("[bold red]error:[/] " + escape(f"run {run!r} did not answer: {str(error).splitlines()[0]}"))
        return 1
    print_status(run, status, out)
    return 0


def print_status(run: str, report: StatusReport, out: Console) -> None:
    from raylastic.cluster.progress import format_event

    status = report.status
    layout = f"  layout {status.layout}" if status.layout else ""
    out.print(f"run {run}: {status.state}  step {status.step}  generation {status.generation}  "
              f"world size {status.world_size}{layout}  failures {status.failures}")
    if (row := report.last_row) is not None:
        out.print(f"last step {row['step']}: loss {row['loss']:.4f}  {row['samples_per_s']:.0f} samples/s")
    row = report.last_row if report.last_row and report.last_row.get("world_size") == len(status.members) else {}
    shares, compute = row.get("shares") or [], row.get("compute_s") or []
    out.print("members (rank, worker, node; the last step's share of the samples and compute time):")
    for rank, name in enumerate(status.members):
        measured = f"  {shares[rank]} samples  {compute[rank] * 1000:.1f} ms" if rank < len(compute) else ""
        out.print(f"  {rank}  {name}  {report.nodes.get(name, 'node unknown (no dashboard)')}{measured}")
    out.print(f"recent events (last {RECENT_EVENTS}):")
    for event in status.events:
        out.print(f"  {format_event(event)}")
