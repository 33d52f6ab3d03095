"""What a config builds: the optimizer and its schedule, stages, mesh, executor and evaluation.

``build_run(config)`` gives the loop its `Run`: the dataset, the mesh, the
`Runner` (the executor of ``config.parallelism`` bound to the initial
variables, ``K`` steps a call) and the evaluation.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import config as config_lib
from cdpjax import executor as executor_lib
from cdpjax import executors, models, stages, tasks


class Runner(NamedTuple):
  """An executor bound to the run's initial variables (what the loop needs)."""
  init: Callable[[], Any]                    # -> state at step 0.
  step: Callable[..., tuple]                 # (state, k batches, k norms flags) -> (state, [k] metrics)
  variables: Callable[[Any], dict]           # state -> flax variables of theta_t.
  to_portable: Callable[[Any], Any]          # state -> the form checkpoints hold (any executor).
  from_portable: Callable[[Any], Any]        # that form -> state, on this run's devices.
  steps_per_call: int                        # K: the steps of one compiled call.
  idle_fraction: float                       # Idle device-slots of the executed K-step call.
  plan: executor_lib.RulePlan                # The rule, resolved once for the run.


def learning_rate_schedule(c: ml_collections.ConfigDict, steps_per_epoch: int,
                           num_steps: int) -> optax.Schedule:
  """The config's schedule, in steps, after an optional linear warm-up."""
  warmup = c.warmup_steps or int(round(c.warmup_epochs * steps_per_epoch))
  if c.lr_schedule == "constant":
    main = optax.constant_schedule(c.learning_rate)
  elif c.lr_schedule == "cosine":
    main = optax.cosine_decay_schedule(c.learning_rate, max(1, num_steps - warmup))
  else:
    every = max(1, int(round(c.lr_decay_every_epochs * steps_per_epoch)))
    main = optax.piecewise_constant_schedule(
        c.learning_rate, {k * every: c.lr_decay_factor for k in range(1, num_steps // every + 1)})
  if not warmup:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, c.learning_rate, warmup), main], [warmup])


class DecayMaskState(NamedTuple):
  """Per parameter leaf, 1.0 where it decays (a matrix) and 0.0 elsewhere."""
  mask: Any


def decay_matrices(weight_decay: float) -> optax.GradientTransformation:
  """AdamW's decoupled weight decay of matrices (kernels, embeddings) only.

  ``optax.add_decayed_weights(weight_decay, mask)`` with the mask in the
  state: optax computes a mask from the parameters at every update, and the
  executed schedules' parameters are flat stage buffers, in which no leaf is a
  matrix. Here ``init`` decides on the tree and keeps a scalar per leaf, which
  the staged state holds as one row per stage (`executed.pipeline.Trees`;
  one parameter size of optimizer state there). Equal to optax's, bit for bit.
  """
  def init(params):
    return DecayMaskState(jax.tree.map(lambda x: jnp.asarray(x.ndim >= 2, x.dtype), params))

  def update(updates, state, params):
    return jax.tree.map(lambda g, m, x: g + weight_decay * m * x, updates, state.mask,
                        params), state
  return optax.GradientTransformation(init, update)


def make_optimizer(c: ml_collections.ConfigDict, lr: optax.Schedule):
  """SGD with momentum (coupled weight decay, as PyTorch's SGD), Adam or AdamW.

  AdamW decays matrices only (kernels, embeddings), not biases or norms.
  ``grad_clip_norm > 0`` first clips the gradient by its global norm: the
  engine updates the whole model at once, so the norm is over every stage.
  """
  if c.optimizer == "sgd":
    opt = optax.sgd(lr, momentum=c.momentum or None)
  elif c.optimizer == "adam":
    opt = optax.adam(lr, b1=c.adam_b1, b2=c.adam_b2)
  elif c.optimizer == "adamw":  # optax.adamw's chain, with the mask kept in the state.
    opt = optax.chain(optax.scale_by_adam(b1=c.adam_b1, b2=c.adam_b2),
                      decay_matrices(c.weight_decay),
                      optax.scale_by_learning_rate(lr))
  else:
    raise ValueError(f"Unknown optimizer {c.optimizer!r}: use 'sgd', 'adam' or 'adamw'.")
  if c.weight_decay and c.optimizer != "adamw":
    opt = optax.chain(optax.add_decayed_weights(c.weight_decay), opt)
  if c.grad_clip_norm:
    opt = optax.chain(optax.clip_by_global_norm(c.grad_clip_norm), opt)
  return opt


def model_stage_ids(c, model, params, sample):
  """Stages in execution order: identical blocks per stage, or balanced FLOPs/params.

  ``blocks`` puts ``num_blocks / J`` of the units named ``block_<k>`` on each
  stage (what comes before the first block joins stage 0, the rest the last).
  """
  if c.stages_by == "blocks":
    blocks = sum(1 for name in params if re.fullmatch(r"block_\d+", name))
    if not blocks or blocks % c.num_stages:
      raise ValueError(
          f"stages_by='blocks' needs a model of units block_0..block_<L-1> with L a "
          f"multiple of num_stages ({c.num_stages}); {c.model!r} has {blocks}. Change the "
          "model's number of blocks or use --config.stages_by=params (or flops).")
    per = blocks // c.num_stages
    return stages.model_stage_ids(model, params, c.num_stages, sample, by="boundaries",
                                  boundaries=[f"block_{s * per}" for s in range(1, c.num_stages)],
                                  train=False)
  return stages.model_stage_ids(model, params, c.num_stages, sample, by=c.stages_by,
                                train=False)


_CPU_CONVOLUTIONS = (
    "a convolutional model on the CPU, where XLA runs the backward convolutions of a loop "
    "body on a slow path (jax issue 12868; ResNet-18 about 17x slower per step at 16 steps per "
    "call in bench_engine)")


# The idle fraction the default K keeps an executed timetable under, where the intervals allow.
IDLE_GOAL = 0.05
# The default K of a timetable without idle slots (the engine, ZeRO-3): a scan saves dispatches.
LOCKSTEP_STEPS_PER_CALL = 16


def steps_per_call(c, platform: str | None = None,
                   plan: executor_lib.RulePlan | None = None) -> tuple[int, str]:
  """``(K, why)``: a ``K`` dividing the eval and checkpoint intervals.

  Those steps then end a call, so one compiled ``K`` serves the whole run; a
  logged step needs no call boundary (its metrics come with its call).
  ``steps_per_call > 0`` asks for the largest such ``K`` up to it. ``0``, the
  default: with ``plan``'s cyclic timetable, the smallest ``K`` whose idle
  fraction (its fill and drain, `executors.idle_fraction`) is under
  ``IDLE_GOAL``; otherwise (lockstep, GPipe's flush every step, intervals too
  short for the goal) the largest up to ``LOCKSTEP_STEPS_PER_CALL``. On
  the ``"cpu"`` ``platform`` the engine (``parallelism="data"``) runs a
  convolutional model one step per call (``why`` says so; empty otherwise):
  the engine gains only dispatch time from a scan, and the CPU's scanned
  backward convolutions cost far more. The executed schedules keep ``K``,
  which removes their fill and drain.
  """
  every = math.gcd(c.eval_every_steps, c.checkpoint_every_steps)
  divisors = [k for k in range(1, every + 1) if every % k == 0]
  reaching = [d for d in divisors if plan is not None and 0 < executors.idle_fraction(plan, 1)
              and executors.idle_fraction(plan, d) < IDLE_GOAL]
  if c.steps_per_call:
    k = max(d for d in divisors if d <= c.steps_per_call)
  elif reaching:
    k = reaching[0]
  else:  # Lockstep, or a flush every step (GPipe), or intervals too short for the goal.
    k = max(d for d in divisors if d <= LOCKSTEP_STEPS_PER_CALL)
  if k > 1 and platform == "cpu" and c.parallelism == "data" and models.is_convolutional(c.model):
    return 1, _CPU_CONVOLUTIONS
  return k, ""


def build_runner(c, model, tx, variables, sample, mesh) -> Runner:
  """The executor of ``c.parallelism`` (one table, `executors.EXECUTORS`) for this run.

  One call runs ``K = steps_per_call(c)`` steps; a call of another length (the
  run's tail, or the first call of a resume from another ``K``) compiles its
  own, once. Prints (process 0) what runs the rule: under ``model`` and
  ``zero`` ``dp`` runs GPipe and ZeRO-3.
  """
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"} or None
  stage_ids = model_stage_ids(c, model, params, sample)

  # The rule resolved once for the run (a DelayRule gives the engine each step's delays as data).
  plan = executor_lib.resolve(config_lib.delay_rule(c), c.parallelism, c.num_workers,
                              c.num_stages, predict=c.weight_prediction,
                              dc_lambda=c.dc_lambda, lr_delay_scale=c.lr_delay_scale)

  def build(k):  # K = 1 is the step without scan (the engine then rotates its versions).
    return executors.build(
        c.parallelism, model, tx, params=params, model_state=model_state, stage_ids=stage_ids,
        sample_input=sample, rule=plan, mesh=mesh, loss_fn=tasks.cross_entropy,
        backend=c.backend, scan_steps=k if k > 1 else None, tied_backward=c.tied_backward,
        keep_activations=c.keep_activations, gradient_reduction=c.gradient_reduction)

  num, why = steps_per_call(c, jax.default_backend(), plan)
  by_k = {num: build(num)}
  idle = executors.idle_fraction(plan, num)
  if jax.process_index() == 0:
    print(f"cdpjax: {plan.describe()}{_mesh_words(c)}; steps per compiled call: {num}"
          f"{f' ({why})' if why else ''}, idle fraction {idle:.3f} "
          f"({executors.idle_fraction(plan, 1):.3f} at one step per call)", flush=True)

  def step(state, batches, norms):
    k = len(batches)
    if k not in by_k:
      by_k[k] = build(k)
    if k == 1:
      state, metrics = by_k[1].step(state, to_global(batches[0], mesh), norms=norms[0])
      return state, jax.tree.map(lambda m: m[None], metrics)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
    return by_k[k].step(state, to_global(stacked, mesh, stacked=True), norms=np.array(norms))

  ex = by_k[num]
  return Runner(init=lambda: ex.init(params, model_state), step=step, variables=ex.variables,
                to_portable=ex.to_portable, from_portable=ex.from_portable,
                steps_per_call=num, idle_fraction=idle, plan=plan)


def _mesh_words(c) -> str:
  """What the second mesh axis adds, for the log line (empty on a 1-D mesh)."""
  if c.num_replicas > 1:
    return (f", {c.num_replicas} replicas of it ({config_lib.global_batch_size(c)} rows, "
            f"{c.num_replicas * c.num_workers} micro-batches per step)")
  if c.devices_per_worker > 1:
    return f", each worker on {c.devices_per_worker} devices (state sharded over 'fsdp')"
  return ""


def make_mesh(c: ml_collections.ConfigDict, devices=None):
  """The mesh of ``config.parallelism`` (`config.mesh_axes`) over the first devices of every process.

  With several processes, each gives the same number of devices, in process
  order: process ``p`` holds the ``p``-th block of rows, the rows it loads
  (the mesh's devices in row-major order are the rows' order). ``devices``:
  build it on these instead (one process; e.g. a TPU topology's, `cdpjax.aot`).
  """
  shape, names = config_lib.mesh_axes(c)
  needed = config_lib.num_devices(c)
  given = devices is not None
  devices = jax.devices() if devices is None else list(devices)
  if len(devices) < needed:
    raise ValueError(
        f"parallelism={c.parallelism!r} on a mesh {dict(zip(names, shape))} needs {needed} "
        f"devices, but only {len(devices)} are visible. On CPU, "
        f"set XLA_FLAGS=--xla_force_host_platform_device_count={needed} (the launcher does this "
        "unless XLA_FLAGS already sets a count).")
  count = 1 if given else jax.process_count()
  if count == 1:
    return jax.make_mesh(shape, names, devices=devices[:needed],
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(names))
  per_process = needed // count
  if needed % count or jax.local_device_count() < per_process:
    raise ValueError(
        f"The mesh needs {needed} devices, which {count} processes with "
        f"{jax.local_device_count()} devices each cannot give in equal shares: run a number of "
        f"processes that divides {needed}, each with at least {needed} / processes devices.")
  devices = [d for p in range(count) for d in jax.local_devices(process_index=p)[:per_process]]
  # Not jax.make_mesh: on TPU it may reorder devices across processes.
  return jax.sharding.Mesh(np.array(devices).reshape(shape), names,
                           axis_types=(jax.sharding.AxisType.Explicit,) * len(names))


def rows_spec(mesh, num_rows: int) -> P:
  """Rows over every mesh axis (row-major: process ``p`` holds block ``p``), else the first."""
  return P(tuple(mesh.axis_names) if num_rows % mesh.size == 0 else mesh.axis_names[0])


def make_eval_fn(task: tasks.Task, mesh):
  """The task's eval metrics from its sums (e.g. correct, loss, weights) over sharded batches."""
  axes = tuple(mesh.axis_names)  # Every device evaluates its rows (config.validate: divisible).

  # Per device on its rows, then summed: plain jit cannot infer the sharding
  # of an embedding lookup with sharded token ids under explicit mesh axes.
  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(axes)), out_specs=P())
  def sums(variables, batch):
    local = task.eval_sums(task.model.apply(variables, task.inputs(batch), train=False), batch)
    return jax.lax.psum(local, axes)

  replicated = NamedSharding(mesh, P())

  def on_mesh(x):
    # The pmap backend returns its state on pmap's own mesh (Auto axes), which
    # jit refuses to mix with the batch's (Explicit axes), and a worker of
    # several devices shards it over 'fsdp': replicate it on ours.
    if not isinstance(x, jax.Array) or (getattr(x.sharding, "mesh", None) == mesh
                                        and x.sharding.is_fully_replicated):
      return x
    return jax.device_put(x, replicated)

  def evaluate(variables, batches):
    variables = jax.tree.map(on_mesh, variables)
    totals = 0.0
    for batch in batches:
      totals += np.array(jax.device_get(sums(variables, to_global(batch, mesh))))
    return task.eval_metrics(totals)
  return evaluate


def model_kwargs(c) -> dict:
  """``config.model_kwargs`` for ``config.model``, without the keys it does not take.

  A config's ``model_kwargs`` are written for its own model, and an override
  cannot remove a key; so ``--config.model=resnet18`` on the digits config
  drops the residual MLP's ``hidden`` and ``num_blocks``, and says so.
  """
  kwargs = dict(c.model_kwargs)
  # Flax modules are dataclasses: their init fields are the options they take.
  module = models.create_model(c.model, num_classes=1)
  taken = [f.name for f in dataclasses.fields(module)
           if f.init and f.name not in ("parent", "name", "num_classes")]
  dropped = sorted(set(kwargs) - set(taken))
  if dropped:
    logging.warning("model=%s takes no %s: ignoring those model_kwargs (it takes %s).",
                    c.model, ", ".join(dropped), ", ".join(taken))
  return {k: v for k, v in kwargs.items() if k not in dropped}


class Run(NamedTuple):
  """What the loop needs, built from the config."""
  dataset: Any
  mesh: Any
  runner: Runner
  evaluate: Callable                         # variables -> eval metrics (one pass).
  lr: optax.Schedule
  num_steps: int
  global_batch: int
  model: Any
  sample: Any
  task: tasks.Task


def build_run(c) -> Run:
  task = tasks.build(c, model_kwargs=model_kwargs(c))
  dataset, model, sample = task.dataset, task.model, task.sample_input
  global_batch = config_lib.global_batch_size(c)
  steps_per_epoch = max(1, dataset.num_train // global_batch)
  num_steps = c.num_train_steps if c.num_train_steps > 0 else int(
      math.ceil(c.num_epochs * steps_per_epoch))
  lr = learning_rate_schedule(c, steps_per_epoch, num_steps)
  tx = make_optimizer(c, lr)

  # XLA's RNG-bit-generator: a ResNet's ~60 initialisers compile ~4x faster
  # than with threefry (seconds, not a minute, on a CPU).
  init_key = jax.random.key(c.seed, impl="rbg")
  variables = dict(jax.jit(lambda k: model.init(k, sample, train=False))(init_key))
  mesh = make_mesh(c)
  runner = build_runner(c, model, tx, variables, sample, mesh)
  evaluate = make_eval_fn(task, mesh)
  return Run(dataset, mesh, runner, lambda v: evaluate(v, dataset.eval_batches(
      c.eval_batch_size, process_index=jax.process_index(), process_count=jax.process_count())),
              lr, num_steps, global_batch, model, sample, task)


def to_global(local_batch: dict, mesh, stacked: bool = False) -> dict:
  """The process-local rows as one global array, sharded by `rows_spec`.

  ``stacked``: leaves are ``[K, rows, ...]``, the rows of ``K`` steps.
  """
  def put(x):
    rows = x.shape[int(stacked)] * jax.process_count()
    sharding = NamedSharding(mesh, P(*([None] if stacked else []), *rows_spec(mesh, rows)))
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, x)
  return jax.tree.map(put, local_batch)
