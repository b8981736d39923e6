"""Where a conversion writes, all or nothing.

:func:`check_destination` refuses, before any work, an ``out`` that is (or lies inside, or holds) a file the
conversion reads, and an existing non-empty ``out`` unless it is to be replaced (``overwrite``). :func:`staged` gives
the conversion a new folder beside ``out`` (``.<name>.converting-<random>``, on the same file system, so that the
final move is a rename); when every file is written and :func:`check_written` has loaded them back, the folder takes
``out``'s place (an old ``out`` is moved aside first and removed after). If anything raises before that, the staged
folder and any parent folder made for it are removed, and ``out`` is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders import WanLoraLoaderMixin

from .reading import INDEX_SUFFIX, read_checkpoint

WEIGHTS_NAME = "diffusion_pytorch_model"  # save_pretrained's file names: <name>.safetensors, or shards and an index
logger = logging.getLogger(__name__)

# (shape, dtype) of every tensor a file (or a model folder) is planned to hold, by key.
Planned = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def check_destination(out: str, sources: Iterable[str | os.PathLike | None], overwrite: bool) -> None:
    """Refuse ``out`` when it is, lies inside or holds one of ``sources`` (by path and by resolved links), and when
    it exists and is not an empty folder unless ``overwrite``."""
    for source in filter(None, sources):
        for target, path in ((os.path.abspath(out), os.path.abspath(source)),
                             (os.path.realpath(out), os.path.realpath(source))):
            relation = ("is" if target == path else "lies inside" if _inside(target, path)
                        else "holds" if _inside(path, target) else None)
            if relation is not None:
                raise ValueError(
                    f"OUT {out} {relation} the source {source}: the converter never writes where it reads (a "
                    "failure, or the replacement of OUT, would destroy the checkpoint); pass an OUT outside the "
                    "checkpoint's files, e.g. converted/<name>."
                )
    if os.path.lexists(out) and not _empty_folder(out) and not overwrite:
        raise ValueError(
            f"OUT {out} already exists and is not empty; pass overwrite=True (--overwrite) to replace it whole (no "
            "file of it survives), or another OUT."
        )


@contextlib.contextmanager
def staged(out: str, overwrite: bool) -> Iterator[str]:
    """A new folder beside ``out`` to write into; moved into ``out``'s place when the block completes, removed (with
    the parent folders made for it) when it raises."""
    out = os.path.abspath(out)
    made: list[str] = []
    folder = None
    try:
        _make_parents(os.path.dirname(out), made)
        folder = _new_sibling(out, "converting")
        yield folder
        _move_into_place(folder, out, overwrite)
    except BaseException:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        for parent in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(parent)
        raise


def check_written(folder: str, planned: Planned) -> None:
    """Load the ``WanTransformer3DModel`` in ``folder`` with stock ``from_pretrained`` and check that it and its
    safetensors files hold exactly the ``planned`` keys, shapes and dtypes."""
    stored = _stored_tensors(folder)
    dtypes = [dtype for _, dtype in planned.values()]
    model, info = WanTransformer3DModel.from_pretrained(  # the bulk dtype: nothing is cast, the files stay mapped
        folder, torch_dtype=max(set(dtypes), key=dtypes.count), output_loading_info=True)
    loaded = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    problems = [f"{name}: {info[name]}" for name in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if info[name]]
    if stored != dict(planned) or loaded != {key: shape for key, (shape, _) in planned.items()} or problems:
        _refuse_written(folder, planned, stored, problems)


def check_written_lora(folder: str, weight_name: str, planned: Planned) -> None:
    """Read the LoRA file back with diffusers' own loader and check its keys, shapes and dtypes."""
    state = WanLoraLoaderMixin.lora_state_dict(folder, weight_name=weight_name)
    stored = {key.removeprefix("transformer."): (tuple(t.shape), t.dtype) for key, t in state.items()}
    if stored != dict(planned):
        _refuse_written(os.path.join(folder, weight_name), planned, stored, [])


def _refuse_written(where: str, planned: Planned, stored: Mapping, problems: list[str]) -> None:
    differing = sorted(key for key in set(planned) | set(stored) if planned.get(key) != stored.get(key))
    raise RuntimeError(
        f"the converted folder failed its check after writing: {where} does not load back as planned (keys whose "
        f"shape or dtype differ, or that are missing or extra: {differing[:8]}{' ...' if len(differing) > 8 else ''}"
        f"{'; ' + '; '.join(problems) if problems else ''}). Nothing was moved into OUT, which is as it was; check "
        "the disk and run the conversion again."
    )


def _stored_tensors(folder: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of the safetensors files ``from_pretrained`` reads in ``folder`` (its index's shards,
    else the single weights file)."""
    index, single = (os.path.join(folder, WEIGHTS_NAME + suffix) for suffix in (INDEX_SUFFIX, ".safetensors"))
    _, contents = read_checkpoint(index if os.path.isfile(index) else single)
    return {key: (contents.shape(key), contents.dtype(key)) for key in contents}


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` lies strictly inside ``folder``."""
    return path != folder and os.path.commonpath([path, folder]) == folder


def _empty_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _make_parents(folder: str, made: list[str]) -> None:
    """Make ``folder`` and its missing parents, outermost first, adding each to ``made`` once it exists."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for parent in reversed(missing):
        os.mkdir(parent)
        made.append(parent)


def _new_sibling(out: str, purpose: str) -> str:
    """A new, empty folder ``.<name>.<purpose>-<random>`` beside ``out`` (made with the usual permissions)."""
    while True:
        path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{purpose}-{secrets.token_hex(4)}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
            return path


def _move_into_place(folder: str, out: str, overwrite: bool) -> None:
    """Rename ``folder`` to ``out``; an existing ``out`` (an empty folder, or anything with ``overwrite``) is moved
    aside first, put back if the rename fails, and removed after."""
    if not os.path.lexists(out):
        os.rename(folder, out)
        return
    check_destination(out, (), overwrite)  # it may have been filled since the conversion began
    aside = _new_sibling(out, "replaced")
    os.rmdir(aside)  # a free name to move out to
    os.rename(out, aside)
    try:
        os.rename(folder, out)
    except BaseException:
        os.rename(aside, out)
        raise
    try:
        shutil.rmtree(aside) if os.path.isdir(aside) and not os.path.islink(aside) else os.remove(aside)
    except OSError as error:  # the conversion is in place: what is left of the old OUT is only reported
        logger.warning("could not remove the replaced %s (moved aside to %s): %s", out, aside, error)
