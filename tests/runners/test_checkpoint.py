"""Checkpoint save/load: exact continuation, deterministic bytes, typed refusals, no unpickling."""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ledger import digests
from ledger import state as ledger_state
from ledger.errors import (
    CheckpointExists,
    CheckpointMismatch,
    DigestMismatch,
    LedgerError,
    MissingComponent,
    NonCanonical,
)
from runners.checkpoint import OuterState, _rename_noreplace, cleanup_partial, load_checkpoint, save_checkpoint
from runners.rng import Rngs, seed_global_rngs

V, D, B, L = 32, 16, 8, 6
K = 4  # save at step K, continue to 2K


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make_model(init_seed: int) -> nn.Sequential:
    """Embedding -> dropout -> MLP -> output head tied to the embedding (shared storage in the state_dict)."""
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Embedding(V, D), nn.Dropout(0.2), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, V, bias=False))
    model[4].weight = model[0].weight
    return model


def make_optimizer(model: nn.Sequential, lr: float = 1e-2,
                   betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    # Two groups, so the param-group layout is part of what must round-trip.
    return torch.optim.AdamW(
        [{"params": [model[0].weight], "weight_decay": 0.0},
         {"params": [model[2].weight, model[2].bias], "weight_decay": 0.1}],
        lr=lr, betas=betas,
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, rngs: Rngs, start: int, stop: int) -> list[float]:
    """Each step draws from all six generators: explicit torch/numpy/python, and the globals (dropout, scale)."""
    model.train()
    losses = []
    for _ in range(start, stop):
        x = torch.from_numpy(rngs.numpy.integers(0, V, size=(B, L)))
        y = (x + rngs.python.randrange(1, V)) % V
        noise = 0.01 * torch.randn(B, L, V, generator=rngs.torch)
        scale = 1.0 + 0.1 * np.random.random() + 0.1 * random.random()
        loss = F.cross_entropy((model(x) + noise).reshape(-1, V), y.reshape(-1)) * scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def bits(values: list[float]) -> list[str]:
    return [v.hex() for v in values]


def assert_same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert {k: type(v) for k, v in ga.items()} == {k: type(v) for k, v in gb.items()}  # tuple betas stay tuples
    assert a["state"].keys() == b["state"].keys()
    for idx, entries in a["state"].items():
        assert entries.keys() == b["state"][idx].keys()
        for key, value in entries.items():
            other = b["state"][idx][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (idx, key)


def scramble_globals() -> None:
    torch.manual_seed(987654)
    np.random.seed(987654)
    random.seed(987654)


META = {"run": "test", "rank": 0, "arm": "single"}


@dataclass
class Reference:
    at_k: Path
    at_k_again: Path
    at_2k: Path
    losses: list[float]  # steps K..2K of the uninterrupted run
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ref")
    seed_global_rngs(7, 0)
    rngs = Rngs.from_seed(7, 0)
    model = make_model(1)
    opt = make_optimizer(model)
    train(model, opt, rngs, 0, K)
    save_checkpoint(root / "k", model=model, optimizer=opt, rngs=rngs, cursor=K, meta={**META, "step": K})
    save_checkpoint(root / "k-again", model=model, optimizer=opt, rngs=rngs, cursor=K, meta={**META, "step": K})
    losses = train(model, opt, rngs, K, 2 * K)
    save_checkpoint(root / "2k", model=model, optimizer=opt, rngs=rngs, cursor=2 * K, meta={**META, "step": 2 * K})
    return Reference(root / "k", root / "k-again", root / "2k", losses,
                     {n: t.clone() for n, t in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))


def fresh_objects() -> tuple[nn.Sequential, torch.optim.AdamW, Rngs]:
    """Different init, different hyperparameters, unrelated generators: everything must come from the checkpoint."""
    scramble_globals()
    model = make_model(12345)
    return model, make_optimizer(model, lr=0.5, betas=(0.5, 0.6)), Rngs.from_seed(99, 3)


def test_resume_is_bit_identical(reference: Reference, tmp_path: Path) -> None:
    model, opt, rngs = fresh_objects()
    loaded = load_checkpoint(reference.at_k, model=model, optimizer=opt, rngs=rngs)
    assert loaded.cursor == K and loaded.meta["step"] == K and loaded.outer is None
    assert model[4].weight is model[0].weight  # loading keeps the tie
    losses = train(model, opt, rngs, loaded.cursor, 2 * K)

    assert bits(losses) == bits(reference.losses)
    state = model.state_dict()
    assert state.keys() == reference.model.keys()
    for name, t in reference.model.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name
    assert_same_optimizer_state(opt.state_dict(), reference.optimizer)

    saved = save_checkpoint(tmp_path / "2k", model=model, optimizer=opt, rngs=rngs, cursor=2 * K,
                            meta={**META, "step": 2 * K})
    assert saved.digest == ledger_state.checkpoint_digest(reference.at_2k)
    assert ledger_state.checkpoint_digest(saved.path) == saved.digest
    # File hashes are equal too: the whole manifest (with the same meta) is byte-identical.
    assert (saved.path / "manifest.json").read_bytes() == (reference.at_2k / "manifest.json").read_bytes()


NOT_RESTORED: dict[str, Callable[[Rngs], object]] = {
    "torch-global": lambda r: torch.manual_seed(1),
    "numpy-global": lambda r: np.random.seed(1),
    "python-global": lambda r: random.seed(1),
    "torch": lambda r: r.torch.manual_seed(1),
    "numpy": lambda r: setattr(r.numpy.bit_generator, "state", np.random.PCG64(1).state),
    "python": lambda r: r.python.seed(1),
}


@pytest.mark.parametrize("which", sorted(NOT_RESTORED))
def test_not_restoring_one_generator_diverges(reference: Reference, which: str) -> None:
    """Negative control: the round-trip test above can fail, and every generator is needed."""
    model, opt, rngs = fresh_objects()
    loaded = load_checkpoint(reference.at_k, model=model, optimizer=opt, rngs=rngs)
    NOT_RESTORED[which](rngs)
    losses = train(model, opt, rngs, loaded.cursor, 2 * K)
    assert bits(losses) != bits(reference.losses)


def test_same_state_saved_twice_is_identical(reference: Reference) -> None:
    a, b = ledger_state.read_manifest(reference.at_k), ledger_state.read_manifest(reference.at_k_again)
    assert a.checkpoint == b.checkpoint == ledger_state.checkpoint_digest(reference.at_k)
    assert a.components == b.components and a.tensors == b.tensors
    assert a.files == b.files  # safetensors bytes are deterministic
    names = sorted(p.name for p in reference.at_k.iterdir())
    assert names == ["manifest.json", "model.safetensors", "optimizer.json", "optimizer.safetensors", "rng.json",
                     "rng.safetensors"]
    for name in names:
        assert (reference.at_k / name).read_bytes() == (reference.at_k_again / name).read_bytes(), name
    assert a.files["model.safetensors"] == digests.file_digest(reference.at_k / "model.safetensors")


def test_optimizer_tensors_are_named_by_parameter(reference: Reference) -> None:
    scalars = digests.parse_canonical((reference.at_k / "optimizer.json").read_bytes())
    assert scalars["class"] == "torch.optim.adamw.AdamW"
    assert [g["params"] for g in scalars["param_groups"]] == [["0.weight"], ["2.weight", "2.bias"]]
    assert scalars["param_groups"][1]["betas"] == [0.9, 0.95] and scalars["param_groups"][1]["weight_decay"] == 0.1
    from safetensors import safe_open

    with safe_open(str(reference.at_k / "optimizer.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("state.2.bias.step").dtype == torch.float32
    assert keys == {f"state.{p}.{k}" for p in ("0.weight", "2.weight", "2.bias")
                    for k in ("exp_avg", "exp_avg_sq", "step")}


def _outer(fill: float) -> OuterState:
    return OuterState(tensors={"momentum.0.weight": torch.full((V, D), fill),
                               "params.0.weight": torch.full((V, D), fill)},
                      scalars={"lr": 0.7, "momentum": 0.9, "nesterov": True, "step": 0})


def test_outer_state_round_trip_and_missing_component(reference: Reference, tmp_path: Path) -> None:
    model, opt, rngs = fresh_objects()
    load_checkpoint(reference.at_k, model=model, optimizer=opt, rngs=rngs)
    outer = _outer(0.0)
    gen = torch.Generator().manual_seed(3)
    for t in outer.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    outer.scalars["step"] = 5
    saved = save_checkpoint(tmp_path / "diloco", model=model, optimizer=opt, outer=outer, rngs=rngs, cursor=K, meta={})
    assert {"outer.safetensors", "outer.json"} <= {p.name for p in saved.path.iterdir()}

    target = _outer(-1.0)
    loaded = load_checkpoint(saved.path, model=model, optimizer=opt, outer=target, rngs=rngs)
    assert loaded.outer is target and target.scalars == outer.scalars
    for name, t in outer.tensors.items():
        assert torch.equal(target.tensors[name], t)

    with pytest.raises(MissingComponent, match="'outer'"):
        load_checkpoint(reference.at_k, model=model, optimizer=opt, outer=_outer(0.0), rngs=rngs)
    with pytest.raises(CheckpointMismatch, match="outer"):
        load_checkpoint(saved.path, model=model, optimizer=opt, rngs=rngs)


def test_mismatched_model_is_refused_before_anything_changes(reference: Reference) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(V, D), nn.Dropout(0.2), nn.Linear(D, D + 1), nn.ReLU(), nn.Linear(D + 1, V))
    opt = torch.optim.AdamW(model.parameters())
    rngs = Rngs.from_seed(1, 1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rng_before = rngs.torch.get_state().clone()
    with pytest.raises(CheckpointMismatch):
        load_checkpoint(reference.at_k, model=model, optimizer=opt, rngs=rngs)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert torch.equal(rngs.torch.get_state(), rng_before) and not opt.state


def test_checkpoints_are_immutable_and_failed_writes_leave_nothing(reference: Reference, tmp_path: Path) -> None:
    model, opt, rngs = fresh_objects()
    load_checkpoint(reference.at_k, model=model, optimizer=opt, rngs=rngs)
    target = tmp_path / "ck"
    target.mkdir()  # even an empty directory is never replaced
    with pytest.raises(CheckpointExists):
        save_checkpoint(target, model=model, optimizer=opt, rngs=rngs, cursor=K, meta={})
    src = tmp_path / ".src"
    src.mkdir()
    with pytest.raises(CheckpointExists):  # the rename itself refuses (RENAME_NOREPLACE), not only the pre-check
        _rename_noreplace(src, target)
    assert src.is_dir() and not any(target.iterdir())

    with pytest.raises(NonCanonical):  # meta that canonical JSON cannot hold fails the manifest write
        save_checkpoint(tmp_path / "bad", model=model, optimizer=opt, rngs=rngs, cursor=K, meta={"x": float("nan")})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".src", "ck"]  # no final dir, temp dir removed


def test_partial_directory_is_never_loaded_and_cleanup_removes_it(reference: Reference, tmp_path: Path) -> None:
    import shutil

    partial = tmp_path / ".ck.tmp-0123456789abcdef"
    shutil.copytree(reference.at_k, partial)
    (partial / "manifest.json").unlink()  # killed before the manifest was written
    model, opt, rngs = fresh_objects()
    with pytest.raises(LedgerError):
        load_checkpoint(partial, model=model, optimizer=opt, rngs=rngs)
    keep = tmp_path / "complete"
    shutil.copytree(reference.at_k, keep)
    assert cleanup_partial(tmp_path) == [partial]
    assert [p.name for p in tmp_path.iterdir()] == ["complete"]


class _Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("how", ["torch-pt-beside", "pickle-as-safetensors"])
def test_pickle_files_are_refused_and_never_unpickled(reference: Reference, tmp_path: Path, how: str) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(reference.at_k, ck)
    marker = tmp_path / "unpickled.marker"
    if how == "torch-pt-beside":
        torch.save({"model": _Payload(marker)}, ck / "model.pt")  # a zip file holding the pickle
        assert (ck / "model.pt").read_bytes()[:4] == b"PK\x03\x04"
    else:
        (ck / "model.safetensors").write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    assert not marker.exists()
    model, opt, rngs = fresh_objects()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(LedgerError) as info:
        load_checkpoint(ck, model=model, optimizer=opt, rngs=rngs)
    assert "model." in str(info.value)
    assert not marker.exists()
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_tampered_tensor_is_refused_before_anything_changes(reference: Reference, tmp_path: Path) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(reference.at_k, ck)
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data
    (ck / "model.safetensors").write_bytes(bytes(data))
    model, opt, rngs = fresh_objects()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(DigestMismatch, match="model"):
        load_checkpoint(ck, model=model, optimizer=opt, rngs=rngs)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items()) and not opt.state


def test_sharded_component_loads_identically(reference: Reference, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(reference.at_k, ck)
    tensors = load_file(str(ck / "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:2]}, str(ck / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[2:]}, str(ck / "model-00002-of-00002.safetensors"))
    (ck / "model.safetensors").unlink()
    (ck / "manifest.json").unlink()
    ledger_state.write_manifest(ck, {**META, "step": K})
    assert ledger_state.checkpoint_digest(ck) == ledger_state.checkpoint_digest(reference.at_k)

    model, opt, rngs = fresh_objects()
    loaded = load_checkpoint(ck, model=model, optimizer=opt, rngs=rngs)
    assert loaded.digest == ledger_state.read_manifest(reference.at_k).checkpoint
    assert bits(train(model, opt, rngs, loaded.cursor, 2 * K)) == bits(reference.losses)


def test_file_replaced_after_verification_is_caught(reference: Reference, tmp_path: Path) -> None:
    import shutil

    from runners.checkpoint import _read_component

    ck = tmp_path / "ck"
    shutil.copytree(reference.at_k, ck)
    verified = ledger_state.verify_checkpoint(ck)
    layout = ledger_state.scan_checkpoint(ck)
    assert _read_component(ck, layout, verified, "model") is not None
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[-1] ^= 0x80  # the file changes after it was verified
    (ck / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match="between verification and loading"):
        _read_component(ck, layout, verified, "model")
