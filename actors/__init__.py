"""Raylastic's actors, one folder per role. Each role's docstring says what it owns and which other roles
it may import (tests/test_layering.py holds them to it); the order below is the layering, each role importing
only roles above it:

- ``status/``: what the run reports (events, statuses, results), shared by every role;
- ``data/``: the sample order, batches and batch shares;
- ``faults/``: injected faults (test and demo machinery);
- ``processes/``: the processes workers run in (imports ahead, priority, malloc);
- ``rendezvous/``: the run's key-value store, reached through Ray;
- ``worker/``: the TrainWorker, its training loop and its one step;
- ``worker_group/``: the Controller's handle on its workers;
- ``controller/``: the state machine and its policies;
- ``async_ps/``: asynchronous training on parameter servers, its own Controller, servers and workers.
"""
