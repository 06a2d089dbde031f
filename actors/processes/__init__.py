"""The processes workers run in: the job's setup hook that imports the training modules before a worker
is placed (``setup_hook.py``), processes started ahead for the next worker (``warm_processes.py``), CPU priority
(``priority.py``) and malloc thresholds (``allocator.py``).

May import (of actors/): nothing.
"""
