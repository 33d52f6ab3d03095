"""The CDP update rules as one pure-functional JAX train step.

Worker ``i`` differentiates its micro-batch loss at its own mixed view
``theta~_i^j = theta^j_{t - d[i, j]}``; gradients are averaged per stage with one
all-reduce per stage (a flat bucket; or by collective-permutes, `_permuted_psum`), and
one optimizer update is applied to ``theta_t``. The state carries ``theta_t`` and the ``D`` stale versions the rule
reads, so ``dp``, ``cdp-v1``, ``cdp-v2`` and any delay matrix with entries in
``0..D`` are the same code. A fixed matrix is a compile-time constant (a stage
all workers read at one version needs no select); a ``schedule.DelayRule``'s
per-step matrix is an input of the compiled step, so it may change every step.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import compensation, compiled, schedule
from cdpjax import executor as executor_lib
from cdpjax.executed.device import TPU_TILE

BACKENDS = ("shard_map", "pmap")
REDUCTIONS = ("all-reduce", "permutes")
"""How the engine sums each stage's gradient over the workers (`make_train_step`)."""


CyclicState = executor_lib.State
"""The engine's state: `executor.State` with flax trees (the portable form)."""


def init_state(params, tx: optax.GradientTransformation, *, rule,
               model_state=None) -> CyclicState:
  """Builds the state at ``t = 0``; every stale version is ``theta_0``.

  Args:
    params: ``theta_0``.
    tx: the optimizer.
    rule: a rule name of ``schedule.RULES``, an explicit delay matrix or
      their `executor.RulePlan`; it fixes how many stale versions the state
      carries.
    model_state: optional non-trained state (e.g. ``{"batch_stats": ...}``).
  """
  num_stale = (rule.num_stale if isinstance(rule, executor_lib.RulePlan)
               else schedule.max_delay(rule))
  # Real copies: the step donates the state, which must neither delete the
  # caller's arrays nor hold one buffer twice.
  params = jax.tree.map(jnp.array, params)
  stale = tuple(jax.tree.map(jnp.array, params) for _ in range(num_stale))
  return CyclicState(
      step=jnp.zeros((), jnp.int32), params=params, stale_params=stale,
      opt_state=tx.init(params), model_state=model_state)


def num_stages_of(stage_ids) -> int:
  """``J``: one more than the largest stage id."""
  return 1 + max(int(s) for s in jax.tree.leaves(stage_ids))


def _check_stage_ids(stage_ids, num_stages: int) -> list[int]:
  ids = jax.tree.leaves(stage_ids)
  if not ids:
    raise ValueError("stage_ids has no leaves: give an int stage for every parameter leaf.")
  for s in ids:
    if isinstance(s, (bool, np.bool_)) or int(s) != s or not 0 <= int(s) < num_stages:
      raise ValueError(
          f"Stage id {s!r} is out of range: stage ids must be ints in 0..{num_stages - 1} "
          f"(num_stages = {num_stages}). Use cdpjax.stages.partition to build them.")
  missing = sorted(set(range(num_stages)) - {int(s) for s in ids})
  if missing:
    raise ValueError(
        f"Stages {missing} hold no parameters. Every stage 0..{num_stages - 1} needs at "
        "least one leaf: use fewer stages or cdpjax.stages.partition.")
  return [int(s) for s in ids]


def _bucket_key(leaf) -> tuple:
  return jnp.dtype(leaf.dtype).name


def _permuted_psum(flat, axis_name, num_workers: int):
  """``psum(flat, axis_name)`` of a 1-D ``flat`` by collective-permutes and an all-gather.

  A reduce-scatter in ``N - 1`` steps around the ring of neighbours (each
  device adds its own chunk to the partial sum it receives and passes it on,
  so it ends with the whole sum of one chunk), then an all-gather of the
  chunks: the bytes of a bandwidth-optimal all-reduce. Every device gets the
  same values (each chunk is summed once). By hand because the TPU compiler
  runs collective-permutes asynchronously, beside compute, and all-reduces
  synchronously (BENCHMARKS.md, "Gradient all-reduces against the backward").
  """
  n, size = num_workers, flat.shape[0]
  # Chunks of whole TPU tiles: the compiler then keeps the J all-gathers apart and runs more
  # permutes beside compute (bench_overlap: 10 of 28 against 3, and 2 all-gathers).
  chunks = jnp.pad(flat, (0, -size % (n * TPU_TILE))).reshape(n, -1)
  me = jax.lax.axis_index(axis_name)
  to_next = [(i, (i + 1) % n) for i in range(n)]
  total = chunks[(me - 1) % n]  # After step k: the sum of chunk me-k-2 over devices me-k-1..me.
  for k in range(n - 1):
    total = jax.lax.ppermute(total, axis_name, to_next) + chunks[(me - k - 2) % n]
  return jax.lax.all_gather(total, axis_name, tiled=True)[:size]  # Device d holds chunk d.


def _reduce_by_stage(grads, stage_of_leaf, num_stages, extras, axis_name, num_workers,
                     reduction: str = "all-reduce"):
  """Means ``grads`` and ``extras`` over workers with one psum per (stage, dtype).

  ``extras`` (the loss, model state) ride in the last stage's bucket, so a
  float32 model issues exactly ``J`` all-reduces; with ``reduction="permutes"``
  each bucket is summed by `_permuted_psum` instead. Returns the reduced
  ``(grads, extras)``.
  """
  g_leaves, g_def = jax.tree.flatten(grads)
  x_leaves, x_def = jax.tree.flatten(extras)
  buckets: dict[tuple, list] = {}  # (stage, dtype) -> [(kind, index, leaf)]
  for k, leaf in enumerate(g_leaves):
    buckets.setdefault((stage_of_leaf[k], _bucket_key(leaf)), []).append(("g", k, leaf))
  for k, leaf in enumerate(x_leaves):
    buckets.setdefault((num_stages - 1, _bucket_key(leaf)), []).append(("x", k, leaf))
  g_out, x_out = [None] * len(g_leaves), [None] * len(x_leaves)
  for (stage, _), items in sorted(buckets.items()):
    # Scaled before packing, so the scaling fuses into the copy into the bucket.
    flat = jnp.concatenate([jnp.ravel(leaf) / num_workers for _, _, leaf in items])
    flat = (jax.lax.psum(flat, axis_name) if reduction == "all-reduce"
            else _permuted_psum(flat, axis_name, num_workers))
    offset = 0
    for kind, k, leaf in items:
      part = flat[offset:offset + leaf.size].reshape(leaf.shape)
      offset += leaf.size
      if kind == "g":
        g_out[k] = part
      else:
        x_out[k] = part
  return jax.tree.unflatten(g_def, g_out), jax.tree.unflatten(x_def, x_out)


def _is_none(x) -> bool:
  return x is None


def stale_depths(delays, stage_of_leaf, num_stale: int, predict: bool = False) -> list[int]:
  """Per parameter leaf, how many stale versions some worker reads: ``max_i d[i, stage]``.

  A leaf whose stage every worker reads fresh keeps no stale copy. With delays
  that are data (``delays is None``) every leaf keeps all ``num_stale``. With
  weight prediction (`executor.RulePlan`) a stage read stale keeps one more.
  """
  if delays is None:
    return [num_stale] * len(stage_of_leaf)
  deepest = np.max(delays, axis=0, initial=0)
  deepest = deepest + (deepest > 0) * bool(predict)
  return [int(deepest[stage]) for stage in stage_of_leaf]


def _read(ages, k: int, age: int, predict: bool):
  """Leaf ``k`` as a worker ``age`` steps stale reads it: ``theta_{t-age}``, or with weight
  prediction ``theta_{t-age} + age * (theta_{t-age} - theta_{t-age-1})``."""
  leaf = ages[age][k]
  if not predict or age == 0:
    return leaf
  return compensation.predicted(leaf, ages[age + 1][k], age)


def _version_leaves(state) -> list[list]:
  """``[theta_t, theta_{t-1}, ...]`` as leaf lists in ``params`` order; ``None`` where not kept."""
  return [jax.tree.leaves(tree, is_leaf=_is_none)
          for tree in (state.params,) + tuple(state.stale_params)]


def _worker_view(ages, stage_of_leaf, delays, axis_name, given=None, predict=False):
  """This worker's parameter leaves: the leaf of stage ``j`` taken from age ``d[i, j]``.

  ``ages[a]`` holds the leaves of ``theta_{t-a}``; ``given`` (``{leaf: view}``)
  the leaves a scan carries ready-made (`_carried_view_body`). The result is
  marked varying over ``axis_name``, so its gradient is this worker's own (a
  replicated input's gradient would come back already summed).

  A select per leaf costs cdp-v2 three parameter sizes of traffic a step, yet
  it stays: a ``lax.switch`` reading in place and an arithmetic blend were each
  no faster or held more memory (docs/design_notes.md, "What was tried in the
  code").
  """
  row = jnp.asarray(delays)[jax.lax.axis_index(axis_name)]
  view = []
  for k, stage in enumerate(stage_of_leaf):
    if given and k in given:
      view.append(given[k])
      continue
    column = sorted(set(delays[:, stage].tolist()))
    leaf = jax.lax.pcast(_read(ages, k, column[0], predict), axis_name, to="varying")
    for age in column[1:]:  # No select where every worker reads the same version.
      leaf = jnp.where(row[stage] == age, _read(ages, k, age, predict), leaf)
    view.append(leaf)
  return view


def _dynamic_worker_view(ages, stage_of_leaf, delays_NxJ, axis_name, predict=False):
  """``_worker_view`` for a delay matrix that is data: ``D`` selects per leaf.

  ``delays_NxJ`` is a traced int32 array, so the step serves every matrix with
  entries in ``0..D`` without recompiling.
  """
  row = delays_NxJ[jax.lax.axis_index(axis_name)]
  view = []
  for k, stage in enumerate(stage_of_leaf):
    leaf = jax.lax.pcast(ages[0][k], axis_name, to="varying")
    for age in range(1, len(ages) - bool(predict)):  # With prediction the last is for reads.
      leaf = jnp.where(row[stage] == age, _read(ages, k, age, predict), leaf)
    view.append(leaf)
  return view


class _Slots(NamedTuple):
  """Where each parameter version lives while steps run: rotating buffers, no copies.

  Leaf ``l`` with ``m = depths[l]`` stale versions has ``m + 1`` buffers,
  slots ``0..m`` (``CyclicState.params`` is slot 0, ``stale_params[s - 1]``
  slot ``s``). After ``phase`` steps from the state's order, age ``a``
  (``theta_{t-a}``) is in slot ``(a - phase) % (m + 1)``, and a step writes
  ``theta_{t+1}`` into the slot of the oldest version, which no one reads
  again. Donation pairs each output with the input in the same position, so
  every buffer is updated in place: returning ``(theta_{t+1}, theta_t, ...)``
  in the state's order would make XLA copy each version into its neighbour's
  buffer, about ``D + 1`` parameter copies per step.
  """
  depths: tuple[int, ...]
  rotate: bool

  def slot(self, leaf: int, age: int, phase: int) -> int:
    m = self.depths[leaf]
    return (age - phase) % (m + 1) if self.rotate else age

  def ages(self, slots: list[list], phase: int) -> list[list]:
    """``ages[a][l]``: the leaf of ``theta_{t-a}`` (``None`` beyond its depth)."""
    return [[slots[self.slot(l, a, phase)][l] if a <= m else None
             for l, m in enumerate(self.depths)] for a in range(len(slots))]

  def advance(self, slots: list[list], new_leaves: list, phase: int) -> list[list]:
    """The slots after a step at ``phase`` that produced ``theta_{t+1}`` = ``new_leaves``."""
    out = [list(s) for s in slots]
    for l, m in enumerate(self.depths):
      if self.rotate:
        out[self.slot(l, m, phase)][l] = new_leaves[l]
      else:  # Every version moves to the next slot (XLA copies them).
        for a in range(m, 0, -1):
          out[a][l] = slots[a - 1][l]
        out[0][l] = new_leaves[l]
    return out


def _with_versions(state, version_leaves: list[list], treedef) -> "CyclicState":
  trees = [jax.tree.unflatten(treedef, leaves) for leaves in version_leaves]
  return state._replace(params=trees[0], stale_params=tuple(trees[1:]))


def _norms(want, grads, params, stage_of_leaf, num_stages: int) -> dict:
  """Per-stage gradient norms and the parameter norm, computed only when ``want`` is true.

  Each is a pass over the parameters, which costs a memory-bound model like
  the residual MLP a tenth of its step; skipped, they are NaN.
  """

  def compute(grads, params):
    sq = [jnp.zeros((), jnp.float32) for _ in range(num_stages)]
    for leaf, stage in zip(jax.tree.leaves(grads), stage_of_leaf):
      sq[stage] = sq[stage] + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    sq = jnp.stack(sq)
    return {"grad_norm": jnp.sqrt(jnp.sum(sq)), "grad_norm_per_stage": jnp.sqrt(sq),
            "param_norm": optax.tree.norm(params).astype(jnp.float32)}

  def skip(grads, params):
    del grads, params
    nan = jnp.full((), jnp.nan, jnp.float32)
    return {"grad_norm": nan, "grad_norm_per_stage": jnp.full((num_stages,), jnp.nan, jnp.float32),
            "param_norm": nan}

  return jax.lax.cond(want, compute, skip, grads, params)


def worker_views(state: CyclicState, stage_ids, delays) -> list:
  """Each worker's model: stage ``j`` of worker ``i`` is ``theta^j_{t - d[i, j]}``.

  These are the models the ranks of the authors' code hold at the end of
  training (a stale stage holds the previous version). ``delays`` is the
  ``(N, J)`` matrix of the step that would come next (``rule(t)`` for a
  ``schedule.DelayRule``, the rule's matrix otherwise).
  """
  delays = np.asarray(delays)
  if delays.max(initial=0) > len(state.stale_params):
    raise ValueError(
        f"delays reach {delays.max()} but the state keeps {len(state.stale_params)} stale "
        "versions: pass the delay matrix of the rule the state was built for.")
  versions = _version_leaves(state)  # None where a stage keeps no such version.
  ids, treedef = jax.tree.flatten(stage_ids)
  views = []
  for row in delays:
    leaves = [versions[int(row[s])][k] for k, s in enumerate(ids)]
    if any(x is None for x in leaves):
      raise ValueError("The state keeps no such version of a stage these delays read: pass the "
                       "delay matrix of the rule the state was built for.")
    views.append(jax.tree.unflatten(treedef, leaves))
  return views


def mean_worker_view(state: CyclicState, stage_ids, delays):
  """The authors' final model: the mean over workers of ``worker_views``.

  For ``cdp-v1`` it is ``theta_{t-1}``; for ``dp`` it is ``theta_t``.
  """
  delays = np.asarray(delays)
  weights = [np.mean(delays == k, axis=0) for k in range(1 + len(state.stale_params))]

  def mix(stage, *versions):  # Sum over versions k of (share of workers reading k) * theta_k.
    return sum(float(w[stage]) * v for w, v in zip(weights, versions) if w[stage])
  return jax.tree.map(mix, stage_ids, *state.versions)


def _placed(tree, sharding):
  """``tree`` on ``sharding``; a no-op check when it already is (every step after the first)."""
  # Equivalence, not equality: a shard_map output with out_specs=P() comes back
  # as P(None, ...), which is the same placement but does not compare equal.
  # Abstract inputs (jax.ShapeDtypeStruct, e.g. for compiling ahead of time
  # for devices this host does not have) are lowered as they are.
  if all(isinstance(x, jax.ShapeDtypeStruct)
         or isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)
         for x in jax.tree.leaves(tree)):
    return tree
  return jax.device_put(tree, sharding)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """A compiled train step: ``state, metrics = step(state, batch)``.

  ``init(params, model_state=None)`` builds the state at ``t = 0`` with only
  the stale versions this rule reads; ``lower(state, batch)`` gives the lowered
  program (for StableHLO, memory and cost inspection) after the same input
  checks and placement.

  ``step(state, batch, norms=False)`` skips the gradient and parameter norms
  (NaN in the metrics): a trainer asks for them on the steps it logs. The flag
  is data, so either way runs the same compiled program.

  With a ``schedule.DelayRule``, ``step(state, batch, delays)`` takes the step's
  ``(N, J)`` matrix (``(K, N, J)`` with ``scan_steps=K``) as data. Without
  ``delays`` it reads them from the rule at the state's step: the step of a
  state this ``TrainStep`` returned is known on the host, so only a foreign
  state costs a device-to-host read of ``state.step``.

  The state this step last returned (the same arrays in the same tree) is
  neither checked nor placed again: it is the program's output, placed by its
  ``out_shardings`` with the versions the rule reads.
  """
  run: Callable
  prepare: Callable
  finish: Callable
  init: Callable
  rule: Any = None
  scan_steps: int | None = None
  _host_step: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _returned: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def is_returned(self, state) -> bool:
    """Whether ``state`` holds exactly the arrays of the state this step last returned."""
    refs = self._returned.get("refs")
    if refs is None:
      return False
    leaves, treedef = jax.tree.flatten(state)
    return (treedef == self._returned["treedef"] and len(leaves) == len(refs)
            and all(ref() is x for ref, x in zip(refs, leaves)))

  def _remember(self, state) -> None:
    # Weak references: a state the caller drops is not kept alive here.
    leaves, treedef = jax.tree.flatten(state)
    self._returned.update(treedef=treedef, refs=[weakref.ref(x) for x in leaves])

  def _step_of(self, state) -> int:
    if self._host_step.get("array") is state.step:
      return self._host_step["step"]
    return int(jax.device_get(state.step))

  def _check_delays(self, delays) -> np.ndarray:
    delays = np.asarray(delays)
    shape = (self.rule.num_workers, self.rule.num_stages)
    if self.scan_steps is not None:
      shape = (self.scan_steps,) + shape
    if delays.shape != shape:
      raise ValueError(
          f"delays have shape {delays.shape}; this step needs {shape} (one "
          "(num_workers, num_stages) matrix per step).")
    if delays.size and (delays.min() < 0 or delays.max() > self.rule.max_delay):
      raise ValueError(
          f"delays must lie in 0..{self.rule.max_delay} (the rule's max_delay: the state keeps "
          f"that many stale versions); got {delays.min()}..{delays.max()}.")
    return delays.astype(np.int32)

  def __call__(self, state, batch, delays=None, *, norms=True):
    placed = self.is_returned(state)
    if self.rule is None:
      if delays is not None:
        raise ValueError("This step's delays are fixed; pass delays only with a schedule.DelayRule.")
      new_state, metrics = self.finish(*self.run(*self.prepare(state, batch, norms,
                                                               placed=placed)))
    else:
      count = self.scan_steps or 1
      step = None
      if delays is None:
        step = self._step_of(state)
        delays = self.rule.window(step, count) if self.scan_steps else self.rule(step)
      new_state, metrics = self.finish(*self.run(*self.prepare(
          state, batch, norms, self._check_delays(delays), placed=placed)))
      if step is not None:  # Spares the next call a device-to-host read of the step.
        self._host_step.update(array=new_state.step, step=step + count)
    self._remember(new_state)
    return new_state, metrics

  def lower(self, state, batch, delays=None, *, norms=True):
    if self.rule is None:
      return self.run.lower(*self.prepare(state, batch, norms))
    if delays is None:
      count = self.scan_steps or 1
      delays = self.rule.window(0, count) if self.scan_steps else self.rule(0)
    return self.run.lower(*self.prepare(state, batch, norms, self._check_delays(delays)))


class _Rule(NamedTuple):
  """The run's plan of the rule (`executor.RulePlan`) and where its versions live per leaf."""
  plan: executor_lib.RulePlan
  num_workers: int
  num_stages: int
  stage_of_leaf: list[int]
  slots: _Slots

  @property
  def dynamic(self) -> bool:
    """Whether the delays are data (a ``schedule.DelayRule``): a new matrix every step."""
    return self.plan.delays is None

  @property
  def delays(self) -> np.ndarray | None:
    """``(N, J)``; None when the delays are data."""
    return self.plan.delays

  @property
  def num_stale(self) -> int:
    return self.plan.num_stale


def _resolve_rule(rule, stage_ids, num_workers: int, rotate: bool) -> _Rule:
  """``rule`` (or its plan) with the leaf layout of ``stage_ids``."""
  given = rule.rule if isinstance(rule, executor_lib.RulePlan) else rule
  if isinstance(given, schedule.DelayRule):
    if given.num_workers != num_workers:
      raise ValueError(
          f"The delay rule is for {given.num_workers} workers but the mesh has {num_workers}: "
          f"build the rule with num_workers={num_workers}.")
    num_stages = given.num_stages
  elif isinstance(given, str):
    num_stages = num_stages_of(stage_ids) if jax.tree.leaves(stage_ids) else 1
  else:
    num_stages = int(np.shape(given)[1]) if np.ndim(given) == 2 else 0
  plan = executor_lib.resolve(rule, "data", num_workers, num_stages)
  stage_of_leaf = _check_stage_ids(stage_ids, num_stages)
  depths = tuple(stale_depths(plan.delays, stage_of_leaf, plan.num_stale, plan.predict))
  return _Rule(plan, num_workers, num_stages, stage_of_leaf, _Slots(depths, rotate))


def _tied_backward(staged, view, model_state, batch, reduce_stage):
  """``(loss, new model state, reduced grads)`` of one worker, stage by stage (``staged``).

  The forward runs the stages in order, keeping each one's vjp (residuals, as
  ``jax.value_and_grad`` keeps them: nothing is recomputed); the backward runs
  them in reverse, and ``reduce_stage(j, leaves, extras)`` reduces stage ``j``'s
  gradient leaves right after its backward; the cotangent handed to stage
  ``j - 1`` leaves an ``optimization_barrier`` with them, so the compiler can
  neither merge the ``J`` all-reduces nor move them after the backward. The loss
  and the new model state ride in the last stage's reduction (``extras``).
  """
  x, labels = batch["image"], batch["label"]
  state_of = lambda j: staged.stage_state_flat(j, model_state)
  h = jnp.zeros((staged.act_size(jax.ShapeDtypeStruct(x.shape, x.dtype)),), jnp.float32)
  vjps, losses, new_states = [], [], []
  for j in range(staged.num_stages):
    def stage(p, h, j=j):
      h_out, loss, new_state = staged.apply(j, p, state_of(j), h, x, labels)
      return (h_out, loss), new_state
    (h, loss), vjp, new_state = jax.vjp(stage, staged.stage_params_flat(j, view), h,
                                        has_aux=True)
    vjps.append(vjp)
    losses.append(loss)  # The last stage's; 0 (a constant) before it.
    new_states.append(new_state)
  new_model_state = staged.model_state_tree(new_states) if model_state is not None else None
  cot, grads, extras = jnp.zeros_like(h), {}, (loss, new_model_state)
  for j in reversed(range(staged.num_stages)):
    grad_P, cot = vjps[j]((cot, jnp.ones_like(losses[j])))
    leaves, extras_j = reduce_stage(j, staged.stage_params_tree(j, grad_P),
                                    extras if j == staged.num_stages - 1 else ())
    if j == staged.num_stages - 1:
      extras = extras_j
    cot, _ = jax.lax.optimization_barrier((cot, leaves))
    grads.update(leaves)
  loss, new_model_state = extras
  return loss, new_model_state, grads


def _one_step_fn(loss_fn, tx, r: _Rule, axis_name: str, with_model_state: bool,
                 sharded: bool = False, staged=None, reduction: str = "all-reduce"):
  """``one_step(state_in_slots, phase, batch, delays_NxJ) -> (state_in_slots, metrics)``,
  and ``step_of``, the same step that also returns ``theta_t``'s leaves and
  their update (for `_carried_view_body`), with the slots and views it is given.

  ``sharded``: the state is sharded inside each worker, over the mesh's other
  axes, which the ``shard_map`` leaves to the compiler. The worker's view is gathered there before the loss reads
  it, the reduced gradients are split back, and the new state leaves sharded
  as it came (explicit axes type a scan carry by its sharding).
  """
  def one_step(state: CyclicState, phase: int, batch, want_norms, delays_NxJ=None):
    new_state, metrics, _ = step_of(state, phase, batch, want_norms, delays_NxJ)
    if not sharded:
      return new_state, metrics
    return jax.tree.map(_resharded_like, new_state, state), metrics

  def step_of(state: CyclicState, phase: int, batch, want_norms, delays_NxJ=None, *,
              slots=r.slots, given=None):
    """The step, and the leaves of ``theta_t`` and of its update."""
    treedef = jax.tree.structure(state.params, is_leaf=_is_none)
    ages = slots.ages(_version_leaves(state), phase)
    if r.dynamic:
      view = _dynamic_worker_view(ages, r.stage_of_leaf, delays_NxJ, axis_name, r.plan.predict)
    else:
      view = _worker_view(ages, r.stage_of_leaf, r.delays, axis_name, given, r.plan.predict)
    view = jax.tree.unflatten(treedef, view)
    model_state = state.model_state
    if sharded:  # Gathered in the worker: its gradients (and new model state) come out whole.
      view, model_state = jax.tree.map(lambda x: jax.sharding.reshard(x, P()),
                                       (view, model_state))
    fresh = None
    if r.plan.dc_lambda:
      fresh = [jax.lax.pcast(x, axis_name, to="varying") for x in ages[0]]
      if sharded:  # Gathered as the view is.
        fresh = [jax.sharding.reshard(x, P()) for x in fresh]
      fresh = jax.tree.unflatten(treedef, fresh)

    def reduce(grads, stage_of_leaf, extras, fresh, view):
      """DC-ASGD's correction, g + lambda g^2 (theta_t - theta_read) per worker, then the
      mean over workers, one psum per stage (extras in the last stage's)."""
      if fresh is not None:
        grads = jax.tree.map(lambda g, t, v: compensation.dc_corrected(g, t, v, r.plan.dc_lambda),
                             grads, fresh, view)
      return _reduce_by_stage(grads, stage_of_leaf, r.num_stages, extras, axis_name,
                              r.num_workers, reduction)

    if staged is not None:  # Each stage reduced right after its backward (`_tied_backward`).
      def reduce_stage(j, grads, extras):  # ``grads``: stage j's units.
        units = lambda tree: None if tree is None else {u: tree[u] for u in grads}
        return reduce(grads, [j] * len(jax.tree.leaves(grads)), extras, units(fresh),
                      units(view))
      loss, model_state, grads = _tied_backward(staged, view, model_state, batch, reduce_stage)
      grads = jax.tree.unflatten(treedef, jax.tree.leaves(grads))  # Both in sorted-key order.
    else:
      if with_model_state:
        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            view, model_state, batch)
      else:
        loss, grads = jax.value_and_grad(loss_fn)(view, batch)
      grads, (loss, model_state) = reduce(grads, r.stage_of_leaf, (loss, model_state), fresh,
                                          view)
    current = jax.tree.unflatten(treedef, ages[0])
    if sharded:
      grads = jax.tree.map(_resharded_like, grads, current)
    updates, opt_state = tx.update(grads, state.opt_state, current)
    if r.plan.lr_delay_scale:  # A delay-aware learning rate: 1 / (1 + c * mean_i d[i, j]).
      scale = compensation.lr_scale(delays_NxJ if r.dynamic else r.delays, state.step,
                                    r.plan.lr_delay_scale)
      updates = jax.tree.unflatten(treedef, [u * scale[stage].astype(u.dtype) for u, stage in zip(
          jax.tree.leaves(updates), r.stage_of_leaf)])
    params = optax.apply_updates(current, updates)
    metrics = {"loss": loss, **_norms(want_norms, grads, params, r.stage_of_leaf, r.num_stages)}
    if r.dynamic:
      metrics["mean_delay"] = jnp.mean(delays_NxJ.astype(jnp.float32))
    slots = slots.advance(_version_leaves(state), jax.tree.leaves(params), phase)
    state = _with_versions(state, slots, treedef)._replace(
        step=state.step + 1, opt_state=opt_state, model_state=model_state)
    return state, metrics, (ages[0], jax.tree.leaves(updates))

  return one_step, step_of


def _resharded_like(x, like):
  """``x`` with the sharding of ``like`` over the axes inside a worker (in ``shard_map``)."""
  return jax.sharding.reshard(x, jax.typeof(like).sharding.spec)


def _body_fn(one_step, scan_steps: int | None):
  """The program: one step, or ``K`` steps in a ``lax.scan``."""
  if scan_steps is None:
    return lambda state, batch, want_norms, *delays: one_step(state, 0, batch, want_norms, *delays)

  def body(state, batches, want_norms, *delays):
    return jax.lax.scan(lambda s, xs: one_step(s, 0, *xs), state,
                        (batches, want_norms) + delays)

  return body


def _carried_leaves(r: _Rule, scan_steps: int | None, within, backend: str) -> tuple[bool, ...]:
  """The leaves whose worker views a scan carries (`_carried_view_body`); none where it does not.

  In a ``shard_map`` scan of a fixed rule with one stale version, the leaves
  some workers read fresh and others stale; elsewhere (one step per call,
  general staleness, delays that are data, a worker sharded inside, pmap) the
  versions rotate or shift as `_Slots` says.
  """
  if scan_steps is None or r.dynamic or r.num_stale != 1 or within or backend != "shard_map":
    return (False,) * len(r.stage_of_leaf)
  return tuple(len(set(r.delays[:, stage].tolist())) > 1 for stage in r.stage_of_leaf)


def _carried_view_body(step_of, r: _Rule, axis_name: str, scan_steps: int, carried):
  """``K`` steps that carry each worker's view of the ``carried`` leaves instead of ``theta_{t-1}``.

  A scan's carry keeps each buffer in its place, so the versions cannot
  rotate: the per-worker select of a leaf some workers read stale writes a view
  beside both versions, and shifting ``theta_t`` into the stale slot copies it,
  so cdp-v2's extra peak over dp exceeded its stale bytes. Instead the stale
  slot carries the view: once the update is known, the view of step ``t+1``
  (``theta_t`` where the worker reads stale, ``theta_{t+1}`` where fresh) is
  written over the view of step ``t``, which the gradients no longer need.
  After the last step every worker writes ``theta_t`` there, so the call
  returns the state's usual versions, equal on all workers.

  ``theta_{t+1}`` is recomputed as ``optax.apply_updates`` does (same
  rounding), from ``theta_t`` and the update, so XLA can write the view before
  ``theta_{t+1}`` overwrites ``theta_t`` in place; reading the new parameters
  instead made it keep a third version at small sizes. The final view is
  typed varying over the workers though it is the same on each, so the
  ``shard_map`` of this body is built with ``check_vma=False`` (JAX 0.10 has
  no varying-to-invariant cast).
  """
  in_scan = _Slots(tuple(0 if c else m for c, m in zip(carried, r.slots.depths)), False)
  keys = [k for k, c in enumerate(carried) if c]

  def next_view(fresh, updates, last):  # theta_{t+1-d[i, j]}; theta_t after the last step.
    row = jnp.asarray(r.delays)[jax.lax.axis_index(axis_name)]
    views = []
    for k in keys:
      reads_fresh = (row[r.stage_of_leaf[k]] == 0) & ~last
      # The update this view takes: not the update's own sum, which XLA would merge
      # with this one (the view would then wait for theta_{t+1}, which could no
      # longer overwrite theta_t). An optimization_barrier did as well on the CPU
      # but held more on the TPU.
      update = jnp.where(reads_fresh, updates[k], 0)
      views.append(jnp.where(reads_fresh, (fresh[k] + update).astype(fresh[k].dtype), fresh[k]))
    return views

  def body(state, batches, want_norms):
    treedef = jax.tree.structure(state.params, is_leaf=_is_none)
    versions = _version_leaves(state)
    view = _worker_view(r.slots.ages(versions, 0), r.stage_of_leaf, r.delays, axis_name)
    versions[1] = [None if c else x for c, x in zip(carried, versions[1])]
    state = _with_versions(state, versions, treedef)

    def step(carry, xs):
      state, view = carry
      *xs, i = xs
      state, metrics, (fresh, updates) = step_of(state, 0, *xs, slots=in_scan,
                                                 given=dict(zip(keys, view)))
      return (state, next_view(fresh, updates, i == scan_steps - 1)), metrics

    carry = (state, [view[k] for k in keys])
    (state, view), metrics = jax.lax.scan(step, carry, (batches, want_norms, jnp.arange(scan_steps)))
    versions = _version_leaves(state)
    for k, v in zip(keys, view):
      versions[1][k] = v
    return _with_versions(state, versions, treedef), metrics

  return body


def _init_fn(tx, r: _Rule):
  """``init(params, model_state=None)``: the state at ``t = 0`` with only the versions read."""

  def init(params, model_state=None) -> CyclicState:
    # Real copies: the step donates the state, which must neither delete the
    # caller's arrays nor hold one buffer twice.
    leaves, treedef = jax.tree.flatten(params)
    versions = [[jnp.array(x) if a <= m else None for x, m in zip(leaves, r.slots.depths)]
                for a in range(r.num_stale + 1)]
    current = jax.tree.unflatten(treedef, versions[0])
    return CyclicState(step=jnp.zeros((), jnp.int32), params=current,
                       stale_params=tuple(jax.tree.unflatten(treedef, v) for v in versions[1:]),
                       opt_state=tx.init(current), model_state=model_state)

  return init


def _kept_versions(state: CyclicState, r: _Rule) -> CyclicState:
  """``state`` keeping the stale leaves this rule reads (it may hold more: ``init_state``'s).

  ValueError naming the fix for a state built for a rule that reads fewer versions.
  """
  if len(state.stale_params) != r.num_stale:
    raise ValueError(
        f"The state keeps {len(state.stale_params)} stale parameter versions but this rule "
        f"reads {r.num_stale}: build the state for this rule, with step.init(params) or "
        "engine.init_state(params, tx, rule=...), or resume from a checkpoint of the same rule.")
  versions = _version_leaves(state)
  needed = [[x if a <= m else None for x, m in zip(leaves, r.slots.depths)]
            for a, leaves in enumerate(versions)]
  if any(x is None for a, leaves in enumerate(needed) for x, m in zip(leaves, r.slots.depths)
         if a <= m):
    raise ValueError(
        "The state lacks stale parameters this rule reads (it was built for a rule where fewer "
        "stages are stale): build it with step.init(params) or engine.init_state(params, tx, "
        "rule=...) for this rule.")
  return _with_versions(state, needed, jax.tree.structure(state.params, is_leaf=_is_none))


def make_train_step(
    loss_fn: Callable, tx: optax.GradientTransformation, *, stage_ids, rule,
    mesh: Mesh, axis_name: str = "data", backend: str = "shard_map",
    with_model_state: bool = False, scan_steps: int | None = None,
    donate: bool = True, staged=None, gradient_reduction: str = "all-reduce") -> TrainStep:
  """Builds the CDP train step over the mesh axis ``axis_name``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of one
      worker's micro-batch; with ``with_model_state``,
      ``loss_fn(params, model_state, batch) -> (scalar, new_model_state)``.
      New model states are averaged over workers (BatchNorm statistics).
    tx: any optax ``GradientTransformation``.
    stage_ids: the structure of ``params`` with an int stage on every leaf.
    rule: a name of ``schedule.RULES`` or an ``(N, J)`` delay matrix (static:
      a stage every worker reads at the same version needs no select, and a
      stage no worker reads stale keeps no stale copy), or a
      ``schedule.DelayRule`` whose per-step matrix is an input of the compiled
      step (``D`` selects per leaf; any matrix in ``0..D``, no recompiling).
    mesh: a mesh with axis ``axis_name`` of size ``N`` (the workers). Its
      other axes, if any, are inside a worker: a worker is a group of devices
      (``jax.make_mesh((N, F), ("data", "fsdp"))``) over which its state is
      sharded and its rows are split; the numbers are the 1-D mesh's.
    axis_name: the mesh axis of the workers.
    backend: ``"shard_map"`` (primary) or ``"pmap"``; same numbers.
    with_model_state: whether ``loss_fn`` takes and returns a model state.
    scan_steps: if set to ``K``, one call runs ``K`` steps with ``lax.scan``;
      batch leaves then have shape ``[K, N * b, ...]`` and metrics gain a
      leading ``K`` axis.
    donate: donate the input state's buffers to the output state.
    staged: the model of ``loss_fn`` cut into the stages of ``stage_ids``
      (`cdpjax.executed.staged.StagedModel`, the same loss), or None. Given,
      a worker's backward runs stage by stage and each stage's gradient is
      all-reduced right after that stage's backward, which the next waits for
      (the tied backward, `_tied_backward`): the ``J`` all-reduces stay apart
      over the backward, where the TPU compiler otherwise merges them into one
      after it (BENCHMARKS.md, "Gradient all-reduces against the backward").
      Same numbers; a flax model with dict params, a 1-D mesh.
    gradient_reduction: ``"all-reduce"`` (one ``psum`` per stage) or
      ``"permutes"``: each stage's sum by collective-permutes around the ring
      of workers and an all-gather (`_permuted_psum`, the same bytes), which
      the TPU compiler runs beside the backward where it runs all-reduces
      after it, synchronously (BENCHMARKS.md, "Gradient all-reduces against
      the backward"). The same numbers up to float rounding; a 1-D mesh.

  Returns:
    A ``TrainStep``; ``step(state, batch) -> (state, metrics)`` with metrics
    ``loss`` (mean over workers), ``grad_norm``, ``grad_norm_per_stage`` [J]
    and ``param_norm`` (of the updated parameters, ``theta_{t+1}``); with a
    ``DelayRule``, also ``mean_delay`` (the matrix itself is ``rule(step)``).
    The state it returns keeps only the stale leaves the rule reads
    (``None`` in ``stale_params`` elsewhere).
  """
  if backend not in BACKENDS:
    raise ValueError(f"Unknown backend {backend!r}: use one of {BACKENDS}.")
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)} but no axis {axis_name!r}: build it "
        f"with jax.make_mesh((num_workers,), ({axis_name!r},)) or pass axis_name=.")
  if scan_steps is not None and (int(scan_steps) != scan_steps or scan_steps < 1):
    raise ValueError(f"scan_steps must be a positive int or None, got {scan_steps!r}.")
  # Inside a scan the slots must end where they began, so the versions shift:
  # XLA copies theta_t into each stale leaf's slot once a step (on the CPU with
  # copy insertion's region analysis, `compiled.compiler_options`; three copies
  # a leaf without it). A scan over groups of D + 1 unrolled, rotating steps
  # copies nothing but was slower and held more peak memory. The
  # leaves some workers read fresh and others stale carry each worker's view
  # in the stale slot instead, and copy nothing (`_carried_view_body`).
  r = _resolve_rule(rule, stage_ids, int(mesh.shape[axis_name]), rotate=scan_steps is None)
  within = tuple(a for a in mesh.axis_names if a != axis_name)  # Axes inside a worker.
  if within and backend != "shard_map":
    raise ValueError("The pmap backend needs a 1-D mesh; use backend='shard_map' for more axes.")
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if any(types[a] != jax.sharding.AxisType.Explicit for a in within):
    raise ValueError(
        f"The axes inside a worker {within} must be Explicit (the state's sharding is typed): "
        f"build the mesh with jax.make_mesh(shape, names), or pass "
        "axis_types=(jax.sharding.AxisType.Explicit,) * len(names).")
  if gradient_reduction not in REDUCTIONS:
    raise ValueError(f"Unknown gradient_reduction {gradient_reduction!r}: use one of "
                     f"{REDUCTIONS}.")
  permuted = gradient_reduction == "permutes"
  if permuted and within:
    raise ValueError("gradient_reduction='permutes' sums over a 1-D mesh of workers: use "
                     "devices_per_worker=1, or gradient_reduction='all-reduce'.")
  if staged is not None and within:
    raise ValueError("A tied backward (staged=) runs on a 1-D mesh of workers: use "
                     "devices_per_worker=1, or the engine's own backward.")
  one_step, step_of = _one_step_fn(loss_fn, tx, r, axis_name, with_model_state,
                                    sharded=bool(within), staged=staged,
                                    reduction=gradient_reduction)
  carried = _carried_leaves(r, scan_steps, within, backend)
  if any(carried):
    body = _carried_view_body(step_of, r, axis_name, scan_steps, carried)
  else:
    body = _body_fn(one_step, scan_steps)
  # Unchecked types where a value equal on all workers is typed varying over them: the carried
  # views, and the all-gathered sums (JAX 0.10's public all_gather types its result varying).
  run, place_state, place_batch = _compile(body, r, mesh, axis_name, within, backend, scan_steps,
                                           donate, check_vma=not (any(carried) or permuted))
  prepare = _prepare_fn(r, jax.tree.structure(stage_ids), scan_steps, backend, place_state,
                        place_batch)
  count = scan_steps or 1

  def finish(state, metrics):
    treedef = jax.tree.structure(state.params, is_leaf=_is_none)
    return _with_versions(state, r.slots.ages(_version_leaves(state), count), treedef), metrics

  return TrainStep(run=run, prepare=prepare, finish=finish, init=_init_fn(tx, r),
                   rule=r.plan.rule if r.dynamic else None, scan_steps=scan_steps)


def _compile(body, r: _Rule, mesh, axis_name, within, backend, scan_steps, donate,
             check_vma=True):
  """The jitted (or pmapped) program, and functions that place its state and batch."""
  donate_argnums = (0,) if donate else ()
  delay_specs = (P(),) if r.dynamic else ()
  if backend == "shard_map" and within:
    return _compile_sharded(body, mesh, axis_name, within, scan_steps, delay_specs,
                            donate_argnums)
  if backend == "shard_map":  # (jax.pmap takes no compiler options: pmap compiles without.)
    batch_spec = P(axis_name) if scan_steps is None else P(None, axis_name)
    replicated = NamedSharding(mesh, P())
    # out_shardings: the state comes back placed exactly as it went in (the
    # shard_map alone returns P(None, ...)), so the next call neither re-places
    # it nor compiles again.
    run = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec, P()) + delay_specs,
                      out_specs=(P(), P()), check_vma=check_vma),
        out_shardings=(replicated, replicated), donate_argnums=donate_argnums,
        compiler_options=compiled.compiler_options(mesh))
    batch_sharding = NamedSharding(mesh, batch_spec)
    return (run, lambda state: _placed(state, replicated),
            lambda batch: _placed(batch, batch_sharding))
  run = jax.pmap(body, axis_name, in_axes=(None, 0, None) + (None,) * len(delay_specs),
                 out_axes=None,
                 devices=list(mesh.devices.flat), donate_argnums=donate_argnums)
  return run, None, None


def _compile_sharded(body, mesh, axis_name, within, scan_steps, delay_specs, donate_argnums):
  """The step with its state sharded inside each worker, over the axes ``within``.

  Only the worker axis is manual in the ``shard_map``; the compiler partitions
  a worker's step over ``within`` (Explicit mesh axes), so any optax optimizer (a
  global-norm clip included) and any loss run as written, and the state keeps
  the 1-D engine's pytree. A worker's gradients are summed inside it by the
  compiler, then reduced over the workers by one ``psum`` per stage as on a
  1-D mesh. Every state leaf is split along its first dimension that
  ``within`` divides (replicated if none does); a worker's rows are split over
  ``within`` where they divide.
  """
  size = int(np.prod([mesh.shape[a] for a in within], dtype=int))
  split = within if len(within) > 1 else within[0]
  lead = (None,) * (0 if scan_steps is None else 1)
  rows_per_split = int(mesh.shape[axis_name]) * size

  def state_spec(shape):
    for k, n in enumerate(shape):
      if n and n % size == 0:
        return P(*(None,) * k, split)
    return P()

  def batch_spec(shape):  # Worker i's rows i*b:(i+1)*b, split inside the worker.
    if shape[len(lead)] % rows_per_split == 0:
      return P(*lead, (axis_name,) + within)
    return P(*lead, axis_name)

  def place(tree, spec_of):
    return jax.tree.map(lambda x: _placed(x, NamedSharding(mesh, spec_of(jnp.shape(x)))), tree)

  run = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=(P(), P(*lead, axis_name), P()) + delay_specs,
                    out_specs=(P(), P()), axis_names={axis_name}),
      donate_argnums=donate_argnums, compiler_options=compiled.compiler_options(mesh))
  return run, lambda state: place(state, state_spec), lambda batch: place(batch, batch_spec)


def _prepare_fn(r: _Rule, ids_def, scan_steps, backend, place_state, place_batch):
  """Checks and places ``(state, batch, *delays)`` for the program."""
  batch_axis = 0 if scan_steps is None else 1

  def prepare(state: CyclicState, batch, norms=True, *delays_arg, placed=False):
    """``placed``: ``state`` is the step's own output (`TrainStep`), checked and placed already."""
    want = np.asarray(norms, bool)
    if want.shape not in ((), (scan_steps,)) or (scan_steps is None and want.shape):
      raise ValueError(f"norms must be a bool{'' if scan_steps is None else f' or {scan_steps} bools'}"
                       f", got shape {want.shape}.")
    if scan_steps is not None:
      want = np.broadcast_to(want, (scan_steps,))
    if not placed:
      if jax.tree.structure(state.params) != ids_def:
        raise ValueError(
            "stage_ids do not match params: stage_ids must have the same tree structure "
            f"as params.\n  params:    {jax.tree.structure(state.params)}\n  stage_ids: {ids_def}")
      state = _kept_versions(state, r)
    leaves = jax.tree.leaves(batch)
    if not leaves:
      raise ValueError("The batch has no array leaves.")
    if scan_steps is not None:
      for x in leaves:
        if np.ndim(x) < 2 or np.shape(x)[0] != scan_steps:
          raise ValueError(
              f"With scan_steps={scan_steps} every batch leaf needs shape "
              f"[{scan_steps}, num_workers * b, ...]; got {np.shape(x)}.")
    sizes = {np.shape(x)[batch_axis] for x in leaves}
    if len(sizes) != 1:
      raise ValueError(f"Batch leaves disagree on the batch dimension: sizes {sorted(sizes)}.")
    size = sizes.pop()
    if size % r.num_workers or size == 0:
      raise ValueError(
          f"Batch size {size} is not divisible by the {r.num_workers} workers: use a global "
          f"batch of num_workers * per_worker_batch rows (worker i gets rows i*b:(i+1)*b).")
    if backend == "shard_map":
      return (state if placed else place_state(state), place_batch(batch), want, *delays_arg)
    b = size // r.num_workers

    def split(x):  # [.., N*b, ..] -> [N, .., b, ..]: the pmap axis leads.
      x = jnp.asarray(x)
      shape = x.shape[:batch_axis] + (r.num_workers, b) + x.shape[batch_axis + 1:]
      return jnp.moveaxis(x.reshape(shape), batch_axis, 0)
    return (state, jax.tree.map(split, batch), want, *delays_arg)

  return prepare
