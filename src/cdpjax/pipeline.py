"""Executed pipeline schedules: CDP with model parallelism, GPipe and DP+MP.

The model is the digits ``ResidualMLP`` cut into ``J`` stages over the mesh
axis ``stage``: stage ``s`` holds blocks ``s*k .. (s+1)*k - 1``
(``k = num_blocks / J``), stage 0 also the ``embed`` layer and stage ``J-1`` the
``head`` and the loss. Every device holds its stage's parameter versions and
optimizer state on a leading stage axis; ``embed`` and ``head`` are stacked
too, as zeros on the stages that do not run them (SPMD needs equal shapes).

Each device runs one event per slot: idle, a stage forward or a stage
backward, chosen from the schedule by its stage index and the slot counter.
Activations move ``j -> j+1`` and cotangents ``j -> j-1`` by ``lax.ppermute``.
A stage stashes only its input; its backward recomputes the stage forward with
``jax.vjp`` at the parameter version its forward read, and adds the weight
gradient to a running accumulator that never leaves the device.

Schedules (``N`` micro-batches of ``b`` rows per step, ``K`` steps per call):

- ``cyclic``: CDP, ``N = J``. Micro-batch ``i`` of step ``t`` is worker ``i``
  of the timeline of ``schedule.timeline``: it enters stage ``j`` at slot
  ``2Jt + 2i + j`` and leaves it at ``2Jt + 2i + 2J-1-j``, so device ``j``
  runs a forward when ``s - j`` is even and a backward when it is odd. A
  stage's update is applied on its device right after its ``N``-th backward
  of the step; a forward then reads ``theta^j_{t - d[i, j]}`` from the ``D+1``
  newest versions, with ``d = schedule.delay_matrix(rule, N, J)``. Steps follow
  each other without a flush.
- ``gpipe``: all ``N`` forwards, all ``N`` backwards, the update, a flush.
- ``dp+mp``: ``N`` replicas (mesh axis ``data``) of ``J`` stages, one
  micro-batch each, gradients all-reduced over ``data``.

One call runs ``K`` steps in one ``lax.scan`` over slots; the pipeline fills
at the start of the call and drains at its end (``2J-2`` idle slots per device
per call for ``cyclic``). Between calls the state is the engine's:
``(theta_t, theta_{t-1}, ..., theta_{t-D})`` and the optimizer state, so the
numbers equal ``engine.make_train_step`` step by step for every ``K``.

The optimizer runs per stage on that stage's device, so it must act leaf by
leaf (``sgd``, ``adam``, ...): a global-norm clip would see one stage only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import schedule as schedule_lib
from cdpjax.models.residual_mlp import block_apply, embed_apply, head_apply

SCHEDULES = ("cyclic", "gpipe", "dp+mp")
STAGE_AXIS = "stage"
DATA_AXIS = "data"
IDLE, FWD, BWD = 0, 1, 2


class PipelineState(NamedTuple):
  """The pipeline's train state; every leaf but ``step`` has a leading stage axis.

  Attributes:
    step: int32 scalar, the number of updates applied so far (``t``).
    params: ``theta_t`` as ``{"embed", "blocks", "head"}``; ``blocks`` leaves
      are ``[J, k, ...]``, ``embed``/``head`` leaves ``[J, ...]`` (zero off
      stage 0 / ``J-1``).
    stale_params: ``(theta_{t-1}, ..., theta_{t-D})`` in the same layout.
    opt_state: the optax state of each stage, stacked on the stage axis.
  """
  step: jax.Array
  params: Any
  stale_params: tuple
  opt_state: Any

  @property
  def versions(self) -> tuple:
    """``(theta_t, theta_{t-1}, ..., theta_{t-D})``."""
    return (self.params,) + tuple(self.stale_params)


# ----------------------------------------------------------------------------
# Parameter layout.


def _check_blocks(num_blocks: int, num_stages: int) -> int:
  if int(num_blocks) != num_blocks or num_blocks < 1:
    raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}.")
  if num_blocks % num_stages:
    raise ValueError(
        f"num_blocks={num_blocks} is not a multiple of the {num_stages} pipeline stages "
        f"(mesh axis {STAGE_AXIS!r}): use num_blocks = k * {num_stages} so that every "
        "stage holds k identical blocks.")
  return num_blocks // num_stages


def stack_params(params, num_stages: int, num_blocks: int):
  """The ResidualMLP flax ``params`` dict in the stage-stacked layout of ``PipelineState``."""
  k = _check_blocks(num_blocks, num_stages)
  expected = {"embed", "head"} | {f"block_{l}" for l in range(num_blocks)}
  if set(params) != expected:
    raise ValueError(
        f"params must be a ResidualMLP params dict with num_blocks={num_blocks}: expected keys "
        f"embed, block_0..block_{num_blocks - 1}, head; missing {sorted(expected - set(params))}, "
        f"unexpected {sorted(set(params) - expected)}.")

  def on_stage(stage):
    return lambda x: jnp.zeros((num_stages,) + jnp.shape(x), jnp.result_type(x)).at[stage].set(x)

  blocks = jax.tree.map(
      lambda *xs: jnp.stack(xs).reshape((num_stages, k) + jnp.shape(xs[0])),
      *[params[f"block_{l}"] for l in range(num_blocks)])
  return {"embed": jax.tree.map(on_stage(0), params["embed"]), "blocks": blocks,
          "head": jax.tree.map(on_stage(num_stages - 1), params["head"])}


def unstack_params(stacked) -> dict:
  """Inverse of ``stack_params``: the flax params dict (replicated over the mesh)."""
  stacked = jax.tree.map(_replicated, stacked)
  num_stages, k = jax.tree.leaves(stacked["blocks"])[0].shape[:2]
  params = {"embed": jax.tree.map(lambda x: x[0], stacked["embed"])}
  for l in range(num_stages * k):
    params[f"block_{l}"] = jax.tree.map(lambda x: x[l // k, l % k], stacked["blocks"])
  params["head"] = jax.tree.map(lambda x: x[num_stages - 1], stacked["head"])
  return params


def _replicated(x):
  """``x`` copied to every device of its mesh (readable on every process), if on a mesh."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return jax.device_put(x, NamedSharding(sharding.mesh, P()))
  return x


def current_params(state: PipelineState) -> dict:
  """``theta_t`` as the ResidualMLP flax params dict (for evaluation and checkpoints)."""
  return unstack_params(state.params)


def _stage_axis_size(mesh: Mesh) -> int:
  if STAGE_AXIS not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)} but no axis {STAGE_AXIS!r}: build it with "
        f"jax.make_mesh((J,), ({STAGE_AXIS!r},)), or jax.make_mesh((N, J), "
        f"({DATA_AXIS!r}, {STAGE_AXIS!r})) for dp+mp.")
  return int(mesh.shape[STAGE_AXIS])


def _state_sharding(mesh: Mesh, state: PipelineState):
  stage = NamedSharding(mesh, P(STAGE_AXIS))
  return PipelineState(NamedSharding(mesh, P()), *[jax.tree.map(lambda _: stage, part)
                                                   for part in state[1:]])


def init_state(params, tx: optax.GradientTransformation, *, rule, mesh: Mesh,
               num_blocks: int) -> PipelineState:
  """The pipeline state at ``t = 0``, placed on ``mesh``; every stale version is ``theta_0``.

  Args:
    params: the ResidualMLP flax ``params`` dict (``embed``, ``block_*``, ``head``).
    tx: the optimizer; its state is built per stage.
    rule: a rule name of ``schedule.RULES`` or a delay matrix; it fixes ``D``.
    mesh: a mesh with axis ``stage`` (``J`` devices), and ``data`` for dp+mp.
    num_blocks: the number of residual blocks, a multiple of ``J``.
  """
  num_stages = _stage_axis_size(mesh)
  stacked = stack_params(params, num_stages, num_blocks)
  stale = tuple(jax.tree.map(jnp.copy, stacked) for _ in range(schedule_lib.max_delay(rule)))
  state = PipelineState(jnp.zeros((), jnp.int32), stacked, stale, jax.vmap(tx.init)(stacked))
  return jax.device_put(state, _state_sharding(mesh, state))


# ----------------------------------------------------------------------------
# Schedules: what each device does at each slot. ``xp`` is numpy (to check and
# count events) or jax.numpy (in the compiled step).


class SlotEvent(NamedTuple):
  """What one device does in one slot.

  Attributes:
    kind: ``IDLE``, ``FWD`` or ``BWD``.
    step: local step ``t`` of the call (0 when idle).
    micro: micro-batch ``i`` within its step (0 when idle).
    updates: updates applied to this stage in this call before the slot.
    version: which of the ``D+1`` newest versions the event uses (0 = newest).
    stash: the stash entry of this micro-batch's stage input.
    update: whether the stage is updated right after this event.
  """
  kind: Any
  step: Any
  micro: Any
  updates: Any
  version: Any
  stash: Any
  update: Any


def cyclic_slots(num_stages: int, num_steps: int) -> int:
  """Slots of a ``K``-step cyclic call: ``2J(K+1) - 2`` (the last backward ends it)."""
  return 2 * num_stages * (num_steps + 1) - 2


def cyclic_event(slot, stage, delays, num_steps: int, xp=np) -> SlotEvent:
  """The cyclic CDP schedule (``N = J``) at ``slot`` on device ``stage``.

  Micro-batch ``m = J t + i`` runs the forward of stage ``j`` at ``2m + j`` and
  its backward at ``2m + 2J-1-j``; stage ``j`` of step ``t`` is updated after
  its last backward, at slot ``2Jt + 4J-3-j``.
  """
  num_stages = delays.shape[1]
  period = 2 * num_stages
  forward = (slot - stage) % 2 == 0
  m = xp.where(forward, (slot - stage) // 2, (slot + stage + 1 - period) // 2)
  valid = (m >= 0) & (m < num_stages * num_steps)
  m = xp.where(valid, m, 0)
  step, micro = m // num_stages, m % num_stages
  updates = xp.clip((slot - (2 * period - 3 - stage) + period - 1) // period, 0, num_steps)
  version = updates - step + xp.asarray(delays)[micro, stage]
  return SlotEvent(
      kind=xp.where(valid, xp.where(forward, FWD, BWD), IDLE), step=step, micro=micro,
      updates=updates, version=version, stash=m % max(num_stages - 1, 1),
      update=valid & ~forward & (micro == num_stages - 1))


def gpipe_event(slot, stage, delays, *, num_micro: int, num_steps: int, worker0=0,
                xp=np) -> SlotEvent:
  """GPipe at ``slot`` on device ``stage``: ``2(M+J-1)`` slots per step.

  Micro-batch ``i`` of step ``t`` runs the forward of stage ``j`` at slot
  ``r = i + j`` of the step and its backward at ``r = (M+J-1) + i + (J-1-j)``;
  every stage is updated at the end of the step's last slot, then the pipeline
  is empty (the flush). ``worker0`` is the delay-matrix row of micro-batch 0
  (the replica, for ``dp+mp``).
  """
  num_stages = delays.shape[1]
  phase = num_micro + num_stages - 1
  step, r = slot // (2 * phase), slot % (2 * phase)
  forward = r < phase
  micro = xp.where(forward, r - stage, r - phase - (num_stages - 1 - stage))
  valid = (micro >= 0) & (micro < num_micro) & (step < num_steps)
  micro = xp.where(valid, micro, 0)
  step = xp.clip(step, 0, num_steps - 1)
  return SlotEvent(
      kind=xp.where(valid, xp.where(forward, FWD, BWD), IDLE), step=step, micro=micro,
      updates=step, version=xp.asarray(delays)[worker0 + micro, stage], stash=micro,
      update=r == 2 * phase - 1)


def executed_events(schedule: str, rule, num_stages: int, num_steps: int,
                    num_micro_batches: int | None = None) -> list[schedule_lib.Event]:
  """The events a ``K``-step call executes, as ``schedule.Event``s sorted by time.

  Versions are global step indices (``theta_{-1} := theta_0`` shows as 0), so
  the cyclic events can be compared with ``schedule.timeline``. For ``dp+mp``,
  ``worker`` is the replica.
  """
  num_micro = num_stages if num_micro_batches is None else num_micro_batches
  delays = schedule_lib.resolve(rule, num_micro, num_stages)
  stages = np.arange(num_stages)[None, :]
  rows = []  # (slot, worker, step, stage, kind, version) arrays.
  if schedule == "cyclic":
    slots = np.arange(cyclic_slots(num_stages, num_steps))[:, None]
    ev = cyclic_event(slots, stages, delays, num_steps)
    rows.append((slots, ev.micro, ev.step, ev.kind, ev.updates - ev.version))
  else:
    per_replica = 1 if schedule == "dp+mp" else num_micro
    slots = np.arange(num_steps * 2 * (per_replica + num_stages - 1))[:, None]
    for r in range(num_micro // per_replica):
      ev = gpipe_event(slots, stages, delays, num_micro=per_replica, num_steps=num_steps,
                       worker0=r * per_replica)
      rows.append((slots, ev.micro + r * per_replica, ev.step, ev.kind, ev.step - ev.version))
  events = []
  for slots, worker, step, kind, version in rows:
    slots, worker, step, kind, version = np.broadcast_arrays(slots, worker, step, kind, version)
    for s, j in zip(*np.nonzero(kind != IDLE)):
      events.append(schedule_lib.Event(
          int(slots[s, j]), int(worker[s, j]), int(step[s, j]), int(j),
          "fwd" if kind[s, j] == FWD else "bwd", max(int(version[s, j]), 0)))
  return sorted(events)


def _check_causal(rule, delays, num_steps: int, num_versions: int) -> None:
  num_stages = delays.shape[1]
  num_steps = max(num_steps, 2)  # Causal in steady state, not only within one step.
  ev = cyclic_event(np.arange(cyclic_slots(num_stages, num_steps))[:, None],
                    np.arange(num_stages)[None, :], delays, num_steps)
  used = ev.version[ev.kind != IDLE]
  if used.min() < 0 or used.max() >= num_versions:
    raise ValueError(
        f"Rule {rule!r} is not causal on the cyclic schedule: some forward would need "
        "parameters that are not updated yet (or older than the state keeps). Use a cdp rule "
        "(cdp-v1, cdp-v2) with schedule='cyclic', or schedule='gpipe' for dp.")


def swap_pairs(num_stages: int, parity: int) -> list[tuple[int, int]]:
  """The cyclic schedule's ``ppermute`` at slots of ``parity``.

  Devices ``j = parity (mod 2)`` ran a forward and send to ``j+1``; the others ran
  a backward and send to ``j-1``: disjoint swaps of neighbours.
  """
  pairs = []
  for j in range(parity, num_stages - 1, 2):
    pairs += [(j, j + 1), (j + 1, j)]
  return pairs


def _permute(pairs, axes):
  """``ppermute`` over ``stage`` along ``pairs``; devices outside them receive zeros."""
  if not pairs:
    return lambda x: _vary(jnp.zeros_like(x), axes)
  return lambda x: jax.lax.ppermute(x, STAGE_AXIS, pairs)


# ----------------------------------------------------------------------------
# Stage computations.


def _stage_apply(params, x, h, labels, first, last):
  """Stage forward: its ``k`` blocks on ``embed(x)`` (stage 0) or ``h`` (others).

  Returns the stage output and the mean cross-entropy of the head on it. Every
  stage runs the small embed and head layers and ``first``/``last`` (traced
  bools) select what counts, so one branch serves all stages.
  """
  h = jnp.where(first, embed_apply(params["embed"], x), h)
  for r in range(jax.tree.leaves(params["blocks"])[0].shape[0]):
    h = block_apply(jax.tree.map(lambda w: w[r], params["blocks"]), h)
  logits = head_apply(params["head"], h)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return h, jnp.where(last, loss, 0.0)


def _vary(tree, axes):
  """Marks every leaf varying over ``axes`` so carries and branches type-check."""
  def cast(x):
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def _version(versions, index):
  """``versions[index]`` for a traced ``index``.

  A ``lax.switch`` rather than per-leaf selects: XLA would fuse the whole event
  arithmetic into every leaf's select, which multiplies the compile time.
  """
  if len(versions) == 1:
    return versions[0]
  return jax.lax.switch(index, [lambda vs, v=v: vs[v] for v in range(len(versions))], versions)


def _branches(axes):
  """``lax.switch`` branches indexed by ``IDLE``, ``FWD``, ``BWD``.

  Operands ``(params, first, last, stash, stash_index, recv, acc, x, labels)``;
  results ``(send, stash, acc, loss)``. A forward stashes its input ``recv``; a
  backward recomputes the stage from the stash and adds its weight gradient
  to ``acc``. What stage 0 stashes and sends back is never read.
  """
  def finish(send, stash, acc, loss):
    return _vary((send, stash, acc, loss), axes)

  def idle(ops):
    _, _, _, stash, _, recv, acc, _, _ = ops
    return finish(jnp.zeros_like(recv), stash, acc, jnp.zeros((), jnp.float32))

  def forward(ops):
    params, first, last, stash, index, recv, acc, x, labels = ops
    h, loss = _stage_apply(params, x, recv, labels, first, last)
    return finish(h, stash.at[index].set(recv), acc, loss)

  def backward(ops):
    params, first, last, stash, index, recv, acc, x, labels = ops
    (h, loss), vjp = jax.vjp(lambda p, h: _stage_apply(p, x, h, labels, first, last),
                             params, stash[index])
    grads, send = vjp((jnp.where(last, jnp.zeros_like(h), recv), jnp.ones_like(loss)))
    return finish(send, stash, jax.tree.map(jnp.add, acc, grads), jnp.zeros_like(loss))

  return [idle, forward, backward]


# ----------------------------------------------------------------------------
# The train step.


@dataclasses.dataclass(frozen=True)
class PipelineStep:
  """A compiled pipeline step: ``state, metrics = step(state, batch)``.

  ``lower(state, batch)`` gives the lowered step (HLO, memory, cost) after the
  same checks and placement. ``devices`` is the number of devices it uses.
  """
  run: Callable
  prepare: Callable
  finish: Callable
  devices: int

  def __call__(self, state, batch):
    state, raw = self.run(*self.prepare(state, batch))
    return state, self.finish(raw)

  def lower(self, state, batch):
    return self.run.lower(*self.prepare(state, batch))


def make_train_step(tx: optax.GradientTransformation, *, rule, mesh: Mesh, num_blocks: int,
                    schedule: str = "cyclic", scan_steps: int | None = None,
                    num_micro_batches: int | None = None, donate: bool = True) -> PipelineStep:
  """Builds the executed pipeline step of the ResidualMLP.

  Args:
    tx: a leaf-wise optax optimizer.
    rule: a name of ``schedule.RULES`` or an ``(N, J)`` delay matrix. The launcher
      maps ``dp`` to ``gpipe`` and cdp rules to ``cyclic``.
    mesh: axis ``stage`` of ``J`` devices; for ``dp+mp`` also axis ``data`` of
      ``N`` replicas.
    num_blocks: residual blocks of the model, a multiple of ``J``.
    schedule: ``cyclic`` (CDP, ``N = J``), ``gpipe`` or ``dp+mp``.
    scan_steps: if ``K``, one call runs ``K`` steps; batch leaves are then
      ``[K, N*b, ...]`` and metrics gain a leading ``K`` axis.
    num_micro_batches: ``N`` for ``gpipe`` (default ``J``); ``cyclic`` needs ``J``.
    donate: donate the input state's buffers.

  Returns:
    A ``PipelineStep``; ``step(state, batch)`` takes ``{"image": [N*b, ...],
    "label": [N*b]}`` as host arrays or global ``jax.Array``s of any sharding
    (micro-batch ``i`` = rows ``i*b:(i+1)*b``). It places them replicated on
    the ``stage`` devices (split over ``data`` for dp+mp) before the step: a
    batch sharded over processes is gathered there. It returns metrics
    ``loss`` (mean over the ``N`` micro-batches of the step), ``grad_norm`` and
    ``grad_norm_per_stage`` ``[J]``. They leave the compiled step sharded and
    are copied to every device after it (readable on every process), so the
    step itself only communicates by collective-permutes (plus dp+mp's
    gradient all-reduce).
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"Unknown schedule {schedule!r}: use one of {SCHEDULES}.")
  if scan_steps is not None and (int(scan_steps) != scan_steps or scan_steps < 1):
    raise ValueError(f"scan_steps must be a positive int or None, got {scan_steps!r}.")
  num_stages = _stage_axis_size(mesh)
  _check_blocks(num_blocks, num_stages)
  num_steps = scan_steps or 1
  if schedule == "dp+mp":
    if DATA_AXIS not in mesh.axis_names:
      raise ValueError(f"dp+mp needs a mesh with axes ({DATA_AXIS!r}, {STAGE_AXIS!r}), got "
                       f"{tuple(mesh.axis_names)}: jax.make_mesh((N, J), ('data', 'stage')).")
    num_micro, per_replica, axes = int(mesh.shape[DATA_AXIS]), 1, (DATA_AXIS, STAGE_AXIS)
  else:
    num_micro = num_stages if num_micro_batches is None else int(num_micro_batches)
    per_replica, axes = num_micro, (STAGE_AXIS,)
    if schedule == "cyclic" and num_micro != num_stages:
      raise ValueError(
          f"The cyclic schedule runs N = J micro-batches; got N={num_micro} for J={num_stages} "
          f"stages. Use num_workers = {num_stages} (the size of mesh axis {STAGE_AXIS!r}), or "
          "the engine (data parallelism) for N != J.")
  if num_micro < 1:
    raise ValueError(f"num_micro_batches must be >= 1, got {num_micro}.")
  delays = schedule_lib.resolve(rule, num_micro, num_stages)
  num_versions = 1 + schedule_lib.max_delay(rule)
  if delays.max(initial=0) >= num_versions:
    raise ValueError(f"The delay matrix needs {delays.max()} stale versions; the state keeps "
                     f"{num_versions - 1}.")
  if schedule == "cyclic":
    _check_causal(rule, delays, num_steps, num_versions)
  branches = _branches(axes)
  stash_size = max(num_stages - 1, 1) if schedule == "cyclic" else per_replica

  def run_slot(carry, event: SlotEvent, x_KxMxbxF, labels_KxMxb):
    """One event on this device; returns the carry and the buffer to send."""
    versions, opt_state, acc, stash, recv, loss_K, sq_K = carry
    j = jax.lax.axis_index(STAGE_AXIS)
    # Varying over every axis, so a dp+mp replica's gradient is its own: the
    # transpose of an invariant input would all-reduce it over `data` per backward.
    params = _vary(_version(versions, event.version), axes)
    send, stash, acc, loss = jax.lax.switch(
        event.kind, branches,
        (params, j == 0, j == num_stages - 1, stash, event.stash, recv, acc,
         x_KxMxbxF[event.step, event.micro], labels_KxMxb[event.step, event.micro]))
    loss_K = loss_K.at[event.step].add(loss)
    return (versions, opt_state, acc, stash, recv, loss_K, sq_K), send

  def apply_update(versions, opt_state, acc):
    grads = acc
    if schedule == "dp+mp":
      grads = jax.lax.psum(grads, DATA_AXIS)
    grads = jax.tree.map(lambda g: g / num_micro, grads)
    updates, opt_state = tx.update(grads, opt_state, versions[0])
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    new = optax.apply_updates(versions[0], updates)
    return ((new,) + versions[:num_versions - 1], opt_state,
            _vary(jax.tree.map(jnp.zeros_like, acc), axes), sq)

  per_step = 2 * (per_replica + num_stages - 1)  # GPipe slots per step.
  if schedule == "cyclic":
    total_slots = cyclic_slots(num_stages, num_steps)
    permutes = (swap_pairs(num_stages, 0), swap_pairs(num_stages, 1))
  else:
    total_slots = num_steps * per_step
    permutes = tuple([(s, s + shift) for s in range(num_stages) if 0 <= s + shift < num_stages]
                     for shift in (1, -1))

  def slot_body(carry, slot, x_KxMxbxF, labels_KxMxb):
    j = jax.lax.axis_index(STAGE_AXIS)
    if schedule == "cyclic":
      event = cyclic_event(slot, j, delays, num_steps, xp=jnp)
      use_first_permute = slot % 2 == 0
    else:
      worker0 = jax.lax.axis_index(DATA_AXIS) if schedule == "dp+mp" else 0
      event = gpipe_event(slot, j, delays, num_micro=per_replica, num_steps=num_steps,
                          worker0=worker0, xp=jnp)
      use_first_permute = slot % per_step < per_step // 2
    carry, send = run_slot(carry, event, x_KxMxbxF, labels_KxMxb)
    versions, opt_state, acc, stash, _, loss_K, sq_K = carry

    def update(ops):
      versions, opt_state, acc, sq_K = ops
      versions, opt_state, acc, sq = apply_update(versions, opt_state, acc)
      return versions, opt_state, acc, _vary(sq_K.at[event.step].set(sq), axes)

    versions, opt_state, acc, sq_K = jax.lax.cond(
        event.update, update, lambda ops: ops, (versions, opt_state, acc, sq_K))
    # The permute of this slot's kind; a cond keeps one copy of the slot's compute.
    recv = jax.lax.cond(use_first_permute, *[_permute(pairs, axes) for pairs in permutes], send)
    return (versions, opt_state, acc, stash, recv, loss_K, sq_K), None

  def body(state: PipelineState, batch):
    local = lambda tree: jax.tree.map(lambda a: a[0], tree)
    versions, opt_state = local(state.versions), local(state.opt_state)
    x = batch["image"]
    x_KxMxbxF = x.reshape(x.shape[:1] + (per_replica, -1) + (int(np.prod(x.shape[2:])),))
    labels_KxMxb = batch["label"].reshape(x_KxMxbxF.shape[:3])
    width = versions[0]["blocks"]["norm"]["scale"].shape[-1]
    zeros = lambda shape: jnp.zeros(shape, x.dtype)
    work = _vary((jax.tree.map(jnp.zeros_like, versions[0]),
                  zeros((stash_size,) + x_KxMxbxF.shape[2:3] + (width,)),
                  zeros(x_KxMxbxF.shape[2:3] + (width,)),
                  jnp.zeros((num_steps,), jnp.float32), jnp.zeros((num_steps,), jnp.float32)),
                 axes)
    carry = (versions, opt_state) + work
    carry, _ = jax.lax.scan(lambda c, s: slot_body(c, s, x_KxMxbxF, labels_KxMxb), carry,
                            jnp.arange(total_slots))
    versions, opt_state, _, _, _, loss_K, sq_K = carry
    glob = lambda tree: jax.tree.map(lambda a: a[None], tree)
    new_state = PipelineState(state.step + num_steps, glob(versions[0]), glob(versions[1:]),
                              glob(opt_state))
    lead = (None,) * len(axes)
    return new_state, (loss_K[lead], sq_K[lead])

  state_spec = PipelineState(P(), P(STAGE_AXIS), P(STAGE_AXIS), P(STAGE_AXIS))
  batch_spec = P(None, DATA_AXIS) if schedule == "dp+mp" else P()
  run = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=(state_spec, batch_spec),
                    out_specs=(state_spec, P(*axes))),
      donate_argnums=(0,) if donate else ())

  def prepare(state: PipelineState, batch):
    if not isinstance(batch, dict) or set(batch) != {"image", "label"}:
      raise ValueError("The batch must be a dict with keys 'image' [N*b, ...] and 'label' [N*b].")
    batch = {k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in batch.items()}
    if scan_steps is None:
      batch = {k: v[None] for k, v in batch.items()}
    elif any(v.ndim < 2 or v.shape[0] != scan_steps for v in batch.values()):
      raise ValueError(f"With scan_steps={scan_steps} batch leaves need shape "
                       f"[{scan_steps}, N*b, ...]; got {[v.shape for v in batch.values()]}.")
    rows = batch["image"].shape[1]
    if batch["label"].shape[:2] != (num_steps, rows) or batch["label"].ndim != 2:
      raise ValueError(f"label must have shape [N*b] matching image rows {rows}; got "
                       f"{batch['label'].shape}.")
    if rows % num_micro or rows == 0:
      raise ValueError(f"Batch size {rows} is not divisible by the N={num_micro} micro-batches: "
                       "use N * b rows (micro-batch i = rows i*b:(i+1)*b).")
    state = jax.device_put(state, _state_sharding(mesh, state))
    return state, jax.device_put(batch, NamedSharding(mesh, batch_spec))

  def finish(raw):
    # Per device [J, K], or [N, J, K] for dp+mp; replicated outside the step, so the
    # step itself holds no collective for its metrics.
    loss_K, sq_K = jax.tree.map(_replicated, raw)
    if schedule == "dp+mp":
      loss_K, sq_K = jnp.sum(loss_K[:, -1], axis=0), sq_K[0]
    else:
      loss_K = loss_K[-1]
    sq_KxJ = sq_K.T
    metrics = {"loss": loss_K / num_micro, "grad_norm": jnp.sqrt(jnp.sum(sq_KxJ, axis=1)),
               "grad_norm_per_stage": jnp.sqrt(sq_KxJ)}
    return metrics if scan_steps else jax.tree.map(lambda m: m[0], metrics)

  return PipelineStep(run=run, prepare=prepare, finish=finish,
                      devices=num_stages * (num_micro if schedule == "dp+mp" else 1))
