"""What the run reports, shared by every role: a run's ``RunStatus``, ``Event`` and ``RunResult``
(``run.py``), the Controller's typed snapshot of its workers (``group.py``), and the telling of a lost peer
from an error of the job (``peer_loss.py``). Plain data and pure functions: no Ray calls, no torch.

May import (of actors/): nothing.
"""
