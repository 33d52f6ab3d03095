"""Delay compensations, as the engine and every executed timetable apply them.

`executor.RulePlan` turns them on (config keys ``weight_prediction``,
``dc_lambda``, ``lr_delay_scale``); `cdpjax.simulate` computes the same update
independently, event by event. A worker reads stage ``j`` ``d = d[i, j]`` steps
stale:

- weight prediction (PipeMare's, per (worker, stage)): the read is
  ``theta_{t-d} + d * (theta_{t-d} - theta_{t-d-1})``, an estimate of
  ``theta_t`` from the last step known at the read; one more version of each
  stage read stale is kept;
- DC-ASGD's correction (Zheng et al., 2017): the worker's gradient ``g`` counts
  as ``g + dc_lambda * g * g * (theta_t - theta_read)`` in the update of
  ``theta_t``;
- a delay-aware learning rate: stage ``j``'s update is scaled by
  ``1 / (1 + c * mean_i min(d[i, j], t))`` (``theta_0`` is read fresh at first).
"""
from __future__ import annotations

import jax.numpy as jnp


def predicted(read, older, delay):
  """Weight prediction of a read ``delay`` steps stale: ``read + delay * (read - older)``;
  ``read`` itself where ``delay`` is 0."""
  return read + delay * (read - older)


def dc_corrected(grad, fresh, read, dc_lambda: float):
  """DC-ASGD: ``grad + dc_lambda * grad**2 * (fresh - read)``, ``fresh`` being ``theta_t``."""
  return grad + dc_lambda * grad * grad * (fresh - read)


def lr_scale(delays, step, c: float):
  """Per stage ``j``: ``1 / (1 + c * mean_i min(d[i, j], t))`` for the ``[N, J]`` delays at step ``t``."""
  delays = jnp.minimum(jnp.asarray(delays), step).astype(jnp.float32)
  return 1.0 / (1.0 + c * jnp.mean(delays, axis=0))
