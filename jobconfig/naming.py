"""Names in Ray: the namespace every Raylastic driver uses, and the names of each run's actors.

A run's Controller, workers and slots (placement groups) carry the run's name, so ``ray list actors``
and the dashboard show whose they are, ``raylastic status`` finds a run by its Controller, and a
second run of the same name on one cluster is refused before it starts.

Example::

    ray.get_actor(controller_name("digits"), namespace=NAMESPACE)   # "raylastic:digits:controller"
"""

from __future__ import annotations

from typing import Any

NAMESPACE = "raylastic"
"""The Ray namespace of every run's actors (named actors are unique within a namespace)."""
RUN_NAME_CHARACTERS = "letters, digits, '-' and '_'"
"""What a run name may hold: no ':', which separates the parts of an actor's name."""
_PREFIX = "raylastic:"
_CONTROLLER = "controller"


def is_run_name(name: Any) -> bool:
    """Whether ``name`` can name a run (see RUN_NAME_CHARACTERS)."""
    return isinstance(name, str) and name.replace("-", "").replace("_", "").isalnum()


def run_prefix(run: str) -> str:
    """What the name of every actor and placement group of run ``run`` starts with."""
    return f"{_PREFIX}{run}:"


def controller_name(run: str) -> str:
    return f"{run_prefix(run)}{_CONTROLLER}"


def worker_name(run: str, number: int) -> str:
    """The ``number``-th worker the run started (1-based; a replacement gets the next number)."""
    return f"{run_prefix(run)}worker{number}"


def slot_name(run: str, number: int) -> str:
    """The placement group of the run's ``number``-th worker slot (1-based)."""
    return f"{run_prefix(run)}slot{number}"


def run_of_controller(actor_name: str) -> str | None:
    """The run whose Controller is named ``actor_name``; None for any other actor."""
    suffix = f":{_CONTROLLER}"
    if actor_name.startswith(_PREFIX) and actor_name.endswith(suffix):
        return actor_name[len(_PREFIX):-len(suffix)]
    return None


def trial_run_name(sweep: str, trial_id: str) -> str:
    """The name of the job a sweep's trial runs."""
    return f"{sweep}-{trial_id}"
