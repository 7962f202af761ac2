"""The small decoder-only transformer (plain torch), greedy generation, and Hugging Face causal LMs.

``TinyLM``: token + learned positional embeddings, ``n_layers`` pre-norm blocks (causal self-attention through
``scaled_dot_product_attention(is_causal=True)`` and a GELU MLP), a final LayerNorm and an LM head (untied by
default). Weights are initialised from an explicit ``torch.Generator``, never the global RNG, and dropout (off by
default) draws its masks from a generator the caller sets, so every random bit has a named source.

Tied embeddings (``model.tie_embeddings``) make ``head.weight`` and ``tok_emb.weight`` one storage. safetensors
refuses to save shared tensors; runners/checkpoint.py clones them, so a tied checkpoint stores the weight under both
names (the model digest covers both) and ``load_state_dict`` re-fills the one shared parameter.

``HFCausalLM``: a Hugging Face causal LM from a local directory (``model.kind = "hf"``; never the network) behind
the same call, ids in and logits out. :func:`build_model` makes either kind: the architecture with seeded initial
weights, which prepare replaces by the directory's own weights (:func:`initial_model`) and every other user by a
checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ledger.errors import InputError
from ledger.experiment.config import ModelConfig


class CausalLM(Protocol):
    """What evaluation and serving need: logits for every position of a batch of token ids."""

    max_len: int

    def __call__(self, idx: Tensor) -> Tensor: ...


class _Dropout(nn.Module):
    """Dropout whose mask comes from an explicit generator (``F.dropout`` only knows the global RNG)."""

    def __init__(self, p: float, owner: TinyLM) -> None:
        super().__init__()
        self.p = p
        self._owner = [owner]  # a list, so the owner is not registered as a submodule (no cycle)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        gen = self._owner[0].dropout_generator
        if gen is None:
            raise RuntimeError("dropout > 0 in training needs model.dropout_generator (an explicit generator)")
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=x.dtype) >= self.p
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, owner: TinyLM) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = _Dropout(cfg.dropout, owner)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyLM(nn.Module):
    """A decoder-only transformer sized by :class:`~ledger.experiment.config.ModelConfig`."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_len = cfg.max_len
        self.dropout_generator: torch.Generator | None = None
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, self) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style initialisation from ``generator``, in a fixed parameter order (names sorted)."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)  # output projections feed the residual stream
        for name, p in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            elif name.endswith("proj.weight") or name.endswith("out.weight"):
                p.normal_(0.0, residual_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``[batch, time, vocab]`` for token ids ``[batch, time]`` (time <= max_len)."""
        t = idx.shape[1]
        if t > self.max_len:
            raise InputError(f"sequence of {t} tokens exceeds the model's max_len {self.max_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> TinyLM | HFCausalLM:
    """A freshly initialised model of ``cfg`` in ``cfg.dtype``; the same (cfg, vocab_size, seed) always gives the
    same bits. For ``hf``, the architecture of ``cfg.path``'s ``config.json`` (its weights are not read here)."""
    if cfg.kind == "hf":
        return hf_from_config(cfg, vocab_size, seed)
    if cfg.kind != "tiny":
        raise InputError(f"unknown model.kind {cfg.kind!r}")
    model = TinyLM(cfg, vocab_size)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(DTYPES[cfg.dtype])


def initial_model(cfg: ModelConfig, vocab_size: int, seed: int) -> TinyLM | HFCausalLM:
    """The model prepare starts from: for ``hf`` the directory's own weights when it has any (a pretrained base
    model), else, like ``tiny``, :func:`build_model`'s seeded initialisation."""
    if cfg.kind == "hf" and _has_weights(Path(cfg.path)):
        return load_hf_causal_lm(cfg.path, dtype=DTYPES[cfg.dtype], max_len=cfg.max_len, vocab_size=vocab_size)
    return build_model(cfg, vocab_size, seed)


def param_count(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


# -------------------------------------------------------------------------------------------- generation


@contextmanager
def _eval_mode(model: CausalLM) -> Iterator[torch.device]:
    """Run ``model`` in eval mode (restoring training mode after); yields the device its inputs go to."""
    module = model if isinstance(model, nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    try:
        yield next(module.parameters()).device if module is not None else torch.device("cpu")
    finally:
        if module is not None and was_training:
            module.train()


def _length_batches(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices batched by equal length (no padding, so a batched result equals the one-by-one result); the
    grouping depends only on the lengths, so the same inputs always give the same batches."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    for length in sorted(by_len):
        group = by_len[length]
        for start in range(0, len(group), batch_size):
            yield group[start : start + batch_size]


@torch.no_grad()
def greedy_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    eos_id: int,
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[list[int]]:
    """Greedy continuation of each prompt, without the EOS (stops there) and at most ``max_new_tokens`` long.

    Prompts are batched by length, so no padding or attention mask is needed and each output is what the prompt
    alone would give; the grouping depends only on the prompts, so the same requests give the same bits. Ties in
    argmax go to the lowest id. A context longer than ``max_len`` keeps its last ``max_len`` tokens.
    """
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty (start it with BOS)")
    outputs: list[list[int]] = [[] for _ in prompts]
    with _eval_mode(model) as device:
        for rows in _length_batches([len(p) for p in prompts], batch_size):
            seq = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                logits = model(seq[:, -model.max_len :])[:, -1, :]
                nxt = logits.argmax(dim=-1)
                for j, i in enumerate(rows):
                    if not done[j] and int(nxt[j]) != eos_id:
                        outputs[i].append(int(nxt[j]))
                done |= nxt == eos_id
                if bool(done.all()):
                    break
                seq = torch.cat([seq, nxt[:, None]], dim=1)
    return outputs


@torch.no_grad()
def sequence_nll(model: CausalLM, sequences: Sequence[Sequence[int]], *, batch_size: int = 32) -> list[float]:
    """Mean next-token negative log-likelihood (nats/token) of each sequence (retention is its change).

    Sequences are batched by length (no padding), like :func:`greedy_generate`.
    """
    for i, s in enumerate(sequences):
        if not 2 <= len(s) <= model.max_len + 1:
            raise InputError(f"sequence {i} has {len(s)} tokens; expected 2 to max_len + 1 ({model.max_len + 1})")
    out = [0.0] * len(sequences)
    with _eval_mode(model) as device:
        for rows in _length_batches([len(s) for s in sequences], batch_size):
            ids = torch.tensor([list(sequences[i]) for i in rows], dtype=torch.long, device=device)
            logits = model(ids[:, :-1])
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(dim=1)
            for j, i in enumerate(rows):
                out[i] = float(nll[j])
    return out


# ------------------------------------------------------------------------------------ Hugging Face models


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the same call as :class:`TinyLM`: ids in, logits out.

    Right padding needs no attention mask: causal attention never lets a real position see a later pad.
    ``max_len`` is the configured bound (``model.max_len``), at most the model's own position limit.
    """

    def __init__(self, inner: Any, max_len: int | None = None) -> None:
        super().__init__()
        self.inner = inner
        config = inner.config
        limit = int(getattr(config, "max_position_embeddings", None) or config.n_positions)
        if max_len is not None and max_len > limit:
            raise InputError(f"model.max_len {max_len} exceeds the model's max_position_embeddings {limit}")
        self.max_len = max_len if max_len is not None else limit
        self.vocab_size = int(config.vocab_size)
        self.dropout_generator: torch.Generator | None = None  # HF dropout draws from the (seeded) global RNG
        self.train(inner.training)  # one mode for wrapper and model, so _eval_mode restores the right one

    def forward(self, idx: Tensor) -> Tensor:
        if idx.shape[1] > self.max_len:
            raise InputError(f"sequence of {idx.shape[1]} tokens exceeds the model's max_len {self.max_len}")
        logits: Tensor = self.inner(input_ids=idx, use_cache=False).logits
        return logits


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise InputError("model.kind = 'hf' needs the optional extra: pip install 'training-ledger[hf]'") from exc
    transformers.utils.logging.disable_progress_bar()  # a rank's log is for its own lines
    return transformers


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))


def _check_vocab(model: HFCausalLM, vocab_size: int | None, path: str) -> HFCausalLM:
    if vocab_size is not None and model.vocab_size != vocab_size:
        raise InputError(f"model at {path} has vocab_size {model.vocab_size}, its tokenizer {vocab_size}")
    return model


def hf_from_config(cfg: ModelConfig, vocab_size: int | None, seed: int) -> HFCausalLM:
    """The architecture of ``cfg.path/config.json`` with initial weights drawn under ``torch.manual_seed(seed)``
    (transformers initialises from the global generator, so it is forked and restored around the call)."""
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(cfg.path, local_files_only=True)
    except OSError as exc:
        raise InputError(f"model.path {cfg.path}: no readable config.json ({str(exc).splitlines()[0]})") from exc
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inner = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype],
                                                              attn_implementation="sdpa")
    inner.eval()
    return _check_vocab(HFCausalLM(inner, cfg.max_len), vocab_size, cfg.path)


def load_hf_causal_lm(path: str, *, dtype: torch.dtype = torch.float32, max_len: int | None = None,
                      vocab_size: int | None = None) -> HFCausalLM:
    """Load a causal LM with its weights from a local directory (never the network). Needs the ``hf`` extra."""
    transformers = _transformers()
    try:
        inner = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                                  attn_implementation="sdpa")
    except OSError as exc:
        raise InputError(f"model.path {path}: cannot load a causal LM ({str(exc).splitlines()[0]})") from exc
    inner.eval()
    return _check_vocab(HFCausalLM(inner, max_len), vocab_size, path)
