"""The run's checkpoints as the Controller sees them: which one to resume or restore, whether it is this
job's, and where the last one is (for every error message).

Example::

    checkpoints = RunCheckpoints(root="runs/digits/checkpoints", config_hash=job.math_hash(), log=log)
    found = checkpoints.newest(max_step=120)    # the newest intact one at or below step 120, or None
    checkpoints.note()                          # "; last checkpoint: .../step_00000120 (step 120)"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.events import RunLog
from strategies.checkpoint import Checkpoint, latest_checkpoint, newest_loadable


class ForeignCheckpoint(ValueError):
    """A checkpoint written by another job (workload, optimizer, global batch or seed)."""


@dataclass(frozen=True, kw_only=True)
class RunCheckpoints:
    root: str
    config_hash: str
    """The job's ``math_hash()``: what a checkpoint must have been written by to be loaded."""
    log: RunLog

    def newest(self, *, max_step: int | None = None, at_step: int = 0) -> Checkpoint | None:
        """The newest intact checkpoint (of at most ``max_step``); newer ones that fail verification are
        reported (as of the run's ``at_step``) and skipped."""
        found, rejected = newest_loadable(self.root, max_step)
        for bad in rejected:
            self.log.event("checkpoint_rejected", at_step, path=bad.path, reason=bad.reason)
        return found

    def require_same_job(self, found: Checkpoint) -> None:
        if found.manifest.config_hash != self.config_hash:
            raise ForeignCheckpoint(f"checkpoint {found.path} was written by a job with another workload, "
                                    "optimizer, global batch or seed; use another --run-dir or checkpoint.path")

    def note(self) -> str:
        """Where the last checkpoint is, for the end of an error message."""
        found = latest_checkpoint(self.root)
        if found is None:
            return "; no checkpoint was written yet (checkpoint.every_steps)"
        return f"; last checkpoint: {found.path} (step {found.manifest.step})"

def default_checkpoint_root(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve() / "checkpoints")
