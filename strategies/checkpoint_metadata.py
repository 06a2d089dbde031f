"""Reading DCP's pickled ``.metadata`` without running code from it.

DCP pickles a checkpoint's ``.metadata``; a planted checkpoint could make unpickling run anything,
and its manifest's checksums cannot help if the manifest is planted too. This module unpickles only
an exact list of (module, name) pairs and refuses entries stored as pickled bytes, which DCP would
``torch.load(weights_only=False)``.

Example::

    dcp.load(state_dict, storage_reader=safe_reader("runs/x/checkpoints/step_00000120"))
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata``; unpickle only the plain classes that file is made of, so a planted
    checkpoint cannot run code (the manifest's checksums cannot help if it is planted too). The list is
    what DCP's metadata of every strategy's checkpoints holds (torch 2.13), and tensors' dtypes."""

    ALLOWED = {("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # the latter: Python 3.13+
               ("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               *(("torch.distributed.checkpoint.metadata", name) for name in (
                   "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorStorageMetadata",
                   "TensorProperties", "_MEM_FORMAT_ENCODING", "BytesStorageMetadata")),
               *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))}
    """BytesStorageMetadata unpickles only to be refused with its reason (see ``load_metadata``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:  # exact names: a dotted one ("os.system") is never among them
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def load_metadata(handle: Any) -> Metadata:
    """DCP's ``.metadata`` from ``handle``, refused unless it is DCP's plain classes and tensors only."""
    metadata = _MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP's Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):  # DCP would torch.load(weights_only=False) those bytes
            raise pickle.UnpicklingError(f"checkpoint metadata stores {key!r} as pickled bytes, which loading "
                                         "would unpickle (running any code in them); checkpoints hold tensors only")
    return metadata


class _SafeMetadata:
    """Mixed into DCP's readers: read ``.metadata`` with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as handle:
            metadata = load_metadata(handle)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    pass


class _SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


def safe_reader(directory: str) -> FileSystemReader | FsspecReader:
    """DCP's reader for ``directory`` (a path or an fsspec URL), reading ``.metadata`` safely."""
    return _SafeFsspecReader(directory) if "://" in str(directory) else _SafeFileSystemReader(directory)
