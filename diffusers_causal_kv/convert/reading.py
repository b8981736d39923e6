"""Reading checkpoint files without holding them twice in memory.

``.pt``/``.pth``/``.bin`` files are opened with ``torch.load(mmap=True, weights_only=True)``: tensors stay views of
the memory-mapped file until something copies them, and no pickled code runs. Safetensors files (one file, a sharded
set with its ``*.safetensors.index.json``, or a folder holding either) are read lazily, one tensor at a time.
:class:`TensorMap` hides the difference: a read-only mapping from key to tensor that also answers shapes and dtypes
without loading anything, and holds tensors computed on access (:class:`Derived`, e.g. dequantized fp8 weights).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors import safe_open

INDEX_SUFFIX = ".safetensors.index.json"

# Wrappers that training code puts around module names: FSDP and activation checkpointing insert a segment
# anywhere in the name, torch.compile and DDP prefix it.
INNER_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
OUTER_PREFIXES = ("module.", "model.", "diffusion_model.")

# The dtype names of the safetensors header; a name missing here (a newer packed type) reads as None: not a float.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Stored:
    """A tensor left in a safetensors file: the file and its name there."""

    path: str
    name: str


@dataclass(frozen=True)
class Derived:
    """A tensor computed from stored ones when it is accessed (a dequantized weight): its shape, dtype and loader."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


class TensorMap(Mapping):
    """Key -> tensor, loaded on access; :meth:`shape` reads only metadata. ``origin`` names the file(s) in errors."""

    def __init__(self, origin: str, entries: Mapping[str, torch.Tensor | _Stored | Derived],
                 handles: dict | None = None):
        self.origin = origin
        self._entries = dict(entries)
        self._handles = {} if handles is None else handles  # safetensors file -> open handle, shared by views

    @classmethod
    def of_safetensors(cls, origin: str, files: Mapping[str, str]) -> TensorMap:
        """The tensors of safetensors files, ``files`` mapping each key to its file."""
        return cls(origin, {key: _Stored(path, key) for key, path in files.items()})

    def _handle(self, path: str):
        if path not in self._handles:
            self._handles[path] = open_safetensors(path)
        return self._handles[path]

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        if isinstance(entry, torch.Tensor):
            return entry
        if isinstance(entry, Derived):
            return entry.load()
        return self._handle(entry.path).get_tensor(entry.name)

    def shape(self, key: str) -> tuple[int, ...]:
        entry = self._entries[key]
        if isinstance(entry, (torch.Tensor, Derived)):
            return tuple(entry.shape)
        return tuple(self._handle(entry.path).get_slice(entry.name).get_shape())

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype, read from the header for safetensors; ``None`` for a type torch has no name for."""
        entry = self._entries[key]
        if isinstance(entry, (torch.Tensor, Derived)):
            return entry.dtype
        return SAFETENSORS_DTYPES.get(self._handle(entry.path).get_slice(entry.name).get_dtype())

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def renamed(self, names: Mapping[str, str]) -> TensorMap:
        """A view with the keys renamed by ``names`` (new -> old); keys not named are left out."""
        return TensorMap(self.origin, {new: self._entries[old] for new, old in names.items()}, self._handles)

    def replaced(self, changes: Mapping[str, Derived | None]) -> TensorMap:
        """A view with the entries of ``changes`` replaced, or left out where the change is ``None``."""
        entries = {**self._entries, **changes}
        return TensorMap(self.origin, {k: v for k, v in entries.items() if v is not None}, self._handles)


def open_safetensors(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own error types for a bad header or a short file
        raise ValueError(
            f"{path} could not be read as a checkpoint (safetensors: {error}); the file is truncated or corrupt: "
            "download it again."
        ) from None


def load_pickle(path: str):
    """``torch.load`` of a ``.pt`` file: memory-mapped, weights only."""
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            # Files written with the legacy (pre-zip) serializer cannot be memory-mapped.
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise ValueError(
                f"{path} cannot be loaded with weights_only=True: it pickles more than tensors and containers "
                f"({str(error).splitlines()[0]}). The converter runs no pickled code; in an environment you trust, "
                "re-save its state dicts with torch.save(torch.load(path, weights_only=False)['generator'], ...)."
            ) from None
        raise ValueError(
            f"{path} could not be read as a checkpoint (torch.load: {error}); it is no torch.save file, or it is "
            "truncated or corrupt: download it again."
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise ValueError(
            f"{path} could not be read as a checkpoint (torch.load: {error}); the file is truncated or corrupt: "
            "download it again."
        ) from None


def _safetensors_index(path: str) -> dict[str, str]:
    """Key -> shard file of a ``*.safetensors.index.json``; every shard must lie in the index's folder."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        names = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        weight_map, names, reason = None, set(), repr(error)
    else:
        reason = None if all(isinstance(name, str) for name in names) else "a shard name that is no string"
    if reason is not None:
        raise ValueError(
            f"{path} could not be read as a checkpoint index ({reason}); expected the JSON object with a "
            "'weight_map' of shard file names that sharded safetensors ship."
        ) from None
    folder = os.path.dirname(os.path.abspath(path))
    outside = sorted(name for name in names if os.path.isabs(name) or os.path.commonpath(
        [folder, os.path.normpath(os.path.join(folder, name))]) != folder)
    if outside:
        raise ValueError(
            f"{path} names a shard outside its folder ({outside[:3]}): an index names its shards by file name, "
            "beside it, and the converter reads nothing else; download the checkpoint again, or fix the index's "
            "weight_map."
        )
    files = {key: os.path.join(folder, name) for key, name in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not os.path.isfile(shard):
            raise ValueError(
                f"{path} could not be read as a checkpoint: its shard {shard} is missing; download every shard."
            )
    return files


def _safetensors_keys(path: str) -> dict[str, str]:
    with open_safetensors(path) as handle:
        return {key: path for key in handle.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def _weights_in_folder(folder: str) -> str:
    """The transformer weights of a folder: its safetensors index, else its only safetensors file."""
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    singles = [n for n in names if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return os.path.join(folder, indexes[0])
    if not indexes and len(singles) == 1:
        return os.path.join(folder, singles[0])
    raise ValueError(
        f"{folder} holds no transformer weights the converter can pick: expected one *{INDEX_SUFFIX} or a single "
        f"*.safetensors file, found {indexes + singles or names}; pass the weights file itself."
    )


def read_checkpoint(path: str | os.PathLike) -> tuple[str, object]:
    """``(origin, contents)``: a safetensors source as a :class:`TensorMap`, a pickle as what it holds."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}; pass the downloaded checkpoint file or folder.")
    if os.path.isdir(path):
        path = _weights_in_folder(path)
    if path.endswith(INDEX_SUFFIX):
        return path, TensorMap.of_safetensors(path, _safetensors_index(path))
    if path.endswith(".safetensors"):
        return path, TensorMap.of_safetensors(path, _safetensors_keys(path))
    return path, load_pickle(path)


def strip_wrapper_prefixes(keys) -> tuple[dict[str, str], list[str]]:
    """``(clean key -> stored key, colliding stored keys)``: the names without the training wrappers' segments
    (``INNER_WRAPPER_SEGMENTS``) and outer prefixes (``OUTER_PREFIXES``, e.g. ``model.`` of the peers'
    ``WanDiffusionWrapper``); a stored key whose clean name another key already took is returned apart."""
    names, collisions = {}, []
    for key in keys:
        clean = key
        for segment in INNER_WRAPPER_SEGMENTS:
            clean = clean.replace(segment, "")
        for prefix in OUTER_PREFIXES:
            clean = clean.removeprefix(prefix)
        if clean in names:
            collisions.append(key)
        else:
            names[clean] = key
    return names, collisions
