"""Temporal workflows only: deterministic, no I/O."""
