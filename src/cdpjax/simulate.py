"""The reference oracle: executes the timeline event by event on one device.

A plain Python loop over ``schedule.timeline``, or over the events of an
executed timetable from the executors' own slot plan (``cdpjax.executed.plan``). Each stage forward and backward
runs at its slot, a stage is updated when the last of its ``N`` gradients of the
step arrives, and a forward reads the parameter version its rule asks for from
the versions this loop has produced so far. Slow and easy to audit: the engine's
numbers are checked against it.
"""
from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cdpjax import schedule
from cdpjax.executed import plan as plan_lib


class Simulation(NamedTuple):
  """What ``simulate`` returns.

  Attributes:
    params: ``theta_T``, the final parameters: a list of ``J`` stage pytrees.
    losses: ``(T,)`` array, per step the mean over workers of the micro-batch
      losses.
    worker_losses: ``(T, N)`` array, the loss of each micro-batch at the view its
      worker computed with.
    history: ``[theta_0, ..., theta_T]``, each a list of ``J`` stage pytrees.
  """
  params: list
  losses: np.ndarray
  worker_losses: np.ndarray
  history: list


def _forward(e, theta, stage_fns, loss_fn, batches, carry, vjps, worker_losses) -> None:
  """Runs forward event ``e`` at stage parameters ``theta``; the last stage records the loss.

  ``carry`` holds each (worker, step)'s activation, then its cotangent;
  ``vjps`` the pullbacks its backward will call.
  """
  j, key = e.stage, (e.worker, e.step)
  x, y = batches[e.step][e.worker]
  h = x if j == 0 else carry.pop(key)
  out, vjps[key + (j,)] = jax.vjp(stage_fns[j], theta, h)
  if j == len(stage_fns) - 1:
    loss, carry[key] = jax.value_and_grad(loss_fn)(out, y)
    worker_losses[e.step, e.worker] = loss
  else:
    carry[key] = out


def _backward(e, carry, vjps):
  """Runs backward event ``e``: returns its stage gradient and passes the cotangent on."""
  j, key = e.stage, (e.worker, e.step)
  grad, cotangent = vjps.pop(key + (j,))(carry.pop(key))
  if j > 0:
    carry[key] = cotangent
  return grad


def simulate(stage_fns: Sequence[Callable], loss_fn: Callable, stage_params: Sequence[Any],
             tx: optax.GradientTransformation, batches: Sequence[Sequence[tuple]],
             rule, *, speeds=None, jitter=None, max_delay: int = 1,
             timetable: str | None = None, weight_prediction: bool = False,
             dc_lambda: float = 0.0, lr_delay_scale: float = 0.0) -> Simulation:
  """Runs ``len(batches)`` training steps of ``rule``, one timeline event at a time.

  Events run in time order; a backward's gradient counts from its end (its
  start slot + its duration), so an update completed at a time is visible to a forward
  starting at that time. For ``dp`` and ``cdp-v2`` a forward reads the newest
  version of its stage produced by then, and the loop checks it is the version
  ``schedule.timeline`` predicts; other rules read ``theta_{t - d[i, j]}``. A
  rule that needs a version before the cyclic timeline produces it (e.g.
  ``cdp-v2-paper`` with ``N > J``) runs in lockstep instead: same numbers, DP
  timing.

  Args:
    stage_fns: ``J`` functions ``f_j(params_j, h) -> h``, in execution order;
      stage 0 gets the micro-batch's ``x``.
    loss_fn: ``loss_fn(out, y) -> scalar``, the mean loss of one micro-batch
      given the last stage's output.
    stage_params: ``J`` pytrees, ``theta_0`` per stage.
    tx: an optax ``GradientTransformation``. Each stage keeps its own state
      (``tx.init(params_j)``) and is updated with the mean over workers of its
      gradient. That equals one global update for per-leaf transforms (SGD,
      momentum, Adam, ...), not for transforms that couple stages, such as
      global-norm clipping.
    batches: per step, per worker, one ``(x, y)`` micro-batch.
    rule: a name in ``schedule.RULES`` or an ``(N, J)`` integer delay matrix.
    speeds, jitter, max_delay: workers of unequal speed, as in
      ``schedule.timeline`` (rule ``cdp-v2``): events then last
      ``(1 + jitter) / speed`` slots, and a forward reads the newest version
      this loop has produced when it starts.
    timetable: run the events that an executor runs instead of the timeline:
      ``cyclic`` (CDP+MP, ``N = J``), ``gpipe`` or ``dp+mp``
      (`plan.executed_events`), with equal speeds.
    weight_prediction: a forward of step ``t`` that reads ``theta_v``, ``d = t - v``
      steps stale, computes with ``theta_v + d * (theta_v - theta_{v-1})``
      (``theta_{-1} = theta_0``), from the versions produced by then.
    dc_lambda: DC-ASGD's correction: each worker's gradient ``g`` of a stage it
      read as ``theta_read`` counts as ``g + dc_lambda * g * g * (theta_t -
      theta_read)`` in the update of ``theta_t``.
    lr_delay_scale: stage ``j``'s update of step ``t`` is scaled by ``1 / (1 +
      lr_delay_scale * mean_i d)``, ``d`` each worker's staleness at its read.

  Returns:
    A ``Simulation``.
  """
  num_stages, num_steps = len(stage_fns), len(batches)
  if len(stage_params) != num_stages:
    raise ValueError(
        f"Got {len(stage_params)} stage_params for {num_stages} stage_fns; pass one "
        "parameter pytree per stage.")
  if num_steps < 1 or not batches[0]:
    raise ValueError("batches must hold at least one step of at least one (x, y) micro-batch.")
  num_workers = len(batches[0])
  if any(len(step) != num_workers for step in batches):
    raise ValueError(
        f"Every step needs the same number of micro-batches (one per worker); got "
        f"{[len(step) for step in batches]}.")
  reads_newest = isinstance(rule, str) and rule in ("dp", "cdp-v2")
  lockstep = None if schedule.is_causal(rule, num_workers, num_stages) else True
  if timetable is None:
    events = schedule.timeline(rule, num_workers, num_stages, num_steps, lockstep=lockstep,
                               speeds=speeds, jitter=jitter, max_delay=max_delay)
  elif speeds is not None or jitter is not None:
    raise ValueError("An executed timetable runs at equal speeds: drop speeds and jitter, or "
                     "timetable.")
  else:
    events = plan_lib.executed_events(timetable, rule, num_stages, num_steps, num_workers)

  versions = [[(Fraction(0), p)] for p in stage_params]  # Per stage: (ready slot, theta_v).
  opt_states = [tx.init(p) for p in stage_params]
  grad_sums = {}  # (step, stage) -> the workers' (gradient, parameters read) so far.
  reads = {}  # (worker, step, stage) -> the parameters its forward read.
  vjps = {}  # (worker, step, stage) -> vjp holding the weights and input of the forward.
  carry = {}  # (worker, step) -> activation going up or cotangent going down.
  worker_losses = np.zeros((num_steps, num_workers))
  for e in events:
    j = e.stage
    if e.kind == "fwd":
      ready = versions[j]
      v = e.version
      if reads_newest:
        v = max(u for u, (slot, _) in enumerate(ready) if slot <= e.slot)
        if v != e.version:
          raise AssertionError(f"{e} read version {v} produced by the simulation.")
      elif v >= len(ready) or ready[v][0] > e.slot:
        raise AssertionError(f"{e} needs a version the simulation has not produced yet.")
      theta, stale = ready[v][1], e.step - v
      if weight_prediction and stale:
        last = ready[max(v - 1, 0)][1]
        theta = jax.tree.map(lambda a, b: a + stale * (a - b), theta, last)
      reads[(e.worker, e.step, j)] = (theta, stale)
      _forward(e, theta, stage_fns, loss_fn, batches, carry, vjps, worker_losses)
    else:
      grads = grad_sums.setdefault((e.step, j), [])
      grads.append((_backward(e, carry, vjps), *reads.pop((e.worker, e.step, j))))
      if len(grads) < num_workers:
        continue
      del grad_sums[(e.step, j)]
      theta = versions[j][e.step][1]
      corrected = [jax.tree.map(lambda g, t, r: g + dc_lambda * g * g * (t - r), g, theta, read)
                   if dc_lambda else g for g, read, _ in grads]
      scale = 1.0 / (1.0 + lr_delay_scale * np.mean([stale for *_, stale in grads]))
      total = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), corrected)
      mean = jax.tree.map(lambda g: g / num_workers, total)
      updates, opt_states[j] = tx.update(mean, opt_states[j], theta)
      if lr_delay_scale:
        updates = jax.tree.map(lambda u: u * scale, updates)
      versions[j].append((e.end, optax.apply_updates(theta, updates)))

  history = [[versions[j][t][1] for j in range(num_stages)] for t in range(num_steps + 1)]
  return Simulation(history[-1], worker_losses.mean(axis=1), worker_losses, history)


class AsyncSimulation(NamedTuple):
  """What ``simulate_async`` returns.

  Attributes:
    params: the final parameters, a list of ``J`` stage pytrees.
    losses: ``(T,)`` array, per step the mean over workers of the micro-batch
      losses.
    staleness: ``(T, N, J)`` int array: how many updates of stage ``j`` were
      applied between worker ``i``'s forward of step ``t`` (its read) and the
      application of its gradient. Divide by ``N`` for steps.
    update_times: ``(T, N, J)`` float array: when each gradient was applied.
  """
  params: list
  losses: np.ndarray
  staleness: np.ndarray
  update_times: np.ndarray


def simulate_async(stage_fns: Sequence[Callable], loss_fn: Callable, stage_params: Sequence[Any],
                   tx: optax.GradientTransformation, batches: Sequence[Sequence[tuple]], *,
                   speeds=None, jitter=None) -> AsyncSimulation:
  """Asynchronous SGD on the cyclic timeline: no per-stage barrier.

  Each stage applies each worker's gradient alone, divided by ``N`` (for SGD,
  a step of ``lr / N``), the moment its backward ends; a forward reads the
  stage as it is when the forward starts. Workers run their micro-batches back
  to back from the cyclic offsets, at ``speeds`` with ``jitter`` as in
  ``schedule.timeline``, and never wait. With ``N = 1`` it is plain SGD.

  The engine cannot express this rule: it applies one update per stage per
  step, the mean of ``N`` gradients, to versions indexed by step, while here a
  stage changes ``N`` times per step and a forward may read any of those
  intermediate versions.
  """
  num_stages, num_steps = len(stage_fns), len(batches)
  num_workers = len(batches[0])
  if len(stage_params) != num_stages:
    raise ValueError(f"Got {len(stage_params)} stage_params for {num_stages} stage_fns.")
  # Event times of the cyclic timeline; a bound of num_steps never makes a worker wait.
  events = schedule.timeline("cdp-v2", num_workers, num_stages, num_steps,
                             speeds=[1] * num_workers if speeds is None else speeds,
                             jitter=jitter, max_delay=num_steps)
  params, opt_states = list(stage_params), [tx.init(p) for p in stage_params]
  applied = [0] * num_stages  # Updates applied so far, per stage.
  pending = []  # (end time, stage, worker, step, gradient, read count), applied at end time.
  vjps, carry, reads = {}, {}, {}
  worker_losses = np.zeros((num_steps, num_workers))
  staleness = np.zeros((num_steps, num_workers, num_stages), dtype=np.int64)
  update_times = np.zeros((num_steps, num_workers, num_stages))

  def apply_until(time):
    pending.sort(key=lambda u: u[0])
    while pending and pending[0][0] <= time:
      end, j, i, t, grad, read = pending.pop(0)
      updates, opt_states[j] = tx.update(
          jax.tree.map(lambda g: g / num_workers, grad), opt_states[j], params[j])
      params[j] = optax.apply_updates(params[j], updates)
      staleness[t, i, j] = applied[j] - read
      update_times[t, i, j] = float(end)
      applied[j] += 1

  for e in events:
    apply_until(e.slot)
    j, key = e.stage, (e.worker, e.step)
    if e.kind == "fwd":
      reads[key + (j,)] = applied[j]
      _forward(e, params[j], stage_fns, loss_fn, batches, carry, vjps, worker_losses)
    else:
      grad = _backward(e, carry, vjps)
      pending.append((e.end, j, e.worker, e.step, grad, reads.pop(key + (j,))))
  apply_until(Fraction(10**18))
  return AsyncSimulation(params, worker_losses.mean(axis=1), staleness, update_times)
