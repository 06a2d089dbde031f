"""The TrainWorker: the Ray actor the Controller starts and calls (``actor.py``, which imports no torch),
the worker it builds in its own process (``train_worker.py``), the training loop (``training_loop.py``),
one step (``step.py``) with its optimizer recipe (``optimizer_recipe.py``), the mailbox the Controller polls
(``mailbox.py``), the stop vote (``stop_vote.py``), the background checkpoint saver (``saver.py``) and
evaluation (``evaluation.py``).

May import (of actors/): status, data, faults, processes, rendezvous.
"""
