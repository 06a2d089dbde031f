"""The run's rendezvous, reached only through Ray: the key-value actor beside the Controller (``keys.py``)
and the ``torch.distributed.Store`` every rank reaches it with (``store.py``).

May import (of actors/): processes.
"""
