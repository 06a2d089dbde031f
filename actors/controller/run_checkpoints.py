"""The run's checkpoints as the Controller sees them: which one to resume or restore, whether it is this
job's, and where the last one is (for every error message).

The Controller reads manifests and file sizes only, never the checkpoint's data (on ``s3://`` that would
bring it all to the head node): the workers that load a checkpoint compare its checksums, each a share of
the files, and a checkpoint they refuse is ``reject``ed here and passed over from then on.

Example::

    checkpoints = RunCheckpoints(root="runs/digits/checkpoints", config_hash=job.math_hash(), log=log)
    found = checkpoints.newest(max_step=120)    # the newest complete one at or below step 120, or None
    checkpoints.reject(found, "__1_0.distcp does not match its checksum", at_step=130)
    checkpoints.note()                          # "; last checkpoint: .../step_00000100 (step 100)"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from raylastic.actors.controller.run_log import RunLog
from raylastic.jobconfig import JobConfig
from raylastic.strategies.checkpoint_catalogue import Checkpoint, CheckpointSettings, Rejected, newest_complete


class ForeignCheckpoint(ValueError):
    """A checkpoint written by another job (workload, optimizer, global batch or seed)."""


@dataclass(kw_only=True)
class RunCheckpoints:
    root: str
    config_hash: str
    """The job's ``math_hash()``: what a checkpoint must have been written by to be loaded."""
    log: RunLog
    rejected: set[str] = field(default_factory=set)
    """Checkpoints refused so far (reported once each)."""

    def newest(self, *, max_step: int | None = None, at_step: int = 0) -> Checkpoint | None:
        """The newest complete checkpoint (of at most ``max_step``) not refused yet; newer ones whose files
        are missing or of the wrong size are reported (as of the run's ``at_step``) and skipped."""
        found, rejected = newest_complete(self.root, max_step, skip=self.rejected)
        for bad in rejected:
            self.reject(bad, bad.reason, at_step=at_step)
        return found

    def reject(self, checkpoint: Checkpoint | Rejected, reason: str, *, at_step: int) -> None:
        """``checkpoint`` must not be loaded (its loaders or the head found ``reason``): reported, never tried
        again."""
        self.rejected.add(checkpoint.path)
        self.log.event("checkpoint_rejected", at_step, path=checkpoint.path, reason=reason)

    def require_same_job(self, found: Checkpoint) -> None:
        if found.manifest.config_hash != self.config_hash:
            raise ForeignCheckpoint(f"checkpoint {found.path} was written by a job with another workload, "
                                    "optimizer, global batch or seed; use another --run-dir or checkpoint.path")

    def resume_point(self, *, at_step: int) -> Checkpoint | None:
        """The checkpoint a starting run resumes from (this job's newest complete one), reported; or None."""
        found = self.newest(at_step=at_step)
        if found is not None:
            self.require_same_job(found)
            self.log.event("resumed", found.manifest.step, path=found.path, saved_world_size=found.manifest.world_size,
                           saved_strategy=found.manifest.strategy)
        return found

    def with_note(self, message: str) -> str:
        """``message``'s first line, the note of where the last checkpoint is, then the rest (a traceback)."""
        first, _, rest = message.partition("\n")
        return f"{first}{self.note()}" + (f"\n{rest}" if rest else "")

    def note(self) -> str:
        """Where the last checkpoint is, for the end of an error message."""
        found = newest_complete(self.root, skip=self.rejected)[0]
        if found is None:
            return "; no checkpoint was written yet (checkpoint.every_steps, checkpoint.every_minutes)"
        return f"; last checkpoint: {found.path} (step {found.manifest.step})"

def checkpoint_settings(job: JobConfig, root: str) -> CheckpointSettings:
    """Where and when ``job``'s training generations save: every ``checkpoint.every_steps`` steps, and a
    time-based checkpoint (asked for by actors/controller/timed_checkpoints.py) at a step a multiple of
    ``strategy.sync_every`` under diloco, of any step otherwise."""
    checkpoint = job.checkpoint
    return CheckpointSettings(root=root, every_steps=checkpoint.every_steps, num_to_keep=checkpoint.num_to_keep,
                              config_hash=job.math_hash(), global_batch_size=job.training.global_batch_size,
                              async_save=checkpoint.async_save,
                              step_multiple=job.strategy.sync_every if job.strategy.name == "diloco" else 1)


def default_checkpoint_root(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve() / "checkpoints")
