"""The small transformer: shapes, causality, determinism, generation, NLL, tying, dropout, and the HF loader."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ledger.errors import InputError
from ledger.experiment.config import ModelConfig
from runners.model import TinyLM, build_model, greedy_generate, load_hf_causal_lm, param_count, sequence_nll

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=24)
VOCAB = 19


def test_forward_shapes_and_param_count() -> None:
    model = build_model(CFG, VOCAB, seed=0)
    idx = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    assert model(idx).shape == (3, 10, VOCAB)
    d, f, n = CFG.d_model, CFG.d_ff, CFG.n_layers
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    expected = VOCAB * d + CFG.max_len * d + n * block + 2 * d + d * VOCAB
    assert param_count(model) == expected
    with pytest.raises(InputError, match="exceeds the model's max_len"):
        model(torch.zeros(1, CFG.max_len + 1, dtype=torch.long))


def test_later_tokens_never_change_earlier_logits() -> None:
    model = build_model(CFG, VOCAB, seed=0).eval()
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 5) % VOCAB
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.equal(a[:, 9:], b[:, 9:])


def test_initialisation_is_a_function_of_the_seed() -> None:
    a, b, c = (build_model(CFG, VOCAB, seed=s) for s in (5, 5, 6))
    for (name, pa), (_, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(),
                                            c.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    torch.manual_seed(123)  # the global RNG plays no part
    d = build_model(CFG, VOCAB, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), d.state_dict().values(), strict=True))


class Counter(nn.Module):
    """A real causal LM with a known greedy output: next token = last token + 1, EOS (id 2) after token 9."""

    max_len = 64

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, idx: Tensor) -> Tensor:
        nxt = torch.where(idx == 9, torch.full_like(idx, 2), (idx + 1) % 16)
        return F.one_hot(nxt, 16).float() + self.dummy


def test_greedy_generate_stops_at_eos_and_max_new_tokens() -> None:
    prompts = [[1, 5], [1, 7, 8], [1, 3], [1, 11]]
    outs = greedy_generate(Counter(), prompts, eos_id=2, max_new_tokens=4, batch_size=2)
    assert outs == [[6, 7, 8, 9], [9], [4, 5, 6, 7], [12, 13, 14, 15]]
    with pytest.raises(InputError, match="empty"):
        greedy_generate(Counter(), [[]], eos_id=2, max_new_tokens=2)


def test_greedy_generate_batched_equals_one_by_one_and_repeats() -> None:
    model = build_model(CFG, VOCAB, seed=3)
    g = torch.Generator().manual_seed(4)
    prompts = [[1, *torch.randint(4, VOCAB, (int(n),), generator=g).tolist()] for n in (3, 5, 3, 7, 5, 3)]
    batched = greedy_generate(model, prompts, eos_id=2, max_new_tokens=6, batch_size=4)
    single = [greedy_generate(model, [p], eos_id=2, max_new_tokens=6)[0] for p in prompts]
    assert batched == single
    assert greedy_generate(model, prompts, eos_id=2, max_new_tokens=6, batch_size=4) == batched
    assert all(len(o) <= 6 and 2 not in o for o in batched)
    assert model.training  # generation leaves the mode as it found it


def test_sequence_nll_matches_cross_entropy() -> None:
    model = build_model(CFG, VOCAB, seed=0).eval()
    seqs = [[1, 4, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4]]
    got = sequence_nll(model, seqs, batch_size=2)
    for s, value in zip(seqs, got, strict=True):
        ids = torch.tensor([s])
        with torch.no_grad():
            ref = F.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
        assert value == pytest.approx(ref, rel=1e-6)
    with pytest.raises(InputError):
        sequence_nll(model, [[1]])


def test_tied_embeddings_share_one_parameter_and_survive_a_checkpoint(tmp_path: Path) -> None:
    from runners.checkpoint import save_checkpoint
    from runners.prepare import load_model_weights
    from runners.rng import Rngs

    cfg = replace(CFG, tie_embeddings=True)
    model = build_model(cfg, VOCAB, seed=0)
    assert isinstance(model, TinyLM)
    assert model.head.weight is model.tok_emb.weight
    assert param_count(model) == param_count(build_model(CFG, VOCAB, seed=0)) - VOCAB * CFG.d_model
    opt = torch.optim.AdamW(model.parameters())
    saved = save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, rngs=Rngs.from_seed(0, 0), cursor=0,
                            meta={})
    fresh = build_model(cfg, VOCAB, seed=1)
    assert isinstance(fresh, TinyLM)
    digest = load_model_weights(saved.path, fresh)
    assert digest == saved.manifest.components["model"]
    assert fresh.head.weight is fresh.tok_emb.weight
    assert torch.equal(fresh.tok_emb.weight, model.tok_emb.weight)


def test_dropout_draws_only_from_the_models_generator() -> None:
    model = build_model(replace(CFG, dropout=0.5), VOCAB, seed=0).train()
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="explicit generator"):
        model(idx)
    outs: list[Tensor] = []
    for _ in range(2):
        model.dropout_generator = torch.Generator().manual_seed(9)
        torch.manual_seed(len(outs))  # a different global RNG each time: it must not matter
        outs.append(model(idx).detach())
    assert torch.equal(outs[0], outs[1])
    model.dropout_generator = torch.Generator().manual_seed(10)
    assert not torch.equal(model(idx).detach(), outs[0])
    model.eval()
    model.dropout_generator = None
    model(idx)  # evaluation never needs a generator


def test_build_model_refuses_hf_specs() -> None:
    # model.kind = "hf" builds from model.path: a path with no readable config.json is one clear InputError
    with pytest.raises(InputError, match="model.path /nowhere"):
        build_model(replace(CFG, kind="hf", path="/nowhere"), VOCAB, seed=0)
    assert isinstance(build_model(CFG, VOCAB, seed=0), TinyLM)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="optional extra 'hf' not installed")
def test_hf_causal_lm_from_a_local_directory(tmp_path: Path) -> None:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "tiny-gpt2")
    model = load_hf_causal_lm(str(tmp_path / "tiny-gpt2"))
    assert model.max_len == 32 and model.vocab_size == VOCAB
    assert model(torch.tensor([[1, 4, 5]])).shape == (1, 3, VOCAB)
    outs = greedy_generate(model, [[1, 4], [1, 5, 6]], eos_id=2, max_new_tokens=3)
    assert outs == greedy_generate(model, [[1, 4], [1, 5, 6]], eos_id=2, max_new_tokens=3)
    assert param_count(model) > 0


def test_hf_loader_without_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test extra installs transformers; a None in sys.modules makes `import transformers` fail as on a machine
    # without it, so this path runs everywhere instead of being skipped where the package is present.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(InputError, match=r"training-ledger\[hf\]"):
        load_hf_causal_lm("/nowhere")
