"""Re-executing models for verification: the runner side of :class:`verify.context.ModelRunner`.

The CLI hands a :class:`TorchModelRunner` to the verifier (``ledger verify --rescore N``), the way sigstore hands a
policy to its verifier: verify never imports torch or the runners, and re-runs a model only through this seam.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from runners import numerics
from runners.evaluate import load_model
from runners.model import CausalLM, greedy_generate, sequence_nll
from runners.prepare import pinned_threads


class _Loaded:
    def __init__(self, model: CausalLM) -> None:
        self._model = model
        self.cpu = numerics.describe()

    def generate(self, prompts: Sequence[Sequence[int]], *, eos_id: int, max_new_tokens: int,
                 batch_size: int) -> list[list[int]]:
        return greedy_generate(self._model, prompts, eos_id=eos_id, max_new_tokens=max_new_tokens,
                               batch_size=batch_size)

    def nll(self, sequences: Sequence[Sequence[int]], *, batch_size: int) -> list[float]:
        return sequence_nll(self._model, sequences, batch_size=batch_size)


class TorchModelRunner:
    """Loads a checkpoint's model after verifying its digests (never unpickling) and runs it with the recorded
    thread count, in inference mode, exactly as the evaluation did."""

    @contextmanager
    def load(self, checkpoint: Path, config: Any, vocab_size: int, *, state: str, model: str, receipt: str,
             threads: int) -> Iterator[_Loaded]:
        with pinned_threads(threads), torch.inference_mode():
            yield _Loaded(load_model(checkpoint, config, vocab_size, state=state, model=model, receipt=receipt))
