"""Verification: recompute digests, check chains, prove equality and statistics."""
