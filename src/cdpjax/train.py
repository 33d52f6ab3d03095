"""Training and evaluation from a config: the framework's main job.

``train_and_evaluate(config, workdir)`` builds the model, data, mesh and the
train step of ``config.parallelism`` (``data``: the update-rule engine;
``model``: the executed CDP+MP pipeline; ``zero``: the executed CDP+ZeRO
ring), resumes from the newest checkpoint in ``workdir`` and trains, writing
``config.json``, ``metrics.jsonl``, TensorBoard events and ``summary.json``.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import config as config_lib
from cdpjax import engine, stages, tasks


class Runner(NamedTuple):
  """One parallelism mode: how to build, step and read its state."""
  init: Callable[[], Any]                    # -> state at step 0.
  step: Callable[[Any, dict], tuple]         # (state, global batch) -> (state, metrics).
  variables: Callable[[Any], dict]           # state -> flax variables of theta_t.


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


def make_optimizer(c: ml_collections.ConfigDict, lr: optax.Schedule):
  """SGD with momentum (coupled weight decay, as PyTorch's SGD), Adam or AdamW.

  AdamW decays matrices only (kernels, embeddings), not biases or norms.
  ``grad_clip_norm > 0`` first clips the gradient by its global norm: the
  engine updates the whole model at once, so the norm is over every stage.
  """
  if c.optimizer == "sgd":
    opt = optax.sgd(lr, momentum=c.momentum or None)
  elif c.optimizer == "adam":
    opt = optax.adam(lr)
  elif c.optimizer == "adamw":
    opt = optax.adamw(lr, weight_decay=c.weight_decay,
                      mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))
  else:
    raise ValueError(f"Unknown optimizer {c.optimizer!r}: use 'sgd', 'adam' or 'adamw'.")
  if c.weight_decay and c.optimizer != "adamw":
    opt = optax.chain(optax.add_decayed_weights(c.weight_decay), opt)
  if c.grad_clip_norm:
    opt = optax.chain(optax.clip_by_global_norm(c.grad_clip_norm), opt)
  return opt


def model_stage_ids(c, model, params, sample):
  """Stages in execution order: identical blocks per stage, or balanced FLOPs/params."""
  if c.stage_strategy == "blocks":
    key = "num_layers" if c.model == "transformer" else "num_blocks"
    blocks = c.model_kwargs.get(key, 0)
    if c.model not in ("residual_mlp", "transformer") or blocks % c.num_stages:
      raise ValueError(
          f"stage_strategy='blocks' needs a residual_mlp or transformer whose {key} ({blocks}) "
          f"is a multiple of num_stages ({c.num_stages}): change --config.model_kwargs.{key} "
          "or use --config.stage_strategy=params.")
    per = blocks // c.num_stages
    return stages.model_stage_ids(model, params, c.num_stages, sample, strategy="boundaries",
                                  boundaries=[f"block_{s * per}" for s in range(1, c.num_stages)],
                                  train=False)
  return stages.model_stage_ids(model, params, c.num_stages, sample, strategy=c.stage_strategy,
                                train=False)


def _data_runner(c, model, tx, variables, sample, mesh, task) -> Runner:
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"} or None
  stage_ids = model_stage_ids(c, model, params, sample)

  if model_state is None:
    def loss_fn(p, batch):
      return task.loss(model.apply({"params": p}, task.inputs(batch), train=True), batch)
  else:
    def loss_fn(p, state, batch):
      logits, new_state = model.apply({"params": p, **state}, task.inputs(batch), train=True,
                                      mutable=list(state))
      return task.loss(logits, batch), new_state

  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=c.rule, mesh=mesh,
                                backend=c.backend, with_model_state=model_state is not None)
  replicated = NamedSharding(mesh, P())
  return Runner(
      init=lambda: jax.device_put(
          engine.init_state(params, tx, rule=c.rule, model_state=model_state), replicated),
      step=step,
      variables=lambda s: {"params": s.params, **(s.model_state or {})})


def _executed_runner(c, module, tx, variables, mesh) -> Runner:
  """``parallelism=model`` (cdpjax.pipeline) or ``zero`` (cdpjax.zero), with any processes.

  Both steps take ``to_global``'s batch, sharded over the mesh axis (``model``
  gathers it onto every stage device), and return metrics that every process
  can read.
  """
  if c.model != "residual_mlp":
    raise ValueError(
        f"parallelism={c.parallelism!r} runs models built of identical blocks; {c.model!r} is "
        "not one. Use --config.model=residual_mlp or --config.parallelism=data.")
  num_blocks = c.model_kwargs.num_blocks
  params = variables["params"]
  step = module.make_train_step(tx, rule=c.rule, mesh=mesh, num_blocks=num_blocks)
  return Runner(
      init=lambda: module.init_state(params, tx, rule=c.rule, mesh=mesh, num_blocks=num_blocks),
      step=step,
      variables=lambda s: {"params": module.current_params(s)})


def make_mesh(c: ml_collections.ConfigDict):
  """The mesh of ``config.parallelism`` over the first devices of every process.

  With several processes, each gives the same number of devices, in process
  order: process ``p`` holds the ``p``-th block of rows, the rows it loads.
  """
  needed = config_lib.num_devices(c)
  devices = jax.devices()
  if len(devices) < needed:
    raise ValueError(
        f"parallelism={c.parallelism!r} with num_workers={c.num_workers}, num_stages="
        f"{c.num_stages} needs {needed} devices, but only {len(devices)} are visible. On CPU, "
        f"set XLA_FLAGS=--xla_force_host_platform_device_count={needed} (the launcher does this "
        "unless XLA_FLAGS already sets a count).")
  axis = "stage" if c.parallelism == "model" else "data"
  count = jax.process_count()
  if count == 1:
    return jax.make_mesh((needed,), (axis,), devices=devices[:needed])
  per_process = needed // count
  if needed % count or jax.local_device_count() < per_process:
    raise ValueError(
        f"The mesh needs {needed} devices, which {count} processes with "
        f"{jax.local_device_count()} devices each cannot give in equal shares: run a number of "
        f"processes that divides {needed}, each with at least {needed} / processes devices.")
  devices = [d for p in range(count) for d in jax.local_devices(process_index=p)[:per_process]]
  # Not jax.make_mesh: on TPU it may reorder devices across processes.
  return jax.sharding.Mesh(np.array(devices), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))


def build_runner(c, model, tx, variables, sample, mesh, task) -> Runner:
  if c.parallelism == "data":
    return _data_runner(c, model, tx, variables, sample, mesh, task)
  if c.parallelism == "model":
    from cdpjax import pipeline  # pylint: disable=g-import-not-at-top
    return _executed_runner(c, pipeline, tx, variables, mesh)
  from cdpjax import zero  # pylint: disable=g-import-not-at-top
  return _executed_runner(c, zero, tx, variables, mesh)


def make_eval_fn(task: tasks.Task, mesh):
  """The task's eval metrics from its sums (e.g. correct, loss, weights) over sharded batches."""
  axis = mesh.axis_names[0]

  # Per device on its rows, then summed: plain jit cannot infer the sharding
  # of an embedding lookup with sharded token ids under explicit mesh axes.
  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(axis)), out_specs=P())
  def sums(variables, batch):
    local = task.eval_sums(task.model.apply(variables, task.inputs(batch), train=False), batch)
    return jax.lax.psum(local, axis)

  def evaluate(variables, batches):
    totals = 0.0
    for batch in batches:
      totals += np.array(jax.device_get(sums(variables, to_global(batch, mesh))))
    return task.eval_metrics(totals)
  return evaluate


class CheckpointMismatchError(ValueError):
  """A checkpoint in the workdir belongs to an incompatible config."""


# Keys whose change makes a checkpoint a different algorithm or model.
IDENTITY_KEYS = ("rule", "num_workers", "num_stages", "parallelism", "model", "model_kwargs",
                 "dataset", "optimizer", "stage_strategy")


def _identity(c) -> dict:
  return json.loads(json.dumps({k: c[k].to_dict() if hasattr(c[k], "to_dict") else c[k]
                                for k in IDENTITY_KEYS}))


class Checkpointer:
  """orbax CheckpointManager of (state, metadata), refusing incompatible runs."""

  def __init__(self, workdir: str, c):
    self.identity = _identity(c)
    self.manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=c.keep_checkpoints, create=True))

  def save(self, step: int, state, data_position: int, seed: int) -> None:
    meta = {"identity": self.identity, "step": step, "data_position": data_position, "seed": seed}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def restore_latest(self, abstract_state):
    """``(state, meta)`` of the newest checkpoint, or ``None`` without one."""
    step = self.manager.latest_step()
    if step is None:
      return None
    where = os.path.join(self.manager.directory, str(step))
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # Unreadable metadata: refuse rather than guess.
      raise CheckpointMismatchError(
          f"Checkpoint {where} is unreadable ({type(e).__name__}: {e}). Delete it to resume from "
          "an older one, or use a fresh --workdir.") from e
    diff = {k: (meta["identity"].get(k), v) for k, v in self.identity.items()
            if meta["identity"].get(k) != v}
    if diff:
      lines = "\n".join(f"  {k}: checkpoint {a!r}, config {b!r}" for k, (a, b) in diff.items())
      raise CheckpointMismatchError(
          f"The checkpoint in {where} comes from an incompatible config:\n{lines}\n"
          "Resuming would change the algorithm. Use a fresh --workdir, or restore the config.")
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
    except Exception as e:
      raise CheckpointMismatchError(
          f"Checkpoint {where} does not match this run's state ({type(e).__name__}: {e}). "
          "Delete it or use a fresh --workdir.") from e
    return restored["state"], meta

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


class _Preemption:
  """Turns SIGTERM into a stop the loop checks, so it can checkpoint and exit.

  With several processes, JAX's own notifier catches SIGTERM and the processes
  agree on the step to stop at, so that they all save the same one.
  """

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if jax.process_count() > 1:
      return self
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # Not the main thread: no handler (and no preemption save).
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def stop_at(self, step: int) -> bool:
    """Whether to checkpoint and stop after ``step``; every process calls it once per step."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested


class MetricsLog:
  """metrics.jsonl and TensorBoard events, written by process 0 only."""

  def __init__(self, workdir: str):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      # Imports TensorFlow (seconds), which the other processes never need.
      from flax.metrics import tensorboard  # pylint: disable=g-import-not-at-top
      self.file = open(os.path.join(workdir, "metrics.jsonl"), "a")
      self.tb = tensorboard.SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    self.file.write(json.dumps({"step": step, **metrics}) + "\n")
    self.file.flush()
    for k, v in metrics.items():
      self.tb.scalar(k, v, step)
    self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      self.tb.close()


def _scalars(metrics: dict) -> dict:
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    if v.ndim == 0:
      out[f"train/{k}"] = float(v)
    elif k == "grad_norm_per_stage":
      out.update({f"train/grad_norm_stage{j}": float(x) for j, x in enumerate(v)})
  return out


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains per ``c``, resuming from ``workdir``; returns the summary."""
  config_lib.validate(c)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))

  task = tasks.build(c)
  dataset, model, sample = task.dataset, task.model, task.sample_input
  global_batch = c.num_workers * c.per_worker_batch_size
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
  runner = build_runner(c, model, tx, variables, sample, mesh, task)
  evaluate = make_eval_fn(task, mesh)

  checkpointer = Checkpointer(workdir, c)
  state = runner.init()
  start = 0
  restored = checkpointer.restore_latest(jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  if restored is not None:
    state, meta = restored
    start = meta["data_position"]
  log = MetricsLog(workdir)
  if task.baseline and start == 0:  # Once per run, not again on resume.
    log.write(0, task.baseline)
  tokens_per_step = global_batch * task.tokens_per_example
  last_log = [time.time(), start]  # For tokens per second between two logs.
  batches = dataset.train_batches(global_batch, seed=c.seed, start_step=start,
                                  process_index=jax.process_index(),
                                  process_count=jax.process_count())

  def eval_now():
    return evaluate(runner.variables(state), dataset.eval_batches(
        c.eval_batch_size, process_index=jax.process_index(), process_count=jax.process_count()))

  def check_and_log(step, metrics):
    """Checks the finished step's loss; logs it if due (``step`` counts from 1)."""
    metrics = jax.device_get(metrics)
    loss = float(np.mean(metrics["loss"]))
    if not math.isfinite(loss):
      raise FloatingPointError(
          f"Non-finite training loss {loss} at step {step}. Lower --config.learning_rate, or "
          "resume from the last checkpoint with a smaller one.")
    if step % c.log_every_steps == 0 or step == num_steps:
      extra = {}
      if tokens_per_step:
        now = time.time()
        extra["train/tokens_per_second"] = (step - last_log[1]) * tokens_per_step / (now - last_log[0])
        last_log[:] = now, step
      log.write(step, {**_scalars(metrics), "train/learning_rate": float(lr(step - 1)), **extra})

  t0 = time.time()
  pending = None  # The previous step's metrics, fetched after the next step is dispatched.
  step = start
  progress = tqdm.tqdm(total=num_steps, initial=start, disable=jax.process_index() != 0,
                       desc="train", unit="step")
  eval_metrics = {}
  preempted = False
  with _Preemption() as preemption:
    while step < num_steps:
      state, metrics = runner.step(state, to_global(next(batches), mesh))
      step += 1
      if pending is not None:
        check_and_log(*pending)
      pending = (step, metrics)
      progress.update(1)
      if step % c.eval_every_steps == 0 or step == num_steps:
        check_and_log(*pending)
        pending = None
        eval_metrics = eval_now()
        log.write(step, eval_metrics)
        progress.set_postfix({k.split("/")[1]: f"{v:.3f}" for k, v in eval_metrics.items()})
      stop = preemption.stop_at(step)
      if step % c.checkpoint_every_steps == 0 or step == num_steps or stop:
        checkpointer.save(step, state, data_position=step, seed=c.seed)
      if stop:
        preempted = True
        break
    if pending is not None:
      check_and_log(*pending)
  progress.close()
  wall = time.time() - t0
  checkpointer.close()
  log.close()
  summary = {"final_step": step, "num_train_steps": num_steps, "preempted": preempted,
             "wall_time_s": wall, "steps_per_second": (step - start) / wall if wall else 0.0,
             **({"tokens_per_second": (step - start) * tokens_per_step / wall}
                if tokens_per_step and wall else {}),
             **{k.replace("baseline/", ""): v for k, v in task.baseline.items()},
             **{k.replace("eval/", "final_"): v for k, v in eval_metrics.items()}}
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary


def to_global(local_batch: dict, mesh) -> dict:
  """The process-local rows as one global array sharded over the mesh's first axis."""
  sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
  if jax.process_count() == 1:
    return jax.device_put(local_batch, sharding)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)
