"""A parameter server's checkpoint file read back, checked as a manifest's files are: before it is opened, it must be
a regular file in its ``ps_<version>`` directory (no named pipe, device, directory or symbolic link out of it:
strategies/checkpoint_manifest.py's ``file_problem``), so that a planted FIFO cannot block the reader; once read
(tensors and plain values only), it must hold what a server writes. Anything else is UnreadableCheckpoint naming the
file and what is wrong: a run's restore then takes an older cut (the Controller), ``raylastic export`` fails
saying so. The model a cut makes (``model_state``) checks that every tied name points at a weight the cut holds.

Example::

    saved = read_server_file("runs/x/checkpoints/ps_00000100/server_0_of_2.18f3a.pt")   # {"params": {...}, ...}
    state = model_state(newest_complete("runs/x/checkpoints"))                          # a plain state dict
"""

from __future__ import annotations

from typing import Any

import fsspec
import torch

from raylastic.actors.async_ps.checkpoints import Cut
from raylastic.actors.async_ps.shards import merged_shares
from raylastic.strategies.checkpoint_manifest import file_problem


class UnreadableCheckpoint(ValueError):
    """A file of the cut to restore cannot be read, or is not what its name says: the Controller takes an older cut."""


REQUIRED: dict[str, type] = {"config_hash": str, "version": int, "tickets": list, "params": dict,
                             "optimizer": dict}
"""What every server file holds (``ParameterServer._submit_save``), and the type of each."""
OPTIONAL: dict[str, type] = {"lineage": str, "prediction": dict, "tied": dict}
"""What files written by earlier versions may lack."""


def read_server_file(path: str) -> dict[str, Any]:
    """The contents of server file ``path``, checked (UnreadableCheckpoint naming it and what is wrong)."""
    directory, _, name = path.rpartition("/")
    if (problem := file_problem(directory, name)) is not None:
        raise UnreadableCheckpoint(f"{path} is refused: {problem}")
    fs, local = fsspec.core.url_to_fs(path)
    try:
        with fs.open(local, "rb") as handle:
            saved = torch.load(handle, weights_only=True)
    except Exception as error:  # noqa: BLE001 - a missing, truncated or foreign file: the cut is not loadable
        raise UnreadableCheckpoint(f"{path} could not be read: {type(error).__name__}: {error}") from None
    if (problem := contents_problem(saved)) is not None:
        raise UnreadableCheckpoint(f"{path} is not a parameter server's checkpoint: {problem}")
    return saved


def contents_problem(saved: object) -> str | None:
    """Why ``saved`` (a loaded server file) is not what a server writes, or None."""
    if not isinstance(saved, dict):
        return f"it holds a {type(saved).__name__}, not a dict"
    for key in REQUIRED:
        if key not in saved:
            return f"it has no {key!r}"
    for key, kind in (REQUIRED | OPTIONAL).items():
        if key in saved and (not isinstance(saved[key], kind) or isinstance(saved[key], bool)):
            return f"its {key!r} is a {type(saved[key]).__name__}, not a {kind.__name__}"
    if bad := [name for name, value in saved["params"].items()
               if not isinstance(name, str) or not isinstance(value, torch.Tensor)]:
        return f"its 'params' entry {bad[0]!r} is not a tensor by a parameter's name"
    if bad := [alias for alias, name in saved.get("tied", {}).items()
               if not isinstance(alias, str) or not isinstance(name, str)]:
        return f"its 'tied' entry {bad[0]!r} is not a name mapped to a name"
    optimizer = saved["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list):
        return "its 'optimizer' is not an optimizer's state dict (a 'state' dict and a 'param_groups' list)"
    return None


def model_state(cut: Cut) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers in ``cut``'s files, by their ``state_dict`` names (a tied weight under each
    of its names), as a plain state dict."""
    saved = {path: read_server_file(path) for path in cut.files()}
    state = merged_shares(file["params"] for file in saved.values())
    for path, file in saved.items():
        for alias, name in file.get("tied", {}).items():
            if name not in state:
                raise UnreadableCheckpoint(f"{path} ties {alias!r} to {name!r}, which no file of {cut.directory} "
                                           "holds")
            state[alias] = state[name]
    return state

