"""The data side of a step, the same on every rank: the global sample order (``order.py``), the batches a
rank's share of a step reads (``batches.py``, ``batch_split.py``), batch shares by measured speed
(``balance.py``, a pure policy) and the per-step compute clock it is fed from (``compute_clock.py``).

May import (of actors/): nothing.
"""
