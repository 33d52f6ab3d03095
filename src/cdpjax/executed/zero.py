"""CDP with ZeRO: the cyclic timetable executed on the ``data`` axis, model states sharded by stage.

Any model that `staged.stage_model` cuts into ``J = N`` stages runs: every
stage is one flat float32 buffer of ``P`` elements (`staged`), so stages
travel and update alike. Worker ``r`` owns stage ``J-1-r``: it alone holds
that stage's ``theta_t``, its stale versions, its optimizer state and its
model state (rows of ``[N, ...]`` state arrays are in owner order).

**cyclic.** Worker ``i`` runs its micro-batch through all stages starting
``2J/N = 2`` slots after worker ``i-1``: the forward of stage ``j`` at slot
``2i + j``, its backward at ``2i + 2J-1-j`` (DESIGN.md section 1). Every
message is one ``lax.ppermute`` of a stage buffer (`plan.cyclic_transfers`):

- The buffer a worker uses for stage ``j`` goes on to worker ``i+1``, which needs
  the same stage, in the same direction, 2 slots later (the ring). The owner
  uses its own copy, and sends the version the rule prescribes to worker 0 and
  to any worker whose version differs from its predecessor's. Forward and
  backward each circulate the stage once: no worker keeps a stage from its
  forward to its backward (ZeRO-3 gathers twice for the same reason). The
  stage's model state (BatchNorm statistics, ``M`` elements) travels with it.
- A stage's gradient is accumulated along two ring chains as backwards run:
  workers ``0..o`` end at the owner ``o``; workers ``o+1..N-1`` end at worker
  ``N-1``, which sends the sum to the owner. The new model states of the
  step's forwards ride in the same buffers, so the owner gets their sum.
- Each owner then applies the optimizer to its stage and sets its model state
  to the mean of the new ones, as the engine does. The step is flushed: one
  call is one training step of the engine, with the same numbers.

The compiled cyclic step holds collective-permutes only. Metrics leave it
per worker and are summed outside it. Each backward recomputes its stage
forward from the stage input it stashed.

**zero3.** The baseline with the same state: ZeRO-3 (FSDP) data parallelism in
lockstep. Each stage's parameter buffers are sharded ``P/N`` per worker; a
stage is all-gathered at use in the forward and again in the backward, and its
gradient is reduce-scattered. Model states are replicated and averaged by one
all-reduce. Rule ``dp`` runs this way (`executor.resolve`).

The optimizer sees each stage as one flat vector, so it must act elementwise
(sgd, momentum, adam, weight decay): a transform that needs a global view,
such as ``clip_by_global_norm``, would need an all-reduce.
"""
from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import executor as executor_lib
from cdpjax import schedule
from cdpjax.executed import plan as plan_lib
from cdpjax.executed.pipeline import StagedState, replicated
from cdpjax.executed.staged import StagedModel, vary

AXIS = "data"
TIMETABLES = ("cyclic", "zero3")


def owner(stage: int, num_stages: int) -> int:
  """The worker that owns ``stage``: worker ``J-1-j`` (row ``J-1-j`` of the state)."""
  return num_stages - 1 - stage


def _num_workers(mesh: Mesh) -> int:
  if AXIS not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)} but no axis {AXIS!r}: build it with "
        f"jax.make_mesh((num_workers,), ({AXIS!r},)).")
  return int(mesh.shape[AXIS])


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


def init_state(staged: StagedModel, params, tx: optax.GradientTransformation, *, rule,
               mesh: Mesh, model_state=None) -> StagedState:
  """The sharded state at ``t = 0``; every stale version is ``theta_0``.

  Args:
    staged: the model cut into ``J = N`` stages, ``pad_to=N``.
    params: the flax ``params``.
    tx: an elementwise optax optimizer.
    rule: a name of ``schedule.RULES`` or an ``(N, N)`` delay matrix.
    mesh: a mesh with axis ``data`` of size ``N``.
    model_state: the model's other collections, or None.
  """
  num_workers = _num_workers(mesh)
  _check_staged(staged, num_workers)
  params_JxP, state_JxM = staged.pack(params, model_state)
  rows = jnp.asarray(_owner_rows(params_JxP))
  state = StagedState(
      step=jnp.zeros((), jnp.int32), params=rows,
      stale_params=tuple(jnp.array(rows) for _ in range(schedule.max_delay(rule))),
      opt_state=jax.vmap(tx.init)(rows),
      model_state=jnp.asarray(_owner_rows(state_JxM)) if staged.state_size else None)
  return jax.device_put(state, _shardings(state, mesh, "cyclic"))


def variables(state: StagedState, staged: StagedModel) -> dict:
  """``theta_t`` and the model state as flax variables."""
  model_state = None
  if state.model_state is not None:
    model_state = _owner_rows(np.asarray(jax.device_get(replicated(state.model_state))))
  return staged.unpack(_owner_rows(np.asarray(jax.device_get(replicated(state.params)))),
                       model_state)


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


def _table(values, me):
  """This worker's entry of a static per-worker table."""
  return jnp.asarray(np.asarray(values, np.int32))[me]


def _metrics_row(loss, grad_sq_J, param_sq_J):
  """``[1, 1 + 2J]``: this worker's loss and its parts of the per-stage squared norms."""
  return jnp.concatenate([loss[None], grad_sq_J, param_sq_J])[None]


def _advance(state: StagedState, updates, opt_state, model_state) -> StagedState:
  """``theta_{t+1} = theta_t + updates``; ``theta_t`` becomes the newest stale version."""
  stale = ((state.params,) + tuple(state.stale_params))[:len(state.stale_params)]
  return StagedState(state.step + 1, state.params + updates, stale, opt_state, model_state)


def _cyclic_body(staged: StagedModel, tx, delays):
  """The per-worker cyclic step, for ``shard_map`` over ``data``."""
  num_workers = num_stages = staged.num_stages
  size_p, size_m = staged.param_size, staged.state_size
  by_slot = defaultdict(list)
  for t in plan_lib.cyclic_transfers(delays):
    by_slot[t.slot].append(t)
  last_work = plan_lib.work_slot(num_workers - 1, 2 * num_stages - 1)
  num_slots = 1 + max(max(by_slot, default=0), last_work)
  work = [[None] * num_workers for _ in range(num_slots)]  # (stage, is_backward) or None.
  for i in range(num_workers):
    for phase in range(2 * num_stages):
      j = phase if phase < num_stages else 2 * num_stages - 1 - phase
      work[plan_lib.work_slot(i, phase)][i] = (j, phase >= num_stages)
  axes = (AXIS,)

  def body(state: StagedState, batch):
    me = jax.lax.axis_index(AXIS)
    x, y = batch["image"], batch["label"]
    act = staged.act_size(jax.ShapeDtypeStruct(x.shape, x.dtype))
    # A stage buffer: its parameters (a version), then its model state.
    own_state = (jnp.zeros((0,), jnp.float32) if state.model_state is None
                 else state.model_state[0])
    versions = [jnp.concatenate([v[0], own_state])
                for v in (state.params,) + tuple(state.stale_params)]
    zeros_buf = vary(jnp.zeros((size_p + size_m,), jnp.float32), axes)
    h = cot = vary(jnp.zeros((act,), jnp.float32), axes)
    stash = vary(jnp.zeros((num_stages, act), jnp.float32), axes)  # Each stage's input.
    stash_state = vary(jnp.zeros((num_stages, size_m), jnp.float32), axes)
    loss = vary(jnp.zeros((), jnp.float32), axes)
    acc = zeros_buf  # The owned stage's gradient and new-state sum.
    used, partial = {}, {}  # Per slot: the stage buffer used, the sum sent on.
    # Owner sends depend on ``clock`` (0 * a value that changes every slot; XLA
    # cannot fold it, 0 * nan is not 0): else CSE merges a backward's send into
    # the forward's, and the receiver holds the stage in between.
    clock = jnp.zeros((), jnp.float32)
    carry = (h, cot, stash, stash_state, loss)

    def idle(buf, carry, j):
      return vary((carry, zeros_buf), axes)

    def forward(buf, carry, j):
      h, cot, stash, stash_state, loss = carry
      stash = jax.lax.dynamic_update_index_in_dim(stash, h, j, 0)
      h, stage_loss, new_state = staged.apply(j, buf[:size_p], buf[size_p:], h, x, y)
      stash_state = jax.lax.dynamic_update_index_in_dim(stash_state, new_state, j, 0)
      loss = jnp.where(j == num_stages - 1, stage_loss, loss)
      return vary(((h, cot, stash, stash_state, loss), zeros_buf), axes)

    def backward(buf, carry, j):
      h, cot, stash, stash_state, loss = carry
      h_in = jax.lax.dynamic_index_in_dim(stash, j, 0, keepdims=False)
      grad, cot = staged.vjp(j, buf[:size_p], buf[size_p:], h_in, x, y, cot)
      new_state = jax.lax.dynamic_index_in_dim(stash_state, j, 0, keepdims=False)
      return vary(((h, cot, stash, stash_state, loss), jnp.concatenate([grad, new_state])), axes)

    for s in range(num_slots):
      cur, chain_in = zeros_buf, zeros_buf
      groups = defaultdict(list)  # Transfers with the same operand.
      for t in by_slot[s]:
        groups[(t.kind, t.route, t.delay if t.route == "owner" else 0)].append(t)
      for (kind, route, delay), group in sorted(groups.items()):
        operand = {("param", "ring"): lambda: used[s - 2],
                   ("param", "owner"): lambda: versions[delay] + 0 * clock,
                   ("grad", "ring"): lambda: partial[s - 2],
                   ("grad", "final"): lambda: partial[s - 1]}[(kind, route)]()
        for perm in plan_lib._permutations(group):  # pylint: disable=protected-access
          received = jax.lax.ppermute(operand, AXIS, [(t.src, t.dst) for t in perm])
          if kind == "param":
            is_dst = _table([any(t.dst == i for t in perm) for i in range(num_workers)], me)
            cur = jnp.where(is_dst == 1, received, cur)
          elif route == "ring":
            chain_in = chain_in + received  # Zeros on workers that are not targets.
          else:
            acc = acc + received
      row = work[s]
      if not any(row):
        continue
      local = [w is not None and owner(w[0], num_stages) == i for i, w in enumerate(row)]
      local_delay = [int(delays[i, w[0]]) if w else 0 for i, w in enumerate(row)]
      own = jnp.stack(versions)[_table(local_delay, me)]
      cur = jnp.where(_table(local, me) == 1, own, cur)
      used[s] = cur
      codes = [0 if w is None else 1 + int(w[1]) for w in row]
      present = sorted(set(codes))
      branches = [(idle, forward, backward)[c] for c in present]
      stage = _table([w[0] if w else 0 for w in row], me)
      carry, grad = jax.lax.switch(_table([present.index(c) for c in codes], me), branches,
                                   cur, carry, stage)
      partial[s] = chain_in + grad
      clock = carry[0][0] + carry[1][0]
      owns = [w is not None and w[1] and owner(w[0], num_stages) == i for i, w in enumerate(row)]
      acc = jnp.where(_table(owns, me) == 1, acc + partial[s], acc)

    grads = acc[:size_p] / num_workers
    updates, opt_state = jax.vmap(tx.update)(grads[None], state.opt_state, state.params)
    new = _advance(state, updates, opt_state,
                   None if state.model_state is None else (acc[size_p:] / num_workers)[None])
    # Squared norms of the owned stage, at its column of the stage-order vector.
    mine = jax.nn.one_hot(num_stages - 1 - me, num_stages, dtype=jnp.float32)
    metrics = _metrics_row(carry[4] / num_workers, mine * jnp.sum(jnp.square(grads)),
                           mine * jnp.sum(jnp.square(new.params)))
    return new, metrics

  return body


def _zero3_body(staged: StagedModel, tx, delays):
  """The per-worker ZeRO-3 step (lockstep DP, stages gathered at use), for ``shard_map``."""
  num_workers = num_stages = staged.num_stages

  def body(state: StagedState, batch):
    me = jax.lax.axis_index(AXIS)
    x, y = batch["image"], batch["label"]

    def gather(versions, j, after=None):
      """This worker's view of stage ``j``: every version it may read, gathered.

      ``after`` adds ``0 * after`` to the shards: a data dependence XLA cannot
      fold (``0 * nan`` is not 0), so a backward gathers again at use instead of
      sharing the forward's gather (CSE; an optimization barrier is expanded
      before CSE on CPU).
      """
      column = sorted(set(delays[:, j].tolist()))
      shard = lambda v: versions[v][owner(j, num_stages)]
      if after is not None:
        shard = lambda v, shard=shard: shard(v) + 0 * after
      full = {v: jax.lax.all_gather(shard(v), AXIS, tiled=True) for v in column}
      view = full[column[0]]
      for v in column[1:]:
        view = jnp.where(_table(delays[:, j], me) == v, full[v], view)
      return view

    versions = (state.params,) + tuple(state.stale_params)  # Each [N, P/N].
    states = (jnp.zeros((num_stages, 0), jnp.float32) if state.model_state is None
              else state.model_state)
    act = staged.act_size(jax.ShapeDtypeStruct(x.shape, x.dtype))
    h = vary(jnp.zeros((act,), jnp.float32), (AXIS,))
    stash, new_states = [], []
    for j in range(num_stages):
      stash.append(h)
      h, loss, new_state = staged.apply(j, gather(versions, j),
                                        states[owner(j, num_stages)], h, x, y)
      new_states.append(new_state)
    cot = jnp.zeros_like(h)
    grads = [None] * num_workers
    for j in reversed(range(num_stages)):
      after = loss if j == num_stages - 1 else cot[0]
      grad, cot = staged.vjp(j, gather(versions, j, after),
                             states[owner(j, num_stages)], stash[j], x, y, cot)
      grads[owner(j, num_stages)] = jax.lax.psum_scatter(grad, AXIS, tiled=True) / num_workers
    grads = jnp.stack(grads)
    updates, opt_state = jax.vmap(tx.update)(grads, state.opt_state, state.params)
    model_state = state.model_state
    if model_state is not None:
      model_state = jax.lax.pmean(jnp.stack(new_states[::-1]), AXIS)
    new = _advance(state, updates, opt_state, model_state)
    metrics = _metrics_row(loss / num_workers, jnp.sum(jnp.square(grads), axis=1)[::-1],
                           jnp.sum(jnp.square(new.params), axis=1)[::-1])
    return new, metrics

  return body


def make_train_step(staged: StagedModel, tx: optax.GradientTransformation, *, rule,
                    mesh: Mesh, timetable: str | None = None,
                    donate: bool = True) -> executor_lib.Executor:
  """CDP-ZeRO (``cyclic``) or ZeRO-3 (``zero3``) of ``staged`` behind the executor contract.

  Args:
    staged: the model cut into ``J = N`` stages, built with ``pad_to=N``.
    tx: an elementwise optax optimizer (it sees each stage as one flat vector).
    rule: a name of ``schedule.RULES`` or an ``(N, N)`` delay matrix.
    mesh: a mesh with axis ``data`` of size ``N``.
    timetable: ``cyclic`` or ``zero3``; by default the rule's
      (`executor.resolve`): ``zero3`` for ``dp``, else ``cyclic``.
    donate: donate the input state's buffers.

  Returns:
    An ``Executor``. ``batch`` is ``{"image": [N*b, ...], "label": [N*b]}``,
    host arrays or global ``jax.Array``s; worker ``i`` gets rows
    ``i*b:(i+1)*b``. Metrics: ``loss``, ``grad_norm``, ``grad_norm_per_stage``,
    ``param_norm``, replicated on every device.
  """
  num_workers = _num_workers(mesh)
  _check_staged(staged, num_workers)
  if not isinstance(rule, str) and np.shape(rule) != (num_workers, num_workers):
    raise ValueError(
        f"Delay matrix has shape {np.shape(rule)}; CDP-ZeRO needs (N, J) = ({num_workers}, "
        f"{num_workers}): one stage per worker. Use J = N stages, or the replicated engine "
        "(parallelism='data') for N != J.")
  plan = executor_lib.resolve(rule, "zero", num_workers, num_workers)
  if timetable is not None:
    if timetable not in TIMETABLES:
      raise ValueError(f"Unknown timetable {timetable!r}: use one of {TIMETABLES}.")
    if timetable == "cyclic" and plan.timetable != "cyclic":
      raise ValueError(f"Rule {rule!r} has no delays and is not causal on the cyclic timetable: "
                       "use timetable='zero3' (or leave timetable unset) for dp.")
    plan = plan._replace(timetable=timetable)
  make_body = _cyclic_body if plan.timetable == "cyclic" else _zero3_body
  body = make_body(staged, tx, plan.delays)
  batch_specs = {"image": P(AXIS), "label": P(AXIS)}

  def run(state: StagedState, batch):
    specs = _specs(state, plan.timetable)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, batch_specs),
                         out_specs=(specs, P(AXIS)))(state, batch)

  run = jax.jit(run, donate_argnums=(0,) if donate else ())

  def prepare(state: StagedState, batch):
    executor_lib.check_versions(state, plan)
    if np.shape(state.params) != (num_workers, staged.param_size):
      raise ValueError(
          f"The state holds stage buffers {np.shape(state.params)}, the step expects "
          f"({num_workers}, {staged.param_size}): build both from the same staged model and mesh.")
    if not isinstance(batch, dict) or set(batch) != {"image", "label"}:
      raise ValueError("batch must be a dict with keys 'image' and 'label'.")
    size = np.shape(batch["label"])[0]
    if size == 0 or size % num_workers or np.shape(batch["image"])[0] != size:
      raise ValueError(
          f"Batch of {np.shape(batch['image'])[0]} images and {size} labels: use "
          f"num_workers * b rows for both ({num_workers} workers; worker i gets rows "
          "i*b:(i+1)*b).")
    sharding = NamedSharding(mesh, P(AXIS))
    batch = executor_lib.place(batch, sharding)
    return executor_lib.place(state, _shardings(state, mesh, plan.timetable)), batch

  def step(state, batch, norms=True):
    del norms  # The norms ride the owners' update; they cost no extra pass here.
    state, rows = run(*prepare(state, batch))
    totals = jnp.sum(replicated(rows), axis=0)
    grad_sq, param_sq = totals[1:1 + num_workers], totals[1 + num_workers:]
    return state, {"loss": totals[0], "grad_norm": jnp.sqrt(jnp.sum(grad_sq)),
                   "grad_norm_per_stage": jnp.sqrt(grad_sq),
                   "param_norm": jnp.sqrt(jnp.sum(param_sq))}

  return executor_lib.Executor(
      init=lambda params, model_state=None: init_state(staged, params, tx, rule=rule, mesh=mesh,
                                                       model_state=model_state),
      step=step, variables=lambda state: variables(state, staged),
      lower=lambda state, batch: run.lower(*prepare(state, batch)), plan=plan)
