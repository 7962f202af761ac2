"""Save and load one rank's full training state: safetensors + canonical JSON, no pickle, atomic.

A checkpoint is a directory (format in ``docs/receipts.md``; digests in :mod:`ledger.state`) with these components:

* ``model``: ``model.state_dict()`` -> ``model.safetensors``.
* ``optimizer``: per-parameter state tensors, named by the *model parameter name* (not the optimizer's index),
  as ``state.<param name>.<key>`` (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step`` with its own dtype, and
  ``max_exp_avg_sq`` with amsgrad) -> ``optimizer.safetensors``; the optimizer class, every param group's
  hyperparameters and its parameter names in order, and any non-tensor per-parameter state -> ``optimizer.json``.
* ``outer`` (arms with an outer optimizer, e.g. DiLoCo): an :class:`OuterState` -> ``outer.safetensors`` +
  ``outer.json``.
* ``rng``: :func:`runners.rng.capture_rng_state` (explicit and global generators, data cursor) -> ``rng.safetensors``
  + ``rng.json``.

Writing is atomic: every file goes into a hidden sibling ``.<name>.tmp-<random>`` and is fsynced, the manifest is
written last, the temporary directory is fsynced and renamed to ``<name>`` (refusing to replace an existing
checkpoint: checkpoints are immutable), and the parent directory is fsynced. A process killed at any moment leaves
no ``<name>`` or a complete one; leftover hidden temporaries are ignored by readers and removed by
:func:`cleanup_partial`.

Loading verifies the whole directory against its manifest (:func:`ledger.state.verify_checkpoint`, torch-free,
refusing pickle files) before touching any live object, reads tensors only with ``safetensors.torch.load_file``
(never ``torch.load``) and re-checks their bytes against the verified digests, checks that every name, shape and
dtype fits, and only then restores everything exactly.

Tied weights: a state_dict lists a shared tensor under each of its names, and safetensors refuses shared storage,
so each name is written as its own copy; loading copies both into the one shared parameter.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save_file

from ledger import digests
from ledger import state as ledger_state
from ledger.artifacts import fsync_path
from ledger.errors import CheckpointExists, CheckpointMismatch, DigestMismatch, MissingComponent
from runners.rng import Rngs, apply_rng_state, capture_rng_state, parse_rng_state

JSON = dict[str, Any]
_TEMP_RE: Final = re.compile(r"^\..+\.tmp-[0-9a-f]{16}$")
_STATE_PREFIX: Final = "state."


@dataclass
class OuterState:
    """The outer optimizer's state of an arm that has one (DiLoCo): the training code builds it.

    ``tensors``: e.g. the Nesterov momentum buffers and the outer copy of the parameters, by name.
    ``scalars``: canonical-JSON-safe values, e.g. outer lr, momentum, nesterov, outer step count.
    Loading copies into ``tensors`` in place (names, shapes and dtypes must match) and replaces ``scalars``.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: JSON = field(default_factory=dict)


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    digest: str  # the state digest (manifest "checkpoint")
    manifest: ledger_state.Manifest


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    digest: str
    meta: JSON
    cursor: int
    outer: OuterState | None


# --------------------------------------------------------------------------------------------- file helpers



def _storable(tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that each own their storage.

    safetensors refuses tensors that share storage (tied weights appear under two names in a state_dict): those are
    cloned, so a tied weight is stored once per name. Others are passed through untouched (no extra copy).
    """
    owners = Counter(
        t.untyped_storage().data_ptr()
        for t in tensors.values()
        if isinstance(t, torch.Tensor) and t.device.type == "cpu"
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} entry {name!r} is a {type(t).__name__}, not a tensor; it cannot be checkpointed")
        if t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"{what} tensor {name!r} has layout {t.layout}; only dense tensors can be checkpointed")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu").contiguous()  # a fresh copy that owns its storage
        elif not t.is_contiguous() or t.numel() == 0 or owners[t.untyped_storage().data_ptr()] > 1:
            t = t.clone(memory_format=torch.contiguous_format)
        out[name] = t
    return out


def _write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    save_file(_storable(tensors, what), str(path))
    os.chmod(path, 0o644)  # safetensors creates its files 0600; a verifier running as another user must read them
    fsync_path(path)


def _write_json(path: Path, value: JSON) -> None:
    data = digests.canonical_bytes(value)
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails if ``dst`` exists (Linux renameat2 RENAME_NOREPLACE; else check, then rename).

    Plain rename would silently replace an existing *empty* directory; NOREPLACE makes immutability race-free.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        at_fdcwd, rename_noreplace = -100, 1
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise CheckpointExists(str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: the filesystem does not support the flag
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise CheckpointExists(str(dst))
    os.rename(src, dst)


# ------------------------------------------------------------------------------------------ optimizer state


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    # named_parameters() lists a tied parameter once, under its first name: the name the optimizer state uses.
    return {id(p): name for name, p in model.named_parameters()}


def _to_json(value: Any, what: str) -> Any:
    if isinstance(value, tuple | list):
        return [_to_json(v, what) for v in value]
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{what} is a tensor; tensor-valued hyperparameters are not supported (use a float)")
    return value


def _from_json(value: Any, like: Any) -> Any:
    """Restore tuples (e.g. AdamW betas) where the live optimizer holds a tuple, so state_dict() matches exactly."""
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def _capture_optimizer(model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], JSON]:
    names = _param_names(model)
    sd = optimizer.state_dict()
    index_name: dict[int, str] = {}
    groups: list[JSON] = []
    for gi, (live, saved) in enumerate(zip(optimizer.param_groups, sd["param_groups"], strict=True)):
        group_names = []
        for p, index in zip(live["params"], saved["params"], strict=True):
            if id(p) not in names:
                raise ValueError(f"optimizer param group {gi} holds a parameter that is not in the model")
            index_name[index] = names[id(p)]
            group_names.append(names[id(p)])
        hyper = {k: _to_json(v, f"optimizer param_groups[{gi}].{k}") for k, v in saved.items() if k != "params"}
        hyper["params"] = group_names
        groups.append(hyper)
    tensors: dict[str, torch.Tensor] = {}
    other: JSON = {}
    for index, entries in sd["state"].items():
        pname = index_name[index]
        for key, value in entries.items():
            if "." in key:  # tensor names are parsed as state.<param name>.<key>
                raise ValueError(f"optimizer state key {key!r} contains '.'")
            if isinstance(value, torch.Tensor):
                tensors[f"{_STATE_PREFIX}{pname}.{key}"] = value
            else:
                other.setdefault(pname, {})[key] = _to_json(value, f"optimizer state {pname}.{key}")
    cls = type(optimizer)
    return tensors, {"class": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups, "state": other}


def _optimizer_state_dict(where: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          tensors: dict[str, torch.Tensor], scalars: JSON) -> dict[str, Any]:
    """Rebuild ``optimizer.state_dict()`` from a checkpoint, checking that it fits ``optimizer`` exactly."""
    cls = type(optimizer)
    cls_name = f"{cls.__module__}.{cls.__qualname__}"
    if scalars.get("class") != cls_name:
        raise CheckpointMismatch(where, f"optimizer class is {scalars.get('class')!r}, loading into {cls_name!r}",
                                 expected=scalars.get("class"), actual=cls_name)
    names = _param_names(model)
    saved_groups = scalars["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointMismatch(where, f"optimizer has {len(saved_groups)} param groups, loading into "
                                 f"{len(optimizer.param_groups)}", expected=len(saved_groups),
                                 actual=len(optimizer.param_groups))
    name_index: dict[str, int] = {}
    groups = []
    for gi, (live, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        live_names = [names.get(id(p), "<not in model>") for p in live["params"]]
        if live_names != saved["params"]:
            raise CheckpointMismatch(where, f"optimizer param group {gi} parameter names differ",
                                     expected=saved["params"], actual=live_names)
        group = {k: _from_json(v, live.get(k)) for k, v in saved.items() if k != "params"}
        group["params"] = list(range(len(name_index), len(name_index) + len(live_names)))
        name_index.update({n: len(name_index) + i for i, n in enumerate(live_names)})
        groups.append(group)
    live_params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    by_name = {names[i]: p for i, p in live_params.items()}
    state: dict[int, dict[str, Any]] = {}
    for tname, t in tensors.items():
        pname, _, key = tname.removeprefix(_STATE_PREFIX).rpartition(".")
        if not tname.startswith(_STATE_PREFIX) or pname not in name_index:
            raise CheckpointMismatch(where, f"optimizer tensor {tname!r} names no parameter of this optimizer")
        if key != "step" and tuple(t.shape) != tuple(by_name[pname].shape):
            raise CheckpointMismatch(where, f"optimizer tensor {tname!r} has shape {tuple(t.shape)}",
                                     expected=tuple(by_name[pname].shape), actual=tuple(t.shape))
        state.setdefault(name_index[pname], {})[key] = t
    for pname, entries in scalars.get("state", {}).items():
        if pname not in name_index:
            raise CheckpointMismatch(where, f"optimizer state names unknown parameter {pname!r}")
        state.setdefault(name_index[pname], {}).update(entries)
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------------- saving


def save_checkpoint(path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    outer: OuterState | None = None, rngs: Rngs, cursor: int, meta: JSON) -> SavedCheckpoint:
    """Write the full state of one rank atomically to the new directory ``path``; return its state digest.

    ``meta`` holds non-state facts (run, rank, step, world, arm...) for the manifest. Raises CheckpointExists if
    ``path`` exists. Tensors are written from their live storage without an extra copy (CPU; GPU tensors are
    copied to CPU), so the caller must not change the model, optimizer or outer state during the call.
    """
    final = Path(path)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(final):
        raise CheckpointExists(str(final))

    opt_tensors, opt_scalars = _capture_optimizer(model, optimizer)
    rng_tensors, rng_scalars = capture_rng_state(rngs, cursor)

    tmp = parent / f".{final.name}.tmp-{secrets.token_hex(8)}"
    tmp.mkdir()
    try:
        _write_tensors(tmp / "model.safetensors", model.state_dict(), "model")
        if opt_tensors:
            _write_tensors(tmp / "optimizer.safetensors", opt_tensors, "optimizer")
        _write_json(tmp / "optimizer.json", opt_scalars)
        if outer is not None:
            if outer.tensors:
                _write_tensors(tmp / "outer.safetensors", outer.tensors, "outer")
            _write_json(tmp / "outer.json", outer.scalars)
        _write_tensors(tmp / "rng.safetensors", rng_tensors, "rng")
        _write_json(tmp / "rng.json", rng_scalars)
        # The manifest is written last (hashing what is on disk); its presence marks a complete checkpoint.
        manifest = ledger_state.write_manifest(tmp, meta)
        fsync_path(tmp / "manifest.json")
        fsync_path(tmp)
        _rename_noreplace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(parent)
    return SavedCheckpoint(path=final, digest=manifest.checkpoint, manifest=manifest)


def cleanup_partial(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove leftover hidden ``.<name>.tmp-<random>`` directories (writes that were killed); return them.

    Call it only when no writer is active in ``parent`` (e.g. when a run starts or resumes).
    """
    removed = []
    for entry in sorted(Path(parent).iterdir()):
        if _TEMP_RE.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
            removed.append(entry)
    if removed:
        fsync_path(Path(parent))
    return removed


# ------------------------------------------------------------------------------------------------ loading


def _read_component(path: Path, layout: ledger_state.Layout, verified: ledger_state.CheckpointState,
                    component: str) -> tuple[dict[str, torch.Tensor], JSON] | None:
    """Tensors (all shards) and scalars of one component, or None if the checkpoint does not have it.

    Scalars are the ones verification parsed; tensors are read with safetensors only (nothing can unpickle).
    """
    if component not in verified.components:
        return None
    expected = verified.components[component].tensors
    tensors: dict[str, torch.Tensor] = {}
    for name in layout.tensor_files.get(component, ()):
        for tname, t in load_file(str(path / name)).items():
            if tname in tensors:
                raise CheckpointMismatch(str(path), f"tensor {tname!r} appears in two shards of {component}")
            tensors[tname] = t
    # What we load must be what was verified: a file replaced in between is caught here (one in-memory pass).
    if set(tensors) != set(expected):
        raise CheckpointMismatch(str(path), f"component {component!r} changed while it was being loaded")
    for tname, t in tensors.items():
        actual = digests.raw_digest(t.reshape(-1).view(torch.uint8).numpy().data)
        if actual != expected[tname].data or list(t.shape) != list(expected[tname].shape):
            raise DigestMismatch(f"checkpoint {path}: component {component!r} tensor {tname!r} changed between "
                                 f"verification and loading", expected=expected[tname].data, actual=actual)
    return tensors, dict(verified.components[component].scalars)


def _check_tensors(where: str, what: str, saved: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]) -> None:
    if set(saved) != set(live):
        missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        raise CheckpointMismatch(where, f"{what} tensor names differ (missing {missing[:5]}, unexpected {extra[:5]})",
                                 expected=sorted(live), actual=sorted(saved))
    for name, t in saved.items():
        ref = live[name]
        if t.dtype != ref.dtype or t.shape != ref.shape:
            raise CheckpointMismatch(where, f"{what} tensor {name!r} is {t.dtype} {tuple(t.shape)}, loading into "
                                     f"{ref.dtype} {tuple(ref.shape)}", expected=(str(ref.dtype), tuple(ref.shape)),
                                     actual=(str(t.dtype), tuple(t.shape)))


def load_checkpoint(path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    outer: OuterState | None = None, rngs: Rngs) -> LoadedCheckpoint:
    """Restore model, optimizer, outer state (if ``outer`` is given) and every RNG exactly from ``path``.

    The directory is verified against its manifest first; then everything is read and checked against the live
    objects; only then is any of them changed. Raises MissingComponent if a needed component is absent,
    CheckpointMismatch if the checkpoint does not fit (including an ``outer`` component when ``outer`` is None).
    """
    ckpt = Path(path)
    where = str(ckpt)
    # Torch-free verification first: file set, no pickle, headers, every digest against the manifest.
    verified = ledger_state.verify_checkpoint(ckpt)
    manifest = verified.manifest
    assert manifest is not None  # verify_checkpoint requires one
    layout = ledger_state.scan_checkpoint(ckpt)
    present = list(verified.components)

    parts: dict[str, tuple[dict[str, torch.Tensor], JSON]] = {}
    for component in ledger_state.COMPONENTS:
        got = _read_component(ckpt, layout, verified, component)
        if got is not None:
            parts[component] = got
    for component in ("model", "optimizer", "rng") + (("outer",) if outer is not None else ()):
        if component not in parts:
            raise MissingComponent(where, component, present)
    if outer is None and "outer" in parts:
        raise CheckpointMismatch(where, "checkpoint has an outer optimizer state but no OuterState was given to "
                                 "load it into (an arm mismatch?)")

    model_tensors, _ = parts["model"]
    _check_tensors(where, "model", model_tensors, model.state_dict())
    opt_sd = _optimizer_state_dict(where, model, optimizer, *parts["optimizer"])
    if outer is not None:
        _check_tensors(where, "outer", parts["outer"][0], outer.tensors)
    rng_state = parse_rng_state(*parts["rng"], where=where, into=rngs)

    model.load_state_dict(model_tensors, strict=True)
    optimizer.load_state_dict(opt_sd)
    if outer is not None:
        outer_tensors, outer_scalars = parts["outer"]
        with torch.no_grad():
            for name, t in outer_tensors.items():
                outer.tensors[name].copy_(t)
        outer.scalars.clear()
        outer.scalars.update(outer_scalars)
    cursor = apply_rng_state(rngs, rng_state, where=where)
    return LoadedCheckpoint(path=ckpt, digest=verified.digest, meta=dict(manifest.meta), cursor=cursor, outer=outer)
