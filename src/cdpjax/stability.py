"""When delayed gradient descent on a quadratic is stable: closed form and numerics.

Pure numpy. On ``f(theta) = 1/N sum_i 1/2 theta^T H_i theta - b_i^T theta``
(worker ``i``'s micro-batch has Hessian ``H_i``), plain SGD with the delays
``d_t[i, j]`` of a rule is the linear recursion

    theta_{t+1} = theta_t - lr * sum_k A_k(t) theta_{t-k} + const,
    A_k(t) = 1/N sum_i H_i P_{i,k}(t),

where ``P_{i,k}(t)`` keeps the coordinates of the stages ``j`` with
``d_t[i, j] = k``. With fixed delays it is stable iff the companion matrix of
the recursion has spectral radius ``< 1``; ``stability_limit`` bisects on
``lr * L`` (``L`` the largest eigenvalue of ``H = mean_i H_i``).

Closed form for one delay ``tau`` on every coordinate: per eigenvalue
``lambda`` of ``H`` the recursion is ``x_{t+1} = x_t - a x_{t-tau}`` with
``a = lr * lambda``, asymptotically stable iff ``0 < a < 2 cos(tau pi / (2 tau + 1))``
(Levin & May, "A note on difference-delay equations", Theoretical Population
Biology 9, 1976; also Kuruklis, J. Math. Anal. Appl. 188, 1994). So
``lr * L < 2`` without delay, ``< 1`` for ``tau = 1`` (``cdp-v1``), ``< 0.618``
for ``tau = 2``.

With heavy-ball momentum ``beta`` (`companion`), per eigenvalue
``x_{t+1} = (1 + beta) x_t - beta x_{t-1} - a x_{t-tau}``. Without delay its
characteristic polynomial ``z^2 - (1 + beta - a) z + beta`` is stable iff
``0 < a < 2 (1 + beta)``; with ``tau = 1``, ``z^2 - (1 + beta) z + beta + a``
iff ``0 < a < 1 - beta`` (Jury's conditions). So momentum widens DP's stable
steps and narrows a one-step delay's: at ``beta = 0.9`` the delay cuts the
largest stable step 38-fold (3.8 against 0.1), at ``beta = 0`` 2-fold. With
momentum as an average (Adam's ``b1``: ``m = b1 m + (1 - b1) g``, so
``a = lr lambda (1 - b1)``) the limits on ``lr * L`` are ``2 (1 + b1) / (1 - b1)``
and ``1``: a one-step delay takes all that the average gives the step.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np


def fixed_delay_limit(tau: int) -> float:
  """The largest stable ``lr * L`` of GD with every gradient ``tau`` steps old (Levin & May)."""
  if int(tau) != tau or tau < 0:
    raise ValueError(f"tau must be an integer >= 0, got {tau!r}.")
  return 2 * math.cos(tau * math.pi / (2 * tau + 1))


def delay_operators(hessians, stage_of_coord, delays, *, predict: bool = False,
                    lr_delay_scale: float = 0.0, dc=None) -> np.ndarray:
  """``A_k = 1/N sum_i H_i P_{i,k}`` for ``k = 0..D``, shape ``(D + 1, p, p)``.

  Args:
    hessians: ``(N, p, p)``, worker ``i``'s Hessian ``H_i``.
    stage_of_coord: ``(p,)`` ints, the stage of each coordinate of ``theta``.
    delays: ``(N, J)`` delay matrix.
    predict: weight prediction (`cdpjax.executor.RulePlan`): a read ``k > 0``
      steps stale is ``(1 + k) theta_{t-k} - k theta_{t-k-1}``, so its share
      moves to ``A_k`` and ``A_{k+1}`` (shape ``(D + 2, p, p)``).
    lr_delay_scale: ``c``: the update of stage ``j``'s coordinates is scaled by
      ``1 / (1 + c mean_i d[i, j])`` (rows of every ``A_k``).
    dc: DC-ASGD linearized at the optimum: ``(N, p)``, ``dc_lambda * g_i*^2``
      with ``g_i*`` worker ``i``'s gradient at the optimum (the workers' gradients
      there sum to 0, not each). Worker ``i``'s corrected gradient
      ``g + dc_lambda g^2 (theta_t - theta_read)`` is then, to first order,
      ``H_i x_read + diag(dc_i) (x_t - x_read)``: ``diag(dc_i)`` joins ``A_0`` and
      leaves the operators of the (predicted) read.
  """
  hessians = np.asarray(hessians, np.float64)
  stage_of_coord = np.asarray(stage_of_coord)
  delays = np.asarray(delays)
  num_workers, p, _ = hessians.shape
  if delays.shape[0] != num_workers or stage_of_coord.shape != (p,):
    raise ValueError(
        f"hessians {hessians.shape}, stage_of_coord {stage_of_coord.shape} and delays "
        f"{delays.shape} disagree: need (N, p, p), (p,) and (N, J).")
  depth = int(delays.max(initial=0))
  ops = np.zeros((depth + 1 + (bool(predict) and depth > 0), p, p))
  dc = None if dc is None else np.asarray(dc, np.float64)
  for i in range(num_workers):
    delay_of_coord = delays[i][stage_of_coord]
    for k in range(depth + 1):
      share = hessians[i] * (delay_of_coord == k)[None, :] / num_workers
      if dc is not None and k > 0:  # + diag(dc_i) (x_t - x_read) on the stale coordinates.
        correction = np.diag(dc[i] * (delay_of_coord == k)) / num_workers
        ops[0] += correction
        share = share - correction
      if predict and k > 0:
        ops[k] += (1 + k) * share
        ops[k + 1] -= k * share
      else:
        ops[k] += share
  scale = 1.0 / (1.0 + lr_delay_scale * delays.mean(axis=0))  # Per stage.
  return ops * scale[stage_of_coord][None, :, None]


def companion(ops, lr: float, momentum: float = 0.0) -> np.ndarray:
  """The ``(D+1) p`` square matrix mapping ``(theta_t, ..., theta_{t-D})`` one step on.

  ``momentum``: heavy-ball momentum ``beta`` (``optax.sgd(lr, momentum=beta)``:
  ``theta_{t+1} = theta_t + beta (theta_t - theta_{t-1}) - lr sum_k A_k theta_{t-k}``),
  which needs ``theta_{t-1}`` in the state even without delay.
  """
  if momentum and len(ops) == 1:
    ops = np.concatenate([ops, np.zeros_like(ops)])
  num, p, _ = ops.shape
  c = np.zeros((num * p, num * p))
  c[:p, :p] = (1 + momentum) * np.eye(p)
  if momentum:
    c[:p, p:2 * p] = -momentum * np.eye(p)
  for k in range(num):
    c[:p, k * p:(k + 1) * p] -= lr * ops[k]
  for k in range(1, num):
    c[k * p:(k + 1) * p, (k - 1) * p:k * p] = np.eye(p)
  return c


def spectral_radius(matrix) -> float:
  return float(np.max(np.abs(np.linalg.eigvals(matrix))))


def _bisect(unstable: Callable[[float], bool], hi: float, tol: float) -> float:
  """The smallest ``x`` in ``(0, hi]`` with ``unstable(x)``, to ``tol``; stability below it assumed."""
  lo = 0.0
  while not unstable(hi):
    lo, hi = hi, 2 * hi
  while hi - lo > tol:
    mid = 0.5 * (lo + hi)
    lo, hi = (lo, mid) if unstable(mid) else (mid, hi)
  return 0.5 * (lo + hi)


def lipschitz(hessians) -> float:
  """``L``, the largest eigenvalue of ``H = mean_i H_i``."""
  return float(np.linalg.eigvalsh(np.mean(np.asarray(hessians, np.float64), axis=0)).max())


def stability_limit(hessians, stage_of_coord, delays, *, tol: float = 1e-4,
                    momentum: float = 0.0, **compensation) -> float:
  """The largest stable ``lr * L`` for a fixed delay matrix (companion-matrix spectral radius).

  The stable set of ``lr`` is taken to be an interval ``(0, limit)``, as it is
  for one delay; the bisection finds its end. ``momentum``: heavy-ball momentum
  (`companion`). ``compensation``: ``predict``, ``lr_delay_scale`` and ``dc`` of
  `delay_operators`.
  """
  ops = delay_operators(hessians, stage_of_coord, delays, **compensation)
  big_l = lipschitz(hessians)
  return _bisect(lambda x: spectral_radius(companion(ops, x / big_l, momentum)) >= 1.0, 2.0,
                 tol)


def mean_delay_limit(probs: Sequence[float], *, tol: float = 1e-4) -> float:
  """The largest ``lr * L`` for which the *expected* iterate of a random rule converges.

  With each entry of the delay matrix i.i.d. with law ``probs`` on ``0..D`` and
  independent of the iterates, ``E theta`` follows
  ``x_{t+1} = x_t - a sum_k probs[k] x_{t-k}`` per eigenvalue; stable iff
  every root of ``z^{D+1} - z^D + a sum_k probs[k] z^{D-k}`` lies in the unit
  disc. A necessary condition for the random iteration, not a sufficient one
  (the second moment can grow first): compare ``random_rule_limit``.
  """
  probs = np.asarray(probs, np.float64)

  def unstable(a):
    poly = np.zeros(probs.size + 1)
    poly[0], poly[1] = 1.0, -1.0
    poly[1:] += a * probs
    return float(np.max(np.abs(np.roots(poly)))) >= 1.0

  return _bisect(unstable, 2.0, tol)


def growth_rate(hessians, stage_of_coord, delays_TxNxJ, lr: float, seed: int = 0) -> float:
  """Mean log growth per step of ``theta_t - theta*`` under per-step delays (Lyapunov exponent).

  Runs the homogeneous recursion in float64 from a random start, renormalising
  every step; ``> 0`` means the iterates blow up.
  """
  delays_TxNxJ = np.asarray(delays_TxNxJ)
  num_versions = int(delays_TxNxJ.max(initial=0)) + 1
  p = np.asarray(hessians).shape[1]
  start = np.random.default_rng(seed).normal(size=p)
  history = [start / np.linalg.norm(start)] * num_versions  # Newest first.
  total = 0.0
  for delays in delays_TxNxJ:
    ops = delay_operators(hessians, stage_of_coord, delays)
    step = history[0] - lr * sum(ops[k] @ history[k] for k in range(ops.shape[0]))
    history = [step] + history[:num_versions - 1]
    scale = max(np.linalg.norm(h) for h in history)
    total += math.log(scale)
    history = [h / scale for h in history]
  return total / len(delays_TxNxJ)


def random_rule_limit(hessians, stage_of_coord, rule, *, num_steps: int = 400,
                      tol: float = 0.01) -> float:
  """The largest stable ``lr * L`` of a per-step rule, by simulating its recursion.

  Bisects on the sign of ``growth_rate`` over ``rule``'s first ``num_steps``
  matrices (a ``schedule.DelayRule`` or anything with ``window(start, count)``).
  """
  delays = rule.window(0, num_steps)
  big_l = lipschitz(hessians)
  return _bisect(lambda x: growth_rate(hessians, stage_of_coord, delays, x / big_l) > 0, 2.0, tol)
