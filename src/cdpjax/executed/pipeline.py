"""Executed pipeline timetables: CDP with model parallelism, GPipe and DP+MP.

Any model that `staged.stage_model` cuts into ``J`` stages runs over the mesh
axis ``stage``: device ``j`` holds stage ``j`` as flat buffers (`staged`):
its parameter versions, optimizer state and model state (BatchNorm
statistics), rows of ``[J, ...]`` state arrays sharded over ``stage``.

Each device runs one event per slot, from `plan`: idle, a stage forward or a
stage backward. Activations move ``j -> j+1`` and cotangents ``j -> j-1`` by
``lax.ppermute``. A stage stashes only its input; its backward recomputes the
stage forward with ``jax.vjp`` at the version its forward read, and adds the
weight gradient to a running accumulator that never leaves the device. With
``keep_activations``, a forward of every stage but the first stashes instead
what its backward needs of the activations (`StagedModel.apply_keeping`;
what depends on the parameters alone is recomputed), and the backward
recomputes nothing of them; the first stage recomputes (its input is the
batch, kept anyway). The stash holds ``J-1`` micro-batches on the cyclic
timetable (stage ``j`` needs ``J-j`` at once, the first none), ``N`` on GPipe.

Timetables (``N`` micro-batches of ``b`` rows per step, ``K`` steps per call):

- ``cyclic``: CDP, ``N = J``. Micro-batch ``i`` of step ``t`` is worker ``i``
  of ``schedule.timeline``: device ``j`` runs a forward when ``s - j`` is even
  and a backward when it is odd. A stage's update is applied on its device
  right after its ``N``-th backward of the step; a forward reads
  ``theta^j_{t - d[i, j]}`` from the ``D+1`` newest versions. No flush between
  steps.
- ``gpipe``: all ``N`` forwards, all ``N`` backwards, the update, a flush.
- ``dp+mp``: ``N`` replicas (mesh axis ``data``) of ``J`` stages, one
  micro-batch each, gradients all-reduced over ``data``.

Replicated (a pod's 2-D mesh ``(replica, stage)``, ``R x J`` devices): ``R``
copies of the ``cyclic`` or ``gpipe`` pipeline run side by side, each on its
own ``N*b`` rows of an ``[R*N*b, ...]`` batch (replica-major). Each stage's
gradient sum is all-reduced over ``replica`` with one ``psum`` at the slot
where that stage updates, so replica ``r``'s micro-batch ``i`` is worker
``r*N + i`` of the engine with the delay matrix tiled ``R`` times
(``np.tile(d, (R, 1))``); model states are averaged over all ``R*N``
micro-batches (one more ``psum`` per stage and step, where they are averaged).

Model state: each forward computes the stage's new statistics from the
stage's statistics of step ``t``; their mean over the step's ``N`` micro-batches
becomes the statistics of step ``t+1``, as the engine averages them. On the
cyclic timetable this happens after the stage's ``N``-th forward, which every
forward of step ``t+1`` follows.

One call runs ``K`` steps in one ``lax.scan`` over slots; the pipeline fills at
the start of a call and drains at its end. Between calls the state is the
engine's, ``(theta_t, ..., theta_{t-D})`` and the optimizer state, so the
numbers equal ``engine.make_train_step`` step by step for every ``K``.

Delay compensations (`executor.RulePlan`, `compensation`): weight prediction
extrapolates a read inside its stage branch by the worker's delay ``d[i, j]``
(one more version in the ring); DC-ASGD corrects each backward's gradient
against the newest version, ``theta_t`` until the stage's update; the
delay-scaled rate scales the stage's update.

The optimizer runs per stage on one flat vector, so it must act elementwise
(``sgd``, ``adam``, weight decay): a global-norm clip would see one stage only.
A decision per leaf is made on the tree and kept in the optimizer state
(`Trees`; AdamW's decay of matrices, `train.decay_matrices`).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import compensation, compiled, engine
from cdpjax import executor as executor_lib
from cdpjax.executed import plan as plan_lib
from cdpjax.executed.plan import BWD, FWD
from cdpjax.executed.device import (VersionRing, after as staged_after, block as staged_block,
                                    set_block as staged_set_block, steps_batch, vary as _vary,
                                    with_steps_axis)
from cdpjax.executed.staged import StagedModel

STAGE_AXIS = "stage"
DATA_AXIS = "data"
REPLICA_AXIS = "replica"


StagedState = executor_lib.State
"""An executed timetable's state: `executor.State` whose leaves but ``step`` lead with a stage
axis: ``params`` and each stale version ``[J, P]`` (flat stages, `staged`; ZeRO-3's one flat
row ``[1, N S]`` of shards, `zero.shard_columns`), the optimizer state stacked as they are, the
model state ``[J, M]`` (None without one)."""


def replicated(x):
  """``x`` copied to every device of its mesh (readable on every process), if on a mesh."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return jax.device_put(x, NamedSharding(sharding.mesh, P()))
  return x


class Trees:
  """Between a ``StagedState``'s flat stage rows and the engine's ``CyclicState`` of flax trees.

  ``rows`` maps stage order to the state's row order and back (an involution:
  ZeRO keeps owner order). The optimizer state follows the parameter tree's
  (``tx.init(params)``): each subtree shaped as the parameters becomes one
  ``[J, P]`` row per stage (a per-leaf scalar, such as the AdamW decay mask
  of `train.make_optimizer`, is broadcast over its leaf), each other leaf (a
  step count) one copy per row. ``columns``: ``(to_state, from_state)``
  between ``[J, P]`` rows in stage order and the state's parameter layout,
  where it keeps the stages otherwise (ZeRO-3's shards, `zero.shard_columns`).
  Runs on host arrays or under ``jax.jit``.
  """

  def __init__(self, staged: StagedModel, tx: optax.GradientTransformation, rows=lambda x: x,
               columns=(lambda x: x, lambda x: x)):
    self.staged, self.rows = staged, rows
    self.to_columns, self.from_columns = columns
    self.state_like = jax.eval_shape(lambda x: rows(self.to_columns(x)), jax.ShapeDtypeStruct(
        (staged.num_stages, staged.param_size), jnp.float32))
    self.params_like = jax.eval_shape(self.params, self.state_like)
    self.opt_like = jax.eval_shape(tx.init, self.params_like)
    self._params_def = jax.tree.structure(self.params_like)

  def _params_shaped(self, x) -> bool:
    return jax.tree.structure(x) == self._params_def

  def params(self, rows_JxP):
    return self.staged.unpack(self.from_columns(self.rows(rows_JxP)))["params"]

  def flat(self, params):
    return self.rows(self.to_columns(self.staged.pack_params(params)))

  def variables(self, state: StagedState) -> dict:
    """``theta_t`` and the model state as flax variables (evaluation, checkpoints)."""
    params, model_state = jax.device_get((replicated(state.params),
                                          jax.tree.map(replicated, state.model_state)))
    return self.staged.unpack(
        self.from_columns(self.rows(np.asarray(params))),
        None if model_state is None else self.rows(np.asarray(model_state)))

  def to_trees(self, state: StagedState, depth) -> engine.CyclicState:
    """``state`` as the engine keeps it; stale leaves of stages read no older than ``depth[j]``
    are None."""
    stage_of_unit = {u: j for j, units in enumerate(self.staged.units) for u in units}
    stale = tuple({u: tree if depth[stage_of_unit[u]] >= age else jax.tree.map(lambda _: None, tree)
                   for u, tree in self.params(version).items()}
                  for age, version in enumerate(state.stale_params, 1))
    def opt_leaf(like, x):
      if not self._params_shaped(like):
        return x[0]
      return jax.tree.map(lambda l, y: y.reshape(l.shape) if l.shape == y.shape
                          else y.reshape(-1)[0], like, self.params(x))
    opt = jax.tree.map(opt_leaf, self.opt_like, state.opt_state, is_leaf=self._params_shaped)
    model_state = None
    if state.model_state is not None:
      model_state = self.staged.unpack(self.from_columns(self.rows(state.params)),
                                       self.rows(state.model_state))
      model_state.pop("params")
    return engine.CyclicState(state.step, self.params(state.params), stale, opt, model_state)

  def from_trees(self, p: engine.CyclicState) -> StagedState:
    """The ``StagedState`` of ``p``; a None stale leaf (never read) gets ``theta_t``'s."""
    stale = tuple(self.flat(jax.tree.map(lambda s, x: x if s is None else s, version, p.params,
                                         is_leaf=lambda s: s is None))
                  for version in p.stale_params)
    def opt_leaf(like, sub):
      if not self._params_shaped(like):
        rows = self.state_like.shape[0]
        return jnp.broadcast_to(jnp.asarray(sub, like.dtype), (rows, *like.shape))
      return self.flat(jax.tree.map(lambda x, l: jnp.broadcast_to(x, l.shape), sub,
                                    self.params_like))
    opt = jax.tree.map(opt_leaf, self.opt_like, p.opt_state, is_leaf=self._params_shaped)
    model_state = None
    if p.model_state is not None and self.staged.state_size:
      model_state = self.rows(self.staged.pack(p.params, p.model_state)[1])
    return StagedState(jnp.asarray(p.step, jnp.int32), self.flat(p.params), stale, opt,
                       model_state)


def portable_fns(trees: Trees, plan, mesh: Mesh, shardings):
  """``(to_portable, from_portable)`` of `executor.Executor` for a staged state.

  The portable form is the engine's ``CyclicState`` (`Trees`), with a stale
  leaf of a stage that no worker reads at that age None, as the engine keeps
  it. Each direction is one program on the devices; the portable arrays are
  spread over the mesh (`executor.spread`), the staged ones placed by
  ``shardings(state)``.
  """
  # Per stage: the oldest version some worker reads.
  depth = engine.stale_depths(plan.delays, range(plan.delays.shape[1]), plan.num_stale,
                              plan.predict)
  everywhere = NamedSharding(mesh, P())

  def jitted(fn, out_shardings):
    def whole(state):  # Each device converts the whole state (as `variables` copies theta_t).
      return fn(jax.tree.map(lambda x: jax.sharding.reshard(x, everywhere), state))
    cache = {}

    def run(state):
      key = jax.tree.structure(state, is_leaf=lambda s: s is None)
      if key not in cache:
        cache[key] = jax.jit(whole, out_shardings=out_shardings(jax.eval_shape(whole, state)))
      return cache[key](state)
    return run

  return (jitted(lambda state: trees.to_trees(state, depth),
                 lambda out: executor_lib.spread(out, mesh)),
          jitted(trees.from_trees, shardings))


def _stage_axis_size(mesh: Mesh) -> int:
  if STAGE_AXIS not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)} but no axis {STAGE_AXIS!r}: build it with "
        f"jax.make_mesh((J,), ({STAGE_AXIS!r},)), or jax.make_mesh((N, J), "
        f"({DATA_AXIS!r}, {STAGE_AXIS!r})) for dp+mp.")
  return int(mesh.shape[STAGE_AXIS])


def _state_sharding(mesh: Mesh, state: StagedState):
  stage = NamedSharding(mesh, P(STAGE_AXIS))
  return StagedState(NamedSharding(mesh, P()), *[jax.tree.map(lambda _: stage, part)
                                                 for part in state[1:]])


def init_state(staged: StagedModel, params, tx: optax.GradientTransformation, *, rule,
               mesh: Mesh, model_state=None) -> StagedState:
  """The state at ``t = 0`` on ``mesh``; every stale version is ``theta_0``.

  Args:
    staged: the model cut into ``J`` stages (`staged.stage_model`).
    params: the flax ``params``.
    tx: the optimizer; its state is built per stage.
    rule: a rule name of ``schedule.RULES`` or a delay matrix; it fixes ``D``.
    mesh: a mesh with axis ``stage`` (``J`` devices), and ``data`` for dp+mp.
    model_state: the model's other collections (``{"batch_stats": ...}``), or None.
  """
  num_stages = _stage_axis_size(mesh)
  if staged.num_stages != num_stages:
    raise ValueError(f"The model is cut into {staged.num_stages} stages, the mesh axis "
                     f"{STAGE_AXIS!r} has {num_stages} devices: use as many stages as devices.")
  state = Trees(staged, tx).from_trees(engine.init_state(params, tx, rule=rule,
                                                         model_state=model_state))
  return jax.device_put(state, _state_sharding(mesh, state))


def _permute(pairs, axes):
  """``ppermute`` over ``stage`` along ``pairs``; devices outside them receive zeros."""
  if not pairs:
    return lambda x: _vary(jnp.zeros_like(x), axes)
  return lambda x: jax.lax.ppermute(x, STAGE_AXIS, pairs)


class _Slot(NamedTuple):
  """The scan carry: state rows of this device and the in-flight work."""
  versions_VP: Any  # Ring buffer, flat: theta_{t-v} is block (head + v) % V of size P.
  head: Any
  opt_state: Any
  model_state_M: Any
  acc_P: Any         # This step's weight-gradient sum.
  new_state_M: Any   # This step's sum of new model states.
  stash_SW: Any      # What forwards kept for their backward, S entries of W, flat (a TPU
                     # pads an [S, W] array's rows to a multiple of 4: 3 entries cost 4): the
                     # stage input (W = A), or with keep_activations what the backward needs.
  recv_A: Any
  loss_K: Any
  grad_sq_K: Any
  param_sq_K: Any


def _branches(staged: StagedModel, axes, plan: executor_lib.RulePlan, keep: bool):
  """``lax.switch`` branches indexed by ``IDLE``, ``FWD``, ``BWD``.

  Operands ``(carry, event, stage, stashed, x, labels)``; results ``(send,
  grads, new_state, loss, kept)``, what the event computes (zeros where it
  computes nothing; ``kept``: what a forward stashes, ``stashed`` elsewhere). The version is read inside the branch that uses it, and no state
  (versions, stash, accumulators) is a branch result, so no branch copies one.
  The plan's weight prediction and DC-ASGD correction act there (`compensation`).
  """
  def in_stage(fn, carry, event, stage, *operands):
    """``fn(j, theta, theta_t, *operands)`` on this device's stage ``j``, with ``theta`` the
    event's (predicted) read and ``theta_t`` the newest version, read inside the stage's
    branch: read outside, the row would be an operand of the stage switch, a stage-sized copy."""
    versions_VP = carry.versions_VP
    num_versions = versions_VP.shape[0] // staged.param_size
    row = (carry.head + event.version) % num_versions

    def branch(j):
      def run(versions_VP, head, row, delay, *ops):
        read = lambda r: _vary(staged_block(versions_VP, r, staged.param_size), axes)
        theta = read(row)
        if plan.predict:
          theta = compensation.predicted(theta, read((row + 1) % num_versions), delay)
        return _vary(fn(j, theta, lambda: read(head), *ops), axes)
      return run
    return jax.lax.switch(stage, [branch(j) for j in range(staged.num_stages)], versions_VP,
                          carry.head, row, event.delay, *operands)

  def finish(*results):
    return _vary(results, axes)

  kept = lambda j: keep and j > 0  # The first stage recomputes (its input is the batch).

  def idle(ops):
    carry, stashed = ops[0], ops[3]
    return finish(jnp.zeros_like(carry.recv_A), jnp.zeros_like(carry.acc_P),
                  jnp.zeros_like(carry.new_state_M), jnp.zeros((), jnp.float32), stashed)

  def forward(ops):
    carry, event, stage, stashed, x, labels = ops

    def apply(j, theta, _, state, h, x, labels):
      if kept(j):
        return staged.apply_keeping(j, theta, state, h, x, labels, stashed.shape[0])
      h_out, loss, new_state = staged.apply(j, theta, state, h, x, labels)
      return h_out, loss, new_state, h if not keep else jnp.zeros_like(stashed)
    h, loss, new_state, row = in_stage(apply, carry, event, stage, carry.model_state_M,
                                       carry.recv_A, x, labels)
    return finish(h, jnp.zeros_like(carry.acc_P), new_state, loss, row)

  def backward(ops):
    carry, event, stage, stashed, x, labels = ops
    def vjp(j, theta, theta_t, state, stashed, x, labels, cot):
      if kept(j):
        grads, send = staged.vjp_kept(j, theta, state, x, labels, stashed, cot)
      else:
        h = jnp.zeros_like(cot) if keep else stashed
        grads, send = staged.vjp(j, theta, state, h, x, labels, cot)
      if plan.dc_lambda:  # Against theta_t: the stage updates after the step's backwards.
        grads = compensation.dc_corrected(grads, theta_t(), theta, plan.dc_lambda)
      return grads, send
    grads, send = in_stage(vjp, carry, event, stage, carry.model_state_M, stashed, x, labels,
                           carry.recv_A)
    return finish(send, grads, jnp.zeros_like(carry.new_state_M), jnp.zeros((), jnp.float32),
                  stashed)

  return [idle, forward, backward]


class _Timetable(NamedTuple):
  """Static facts of one timetable on one mesh."""
  name: str
  axes: tuple       # (STAGE_AXIS,), or (replica axis, STAGE_AXIS).
  num_stages: int
  num_micro: int    # Micro-batches per step over all replicas.
  per_replica: int  # Micro-batches per pipeline (1 for dp+mp).
  num_steps: int    # K.

  @property
  def replica_axis(self) -> str | None:
    """The axis gradients and model states are summed over (``data`` for dp+mp)."""
    return self.axes[0] if len(self.axes) == 2 else None

  @property
  def per_step(self) -> int:  # GPipe's slots per step.
    return 2 * (self.per_replica + self.num_stages - 1)

  @property
  def num_slots(self) -> int:
    if self.name == "cyclic":
      return plan_lib.cyclic_slots(self.num_stages, self.num_steps)
    return self.num_steps * self.per_step

  def event(self, slot, delays):
    j = jax.lax.axis_index(STAGE_AXIS)
    if self.name == "cyclic":
      return plan_lib.cyclic_event(slot, j, delays, self.num_steps, xp=jnp)
    worker0 = jax.lax.axis_index(DATA_AXIS) if self.name == "dp+mp" else 0
    return plan_lib.gpipe_event(slot, j, delays, num_micro=self.per_replica,
                                num_steps=self.num_steps, worker0=worker0, xp=jnp)

  def permutes(self):
    """The two ``ppermute`` pair lists and, per slot, which one runs."""
    if self.name == "cyclic":
      return ((plan_lib.swap_pairs(self.num_stages, 0), plan_lib.swap_pairs(self.num_stages, 1)),
              lambda slot: slot % 2 == 0)
    shifts = tuple([(s, s + d) for s in range(self.num_stages) if 0 <= s + d < self.num_stages]
                   for d in (1, -1))
    return shifts, lambda slot: slot % self.per_step < self.per_step // 2


def _make_body(staged: StagedModel, tx, plan: executor_lib.RulePlan, tt: _Timetable,
               keep: bool):
  """The per-device ``K``-step body for ``shard_map``."""
  delays = plan.delays
  branches = _branches(staged, tt.axes, plan, keep)
  # Micro-batches in flight at once: J - j at stage j (the first recomputes from the batch).
  stash_size = max(tt.num_stages - 1, 1) if tt.name == "cyclic" else tt.per_replica
  permutes, first_permute = tt.permutes()
  stateful = staged.state_size > 0

  def average_state(states):
    """``(model_state, new_state_sum)`` -> (their mean over the step's micro-batches, zeros)."""
    _, total = states
    if tt.replica_axis:
      total = jax.lax.psum(total, tt.replica_axis)
    # The mean is replicated over the replicas (as the state is), the new sum varies.
    return total / tt.num_micro, _vary(jnp.zeros_like(total), tt.axes)

  def update(acc_P, carry: _Slot, step, first_step):
    """The stage's optimizer update of the call's step ``step`` (the run's ``first_step +
    step``), and flushed timetables' model-state update."""
    grads, new_state = acc_P, carry.new_state_M
    if tt.replica_axis:  # One all-reduce per stage and step, where the stage updates.
      grads = jax.lax.psum(grads, tt.replica_axis)
    grads = grads / tt.num_micro
    num_versions = carry.versions_VP.shape[0] // staged.param_size
    params = staged_block(carry.versions_VP, carry.head, staged.param_size)
    updates, opt_state = tx.update(grads, carry.opt_state, params)
    if plan.lr_delay_scale:
      scale = compensation.lr_scale(delays, first_step + step, plan.lr_delay_scale)
      updates = updates * scale[jax.lax.axis_index(STAGE_AXIS)]
    params = optax.apply_updates(params, updates)
    head = (carry.head - 1) % num_versions  # The oldest version's row takes theta_{t+1}.
    model_state = carry.model_state_M
    if stateful and tt.name != "cyclic":
      model_state, new_state = average_state((model_state, new_state))
    return carry._replace(
        versions_VP=params,  # Written into the ring by the caller, outside the conditional.
        head=head, opt_state=opt_state,
        model_state_M=model_state, new_state_M=_vary(new_state, tt.axes),
        grad_sq_K=carry.grad_sq_K.at[step].set(_vary(jnp.sum(jnp.square(grads)), tt.axes)),
        param_sq_K=carry.param_sq_K.at[step].set(_vary(jnp.sum(jnp.square(params)), tt.axes)))

  def slot_body(carry: _Slot, slot, x_KxMx, labels_KxMxb, first_step):
    event = tt.event(slot, delays)
    stage = jax.lax.axis_index(STAGE_AXIS)
    width = carry.stash_SW.shape[0] // stash_size
    stashed = staged_block(carry.stash_SW, event.stash, width)
    send, grads, new_state, loss, row = jax.lax.switch(
        event.kind, branches, (carry, event, stage, stashed, x_KxMx[event.step, event.micro],
                               labels_KxMxb[event.step, event.micro]))
    # In place: a forward stashes what it kept, a backward adds its weight gradient (the
    # step's first backward restarts the sum, so the update need not zero it).
    stash = staged_set_block(carry.stash_SW, event.stash, width, row)
    first = (event.kind == BWD) & (event.micro == 0)
    carry = carry._replace(stash_SW=stash, acc_P=jnp.where(first, 0.0, carry.acc_P) + grads,
                           new_state_M=carry.new_state_M + new_state,
                           loss_K=carry.loss_K.at[event.step].add(loss))
    if stateful and tt.name == "cyclic":
      # After the stage's N-th forward of the step: every later forward is of step t+1.
      # A cond, not a select: with replicas it holds the model state's all-reduce.
      done = (event.kind == FWD) & (event.micro == tt.per_replica - 1)
      model_state, new_state = jax.lax.cond(
          done, average_state, lambda states: states,
          (carry.model_state_M, carry.new_state_M))
      carry = carry._replace(model_state_M=model_state, new_state_M=new_state)
    # The accumulator is an operand, not a result: a result passed through is copied.
    # The ring is read inside and written outside: a write under the conditional made the TPU
    # compiler keep a copy of the whole ring in the loop (tpu_plan: CDP+MP's HBM heap).
    rest = carry._replace(acc_P=None)
    rest = jax.lax.cond(
        event.then_update, lambda acc, c: update(acc, c, event.step, first_step),
        lambda acc, c: c._replace(versions_VP=staged_block(c.versions_VP, c.head,
                                                           staged.param_size)),
        carry.acc_P, rest)
    carry = rest._replace(acc_P=carry.acc_P, versions_VP=staged_set_block(
        carry.versions_VP, rest.head, staged.param_size, rest.versions_VP))
    if tt.replica_axis:  # The update's all-reduce goes before the permute on every device.
      send = staged_after(send, rest.param_sq_K)
    # The permute of this slot's kind; a cond keeps one copy of the slot's compute.
    recv = jax.lax.cond(first_permute(slot), *[_permute(pairs, tt.axes) for pairs in permutes],
                        send)
    return carry._replace(recv_A=recv), None

  def body(state: StagedState, ring_1xVP, batch):
    """``state`` without its versions, which come as their flat ring ``[1, V*P]``
    (`device.VersionRing`)."""
    local = lambda tree: jax.tree.map(lambda a: a[0], tree)
    x, labels = batch["image"], batch["label"]
    x_KxMx = x.reshape((tt.num_steps, tt.per_replica, -1) + x.shape[2:])
    labels_KxMxb = labels.reshape(x_KxMx.shape[:3] + labels.shape[2:])  # [..., L] for text.
    act = staged.act_size(jax.ShapeDtypeStruct(x_KxMx.shape[2:], x.dtype))
    zeros_K = jnp.zeros((tt.num_steps,), jnp.float32)
    model_state = (jnp.zeros((0,), jnp.float32) if state.model_state is None
                   else local(state.model_state))
    carry = _Slot(
        versions_VP=ring_1xVP[0], head=jnp.zeros((), jnp.int32),
        opt_state=local(state.opt_state), model_state_M=model_state,
        acc_P=_vary(jnp.zeros((staged.param_size,), jnp.float32), tt.axes),
        new_state_M=_vary(jnp.zeros_like(model_state), tt.axes),
        stash_SW=None,
        recv_A=_vary(jnp.zeros((act,), jnp.float32), tt.axes),
        loss_K=_vary(zeros_K, tt.axes), grad_sq_K=_vary(zeros_K, tt.axes),
        param_sq_K=_vary(zeros_K, tt.axes))
    width = act
    if keep:  # What a forward keeps, for operands typed as the stage branches get them.
      theta = _vary(jnp.zeros((staged.param_size,), jnp.float32), tt.axes)
      width = staged.kept_size(theta, carry.model_state_M, carry.recv_A, x_KxMx[0, 0],
                               labels_KxMxb[0, 0])
    if stash_size * width >= 2**31:
      raise ValueError(
          f"The stash of {stash_size} micro-batches of {width:,} elements each is too large for "
          "the int32 offsets of its flat buffer: use fewer rows per micro-batch, more stages, "
          "or recompute (keep_activations=False).")
    carry = carry._replace(stash_SW=_vary(jnp.zeros((stash_size * width,), jnp.float32), tt.axes))
    carry, _ = jax.lax.scan(lambda c, s: slot_body(c, s, x_KxMx, labels_KxMxb, state.step), carry,
                            jnp.arange(tt.num_slots))
    glob = lambda tree: jax.tree.map(lambda a: a[None], tree)
    new_state = StagedState(state.step + tt.num_steps, None, (), glob(carry.opt_state),
                            None if state.model_state is None else glob(carry.model_state_M))
    lead = (None,) * len(tt.axes)
    return new_state, glob(carry.versions_VP), (
        carry.loss_K[lead], carry.grad_sq_K[lead], carry.param_sq_K[lead])

  return body


def make_executor(staged: StagedModel, tx: optax.GradientTransformation, *, rule, mesh: Mesh,
                    timetable: str | None = None, scan_steps: int | None = None,
                    num_micro_batches: int | None = None, keep_activations: bool = False,
                    donate: bool = True) -> executor_lib.Executor:
  """The executed pipeline of ``staged`` behind the executor contract.

  Args:
    staged: the model cut into ``J`` stages (`staged.stage_model`).
    tx: an elementwise optax optimizer.
    rule: a name of ``schedule.RULES`` or an ``(N, J)`` delay matrix.
    mesh: axis ``stage`` of ``J`` devices; for ``dp+mp`` also axis ``data`` of
      ``N`` replicas; for ``R`` replicas of ``cyclic`` or ``gpipe``, axes
      ``("replica", "stage")`` (``jax.make_mesh((R, J), ("replica", "stage"))``).
    timetable: ``cyclic`` (CDP, ``N = J``), ``gpipe`` or ``dp+mp``; by default
      the rule's (`executor.resolve`): ``gpipe`` for ``dp``, else ``cyclic``.
    scan_steps: if ``K``, one call runs ``K`` steps; batch leaves are then
      ``[K, N*b, ...]`` and metrics gain a leading ``K`` axis.
    num_micro_batches: ``N`` for ``gpipe`` (default ``J``); ``cyclic`` needs ``J``.
    keep_activations: a forward stashes the activations its backward needs
      instead of its input (every stage but the first; the module docstring).
    donate: donate the input state's buffers.

  Returns:
    An ``Executor``. ``step(state, batch)`` takes ``{"image": [N*b, ...],
    "label": [N*b]}`` (micro-batch ``i`` = rows ``i*b:(i+1)*b``; with ``R``
    replicas ``[R*N*b, ...]``, replica ``r`` taking rows ``r*N*b:(r+1)*N*b``),
    host arrays or global ``jax.Array``s of any sharding: they are placed
    replicated on the stage devices (split over ``data`` for dp+mp, over
    ``replica`` with replicas). Metrics leave the compiled step sharded and
    are copied to every device after it, so the step itself communicates by
    collective-permutes only, plus the gradient all-reduces of dp+mp and of
    replicas (one per stage and step; with model state, one more for its mean).
  """
  if scan_steps is not None and (int(scan_steps) != scan_steps or scan_steps < 1):
    raise ValueError(f"scan_steps must be a positive int or None, got {scan_steps!r}.")
  num_stages = _stage_axis_size(mesh)
  if staged.num_stages != num_stages:
    raise ValueError(f"The model is cut into {staged.num_stages} stages, the mesh axis "
                     f"{STAGE_AXIS!r} has {num_stages} devices: use as many stages as devices.")
  axes, per_replica, num_rows = _layout(mesh, timetable, num_stages, num_micro_batches)
  plan = executor_lib.resolve(rule, "model", num_rows, num_stages, timetable)
  num_micro = int(np.prod([mesh.shape[a] for a in axes[:-1]], dtype=int)) * per_replica
  tt = _Timetable(plan.timetable, axes, num_stages, num_micro, per_replica, scan_steps or 1)
  body = _make_body(staged, tx, plan, tt, keep_activations)
  state_spec = StagedState(P(), P(STAGE_AXIS), P(STAGE_AXIS), P(STAGE_AXIS), P(STAGE_AXIS))
  batch_spec = P(None, tt.replica_axis) if tt.replica_axis else P()
  stage_rows = NamedSharding(mesh, P(STAGE_AXIS))
  donated = (0, 1) if donate else ()
  sharded = jax.shard_map(body, mesh=mesh, in_specs=(state_spec, P(STAGE_AXIS), batch_spec),
                          out_specs=(state_spec, P(STAGE_AXIS), P(*axes)))
  run = jax.jit(
      lambda state, versions, batch: sharded(state, versions, with_steps_axis(batch, scan_steps)),
      donate_argnums=donated, compiler_options=compiled.compiler_options(mesh))
  ring = VersionRing(staged.param_size, tt.num_steps, stage_rows, donate)

  def prepare(state: StagedState, batch, abstract_ring=False):
    """``run``'s arguments: the state without its versions, their ring, the batch."""
    executor_lib.check_versions(state, plan)
    batch = steps_batch(batch, scan_steps, num_micro)
    state = executor_lib.place(state, _state_sharding(mesh, state))
    versions = (ring.abstract if abstract_ring else ring.of)(state.versions)
    return (state._replace(params=None, stale_params=()), versions,
            executor_lib.place(batch, NamedSharding(
                mesh, P(*batch_spec[1:]) if scan_steps is None else batch_spec)))

  everywhere = NamedSharding(mesh, P())

  @functools.partial(jax.jit, out_shardings=everywhere)
  def finish(raw):
    # Per device [J, K], or [R, J, K] with replicas; replicated by this program of its
    # own after the step (one dispatch, where eager its dozen small ops cost a call more),
    # so the step itself holds no collective for its metrics.
    loss, grad_sq, param_sq = jax.sharding.reshard(raw, everywhere)
    if tt.replica_axis:
      loss, grad_sq, param_sq = jnp.sum(loss[:, -1], axis=0), grad_sq[0], param_sq[0]
    else:
      loss = loss[-1]
    metrics = {"loss": loss / num_micro, "grad_norm": jnp.sqrt(jnp.sum(grad_sq, axis=0)),
               "grad_norm_per_stage": jnp.sqrt(grad_sq.T),
               "param_norm": jnp.sqrt(jnp.sum(param_sq, axis=0))}
    return metrics if scan_steps else jax.tree.map(lambda m: m[0], metrics)

  def step(state, batch, norms=True):
    del norms  # Each device's norms come with its stage's update; they cost no extra pass here.
    state, versions_ring, raw = run(*prepare(state, batch))
    versions = ring.versions(versions_ring)
    return state._replace(params=versions[0], stale_params=versions[1:]), finish(raw)

  trees = Trees(staged, tx)
  to_portable, from_portable = portable_fns(trees, plan, mesh,
                                            lambda state: _state_sharding(mesh, state))
  return executor_lib.Executor(
      init=lambda params, model_state=None: init_state(staged, params, tx, rule=plan, mesh=mesh,
                                                       model_state=model_state),
      step=step, variables=trees.variables,
      lower=lambda state, batch: run.lower(*prepare(state, batch, abstract_ring=True)),
      plan=plan, to_portable=to_portable, from_portable=from_portable)


def _layout(mesh: Mesh, timetable, num_stages: int, num_micro_batches):
  """``(axes, micro-batches per pipeline, rows of the delay matrix)`` of ``timetable`` on ``mesh``."""
  if timetable == "dp+mp":
    if DATA_AXIS not in mesh.axis_names:
      raise ValueError(f"dp+mp needs a mesh with axes ({DATA_AXIS!r}, {STAGE_AXIS!r}), got "
                       f"{tuple(mesh.axis_names)}: jax.make_mesh((N, J), ('data', 'stage')).")
    axes, per_replica, num_rows = (DATA_AXIS, STAGE_AXIS), 1, int(mesh.shape[DATA_AXIS])
  else:
    per_replica = num_stages if num_micro_batches is None else int(num_micro_batches)
    if per_replica < 1:
      raise ValueError(f"num_micro_batches must be >= 1, got {per_replica}.")
    replicated = REPLICA_AXIS in mesh.axis_names
    axes, num_rows = ((REPLICA_AXIS,) if replicated else ()) + (STAGE_AXIS,), per_replica
  others = [a for a in mesh.axis_names if a not in axes]
  if others:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)}; the {timetable or 'default'} timetable "
        f"runs on ({STAGE_AXIS!r},) or ({REPLICA_AXIS!r}, {STAGE_AXIS!r}) (dp+mp on "
        f"({DATA_AXIS!r}, {STAGE_AXIS!r})): drop or rename {others}.")
  return axes, per_replica, num_rows
