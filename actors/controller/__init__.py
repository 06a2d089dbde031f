"""The Controller: the run's state machine (``controller.py``: the transitions; ``states.py``: the states),
every decision as a pure function (``policies.py``), the run's log of events and committed steps
(``run_log.py``), its metrics, its checkpoints (``run_checkpoints.py``; the time-based one:
``timed_checkpoints.py``), what each poll brings in
(``poll_intake.py``), batch shares across generations (``share_book.py``) and planned departures
(``drains.py``). Imports no torch.

May import (of actors/): status, data, faults, processes, rendezvous, worker_group.
"""
