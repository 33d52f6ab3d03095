"""CDP with ZeRO: the cyclic timetable executed on the ``data`` axis, model states sharded by stage.

Any model that `staged.stage_model` cuts into ``J = N`` stages runs: every
stage is one flat float32 buffer of ``P`` elements (`staged`), so stages
travel and update alike. Worker ``r`` owns stage ``J-1-r``: it alone holds
that stage's ``theta_t``, its stale versions, its optimizer state and its
model state (rows of ``[N, ...]`` state arrays are in owner order).

**cyclic.** Worker ``i`` runs its micro-batch of step ``t`` through all stages
from slot ``2Jt + 2i``: the forward of stage ``j`` at phase ``j``, its backward
at phase ``2J-1-j`` (DESIGN.md section 1), with no flush between steps. One
call runs ``K`` steps as one ``lax.scan`` over the slots of the static plan
`plan.zero_plan`. At any slot a stage is used by at most one worker, so:

- The owner sends the version the rule prescribes straight to the worker that
  uses it, just in time: the slot's stage messages (and the owner's own use, a
  pair ``(o, o)``) are one ``lax.ppermute`` per message class
  (a ``lax.switch`` over the plan's distinct pair lists), and no worker holds
  a stage it is not using. Forward and backward each receive the stage once:
  no worker keeps a stage from its forward to its backward (ZeRO-3 gathers
  twice for the same reason).
- A backward's gradient goes straight to the owner, right after it (one
  ``ppermute`` a slot and class), and the owner adds it to the one sum it
  keeps. The owner applies the optimizer at the start of the slot after
  worker ``N-1``'s backward, before its own forward of the next step; the
  next step's first gradient of the stage comes one slot later.
- Message classes (`message_classes`): one SPMD permute has one buffer size
  on every chip, and the stages a slot's permute carries differ from worker
  to worker. Stages of like size share a permute; a stage much smaller than
  the largest (a ResNet cut by FLOPs) has its own, at its own size, so its
  messages are not padded to the largest stage. Each class's events run in a
  switch of their own, whose results are that class's buffers alone (its
  gradient message passes its stage buffer through), so every chip holds
  each class's stage buffer once. The owned stage, its versions and
  optimizer state stay rows of the largest stage's size.

An earlier version passed stages and gradient sums along the ring of workers
(neighbours only, as the paper draws it): the same messages and bytes, but
each worker held the stage buffers and partial sums of the last 2 slots, 4
stage sizes more per chip on the TPU (BENCHMARKS.md, "Pod plan"). Direct
messages cross up to ``N/2`` torus hops where the ring crossed one.
- Model states (BatchNorm statistics, ``M`` elements) travel a ring of their
  own with the forwards: each forward reads the stage's state of step ``t``
  and adds its new state to a running sum; worker ``N-1`` turns the sum into
  the mean, the state of step ``t+1``, which goes on to worker 0's next
  forward and, with the final gradient, to the owner. A forward of step
  ``t+1`` can come before the stage's update of step ``t``; its state is ready.

Between calls the state is the engine's, so the numbers equal
``engine.make_train_step`` step by step for every ``K``. The compiled step
holds collective-permutes only. Each backward recomputes its stage forward
from the stage input it stashed.

**zero3.** The baseline: ZeRO-3 (FSDP) data parallelism in lockstep. Each
worker holds one flat shard, ``1/N`` of every stage at the stage's own size
(`shard_columns`: no stage is padded to the largest, as FSDP's flat
parameter); a stage is all-gathered at use in the forward and again in the
backward, and its gradient is reduce-scattered (as TPU tiles, in pieces the
TPU compiler keeps as reduce-scatters: `TPU_SHARD`, `TPU_SCATTER_ROWS`).
Model states are replicated and averaged by one all-reduce. Rule ``dp`` runs
this way (`executor.resolve`); its state converts to the cyclic timetable's
through the engine's trees (`Trees`), as every executor's does.

**Replicas.** On a mesh ``(replica, data)`` (``jax.make_mesh((R, N),
("replica", "data"))``) each replica runs its own timetable (or ZeRO-3 group) on its
``N*b`` rows, and each stage's gradient is summed over ``replica`` by one
``psum`` per stage and step, where the stage updates (CDP-ZeRO: at its
message class's size): the engine with ``R*N`` workers and the delay matrix
tiled ``R`` times.

Delay compensations (`executor.RulePlan`, `compensation`): the owner
extrapolates the version it sends or uses (weight prediction; one more version
of the owned stage, messages unchanged). DC-ASGD's ``theta_t`` is the owner's
alone, so the gradient messages also carry, per delay ``d > 0`` of the rule,
``g * g`` where the worker read the stage ``d`` stale (a message of ``2P + M``
for cdp-v1 and cdp-v2), and the owner adds the correction at its update. ZeRO-3 gathers the extra versions those need.

The optimizer sees each stage as one flat vector, so it must act elementwise
(sgd, momentum, adam, weight decay): a transform that needs a global view,
such as ``clip_by_global_norm``, would need an all-reduce.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import compensation, compiled, engine
from cdpjax import executor as executor_lib
from cdpjax.executed import plan as plan_lib
from cdpjax.executed.pipeline import StagedState, Trees, portable_fns
from cdpjax.executed.device import (TPU_TILE, after as staged_after, steps_batch, vary,
                                    varying, with_steps_axis)
from cdpjax.executed.staged import StagedModel

AXIS = "data"
REPLICA = "replica"
TPU_LANES = 128
TPU_SHARD = 16 * TPU_LANES
"""ZeRO-3 gathers and scatters a stage as rows of ``TPU_LANES`` when each worker's shard is a
multiple of ``TPU_SHARD`` elements: the TPU compiler keeps those as ``all-gather`` and
``reduce-scatter``, where it turns a flat buffer's into whole-buffer all-reduces (``tpu_plan``'s
lowering check: 16 rows a shard stayed a reduce-scatter, 8 did not). `pad_to` gives that size."""
TPU_SCATTER_ROWS = 4096
"""ZeRO-3 reduce-scatters a tiled stage in pieces of at most this many rows a shard: on v5p:8x8x4
the TPU compiler turned one reduce-scatter of a 1B transformer's stage (496,912 rows a shard)
into a whole-stage all-reduce, and some sizes (8,192 and 16,384 rows a shard) too, where
pieces of 4,096 rows stay reduce-scatters (measured with `cdpjax.aot`; BENCHMARKS.md, "Pod plan")."""


def pad_to(num_workers: int, timetable: str) -> int:
  """The multiple a staged model's buffers are padded to for ``timetable`` on ``num_workers``:
  whole TPU tiles (`device.TPU_TILE`), split evenly over the workers."""
  if timetable == "zero3":
    return num_workers * TPU_SHARD
  return math.lcm(num_workers, TPU_TILE)


def shard_sizes(staged: StagedModel, num_workers: int) -> list[int]:
  """``q_j``: the elements of stage ``j`` in each ZeRO-3 shard, its own size rounded up to
  ``N`` whole shards (of `TPU_SHARD` elements where the buffers are tiled): ZeRO-3 gathers a
  stage, and scatters its gradient, at that size, not the largest stage's."""
  unit = num_workers * (TPU_SHARD if _tiled(staged, num_workers) else 1)
  return [-(-size // unit) * unit // num_workers for size in staged.stage_param_sizes()]


def _tiled(staged: StagedModel, num_workers: int) -> bool:
  return staged.param_size % (num_workers * TPU_SHARD) == 0


def shard_columns(staged: StagedModel, num_workers: int):
  """``(to_state, from_state)`` between ``[J, P]`` stage-order rows and ZeRO-3's state ``[1, N S]``
  (`Trees`): worker ``r`` holds columns ``[r S, (r+1) S)``, elements ``[r q_j, (r+1) q_j)``
  of each stage ``j`` end to end (``S = sum_j q_j``, `shard_sizes`), and no stage's padding
  to the largest. FSDP's flat parameter, one shard a worker, gathered stage by stage.
  """
  sizes, size = shard_sizes(staged, num_workers), staged.param_size
  offsets = np.cumsum([0] + sizes)
  xp = lambda x: np if isinstance(x, np.ndarray) else jnp

  def to_state(rows):
    shards = [rows[j, :num_workers * q].reshape(num_workers, q) for j, q in enumerate(sizes)]
    return xp(rows).concatenate(shards, axis=1).reshape(1, -1)

  def from_state(state):
    shards, pad = state.reshape(num_workers, -1), xp(state).pad
    return xp(state).stack([pad(shards[:, a:b].reshape(-1), (0, size - num_workers * (b - a)))
                            for a, b in zip(offsets[:-1], offsets[1:])])
  return to_state, from_state


MESSAGE_PADDING = 0.05
"""CDP-ZeRO sends its stages in classes of like size, one permute a slot and class, each
message as long as its class's largest stage: a stage joins a class while the class's messages
stay within this fraction of its stages' own bytes (issue 34's goal: bytes over links at most
1.05x ZeRO-3's). Stages of one size (a transformer's) make one class; a ResNet cut by FLOPs,
whose largest stage is 2.8x the mean, one class a stage (`message_classes`)."""


def message_classes(staged: StagedModel, num_workers: int) -> tuple[tuple[int, tuple], ...]:
  """``((size, stages), ...)``: the stages whose messages share a permute, largest first,
  and the length of their messages (the largest's, in whole TPU tiles; `MESSAGE_PADDING`).

  One SPMD permute has one buffer shape on every chip: a class's messages are
  its largest stage's size, and every chip holds each class's stage buffer
  (the classes' sizes summed, where one class held the largest stage's).
  """
  unit = pad_to(num_workers, "cyclic")
  sizes = [min(-(-size // unit) * unit, staged.param_size) for size in staged.stage_param_sizes()]
  classes = []
  for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
    if classes:
      size, stages = classes[-1]
      if size * (len(stages) + 1) <= (1 + MESSAGE_PADDING) * sum(sizes[k] for k in stages + (j,)):
        classes[-1] = (size, stages + (j,))
        continue
    classes.append((sizes[j], (j,)))
  return tuple((size, tuple(sorted(stages))) for size, stages in classes)


def stash_layout(boundary_sizes) -> tuple[np.ndarray, np.ndarray]:
  """``(offsets, sizes)``: where a cyclic worker's stash keeps each stage's input
  (`StagedModel.boundary_sizes`), and how long it is (stage 0 reads the batch: none).

  The inputs lie end to end at their own sizes, the largest last, so that a
  read of a whole boundary buffer (``A``, the largest) at any offset stays in
  the stash; a forward writes only its input's part of that window (the rest
  written back as it was). Rows of ``A`` padded every input to the largest
  (ResNet-50 cut by FLOPs: three rows of 49 MiB).
  """
  sizes = np.array([0] + list(boundary_sizes), np.int64)
  order = sorted(range(1, len(sizes)), key=lambda j: sizes[j] == sizes.max())  # Largest last.
  offsets = np.zeros_like(sizes)
  offsets[order] = np.cumsum([0] + [sizes[j] for j in order])[:-1]
  return offsets, sizes


def owner(stage: int, num_stages: int) -> int:
  """The worker that owns ``stage``: worker ``J-1-j`` (row ``J-1-j`` of the state)."""
  return num_stages - 1 - stage


def _mesh_axes(mesh: Mesh) -> tuple[str, ...]:
  """``("data",)`` or ``("replica", "data")``; any other mesh is refused."""
  names = tuple(mesh.axis_names)
  if names not in ((AXIS,), (REPLICA, AXIS)):
    raise ValueError(
        f"The mesh has axes {names}: CDP-ZeRO runs on jax.make_mesh((num_workers,), "
        f"({AXIS!r},)), or jax.make_mesh((R, num_workers), ({REPLICA!r}, {AXIS!r})) for R "
        "replicas of the timetable.")
  return names


def _num_workers(mesh: Mesh) -> int:
  _mesh_axes(mesh)
  return int(mesh.shape[AXIS])


def _num_replicas(mesh: Mesh) -> int:
  return int(mesh.shape[REPLICA]) if REPLICA in mesh.axis_names else 1


def _check_staged(staged: StagedModel, num_workers: int) -> None:
  if staged.num_stages != num_workers:
    raise ValueError(
        f"The model is cut into {staged.num_stages} stages for {num_workers} workers: CDP-ZeRO "
        f"needs J = N (worker r owns stage N-1-r). Cut it into {num_workers} stages, or use "
        "parallelism='data'.")
  if staged.param_size % num_workers:
    raise ValueError(f"Stage buffers of {staged.param_size} elements do not split over "
                     f"{num_workers} workers: build the staged model with pad_to={num_workers}.")


def _owner_rows(rows):
  """Stage-order rows ``[J, ...]`` in owner order (row ``r`` = stage ``J-1-r``), and back."""
  return rows[::-1]


def trees(staged: StagedModel, tx: optax.GradientTransformation, num_workers: int,
          timetable: str) -> Trees:
  """Between the state of ``timetable`` and the engine's trees: rows in owner order, and
  ZeRO-3's columns in shards (`shard_columns`)."""
  if timetable == "zero3":
    return Trees(staged, tx, _owner_rows, shard_columns(staged, num_workers))
  return Trees(staged, tx, _owner_rows)


def init_state(staged: StagedModel, params, tx: optax.GradientTransformation, *, rule,
               mesh: Mesh, model_state=None, timetable: str | None = None) -> StagedState:
  """The sharded state at ``t = 0``; every stale version is ``theta_0``.

  Args:
    staged: the model cut into ``J = N`` stages, ``pad_to=N``.
    params: the flax ``params``.
    tx: an elementwise optax optimizer.
    rule: a name of ``schedule.RULES``, an ``(N, N)`` delay matrix or its `executor.RulePlan`.
    mesh: a mesh with axis ``data`` of size ``N``.
    model_state: the model's other collections, or None.
    timetable: ``cyclic`` or ``zero3``; by default the rule's.
  """
  num_workers = _num_workers(mesh)
  _check_staged(staged, num_workers)
  plan = _resolve(rule, timetable, num_workers)
  state = trees(staged, tx, num_workers, plan.timetable).from_trees(
      engine.init_state(params, tx, rule=plan, model_state=model_state))
  return jax.device_put(state, _shardings(state, mesh, plan.timetable))


def _specs(state: StagedState, timetable: str):
  """PartitionSpecs of the state: rows per worker (cyclic) or parameter columns (zero3)."""
  row_shape = np.shape(state.params)

  def spec(leaf):
    if np.ndim(leaf) == 0:
      return P()
    if timetable == "cyclic":
      return P(AXIS)
    return P(None, AXIS) if np.shape(leaf) == row_shape else P()
  specs = jax.tree.map(spec, state)
  if timetable == "zero3" and state.model_state is not None:  # Replicated, whatever its shape.
    specs = specs._replace(model_state=P())
  return specs


def _shardings(state, mesh, timetable):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), _specs(state, timetable),
                      is_leaf=lambda x: isinstance(x, P))


def _metrics_row(loss_K, grad_sq_KxJ, param_sq_KxJ):
  """``[1, K, 1 + 2J]``: this worker's loss and its parts of the per-stage squared norms."""
  return jnp.concatenate([loss_K[:, None], grad_sq_KxJ, param_sq_KxJ], axis=1)[None]


def _select(options, index):
  """``options[index]`` for a traced index (buffers of one shape): a select per buffer, fused
  where it is read."""
  return functools.reduce(lambda acc, k: jnp.where(index == k, options[k], acc),
                          range(1, len(options)), options[0])


class _Carry(NamedTuple):
  """The scan carry of one cyclic worker: its owned stage and its micro-batch in flight.

  The model-state queue is indexed by slot parity: row ``s % 2`` holds what
  slot ``s-2`` produced until slot ``s`` sends it on and overwrites it.
  """
  versions_V: Any    # The owned stage, one buffer per version (they stay in the state's
                     # buffers): theta_{t-v} is versions_V[(head + v) % V].
  head: Any
  opt_state: Any
  model_state_M: Any
  acc_Q: Any         # The owned stage's gradient messages of the step (and its next model
                     # state, DC-ASGD's sums), summed until its update.
  state_2x2M: Any    # Forward model-state messages: the state read, the sum of new ones.
  boundary_A: Any    # A forward's output for the next forward, a backward's cotangent for the
                     # next backward: a worker never needs both (the last stage's output is
                     # its loss, its backward starts from the loss).
  stash_IA: Any      # The input of each stage but the first (it reads the batch) of the
                     # micro-batch in flight, end to end at their own sizes (`stash_layout`):
                     # flat, since the TPU pads an [I, A] array's rows to a multiple of 4.
  stash_JxM: Any     # The model state each stage's forward read.
  next_JxM: Any      # Worker N-1: each stage's next model state, for the final gradient.
  stats_3xK: Any     # Per step: the loss, the owned stage's squared gradient and parameter norms.


class Ring(NamedTuple):
  """Static facts of the cyclic timetable on one mesh."""
  num_workers: int
  size_p: int
  size_m: int
  axes: tuple
  num_replicas: int
  plan: plan_lib.ZeroPlan
  classes: tuple  # `message_classes`: ((size, stages), ...).
  dc_delays: tuple = ()  # With DC-ASGD: the delays d > 0 whose g * g sums the chains carry.

  @property
  def stage_class(self) -> tuple[int, ...]:
    """The message class of each stage."""
    return tuple(next(c for c, (_, stages) in enumerate(self.classes) if j in stages)
                 for j in range(self.num_workers))

  @property
  def size_q(self) -> int:
    """A gradient message: a gradient and the next model state; with DC-ASGD, then per delay
    ``d`` of ``dc_delays`` ``g * g`` where the worker read the stage ``d`` stale."""
    return self.size_p * (1 + len(self.dc_delays)) + self.size_m

  def vary(self, tree, state=False):
    """Typed for the carry: the owned stage is the same on every replica, the rest is not."""
    return vary(tree, (AXIS,) if state else self.axes)

  def route(self, name, slot, after, make, *operands, stages=None):
    """The messages ``name`` of ``plan.ROUTES`` at ``slot`` (of ``stages``, one message class;
    by default all): ``ppermute(make(*operands))`` over the slot's pair list (the buffer
    delivered here; zeros where none is).

    The buffer sent depends on ``after`` (the previous collective's result, or
    None; `device.after`), which fixes the order of the two collectives.
    """
    index, pair_lists = self.plan.routes(*name, stages)
    index = jnp.asarray(index)[slot]
    shape = jax.eval_shape(make, *operands)

    def branch(pairs):
      if not pairs:
        return lambda after, *ops: self.vary(jnp.zeros(shape.shape, shape.dtype))
      return lambda previous, *ops: self.vary(self.permute(
          staged_after(make(*ops), previous), pairs))
    return jax.lax.switch(index, [branch(p) for p in pair_lists], after, *operands)

  def permute(self, buffer, pairs):
    """The one place a message crosses devices (bench_zero times the timetable without it)."""
    return jax.lax.ppermute(buffer, AXIS, pairs)


def _read(carry: _Carry, version, delay, predict: bool, size=None):
  """The owner's read of its stage ``version`` rows behind its newest, ``delay`` steps stale
  for the reader: with weight prediction, extrapolated (`compensation.predicted`); its first
  ``size`` elements (a message class's: one read of the whole stage would be one buffer for
  every class, live from the first class's message to the last's)."""
  versions = [v[:size] for v in carry.versions_V]
  theta = _select(versions, (carry.head + version) % len(versions))
  if not predict:
    return theta
  return compensation.predicted(
      theta, _select(versions, (carry.head + version + 1) % len(versions)), delay)


def _widen(ring: Ring, message, size: int):
  """A gradient message of class size ``size`` (``[S][M][S]*D``) laid out as the owner's sum
  (``[P][M][P]*D``, `Ring.size_q`)."""
  if size == ring.size_p:
    return message
  pad = jnp.zeros((ring.size_p - size,), message.dtype)
  parts = [message[:size], pad, message[size:size + ring.size_m]]
  for k in range(len(ring.dc_delays)):
    parts += [message[size + ring.size_m + k * size:][:size], pad]
  return jnp.concatenate(parts)


def _narrow(ring: Ring, acc, size: int):
  """The owner's sum without its stage's padding: `_widen`'s inverse."""
  if size == ring.size_p:
    return acc
  start = ring.size_p + ring.size_m
  return jnp.concatenate([acc[:size], acc[ring.size_p:start]] + [
      acc[start + k * ring.size_p:][:size] for k in range(len(ring.dc_delays))])


def _update(ring: Ring, tx, rule: executor_lib.RulePlan, acc, carry: _Carry, step,
            first_step, size: int) -> _Carry:
  """The owner's optimizer step on its stage, with its messages' sum ``acc`` (and the
  replicas'), of the call's step ``step`` (the run's ``first_step + step``); the stage's
  message class is ``size`` long."""
  if ring.num_replicas > 1:  # The one all-reduce of this stage and step, at the stage's size.
    acc = _widen(ring, jax.lax.psum(_narrow(ring, acc, size), REPLICA), size)
  params = _select(carry.versions_V, carry.head)
  grads = acc[:ring.size_p]
  for k, d in enumerate(ring.dc_delays):  # DC-ASGD: the sum of g * g (theta_t - theta_read).
    squares = acc[ring.size_p * (1 + k) + ring.size_m:][:ring.size_p]
    read = _read(carry, d, d, rule.predict)  # theta_{t-d}: the head is theta_t.
    grads = grads + rule.dc_lambda * squares * (params - read)
  grads = grads / (ring.num_workers * ring.num_replicas)
  updates, opt_state = tx.update(grads, carry.opt_state, params)
  if rule.lr_delay_scale:
    stage = ring.num_workers - 1 - jax.lax.axis_index(AXIS)
    updates = updates * compensation.lr_scale(rule.delays, first_step + step,
                                              rule.lr_delay_scale)[stage]
  params = optax.apply_updates(params, updates)
  head = (carry.head - 1) % len(carry.versions_V)  # The oldest version's buffer takes theta_{t+1}.
  stats = carry.stats_3xK.at[1, step].set(ring.vary(jnp.sum(jnp.square(grads))))
  stats = stats.at[2, step].set(ring.vary(jnp.sum(jnp.square(params))))
  return carry._replace(
      versions_V=tuple(jnp.where(head == k, params, v) for k, v in enumerate(carry.versions_V)),
      head=head,
      opt_state=ring.vary(opt_state, state=True),
      model_state_M=ring.vary(acc[ring.size_p:][:ring.size_m] / ring.num_replicas, state=True),
      stats_3xK=stats)


def _branches(staged: StagedModel, ring: Ring, cls: int):
  """``lax.switch`` branches indexed by ``IDLE``, ``FWD``, ``BWD`` for the stages of message
  class ``cls`` (`message_classes`; a worker whose stage is in another class is idle here).

  Operands ``(io, ev, received, state_2M, stash_IA, me, x, labels)``: ``io`` what the
  slot's classes hand on (``(boundary, stash_JxM, next_JxM, msg, loss)``, changed only by the
  class of the worker's stage; the slot writes a forward's input into the stash before them,
  so that no class passes the stash on: a conditional's result passed through is copied),
  ``received`` the class's stage message (a stage of the class,
  ``S_c``, then its model state, ``M``). Results ``(io, head, tail)``: a backward's gradient
  message is ``head`` (the gradient, the next model state) then ``tail`` (DC-ASGD's squares).
  Elsewhere ``head`` is ``received`` passed through and ``tail`` zeros: no worker outside a
  backward sends a gradient, and the branches' common result takes the buffer of the stage
  received, which a backward no longer reads once it has its leaves. A result of zeros would
  hold a stage-sized buffer of its own through every branch (the TPU compiler keeps a
  conditional's result in one place across its branches): 0.3 GiB of heap on the 1B
  transformer (BENCHMARKS.md, "Pod plan"). The stage functions read a message whole (its
  leaves lie at its start) and a backward's gradient is as long, its model-state part then
  set: a slice ``[:S_c]`` would be a copy of the stage.
  """
  size_m, last = ring.size_m, ring.num_workers - 1
  size, stages = ring.classes[cls]
  local = jnp.asarray([stages.index(j) if j in stages else 0 for j in range(ring.num_workers)])

  def tail():
    return jnp.zeros((len(ring.dc_delays) * size,), jnp.float32)

  def per_stage(j, fn, *operands):
    """``fn(k, *operands)`` for the traced stage ``j`` of the class (a switch, static ``k``)."""
    axes = varying(operands) | varying(j)
    return jax.lax.switch(local[j], [
        lambda *ops, k=k: vary(fn(k, *ops), axes) for k in stages], *operands)

  def idle(ops):
    io, received = ops[0], ops[2]
    return ring.vary((io, received, tail()))

  def forward(ops):
    (boundary, stash_JxM, next_JxM, _, _), ev, received, state, _, me, x, labels = ops
    j, read = ev["stage"], state[:size_m]
    h, loss, new_state = per_stage(
        j, lambda k, message, *ops: staged.apply(k, message, *ops),
        received, read, boundary, x, labels)
    total = state[size_m:] + new_state
    mean = total / ring.num_workers
    # Worker N-1 closes the sum: the state of step t+1 goes on to the next step and the owner.
    msg = jnp.where(me == last, jnp.concatenate([mean, jnp.zeros_like(mean)]),
                    jnp.concatenate([read, total]))
    return ring.vary(((h, stash_JxM.at[j].set(read), next_JxM.at[j].set(mean), msg, loss),
                      received, tail()))

  def backward(ops):
    io, ev, received, _, stash_IA, me, x, labels = ops
    boundary, stash_JxM, next_JxM, _, _ = io
    j = ev["stage"]
    h_in = jax.lax.dynamic_slice(stash_IA, (ev["stash_at"],), (boundary.size,))
    next_state = jnp.where(me == last, next_JxM[j], 0.0)

    def stage_backward(k, message, state_m, h_in, x, labels, cot, next_state, delay):
      grads, cot_in = staged.vjp(k, message, state_m, h_in, x, labels, cot)
      if k:  # The first stage reads the batch: its input's cotangent, zeros, is never read, and
        cot = cot_in  # the one it received stays in its buffer (no boundary of zeros made).
      # DC-ASGD: the owner adds dc_lambda * g * g * (theta_t - theta_read) per delay d.
      squares = [jnp.where(delay == d, grads[:size] * grads[:size], 0.0)
                 for d in ring.dc_delays]
      head = jax.lax.dynamic_update_slice(grads, next_state, (size,))
      return cot, head, jnp.concatenate(squares) if squares else tail()
    cot, head, squares = per_stage(j, stage_backward, received, stash_JxM[j], h_in, x, labels,
                                   boundary, next_state, ev["delay"])
    return ring.vary(((cot,) + io[1:], head, squares))

  return [idle, forward, backward]


def _cyclic_body(staged: StagedModel, tx, rule: executor_lib.RulePlan, num_steps: int, axes,
                 num_replicas: int):
  """The per-worker ``K``-step cyclic body for ``shard_map``: a ``lax.scan`` over the plan's slots."""
  delays = rule.delays
  plan = plan_lib.zero_plan(delays, num_steps)
  dc_delays = tuple(sorted(set(delays[delays > 0].tolist()))) if rule.dc_lambda else ()
  ring = Ring(staged.num_stages, staged.param_size, staged.state_size, tuple(axes),
              num_replicas, plan, message_classes(staged, staged.num_stages), dc_delays)
  tables = {k: getattr(plan, k) for k in ("kind", "stage", "step", "version", "delay", "source",
                                          "serve_version", "serve_delay", "update",
                                          "update_step", "state_ring")}
  branches = [_branches(staged, ring, cls) for cls in range(len(ring.classes))]
  size_p, size_m = ring.size_p, ring.size_m
  stage_class = jnp.asarray(ring.stage_class)
  update_sizes = [size for size, _ in ring.classes] if num_replicas > 1 else [size_p]
  assert (plan.update.sum(axis=0) == num_steps).all()  # `_by_age` relies on it.

  def slot_body(c: _Carry, slot, me, x_KxB, labels_KxB, first_step, stash):
    ev = {k: jnp.asarray(v)[slot, me] for k, v in tables.items()}
    ev["stash_at"], ev["stash_size"] = (jnp.asarray(t)[ev["stage"]] for t in stash)
    # The sum is an operand, not a result: a result passed through is copied. The update's
    # slot receives no gradient; the sum restarts there.
    owned = stage_class[ring.num_workers - 1 - me]  # The class of the stage this worker owns.
    # With replicas, one branch per message class: the owner's all-reduce at its class's size.
    c = jax.lax.switch(ev["update"] * (1 + (owned if num_replicas > 1 else 0)), [
        lambda acc, c: c] + [
        lambda acc, c, size=size: _update(ring, tx, rule, acc, c, ev["update_step"], first_step,
                                          size) for size in update_sizes],
        c.acc_Q, c._replace(acc_Q=None))._replace(acc_Q=c.acc_Q)
    # Per message class, in turn (`device.after`: devices must not order collectives apart):
    # the owner reads the version this slot's user of a stage of the class needs and sends it,
    # to itself for its own use (`plan.ZeroPlan.routes`); the workers whose stage is in the
    # class run their events, in a switch whose results are the class's buffers alone; a
    # backward's gradient goes to the owner (zeros elsewhere), who adds its class's and its
    # own. One switch for all classes passed each class's buffers through every branch.
    mine = stage_class[ev["stage"]]
    ring_state = after = None
    if size_m:
      ring_state = after = ring.route(("state", "ring"), slot, None, lambda m: m[slot % 2],
                                      c.state_2x2M)
    own = (ev["source"] == plan_lib.LOCAL) & (ev["kind"] == plan_lib.BWD)
    acc = jnp.where(ev["update"] == 1, 0.0, c.acc_Q)
    at = (ev["stash_at"],)  # A forward's input, and what lies after it as it was.
    window = jax.lax.dynamic_slice(c.stash_IA, at, c.boundary_A.shape)
    write = (jnp.arange(c.boundary_A.size) < ev["stash_size"]) & (ev["kind"] == plan_lib.FWD)
    stash = jax.lax.dynamic_update_slice(c.stash_IA, jnp.where(write, c.boundary_A, window), at)
    io = (c.boundary_A, c.stash_JxM, c.next_JxM,
          ring.vary(jnp.zeros((2 * size_m,), jnp.float32)), ring.vary(jnp.zeros((), jnp.float32)))
    x, labels = x_KxB[ev["step"]], labels_KxB[ev["step"]]
    single = len(ring.classes) == 1
    for cls, (size, stages) in enumerate(ring.classes):
      served = ring.vary(_read(c, ev["serve_version"], ev["serve_delay"], rule.predict, size))
      received = ring.route(("param", "owner"), slot, after, lambda *m: jnp.concatenate(m),
                            served, ring.vary(c.model_state_M), stages=stages)
      state = jnp.concatenate([received[size:], jnp.zeros((size_m,), jnp.float32)])
      if ring_state is not None:
        state = jnp.where(ev["state_ring"] == 1, ring_state, state)
      kind = ev["kind"] if single else jnp.where(mine == cls, ev["kind"], plan_lib.IDLE)
      io, head, tail = jax.lax.switch(kind, branches[cls],
                                      (io, ev, received, state, stash, me, x, labels))
      message = jnp.concatenate([head, tail]) if tail.size else head
      grads_in = ring.route(("grad", "owner"), slot, None, lambda g: g, message,
                            stages=stages)
      after = grads_in[0]
      incoming = _widen(ring, grads_in + jnp.where(own, message, 0.0), size)
      acc = acc + (incoming if single else jnp.where(owned == cls, incoming, 0.0))
    boundary, stash_m, next_m, msg, loss = io
    return c._replace(
        acc_Q=acc, state_2x2M=c.state_2x2M.at[slot % 2].set(msg), boundary_A=boundary,
        stash_IA=stash, stash_JxM=stash_m, next_JxM=next_m,
        stats_3xK=c.stats_3xK.at[0, ev["step"]].add(loss)), None

  def body(state: StagedState, batch):
    me = jax.lax.axis_index(AXIS)
    x, labels = batch["image"], batch["label"]
    x_spec = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    act = staged.act_size(x_spec)
    stash = stash_layout(staged.boundary_sizes(x_spec))
    zeros = lambda *shape: ring.vary(jnp.zeros(shape, jnp.float32))
    model_state = (jnp.zeros((1, 0), jnp.float32) if state.model_state is None
                   else state.model_state)
    carry = _Carry(
        versions_V=tuple(ring.vary(v[0], state=True) for v in state.versions),
        head=ring.vary(jnp.zeros((), jnp.int32), state=True),
        opt_state=ring.vary(jax.tree.map(lambda a: a[0], state.opt_state), state=True),
        model_state_M=ring.vary(model_state[0], state=True), acc_Q=zeros(ring.size_q),
        state_2x2M=zeros(2, 2 * size_m), boundary_A=zeros(act),
        stash_IA=zeros(max(int(stash[1].sum()), act)),
        stash_JxM=zeros(ring.num_workers, size_m),
        next_JxM=zeros(ring.num_workers, size_m), stats_3xK=zeros(3, num_steps))
    carry, _ = jax.lax.scan(lambda c, s: slot_body(c, s, me, x, labels, state.step, stash),
                            carry, jnp.arange(plan.num_slots))
    # The versions leave in the buffers they came in (`_by_age` puts them back in order).
    versions = carry.versions_V
    glob = lambda tree: jax.tree.map(lambda a: a[None], tree)
    new = StagedState(state.step + num_steps, glob(versions[0]),
                      tuple(glob(v) for v in versions[1:]), glob(carry.opt_state),
                      None if state.model_state is None else glob(carry.model_state_M))
    # The owned stage's norms, at its column of the stage-order vector.
    mine = jax.nn.one_hot(ring.num_workers - 1 - me, ring.num_workers, dtype=jnp.float32)
    loss, grad_sq, param_sq = carry.stats_3xK
    return new, _metrics_row(loss, grad_sq[:, None] * mine[None], param_sq[:, None] * mine[None])

  return body


def _by_age(state: StagedState, num_steps: int) -> StagedState:
  """A cyclic call's output state with its versions in age order again (no data moves).

  The call writes ``theta_{t+1}`` into the buffer of the oldest version at each
  update and returns every version in the buffer it came in, so that XLA
  updates the donated buffers in place; each owner updates its stage once a
  step, so after ``K`` steps ``theta_{t-v}`` is in buffer ``(v - K) % V``.
  """
  versions = state.versions
  aged = [versions[(v - num_steps) % len(versions)] for v in range(len(versions))]
  return state._replace(params=aged[0], stale_params=tuple(aged[1:]))


def _zero3_step(staged: StagedModel, tx, rule: executor_lib.RulePlan, num_replicas: int):
  """One ZeRO-3 step of one worker (lockstep DP, stages gathered at use)."""
  delays = rule.delays
  num_workers = num_stages = staged.num_stages
  num_total = num_workers * num_replicas
  axes = (REPLICA, AXIS) if num_replicas > 1 else (AXIS,)
  tiled = _tiled(staged, num_workers)
  shards = shard_sizes(staged, num_workers)
  offsets = np.cumsum([0] + shards)  # Stage j's part of a shard: [offsets[j], offsets[j+1]).
  tile = lambda flat: flat.reshape(-1, TPU_LANES) if tiled else flat
  untile = lambda buffer: buffer.reshape(-1)

  def reduce_scatter(grad):
    """This worker's shard of the sum over workers of ``grad`` (`TPU_SCATTER_ROWS` pieces)."""
    if not tiled:
      return jax.lax.psum_scatter(grad, AXIS, tiled=True)
    rows = tile(grad).reshape(num_workers, -1, TPU_LANES)  # [N, rows a shard, lanes].
    cuts = list(range(TPU_SCATTER_ROWS, rows.shape[1], TPU_SCATTER_ROWS))
    return untile(jnp.concatenate([
        jax.lax.psum_scatter(piece.reshape(-1, TPU_LANES), AXIS, tiled=True)
        for piece in jnp.split(rows, cuts, axis=1)]))

  def step(state: StagedState, batch):
    me = jax.lax.axis_index(AXIS)
    x, y = batch

    def gather(versions, j, after=None):
      """This worker's view of stage ``j`` and ``theta_t`` where DC-ASGD needs it: every
      version it may read (with weight prediction, the one before each), gathered.

      ``after`` adds ``0 * after`` to the shards: a data dependence XLA cannot
      fold (``0 * nan`` is not 0), so a backward gathers again at use instead of
      sharing the forward's gather (CSE; an optimization barrier is expanded
      before CSE on CPU).
      """
      column = sorted(set(delays[:, j].tolist()))
      needed = set(column) | {v + 1 for v in column if v and rule.predict}
      needed |= {0} if rule.dc_lambda and after is not None else set()
      shard = lambda v: versions[v][0, offsets[j]:offsets[j + 1]]
      if after is not None:
        shard = lambda v, shard=shard: shard(v) + 0 * after
      full = {v: untile(jax.lax.all_gather(tile(shard(v)), AXIS, tiled=True))
              for v in sorted(needed)}
      # Lockstep: the version read is the delay (the step updates after every read).
      read = lambda v: (compensation.predicted(full[v], full[v + 1], v) if v and rule.predict
                        else full[v])
      view = read(column[0])
      for v in column[1:]:
        view = jnp.where(jnp.asarray(delays[:, j])[me] == v, read(v), view)
      return view, full.get(0)

    versions = state.versions  # Each [1, S]: this worker's shard of every stage.
    states = (jnp.zeros((num_stages, 0), jnp.float32) if state.model_state is None
              else state.model_state)
    act = staged.act_size(jax.ShapeDtypeStruct(x.shape, x.dtype))
    h = vary(jnp.zeros((act,), jnp.float32), axes)
    stash, new_states = [], []
    for j in range(num_stages):
      stash.append(h)
      h, loss, new_state = staged.apply(j, gather(versions, j)[0],
                                        states[owner(j, num_stages)], h, x, y)
      new_states.append(new_state)
    cot = jnp.zeros_like(h)
    grads = [None] * num_stages
    for j in reversed(range(num_stages)):
      after = loss if j == num_stages - 1 else cot[0]
      view, fresh = gather(versions, j, after)
      grad, cot = staged.vjp(j, view, states[owner(j, num_stages)], stash[j], x, y, cot)
      if rule.dc_lambda:
        grad = compensation.dc_corrected(grad, fresh, view, rule.dc_lambda)
      grad = reduce_scatter(grad)
      if num_replicas > 1:
        grad = jax.lax.psum(grad, REPLICA)  # One all-reduce per stage and step.
      grads[j] = grad / num_total
    grad_sq = jnp.stack([jnp.sum(jnp.square(g)) for g in grads])
    updates, opt_state = jax.vmap(tx.update)(jnp.concatenate(grads)[None], state.opt_state,
                                             state.params)
    if rule.lr_delay_scale:
      scale = compensation.lr_scale(delays, state.step, rule.lr_delay_scale)
      updates = updates * jnp.repeat(scale, np.asarray(shards), total_repeat_length=offsets[-1])[None]
    model_state = state.model_state
    if model_state is not None:
      model_state = jax.lax.pmean(jnp.stack(new_states[::-1]), axes)
    stale = (state.params,) + tuple(state.stale_params)
    new = StagedState(state.step + 1, state.params + updates, stale[:len(state.stale_params)],
                      opt_state, model_state)
    param_sq = jnp.stack([jnp.sum(jnp.square(new.params[0, a:b]))
                          for a, b in zip(offsets[:-1], offsets[1:])])
    row = vary([loss[None], grad_sq, param_sq], axes)
    return new, jnp.concatenate(row)

  return step


def _zero3_body(staged: StagedModel, tx, rule: executor_lib.RulePlan, num_steps: int, axes,
                num_replicas: int):
  """The per-worker ``K``-step ZeRO-3 body for ``shard_map``: a ``lax.scan`` over steps."""
  del num_steps, axes  # The batch's leading axis gives K.
  step = _zero3_step(staged, tx, rule, num_replicas)

  def body(state: StagedState, batch):
    state, rows = jax.lax.scan(step, state, (batch["image"], batch["label"]))
    return state, rows[None]

  return body


def make_executor(staged: StagedModel, tx: optax.GradientTransformation, *, rule,
                    mesh: Mesh, timetable: str | None = None, scan_steps: int | None = None,
                    donate: bool = True) -> executor_lib.Executor:
  """CDP-ZeRO (``cyclic``) or ZeRO-3 (``zero3``) of ``staged`` behind the executor contract.

  Args:
    staged: the model cut into ``J = N`` stages, built with ``pad_to=N``.
    tx: an elementwise optax optimizer (it sees each stage as one flat vector).
    rule: a name of ``schedule.RULES`` or an ``(N, N)`` delay matrix.
    mesh: a mesh with axis ``data`` of size ``N``, or axes ``(replica, data)``
      for ``R`` replicas of the ring.
    timetable: ``cyclic`` or ``zero3``; by default the rule's
      (`executor.resolve`): ``zero3`` for ``dp``, else ``cyclic``.
    scan_steps: if ``K``, one call runs ``K`` steps (one fill and one drain of
      the ring); batch leaves are then ``[K, R*N*b, ...]`` and metrics gain a
      leading ``K`` axis.
    donate: donate the input state's buffers.

  Returns:
    An ``Executor``. ``batch`` is ``{"image": [R*N*b, ...], "label": [R*N*b]}``,
    host arrays or global ``jax.Array``s; worker ``i`` of replica ``r`` gets
    rows ``(r*N + i)*b : (r*N + i + 1)*b``. Metrics: ``loss``, ``grad_norm``,
    ``grad_norm_per_stage``, ``param_norm``, replicated on every device.
  """
  if scan_steps is not None and (int(scan_steps) != scan_steps or scan_steps < 1):
    raise ValueError(f"scan_steps must be a positive int or None, got {scan_steps!r}.")
  num_workers, num_replicas, axes = _num_workers(mesh), _num_replicas(mesh), _mesh_axes(mesh)
  _check_staged(staged, num_workers)
  plan = _resolve(rule, timetable, num_workers)
  make_body = _cyclic_body if plan.timetable == "cyclic" else _zero3_body
  body = make_body(staged, tx, plan, scan_steps or 1, axes, num_replicas)
  state_trees = trees(staged, tx, num_workers, plan.timetable)
  batch_spec = P(None, axes)

  def run(state: StagedState, batch):
    specs = _specs(state, plan.timetable)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, batch_spec),
                         out_specs=(specs, P(axes)))(state, with_steps_axis(batch, scan_steps))

  run = jax.jit(run, donate_argnums=(0,) if donate else (),
                compiler_options=compiled.compiler_options(mesh))

  everywhere = NamedSharding(mesh, P())

  @functools.partial(jax.jit, out_shardings=everywhere)
  def metrics(rows):  # One dispatch after the step (eager, and with the batch reshaped outside
    # the step, a call cost more).
    per_step = _metrics(jax.sharding.reshard(rows, everywhere), num_replicas, num_workers)
    return per_step if scan_steps else jax.tree.map(lambda m: m[0], per_step)

  def prepare(state: StagedState, batch):
    executor_lib.check_versions(state, plan)
    if np.shape(state.params) != state_trees.state_like.shape:
      raise ValueError(
          f"The state holds stage buffers {np.shape(state.params)}, the step expects "
          f"{state_trees.state_like.shape}: build both from the same staged model, mesh and "
          "timetable.")
    batch = steps_batch(batch, scan_steps, num_workers * num_replicas)
    batch = executor_lib.place(batch, NamedSharding(mesh, P(*batch_spec[1:]) if scan_steps is None
                                                    else batch_spec))
    return executor_lib.place(state, _shardings(state, mesh, plan.timetable)), batch

  def step(state, batch, norms=True):
    del norms  # The norms ride the owners' update; they cost no extra pass here.
    state, rows = run(*prepare(state, batch))
    if plan.timetable == "cyclic":
      state = _by_age(state, scan_steps or 1)
    return state, metrics(rows)

  to_portable, from_portable = portable_fns(
      state_trees, plan, mesh, lambda state: _shardings(state, mesh, plan.timetable))
  return executor_lib.Executor(
      init=lambda params, model_state=None: init_state(staged, params, tx, rule=plan, mesh=mesh,
                                                       model_state=model_state),
      step=step, variables=state_trees.variables,
      lower=lambda state, batch: run.lower(*prepare(state, batch)), plan=plan,
      to_portable=to_portable, from_portable=from_portable)


def _resolve(rule, timetable, num_workers) -> executor_lib.RulePlan:
  """The rule's plan on the ring (`executor.resolve`), one stage per worker."""
  if not isinstance(rule, (str, executor_lib.RulePlan)) and np.shape(rule) != (num_workers,
                                                                             num_workers):
    raise ValueError(
        f"Delay matrix has shape {np.shape(rule)}; CDP-ZeRO needs (N, J) = ({num_workers}, "
        f"{num_workers}): one stage per worker. Use J = N stages, or the replicated engine "
        "(parallelism='data') for N != J.")
  return executor_lib.resolve(rule, "zero", num_workers, num_workers, timetable)


def _metrics(rows, num_replicas: int, num_workers: int) -> dict:
  """Per-step metrics ``[K, ...]`` from the workers' rows ``[R*N, K, 1 + 2J]`` (traced).

  The rows leave the compiled step sharded and are gathered by the program
  this runs in, so the step itself holds no collective for its metrics.
  Replicas hold the same stages, so the norms are read from replica 0.
  """
  rows = rows.reshape((num_replicas, num_workers) + rows.shape[1:])
  loss = jnp.sum(rows[..., 0], axis=(0, 1)) / (num_replicas * num_workers)
  grad_sq = jnp.sum(rows[0, :, :, 1:1 + num_workers], axis=0)
  param_sq = jnp.sum(rows[0, :, :, 1 + num_workers:], axis=0)
  return {"loss": loss, "grad_norm": jnp.sqrt(jnp.sum(grad_sq, axis=1)),
          "grad_norm_per_stage": jnp.sqrt(grad_sq),
          "param_norm": jnp.sqrt(jnp.sum(param_sq, axis=1))}
