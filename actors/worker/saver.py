"""A worker's checkpoint saves: periodic ones in the background while training goes on, and the
Controller's ``save_checkpoint``, which reuses the loop's save of the same step.

One save is in flight at a time, on the generation's own gloo group (an async save must not share
the training group). Rank 0 reports each periodic save to the worker's status mailbox: a
"checkpointed" event when it completes, or "checkpoint_failed" with the cause (the run carries on
and the next save tries again)::

    saver = AsyncSaver(checkpointer, strategy=strategy, scaler=None, status=status)
    saver.attach(state, checkpoint_group)  # after joining a generation
    saver.after_step(step)                 # in the step loop: starts a save when checkpoint.every_steps says
    saver.after_step(step, asked=True)     # ... or a time-based one the ranks voted for (always in the background)
    path = saver.save_now(step)            # collective: this step's checkpoint, written once
    saver.detach()                         # before leaving the generation
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylastic.actors.status.run import Event
from raylastic.actors.worker.mailbox import StatusMailbox
from raylastic.strategies.base import Strategy, TrainState, scaler_entries
from raylastic.strategies.checkpoint import Checkpointer, CheckpointWriteError
from raylastic.strategies.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class _Save:
    step: int
    future: Future
    """Resolves to the checkpoint's directory, or to the error that failed it."""


class AsyncSaver:
    def __init__(self, checkpointer: Checkpointer, *, strategy: Strategy, scaler: torch.amp.GradScaler | None,
                 status: StatusMailbox) -> None:
        self.checkpointer = checkpointer
        self.strategy = strategy
        self.scaler = scaler
        self.status = status
        self._state: TrainState | None = None
        self._group: dist.ProcessGroup | None = None
        self._layout: ParallelLayout | None = None
        self._pending: Future | None = None
        """The save not yet waited for."""
        self._last: _Save | None = None
        """This generation's newest save, which ``save_now`` of the same step reuses."""
        self._asked = False
        """A time-based save was voted for and waits for a step the checkpoint settings allow."""

    def attach(self, state: TrainState, group: dist.ProcessGroup, layout: ParallelLayout | None = None) -> None:
        """Save ``state`` from now on, writing on ``group`` (the generation's gloo group); ``layout``: the
        generation's model-parallel layout, recorded in the manifest."""
        self._state, self._group, self._layout = state, group, layout

    def detach(self) -> None:
        """Let a save in flight end, then forget the generation: its state and group must be collectable."""
        self.wait()
        self._last, self._asked = None, False
        self._state, self._group, self._layout = None, None, None

    def saves_after(self, step: int, *, asked: bool = False) -> bool:
        """Whether ``after_step(step, asked=asked)`` starts a save (the training loop reads its steps first)."""
        return ((self._asked or asked) and self.checkpointer.may_save_at(step)) or self.checkpointer.due(step)

    def after_step(self, step: int, *, asked: bool = False) -> None:
        """Start the periodic save of ``step`` if one is due, once the previous one has ended. ``asked``: the
        ranks voted for a time-based save after this step (the same on every rank); it is taken at the first step
        from here that the settings allow (``may_save_at``), in the background whatever checkpoint.async_save."""
        self._asked = self._asked or asked
        timed = self._asked and self.checkpointer.may_save_at(step)
        if timed or self.checkpointer.due(step):
            self.wait()
            self._start(step, asynchronous=True if timed else None)
            self._asked = False

    def save_now(self, step: int) -> str:
        """Collective: write ``step``'s checkpoint now (unless the loop already did) and wait for it."""
        if self._last is not None and self._last.step == step:
            try:
                return self._last.future.result()
            except BaseException:  # noqa: BLE001 - that save failed: write it again
                pass
        self.wait()
        return self._start(step, record=False).result()

    def wait(self) -> None:
        """Let an async save in flight finish (or fail: its directory then has no manifest)."""
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException:  # noqa: BLE001 - reported by its callback; an incomplete checkpoint is never loaded
                pass
            self._pending = None

    def _start(self, step: int, *, record: bool = True, asynchronous: bool | None = None) -> Future:
        """Start ``step``'s save; with ``record`` (a periodic save), rank 0 reports how it ended. ``asynchronous``:
        in the background or not (None: as checkpoint.async_save says)."""
        started, reporter = time.perf_counter(), record and dist.get_rank() == 0
        try:
            future = self.checkpointer.save(
                step, {**self.strategy.state_dict(self._state), **scaler_entries(self.scaler)},
                strategy=self.strategy.name, world_size=dist.get_world_size(), group=self._group,
                layout=dataclasses.asdict(self._layout) if self._layout is not None else None,
                asynchronous=asynchronous)
        except CheckpointWriteError as error:  # every rank gets it: DCP gathers the ranks' write results
            future = Future()
            future.set_exception(error)

        def report(done: Future) -> None:
            if not reporter:
                return
            error = done.exception()
            if error is None:
                event = Event("checkpointed", step, details={"path": done.result(),
                                                             "duration_s": round(time.perf_counter() - started, 4)})
            else:
                event = Event("checkpoint_failed", step,
                              details={"path": self.checkpointer.directory(step), "error": str(error)})
            self.status.post_event(event)

        future.add_done_callback(report)
        self._pending = future
        self._last = _Save(step, future)
        return future
