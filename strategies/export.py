"""Export a sharded checkpoint as one ordinary state-dict file that loads without this project.

Example::

    raylastic export runs/digits/checkpoints/step_00000300 model.pt
    model.load_state_dict(torch.load("model.pt", weights_only=True))
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raylastic.strategies.atomic_file import write_atomically
from raylastic.strategies.checkpoint_manifest import MANIFEST_NAME, file_problem, read_manifest, verify
from raylastic.strategies.checkpoint_metadata import safe_reader

MODEL_PREFIX = "model."


def load_full_model_state(directory: str) -> dict[str, torch.Tensor]:
    """The model's full tensors from a checkpoint (any strategy, any world size), in this process. A
    directory without a valid manifest, or whose files do not match it, raises ValueError saying why."""
    manifest = read_manifest(directory)
    if manifest is None:
        why = file_problem(directory, MANIFEST_NAME) or f"{MANIFEST_NAME} is not a valid manifest"
        raise ValueError(f"{directory} is not a complete checkpoint: {why}")
    problem = verify(directory, manifest)
    if problem is not None:
        raise ValueError(f"{directory} is damaged: {problem}")
    reader = safe_reader(directory)
    metadata = reader.read_metadata()
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=safe_reader(directory), no_dist=True)
    return {key.removeprefix(MODEL_PREFIX): tensor for key, tensor in state.items()}


def export_model(state: dict[str, torch.Tensor], output: str | Path) -> Path:
    """Write a checkpoint's model ``state`` (``load_full_model_state``'s) as a plain ``torch.save`` file at
    ``output``, atomically: a write that fails (a full disk) leaves no torn file there."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(output, lambda handle: torch.save(state, handle))
