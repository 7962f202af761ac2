"""Runners: prepare, training arms, recovery, evaluation and serving; each emits receipts."""

from runners import numerics as _numerics

# Before any runner imports torch, so ATen and MKL pick the pinned code paths on their first use (runners/numerics.py).
_numerics.pin()
