"""Cyclic schedules: delay matrices for DP, CDP-v1, CDP-v2 and general staleness.

Pure numpy, no JAX. ``d[i, j]`` is how many steps old the parameters of stage
``j`` are when worker ``i`` uses them: worker ``i`` at stage ``j`` of step ``t``
computes with ``theta^j_{t - d[i, j]}`` (``theta_{-1} := theta_0``).
"""
from __future__ import annotations

import numpy as np

RULES = ("dp", "cdp-v1", "cdp-v2", "cdp-v2-paper")
"""Named rules. ``cdp-v2-paper`` is the authors' code variant (``j >= J-1-i`` fresh)."""


def _check_sizes(num_workers: int, num_stages: int) -> None:
  if int(num_workers) != num_workers or num_workers < 1:
    raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}.")
  if int(num_stages) != num_stages or num_stages < 1:
    raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}.")


def delay_matrix(rule: str, num_workers: int, num_stages: int) -> np.ndarray:
  """The delay matrix ``d`` of a named rule, int array of shape ``(N, J)``.

  Args:
    rule: ``dp`` (no delay), ``cdp-v1`` (every pair one step late),
      ``cdp-v2`` (stale iff ``j*N < (N-1-i)*J``, from the timeline) or
      ``cdp-v2-paper`` (the authors' code: stale iff ``j < J-1-i``).
    num_workers: ``N``, the number of workers (micro-batches per step).
    num_stages: ``J``, the number of model stages.
  """
  _check_sizes(num_workers, num_stages)
  i = np.arange(num_workers)[:, None]
  j = np.arange(num_stages)[None, :]
  shape = (num_workers, num_stages)
  if rule == "dp":
    return np.zeros(shape, dtype=np.int32)
  if rule == "cdp-v1":
    return np.ones(shape, dtype=np.int32)
  if rule == "cdp-v2":
    return (j * num_workers < (num_workers - 1 - i) * num_stages).astype(np.int32)
  if rule == "cdp-v2-paper":
    return np.broadcast_to(j < num_stages - 1 - i, shape).astype(np.int32)
  raise ValueError(
      f"Unknown rule {rule!r}. Use one of {', '.join(RULES)}, or pass an explicit "
      "(num_workers, num_stages) integer delay matrix.")


def validate_delay_matrix(delays, num_workers: int, num_stages: int) -> np.ndarray:
  """Checks a user-supplied delay matrix and returns it as an int32 array.

  Entries must be integers in ``0..D`` for some ``D >= 0``; the state then keeps
  the ``D + 1`` newest parameter versions.
  """
  _check_sizes(num_workers, num_stages)
  d = np.asarray(delays)
  if d.shape != (num_workers, num_stages):
    raise ValueError(
        f"Delay matrix has shape {d.shape}, expected (num_workers, num_stages) = "
        f"({num_workers}, {num_stages}): one row per worker, one column per stage.")
  if d.size and not np.issubdtype(d.dtype, np.integer):
    if not np.all(np.isfinite(d)) or not np.all(d == np.round(d)):
      raise ValueError(f"Delay matrix entries must be whole numbers of steps, got {d!r}.")
  if d.size and d.min() < 0:
    raise ValueError(f"Delay matrix entries must be >= 0 (steps of staleness), got min {d.min()}.")
  return d.astype(np.int32)


def resolve(rule, num_workers: int, num_stages: int) -> np.ndarray:
  """``delay_matrix`` for a rule name, ``validate_delay_matrix`` for an array."""
  if isinstance(rule, str):
    return delay_matrix(rule, num_workers, num_stages)
  return validate_delay_matrix(rule, num_workers, num_stages)


def max_delay(rule) -> int:
  """``D``, the staleness bound a rule needs state for (``D + 1`` versions kept).

  Named rules other than ``dp`` keep one stale version whatever ``N`` and ``J``
  are, so the state's layout depends on the rule only.
  """
  if isinstance(rule, str):
    if rule not in RULES:
      delay_matrix(rule, 1, 1)  # Raises the unknown-rule error.
    return 0 if rule == "dp" else 1
  d = np.asarray(rule)
  return int(d.max()) if d.size else 0
