"""The CDP update rules as one pure-functional JAX train step.

Worker ``i`` differentiates its micro-batch loss at its own mixed view
``theta~_i^j = theta^j_{t - d[i, j]}``; gradients are averaged per stage with one
all-reduce per stage (a flat bucket), and one optimizer update is applied to
``theta_t``. The state carries ``theta_t`` and the ``D`` stale versions the rule
reads, so ``dp``, ``cdp-v1``, ``cdp-v2`` and any delay matrix with entries in
``0..D`` are the same code. A fixed matrix is a compile-time constant (a stage
all workers read at one version needs no select); a ``schedule.DelayRule``'s
per-step matrix is an input of the compiled step, so it may change every step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import schedule

BACKENDS = ("shard_map", "pmap")


class CyclicState(NamedTuple):
  """Everything that shapes the trajectory of CDP training.

  Attributes:
    step: int32 scalar, the number of updates applied so far (``t``).
    params: ``theta_t``, the current parameters.
    stale_params: ``(theta_{t-1}, ..., theta_{t-D})``; empty for ``dp``.
    opt_state: the optax state of ``params``.
    model_state: non-trained state such as BatchNorm statistics, or ``None``.
  """
  step: jax.Array
  params: Any
  stale_params: tuple
  opt_state: Any
  model_state: Any = None

  @property
  def versions(self) -> tuple:
    """``(theta_t, theta_{t-1}, ..., theta_{t-D})``."""
    return (self.params,) + tuple(self.stale_params)


def init_state(params, tx: optax.GradientTransformation, *, rule,
               model_state=None) -> CyclicState:
  """Builds the state at ``t = 0``; every stale version is ``theta_0``.

  Args:
    params: ``theta_0``.
    tx: the optimizer.
    rule: a rule name of ``schedule.RULES`` or an explicit delay matrix; it
      fixes how many stale versions the state carries.
    model_state: optional non-trained state (e.g. ``{"batch_stats": ...}``).
  """
  num_stale = schedule.max_delay(rule)
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


def _reduce_by_stage(grads, stage_of_leaf, num_stages, extras, axis_name, num_workers):
  """Means ``grads`` and ``extras`` over workers with one psum per (stage, dtype).

  ``extras`` (the loss, model state) ride in the last stage's bucket, so a
  float32 model issues exactly ``J`` all-reduces. Returns the reduced
  ``(grads, extras, sq_norm_per_stage)``.
  """
  g_leaves, g_def = jax.tree.flatten(grads)
  x_leaves, x_def = jax.tree.flatten(extras)
  buckets: dict[tuple, list] = {}  # (stage, dtype) -> [(kind, index, leaf)]
  for k, leaf in enumerate(g_leaves):
    buckets.setdefault((stage_of_leaf[k], _bucket_key(leaf)), []).append(("g", k, leaf))
  for k, leaf in enumerate(x_leaves):
    buckets.setdefault((num_stages - 1, _bucket_key(leaf)), []).append(("x", k, leaf))
  g_out, x_out = [None] * len(g_leaves), [None] * len(x_leaves)
  sq_norms = [jnp.zeros((), jnp.float32) for _ in range(num_stages)]
  for (stage, _), items in sorted(buckets.items()):
    # Scaled before packing, so the scaling fuses into the copy into the bucket.
    flat = jnp.concatenate([jnp.ravel(leaf) / num_workers for _, _, leaf in items])
    flat = jax.lax.psum(flat, axis_name)
    num_grads = sum(leaf.size for kind, _, leaf in items if kind == "g")
    sq_norms[stage] = sq_norms[stage] + jnp.sum(jnp.square(flat[:num_grads].astype(jnp.float32)))
    offset = 0
    for kind, k, leaf in items:
      part = flat[offset:offset + leaf.size].reshape(leaf.shape)
      offset += leaf.size
      if kind == "g":
        g_out[k] = part
      else:
        x_out[k] = part
  return (jax.tree.unflatten(g_def, g_out), jax.tree.unflatten(x_def, x_out),
          jnp.stack(sq_norms))


def _worker_view(versions, stage_of_leaf, delays, axis_name):
  """This worker's parameters: leaf of stage ``j`` taken from version ``d[i, j]``.

  The result is marked varying over ``axis_name``, so its gradient is this
  worker's own (a replicated input's gradient would come back already summed).
  """
  row = jnp.asarray(delays)[jax.lax.axis_index(axis_name)]
  leaves = [jax.tree.leaves(v) for v in versions]
  treedef = jax.tree.structure(versions[0])
  view = []
  for k, stage in enumerate(stage_of_leaf):
    column = sorted(set(delays[:, stage].tolist()))
    if len(column) == 1:  # Every worker reads the same version: no select needed.
      leaf = leaves[column[0]][k]
      view.append(jax.lax.pcast(leaf, axis_name, to="varying"))
      continue
    leaf = jax.lax.pcast(leaves[column[0]][k], axis_name, to="varying")
    for version in column[1:]:
      leaf = jnp.where(row[stage] == version, leaves[version][k], leaf)
    view.append(leaf)
  return jax.tree.unflatten(treedef, view)


def _dynamic_worker_view(versions, stage_of_leaf, delays_NxJ, axis_name):
  """``_worker_view`` for a delay matrix that is data: ``D`` selects per leaf.

  ``delays_NxJ`` is a traced int32 array, so the step serves every matrix with
  entries in ``0..D`` without recompiling.
  """
  row = delays_NxJ[jax.lax.axis_index(axis_name)]
  leaves = [jax.tree.leaves(v) for v in versions]
  view = []
  for k, stage in enumerate(stage_of_leaf):
    leaf = jax.lax.pcast(leaves[0][k], axis_name, to="varying")
    for version in range(1, len(versions)):
      leaf = jnp.where(row[stage] == version, leaves[version][k], leaf)
    view.append(leaf)
  return jax.tree.unflatten(jax.tree.structure(versions[0]), view)


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
  versions = state.versions
  return [jax.tree.map(lambda s, *vs, row=row: vs[int(row[s])], stage_ids, *versions)
          for row in delays]


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
  if all(isinstance(x, jax.Array) and x.sharding == sharding for x in jax.tree.leaves(tree)):
    return tree
  return jax.device_put(tree, sharding)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """A compiled train step: ``state, metrics = step(state, batch)``.

  ``lower(state, batch)`` gives the lowered program (for StableHLO, memory and
  cost inspection) after the same input checks and placement.

  With a ``schedule.DelayRule``, ``step(state, batch, delays)`` takes the step's
  ``(N, J)`` matrix (``(K, N, J)`` with ``scan_steps=K``) as data. Without
  ``delays`` it reads them from the rule at the state's step: the step of a
  state this ``TrainStep`` returned is known on the host, so only a foreign
  state costs a device-to-host read of ``state.step``.
  """
  run: Callable
  prepare: Callable
  rule: Any = None
  scan_steps: int | None = None
  _host_step: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

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

  def __call__(self, state, batch, delays=None):
    if self.rule is None:
      if delays is not None:
        raise ValueError("This step's delays are fixed; pass delays only with a schedule.DelayRule.")
      return self.run(*self.prepare(state, batch))
    count = self.scan_steps or 1
    step = None
    if delays is None:
      step = self._step_of(state)
      delays = self.rule.window(step, count) if self.scan_steps else self.rule(step)
    new_state, metrics = self.run(*self.prepare(state, batch, self._check_delays(delays)))
    if step is not None:  # Spares the next call a device-to-host read of the step.
      self._host_step.update(array=new_state.step, step=step + count)
    return new_state, metrics

  def lower(self, state, batch, delays=None):
    if self.rule is None:
      return self.run.lower(*self.prepare(state, batch))
    if delays is None:
      count = self.scan_steps or 1
      delays = self.rule.window(0, count) if self.scan_steps else self.rule(0)
    return self.run.lower(*self.prepare(state, batch, self._check_delays(delays)))


def make_train_step(
    loss_fn: Callable, tx: optax.GradientTransformation, *, stage_ids, rule,
    mesh: Mesh, axis_name: str = "data", backend: str = "shard_map",
    with_model_state: bool = False, scan_steps: int | None = None,
    donate: bool = True) -> TrainStep:
  """Builds the CDP train step over the mesh axis ``axis_name``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of one
      worker's micro-batch; with ``with_model_state``,
      ``loss_fn(params, model_state, batch) -> (scalar, new_model_state)``.
      New model states are averaged over workers (BatchNorm statistics).
    tx: any optax ``GradientTransformation``.
    stage_ids: the structure of ``params`` with an int stage on every leaf.
    rule: a name of ``schedule.RULES`` or an ``(N, J)`` delay matrix (static:
      a stage every worker reads at the same version needs no select), or a
      ``schedule.DelayRule`` whose per-step matrix is an input of the compiled
      step (``D`` selects per leaf; any matrix in ``0..D``, no recompiling).
    mesh: a mesh with axis ``axis_name`` of size ``N`` (the workers).
    axis_name: the mesh axis of the workers.
    backend: ``"shard_map"`` (primary) or ``"pmap"``; same numbers.
    with_model_state: whether ``loss_fn`` takes and returns a model state.
    scan_steps: if set to ``K``, one call runs ``K`` steps with ``lax.scan``;
      batch leaves then have shape ``[K, N * b, ...]`` and metrics gain a
      leading ``K`` axis.
    donate: donate the input state's buffers to the output state.

  Returns:
    A ``TrainStep``; ``step(state, batch) -> (state, metrics)`` with metrics
    ``loss`` (mean over workers), ``grad_norm``, ``grad_norm_per_stage`` [J]
    and ``param_norm`` (of the parameters the step read, ``theta_t``); with a
    ``DelayRule``, also ``mean_delay`` (the matrix itself is ``rule(step)``).
  """
  if backend not in BACKENDS:
    raise ValueError(f"Unknown backend {backend!r}: use one of {BACKENDS}.")
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)} but no axis {axis_name!r}: build it "
        f"with jax.make_mesh((num_workers,), ({axis_name!r},)) or pass axis_name=.")
  if scan_steps is not None and (int(scan_steps) != scan_steps or scan_steps < 1):
    raise ValueError(f"scan_steps must be a positive int or None, got {scan_steps!r}.")
  num_workers = int(mesh.shape[axis_name])
  dynamic = isinstance(rule, schedule.DelayRule)
  if dynamic:
    if rule.num_workers != num_workers:
      raise ValueError(
          f"The delay rule is for {rule.num_workers} workers but the mesh axis {axis_name!r} "
          f"has {num_workers}: build the rule with num_workers={num_workers}.")
    num_stages = rule.num_stages
  elif isinstance(rule, str):
    num_stages = num_stages_of(stage_ids) if jax.tree.leaves(stage_ids) else 1
  else:
    num_stages = int(np.shape(rule)[1]) if np.ndim(rule) == 2 else 0
  delays = None if dynamic else schedule.resolve(rule, num_workers, num_stages)
  stage_of_leaf = _check_stage_ids(stage_ids, num_stages)
  num_stale = schedule.max_delay(rule)
  if not dynamic and delays.max(initial=0) > num_stale:
    raise ValueError(f"Delay matrix needs {delays.max()} stale versions; the state keeps {num_stale}.")
  ids_def = jax.tree.structure(stage_ids)

  def one_step(state: CyclicState, batch, delays_NxJ=None):
    if dynamic:
      view = _dynamic_worker_view(state.versions, stage_of_leaf, delays_NxJ, axis_name)
    else:
      view = _worker_view(state.versions, stage_of_leaf, delays, axis_name)
    if with_model_state:
      (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          view, state.model_state, batch)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(view, batch)
      model_state = state.model_state
    grads, (loss, model_state), sq_norms = _reduce_by_stage(
        grads, stage_of_leaf, num_stages, (loss, model_state), axis_name, num_workers)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # theta_t becomes the newest stale version. Donation aliases each output to
    # the input in the same position, so XLA copies theta_t into the stale
    # slot's buffer: one transient parameter copy per step on top of the state.
    stale = state.versions[:num_stale]
    metrics = {
        "loss": loss,
        "grad_norm": jnp.sqrt(jnp.sum(sq_norms)),
        "grad_norm_per_stage": jnp.sqrt(sq_norms),
        "param_norm": optax.tree.norm(params),
    }
    if dynamic:
      metrics["mean_delay"] = jnp.mean(delays_NxJ.astype(jnp.float32))
    return CyclicState(state.step + 1, params, stale, opt_state, model_state), metrics

  if scan_steps is None:
    body = one_step
  elif dynamic:
    def body(state, batches, delays_KxNxJ):
      return jax.lax.scan(lambda s, xs: one_step(s, *xs), state, (batches, delays_KxNxJ))
  else:
    def body(state, batches):
      return jax.lax.scan(one_step, state, batches)

  batch_axis = 0 if scan_steps is None else 1
  donate_argnums = (0,) if donate else ()
  delay_specs = (P(),) if dynamic else ()
  if backend == "shard_map":
    batch_spec = P(axis_name) if scan_steps is None else P(None, axis_name)
    run = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec) + delay_specs,
                      out_specs=(P(), P())),
        donate_argnums=donate_argnums)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, batch_spec)
  else:
    if len(mesh.axis_names) != 1:
      raise ValueError("The pmap backend needs a 1-D mesh; use backend='shard_map' for more axes.")
    run = jax.pmap(body, axis_name, in_axes=(None, 0) + (None,) * len(delay_specs), out_axes=None,
                   devices=list(mesh.devices.flat), donate_argnums=donate_argnums)
    replicated = batch_sharding = None

  def prepare(state: CyclicState, batch, *delays_arg):
    if jax.tree.structure(state.params) != ids_def:
      raise ValueError(
          "stage_ids do not match params: stage_ids must have the same tree structure "
          f"as params.\n  params:    {jax.tree.structure(state.params)}\n  stage_ids: {ids_def}")
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
    if size % num_workers or size == 0:
      raise ValueError(
          f"Batch size {size} is not divisible by the {num_workers} workers: use a global "
          f"batch of num_workers * per_worker_batch rows (worker i gets rows i*b:(i+1)*b).")
    if backend == "shard_map":
      return (_placed(state, replicated), _placed(batch, batch_sharding),
              *(jax.device_put(d, replicated) for d in delays_arg))
    b = size // num_workers

    def split(x):  # [.., N*b, ..] -> [N, .., b, ..]: the pmap axis leads.
      x = jnp.asarray(x)
      shape = x.shape[:batch_axis] + (num_workers, b) + x.shape[batch_axis + 1:]
      return jnp.moveaxis(x.reshape(shape), batch_axis, 0)
    return (state, jax.tree.map(split, batch), *delays_arg)

  return TrainStep(run=run, prepare=prepare, rule=rule if dynamic else None,
                   scan_steps=scan_steps)
