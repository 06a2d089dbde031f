"""What a process has imported, asked of an actor with ``actor.__ray_call__.remote(training_imports)``. A module of
its own: unpickling the function imports its module in the actor's process, and this one imports nothing."""

from __future__ import annotations

import sys


def training_imports(_actor: object) -> dict:
    """Whether the job's setup hook imported the training modules here, and whether torch is imported at all."""
    warm_start = sys.modules.get("raylastic.actors.processes.setup_hook")
    return {"imported": warm_start is not None and warm_start.imported is not None, "torch": "torch" in sys.modules,
            "dynamo": "torch._dynamo" in sys.modules}

