"""Asynchronous training with parameter servers (strategy.name=async_ps).

The parameters and the optimizer live in ``strategy.num_servers`` ParameterServer actors, each
holding a share of the parameters by size (``shards.py``). A worker leases a step of the global
sample order from the AsyncController (``tickets.py`` keeps the books), pulls the parameters from
every server, computes the step's gradient on its own and asks to commit it; the Controller admits
it with the next update number unless the parameters it was computed on are more than
``strategy.max_staleness`` updates old (then the step goes back in the queue and is computed again).
The servers apply admitted gradients in update order, so every server's shard sees the same
sequence and staleness is exact. Nothing waits for the slowest worker.

May import (of actors/): status, data, faults, processes, rendezvous, worker, worker_group, controller.
"""
