"""The Controller's handle on its workers: the group (``group.py``), who is in it and starting
(``membership.py``), where they are placed (``placement.py``), one poll of every member (``poller.py``), and
one call on every member with a bound on every way it can hang (``member_calls.py``). Imports no torch.

May import (of actors/): status, processes, rendezvous, worker.actor (the worker's interface, without torch).
"""
