"""Training and evaluation from a config: the framework's main job.

``train_and_evaluate(config, workdir)`` builds the model, data, mesh and the
train step of ``config.parallelism`` (``data``: the update-rule engine;
``model``: the executed CDP+MP pipeline; ``zero``: the executed CDP+ZeRO
ring), resumes from the newest checkpoint in ``workdir`` and trains, ``K``
steps per compiled call (`steps_per_call`), writing ``config.json``,
``metrics.jsonl``, TensorBoard events and ``summary.json``.

Faults and misuse: the workdir is locked; a resume refuses a config change
that would change the trajectory (``RESUMABLE_KEYS`` may change) and falls
back past an unreadable checkpoint; only finite states are checkpointed; an
error waits for the save in flight and names the newest checkpoint; after a
divergence, the checkpoints whose loss is not known finite are set aside;
SIGTERM, SIGHUP and Ctrl-C checkpoint and stop (the launcher then exits
``EXIT_PREEMPTED``).
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import re
import signal
import socket
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import config as config_lib
from cdpjax import engine, models, stages, tasks
from cdpjax import executor as executor_lib
from cdpjax import executors


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
    opt = optax.adam(lr)
  elif c.optimizer == "adamw":  # optax.adamw's chain, with the mask kept in the state.
    opt = optax.chain(optax.scale_by_adam(), decay_matrices(c.weight_decay),
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


def steps_per_call(c, platform: str | None = None) -> tuple[int, str]:
  """``(K, why)``: the largest ``K <= steps_per_call`` dividing the eval and checkpoint intervals.

  Those steps then end a call, so one compiled ``K`` serves the whole run; a
  logged step needs no call boundary (its metrics come with its call). On
  the ``"cpu"`` ``platform`` the engine (``parallelism="data"``) runs a
  convolutional model one step per call (``why`` says so; empty otherwise):
  the engine gains only dispatch time from a scan, and the CPU's scanned
  backward convolutions cost far more. The executed schedules keep ``K``,
  which removes their fill and drain.
  """
  every = math.gcd(c.eval_every_steps, c.checkpoint_every_steps)
  k = max(k for k in range(1, min(c.steps_per_call, every) + 1) if every % k == 0)
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
                              c.num_stages)

  def build(k):  # K = 1 is the step without scan (the engine then rotates its versions).
    return executors.build(
        c.parallelism, model, tx, params=params, model_state=model_state, stage_ids=stage_ids,
        sample_input=sample, rule=plan, mesh=mesh, loss_fn=tasks.cross_entropy,
        backend=c.backend, scan_steps=k if k > 1 else None)

  num, why = steps_per_call(c, jax.default_backend())
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


EXIT_PREEMPTED = 75
"""The launcher's exit status after SIGTERM, SIGHUP or Ctrl-C: a checkpoint was saved
and rerunning the same command resumes (``EX_TEMPFAIL`` of sysexits.h)."""


class TrainError(Exception):
  """An error whose message says what to do; the launcher prints it without a traceback."""


class CheckpointMismatchError(TrainError, ValueError):
  """A checkpoint in the workdir belongs to an incompatible config, or none is readable."""


class WorkdirError(TrainError):
  """The workdir cannot be used: not a directory, not writable, or in use."""


class NonFiniteError(TrainError, FloatingPointError):
  """The loss or the parameters stopped being finite.

  ``unsafe_from``: checkpoints of this step and later are not known to give a
  finite loss. The loss of step ``s`` is computed at ``theta_{s-1}`` (and, for
  delayed stages, ``theta_{s-2}``), the versions checkpoint ``s - 1`` holds; so
  a non-finite loss at step ``s`` makes checkpoints from ``s - 1`` on unsafe.
  """

  def __init__(self, message: str, unsafe_from: int):
    super().__init__(message)
    self.unsafe_from = unsafe_from


# Config keys a resume may change: they change the learning rate, the length
# of the run or what is written, which is what a user continues a run to do,
# or which executor runs the same rule on which devices (parallelism, backend,
# devices_per_worker: checkpoints hold the portable state, `executor.Executor`,
# which each executor restores into its own layout).
# Every other key changes the trajectory (the seed and batch size pick the
# data, the rest the algorithm or model), so a change refuses to resume.
RESUMABLE_KEYS = ("learning_rate", "lr_schedule", "lr_decay_factor", "lr_decay_every_epochs",
                  "warmup_epochs", "num_train_steps", "num_epochs", "log_every_steps",
                  "eval_every_steps", "checkpoint_every_steps", "keep_checkpoints",
                  "eval_batch_size", "data_dir", "backend", "steps_per_call", "resume_step",
                  "devices_per_worker", "parallelism")


def _config_dict(c) -> dict:
  return json.loads(c.to_json_best_effort())


def config_changes(saved: dict, current: dict) -> tuple[dict, dict]:
  """``(refused, allowed)``: the keys whose value differs, as ``{key: (saved, current)}``.

  A key the checkpoint does not know (one added to the configs since) is not
  compared, unless `config.ADDED_KEYS` gives the value it ran with; a renamed
  key (`config.RENAMED_KEYS`) is compared under its new name.
  """
  saved = {**config_lib.ADDED_KEYS,
           **{config_lib.RENAMED_KEYS.get(k, k): v for k, v in saved.items()}}
  diff = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v}
  allowed = {k: d for k, d in diff.items() if k in RESUMABLE_KEYS}
  return {k: d for k, d in diff.items() if k not in allowed}, allowed


def _finite(loss, variables) -> jax.Array:
  """One fused reduction: whether the loss and every float leaf are finite."""
  leaves = [x for x in [loss, *jax.tree.leaves(variables)] if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


_all_finite = jax.jit(_finite)


class Checkpointer:
  """orbax CheckpointManager of (state, metadata), refusing incompatible runs."""

  def __init__(self, workdir: str, c):
    self.config = _config_dict(c)
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=c.keep_checkpoints, create=True))
    self.saved_step = None  # The newest step saved by this run (maybe still being written).

  def save(self, step: int, state, data_position: int) -> None:
    meta = {"config": self.config, "step": step, "data_position": data_position}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self.saved_step = step

  def _where(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def check_config(self, meta: dict, step: int) -> None:
    saved = meta.get("config")
    if saved is None:  # Checkpoints of earlier versions saved the identity keys and the seed.
      saved = {**meta["identity"], "seed": meta["seed"]}
    refused, allowed = config_changes(saved, self.config)
    if refused:
      lines = "\n".join(f"  {k}: checkpoint {a!r}, config {b!r}" for k, (a, b) in refused.items())
      raise CheckpointMismatchError(
          f"The checkpoint in {self._where(step)} comes from a different run:\n{lines}\n"
          "Resuming with these changed would change the trajectory. Restore them with "
          "--config.KEY=VALUE, or use a fresh --workdir to start a new run.")
    for k, (a, b) in allowed.items():
      logging.warning("Resuming from step %d with %s changed: %r -> %r.", step, k, a, b)

  def restore_latest(self, abstract_state, resume_step: int = -1):
    """``(state, meta)`` of the newest readable checkpoint, or ``None`` without one.

    An unreadable checkpoint (a disk fault, a copy cut short) is reported and
    moved to ``unreadable_checkpoints/``, and the previous one is used; a
    checkpoint of a different config is refused. ``resume_step >= 0``: that
    checkpoint, the newer ones moved to ``superseded_checkpoints/``.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    # A run that already resumed from resume_step wrote the newest: resume it, as any run.
    if resume_step >= 0 and not (steps and self._resumed_from(steps[0]) == resume_step):
      if resume_step not in steps:
        raise CheckpointMismatchError(
            f"--config.resume_step={resume_step}: there is no checkpoint {self._where(resume_step)}"
            f"; the checkpoints are at steps {sorted(steps) or 'none'}. Give one of them, or -1 "
            "for the newest.")
      newer = [s for s in steps if s > resume_step]
      if newer:
        logging.warning("Resuming from step %d: checkpoints %s are moved to %s.", resume_step,
                        newer, self._move(newer, "superseded_checkpoints"))
      steps = [resume_step]
    unreadable = []
    for step in steps:
      try:
        meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        unreadable.append((step, e))
        continue
      self.check_config(meta, step)
      try:
        state = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))["state"]
      except Exception as e:  # pylint: disable=broad-except
        unreadable.append((step, e))
        continue
      if unreadable:
        self._set_aside(unreadable, step)
      return state, meta
    if unreadable:
      lines = "\n".join(f"  {self._where(s)}: {type(e).__name__}: {_first_line(e)}"
                        for s, e in unreadable)
      raise CheckpointMismatchError(
          f"No checkpoint in {self.directory} can be restored into this run's state:\n{lines}\n"
          "If the code changed since they were written, run the version that wrote them; "
          "otherwise use a fresh --workdir (or delete the checkpoints to start over).")
    return None

  def _resumed_from(self, step: int) -> int | None:
    """The ``resume_step`` of the run that wrote checkpoint ``step`` (None: unreadable)."""
    try:
      return self.read_meta(step)["config"].get("resume_step", -1)
    except Exception:  # pylint: disable=broad-except
      return None

  def _set_aside(self, unreadable, step: int) -> None:
    for s, e in unreadable:
      logging.warning("Checkpoint %s is unreadable (%s: %s); resuming from the previous one, "
                      "step %d. It is moved to %s.", self._where(s), type(e).__name__,
                      _first_line(e), step, os.path.join(self.workdir, "unreadable_checkpoints"))
    self._move([s for s, _ in unreadable], "unreadable_checkpoints")

  def _move(self, steps, folder: str) -> str:
    """Moves the checkpoints of ``steps`` to ``workdir/folder`` (kept, out of the way)."""
    aside = os.path.join(self.workdir, folder)
    if jax.process_index() == 0 and steps:
      os.makedirs(aside, exist_ok=True)
      for s in steps:
        os.replace(self._where(s), os.path.join(aside, f"{s}-{int(time.time())}"))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"cdpjax: checkpoints moved to {folder}")
    self.manager.reload()
    return aside

  def set_aside_diverged(self, unsafe_from: int) -> str:
    """After a divergence: moves checkpoints from ``unsafe_from`` on aside; says where to resume."""
    unsafe = [s for s in self.manager.all_steps() if s >= unsafe_from]
    moved = ""
    if unsafe:
      aside = self._move(unsafe, "diverged_checkpoints")
      moved = (f"Checkpoint(s) {', '.join(map(str, sorted(unsafe)))} were moved to {aside}: "
               "the loss at their parameters is not known to be finite. ")
    step = self.manager.latest_step()
    if step is None:
      return moved + ("No checkpoint is left to resume from: lower --config.learning_rate and "
                      "rerun, which starts from step 0.")
    return moved + (f"The newest checkpoint is {self._where(step)} (step {step}): rerun with a "
                    "lower --config.learning_rate to resume from it, or choose an older one "
                    "with --config.resume_step=N.")

  def newest(self) -> str:
    """Where the newest saved checkpoint is, for error messages."""
    step = self.manager.latest_step()
    if step is None:
      return f"No checkpoint was saved in {self.directory}: a rerun starts from step 0."
    return (f"The newest checkpoint is {self._where(step)} (step {step}): rerunning the same "
            "command resumes from it.")

  def finish_after_error(self, diverged_from: int | None = None) -> str:
    """Waits for the save in flight, so it is kept whole; returns ``newest()``, or after a
    divergence ``set_aside_diverged(diverged_from)``."""
    failed = ""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      failed = f"Saving checkpoint {self.saved_step} failed ({type(e).__name__}: {e}). "
    if diverged_from is None:
      return failed + self.newest()
    return failed + self.set_aside_diverged(diverged_from)

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [""])[0][:300]


class WorkdirLock:
  """``workdir/lock``, held (``flock``) by process 0 of the run that uses the workdir.

  The kernel releases the lock when its process ends in any way, kill -9
  included, so a lock file left behind by a dead run is stale and is taken
  over; the file names the holder for the error a second run gets.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "lock")
    self.file = None

  def acquire(self) -> None:
    try:
      self.file = open(self.path, "a+")
    except OSError as e:
      raise WorkdirError(f"Cannot write in --workdir {os.path.dirname(self.path)} ({e.strerror}): "
                         "give a directory this user can write.") from e
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.file.seek(0)
      holder = self.file.read().strip() or "another process"
      self.file.close()
      raise WorkdirError(
          f"--workdir {os.path.dirname(self.path)} is in use by {holder}. Two runs in one "
          "workdir would mix their checkpoints and metrics: wait for it to end, stop it, or "
          "use another --workdir.") from None
    self.file.seek(0)
    previous = self.file.read().strip()
    if previous:
      logging.info("Taking over the lock of an ended run (%s).", previous)
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f"pid {os.getpid()} on host {socket.gethostname()} "
                    f"(started {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
    self.file.flush()

  def release(self) -> None:
    if self.file is not None:
      self.file.close()  # Closing releases the flock.
      self.file = None


# What a run writes in its workdir: name -> whether it is a directory.
WORKDIR_LAYOUT = {"lock": False, "config.json": False, "metrics.jsonl": False,
                  "summary.json": False, "checkpoints": True, "tensorboard": True}


def _prepare_workdir(workdir: str) -> WorkdirLock | None:
  """Creates ``workdir`` and, on process 0, locks it; raises WorkdirError naming the fix."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir {workdir} is a file, not a directory: give a directory path.")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"Cannot create --workdir {workdir} ({e.strerror}): give a path this "
                       "user can write.") from e
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"--workdir {workdir} is not writable: give a directory this user can "
                       "write.")
  for name, is_dir in WORKDIR_LAYOUT.items():
    path = os.path.join(workdir, name)
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
      raise WorkdirError(
          f"{path} is a {'file' if is_dir else 'directory'}, where the run keeps its {name} "
          f"{'directory' if is_dir else 'file'}: move it out of --workdir {workdir} (or use "
          "another --workdir).")
  if jax.process_index() != 0:
    return None
  lock = WorkdirLock(workdir)
  lock.acquire()
  return lock


class _Interrupts:
  """SIGTERM, SIGHUP (a closed terminal or SSH session) and Ctrl-C (SIGINT) become a stop the
  loop checks, so it can checkpoint and exit.

  After the first Ctrl-C, a second one exits at once (the default action), for
  a user who does not want to wait for the step to end. With several
  processes, JAX's own notifier catches SIGTERM and the processes agree on the
  step to stop at, so that they all save the same one; Ctrl-C keeps Python's
  default there.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

  def __init__(self):
    self.requested = None  # The name of the signal that asked to stop.
    self._previous = {}

  def __enter__(self):
    if jax.process_count() > 1:
      return self
    try:
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    except ValueError:  # Not the main thread: no handler (and no preemption save).
      pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.requested = signal.Signals(signum).name
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      sys.stderr.write("\nInterrupted: saving a checkpoint at the end of this step, then "
                       "stopping. Press Ctrl-C again to exit at once, without it.\n")

  def __exit__(self, *exc):
    for s, previous in self._previous.items():
      signal.signal(s, previous)

  def stop_at(self, call: int) -> bool:
    """Whether to checkpoint and stop now; every process calls it after each call, numbered.

    JAX's sync point is the largest number the processes reported, plus one:
    so the numbers are consecutive (calls, not steps, which advance by ``K``).
    """
    if jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(call):
      self.requested = "SIGTERM"
    return self.requested is not None


def _read_jsonl(path: str) -> list[dict]:
  """The metric rows of ``path``; a line cut short by a kill, or not a JSON object, is dropped."""
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        row = None
      if isinstance(row, dict):
        rows.append(row)
      elif line.strip():
        logging.warning("%s:%d is not a JSON object of metrics: dropping it.", path, number)
  return rows


class MetricsLog:
  """metrics.jsonl and TensorBoard events, written by process 0 only.

  On a resume from ``start``, rows after ``start`` (written by a run that
  ended before it checkpointed them) are dropped, so the file holds one
  trajectory: a replayed step appears once.
  """

  def __init__(self, workdir: str, start: int = 0):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      path = os.path.join(workdir, "metrics.jsonl")
      if os.path.exists(path):
        kept = [r for r in _read_jsonl(path) if r.get("step", 0) <= start]
        with open(path + ".tmp", "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(path + ".tmp", path)
      # Imports TensorFlow (seconds), which the other processes never need.
      from flax.metrics import tensorboard  # pylint: disable=g-import-not-at-top
      self.file = open(path, "a")
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


class _Run(NamedTuple):
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


def _build(c) -> _Run:
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
  return _Run(dataset, mesh, runner, lambda v: evaluate(v, dataset.eval_batches(
      c.eval_batch_size, process_index=jax.process_index(), process_count=jax.process_count())),
              lr, num_steps, global_batch, model, sample, task)


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains per ``c``, resuming from ``workdir``; returns the summary.

  Raises:
    TrainError: a user error or a diverged run; the message says what to do.
  """
  config_lib.validate(c)
  lock = _prepare_workdir(workdir)
  try:
    return _train_locked(c, workdir)
  finally:
    if lock is not None:
      lock.release()


def _finished(c, workdir: str, checkpointer: Checkpointer) -> dict | None:
  """The summary of a run that already reached ``num_train_steps``, or ``None``.

  Checked before anything is built, so that rerunning a finished run is quick
  and leaves its summary alone.
  """
  path = os.path.join(workdir, "summary.json")
  step = checkpointer.manager.latest_step()
  if c.num_train_steps < 1 or step is None or step < c.num_train_steps or not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  if summary.get("final_step") != step or summary.get("preempted"):
    return None
  checkpointer.check_config(checkpointer.read_meta(step), step)
  return summary


def _train_locked(c, workdir: str) -> dict:
  checkpointer = Checkpointer(workdir, c)
  summary = _finished(c, workdir, checkpointer)
  if summary is not None:
    checkpointer.close()
    logging.warning("The run in %s already reached step %d: nothing to do (raise "
                    "--config.num_train_steps to train on).", workdir, summary["final_step"])
    return summary
  run = _build(c)
  state = run.runner.init()
  start = 0
  restored = checkpointer.restore_latest(_abstract_portable(run.runner, state), c.resume_step)
  if restored is not None:
    portable, meta = restored
    state = run.runner.from_portable(portable)
    start = meta["data_position"]
  # Only now, after the checks: config.json describes the run the checkpoints hold.
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  summary_path = os.path.join(workdir, "summary.json")
  if start >= run.num_steps and os.path.exists(summary_path):
    checkpointer.close()
    logging.warning("The run in %s already reached step %d of %d: nothing to do.", workdir,
                    start, run.num_steps)
    with open(summary_path) as f:
      return json.load(f)
  log = MetricsLog(workdir, start)
  if run.task.baseline and start == 0:  # Once per run, not again on resume.
    log.write(0, run.task.baseline)
  try:
    summary, state = _loop(c, run, state, start, checkpointer, log)
  except BaseException as e:
    where = checkpointer.finish_after_error(
        e.unsafe_from if isinstance(e, NonFiniteError) else None)
    if isinstance(e, Exception):
      e.add_note(where)
    raise
  finally:
    log.close()
  checkpointer.close()
  if not summary["preempted"]:
    summary.update(export_models(c, run, state, workdir))
  if jax.process_index() == 0:
    with open(summary_path, "w") as f:
      json.dump(summary, f, indent=2)
  return summary


def _logged(c, step: int, num_steps: int) -> bool:
  """Whether ``step`` (counting from 1) is written to the metrics."""
  return step % c.log_every_steps == 0 or step == num_steps


class _StepLog:
  """Checks a finished call's losses and writes its logged steps."""

  def __init__(self, c, run: _Run, log: MetricsLog, start: int):
    self.c, self.run, self.log = c, run, log
    self.tokens_per_step = run.global_batch * run.task.tokens_per_example
    self.last = (time.time(), start)  # For tokens per second between two logged calls.

  def __call__(self, first: int, metrics: dict) -> None:
    """``metrics`` of steps ``first, first + 1, ...`` (leading ``[k]`` axis)."""
    metrics = jax.device_get(metrics)
    losses = np.asarray(metrics["loss"])
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
      raise NonFiniteError(
          f"Non-finite training loss {losses[bad[0]]} at step {first + bad[0]}.",
          unsafe_from=first + int(bad[0]) - 1)
    steps = [first + i for i in range(len(losses))
             if _logged(self.c, first + i, self.run.num_steps)]
    extra = {}
    if steps and self.tokens_per_step:
      now, end = time.time(), first + len(losses) - 1
      extra["train/tokens_per_second"] = ((end - self.last[1]) * self.tokens_per_step
                                          / (now - self.last[0]))
      self.last = now, end
    for step in steps:
      row = jax.tree.map(lambda v, i=step - first: v[i], metrics)
      self.log.write(step, {**_scalars(row), "train/learning_rate": float(self.run.lr(step - 1)),
                            **extra})


def _loop(c, run: _Run, state, start: int, checkpointer: Checkpointer,
          log: MetricsLog) -> tuple[dict, Any]:
  """Steps ``start`` to ``num_steps``, ``K`` per call; returns the summary and the last state.

  A call ends at the next multiple of ``K`` (so at every eval and checkpoint
  step, which ``K`` divides) or at ``num_steps``.
  """
  dataset, runner, num_steps, task = run.dataset, run.runner, run.num_steps, run.task
  num = runner.steps_per_call
  check_and_log = _StepLog(c, run, log, start)
  batches = dataset.train_batches(run.global_batch, seed=c.seed, start_step=start,
                                  process_index=jax.process_index(),
                                  process_count=jax.process_count())

  t0 = time.time()
  pending = None  # The previous call's metrics, fetched after the next call is dispatched.
  step, calls = start, 0
  eval_metrics, eval_step = {}, None
  progress = tqdm.tqdm(total=num_steps, initial=start, disable=jax.process_index() != 0,
                       desc="train", unit="step")
  try:
    with _Interrupts() as interrupts:
      while step < num_steps:
        k = min(num - step % num, num_steps - step)
        # The health norms are passes over the parameters: only on logged steps.
        norms = [_logged(c, s, num_steps) for s in range(step + 1, step + k + 1)]
        state, metrics = runner.step(state, [task.pairs(next(batches)) for _ in range(k)], norms)
        if pending is not None:
          check_and_log(*pending)
        pending = (step + 1, metrics)
        step += k
        calls += 1
        progress.update(k)
        stop = interrupts.stop_at(calls)
        save = step % c.checkpoint_every_steps == 0 or step == num_steps or stop
        evaluate = step % c.eval_every_steps == 0 or step == num_steps
        if save or evaluate:
          check_and_log(*pending)
          pending = None
        if evaluate:
          eval_metrics, eval_step = run.evaluate(runner.variables(state)), step
          log.write(step, eval_metrics)
          progress.set_postfix({k.split("/")[1]: f"{v:.3f}" for k, v in eval_metrics.items()})
        if save:
          # A checkpoint is a promise that training can go on from it: only
          # finite parameters are saved (checked only on the steps that save).
          if not bool(_all_finite(metrics["loss"][-1], runner.variables(state))):
            raise NonFiniteError(
                f"The parameters after step {step} are not finite (the loss of that step was "
                "finite): not saving them.", unsafe_from=step)
          checkpointer.save(step, runner.to_portable(state), data_position=step)
        if stop:
          break
      if pending is not None:
        check_and_log(*pending)
  finally:
    progress.close()
  wall = time.time() - t0
  if step == num_steps and eval_step != step:  # Finished earlier, but no summary was written.
    eval_metrics, eval_step = run.evaluate(runner.variables(state)), step
  tokens_per_step = check_and_log.tokens_per_step
  summary = {"final_step": step, "num_train_steps": num_steps,
             "preempted": interrupts.requested is not None, "stopped_by": interrupts.requested,
             "wall_time_s": wall,
             "steps_per_second": (step - start) / wall if step > start else None,
             "steps_per_call": num, "idle_fraction": runner.idle_fraction,
             "eval_step": eval_step,
             **({"tokens_per_second": (step - start) * tokens_per_step / wall}
                if tokens_per_step and step > start else {}),
             **{k.replace("baseline/", ""): v for k, v in task.baseline.items()}}
  # final_* only for an evaluation of the final parameters; otherwise say which step.
  prefix = "final_" if eval_step == step else "eval_"
  summary.update({k.replace("eval/", prefix): v for k, v in eval_metrics.items()})
  return summary, state


def export_models(c, run: _Run, state, directory: str, prefix: str = "final_",
                  mean_view: bool | None = None) -> dict:
  """Saves ``theta_t`` as flax msgpack; with ``mean_view`` (default ``c.final_mean_view``), the
  authors' final model too.

  Writes to ``directory``: ``{prefix}params.msgpack`` (``theta_t``'s
  parameters), ``{prefix}model_state.msgpack`` for a model with state
  (BatchNorm statistics, ``{"batch_stats": ...}``) and, with ``mean_view``,
  ``{prefix}mean_view.msgpack`` (``engine.mean_worker_view``: for ``cdp-v1``,
  ``theta_{t-1}``), whose eval metrics it returns as ``{prefix}mean_view_accuracy`` ...
  """
  from flax import serialization  # pylint: disable=g-import-not-at-top
  variables = run.runner.variables(state)
  files = {"params": variables["params"]}
  model_state = {k: v for k, v in variables.items() if k != "params"}
  if model_state:
    files["model_state"] = model_state
  metrics = {}
  if c.final_mean_view if mean_view is None else mean_view:
    stage_ids = model_stage_ids(c, run.model, variables["params"], run.sample)
    plan = run.runner.plan
    delays = (plan.delays if plan.delays is not None
              else plan.rule(int(jax.device_get(state.step))))
    view = {**variables,
            "params": engine.mean_worker_view(run.runner.to_portable(state), stage_ids, delays)}
    files["mean_view"] = view["params"]
    metrics = {k.replace("eval/", f"{prefix}mean_view_"): v
               for k, v in run.evaluate(view).items()}
  files = _on_host(files)  # Every process takes part where arrays span processes.
  if jax.process_index() == 0:
    for name, tree in files.items():
      with open(os.path.join(directory, f"{prefix}{name}.msgpack"), "wb") as f:
        f.write(serialization.to_bytes(tree))
  return metrics


def exported(directory: str, prefix: str = "final_") -> dict:
  """``{"params": ..., "model_state": ...}`` (those present) as `export_models` wrote them."""
  from flax import serialization  # pylint: disable=g-import-not-at-top
  out = {}
  for name in ("params", "model_state", "mean_view"):
    path = os.path.join(directory, f"{prefix}{name}.msgpack")
    if os.path.exists(path):
      with open(path, "rb") as f:
        out[name] = serialization.msgpack_restore(f.read())
  return out


def restore(c, workdir: str) -> tuple[_Run, Any, int]:
  """``(run, state, step)``: the run of ``c`` rebuilt, at the newest checkpoint in ``workdir``."""
  run = _build(c)
  checkpointer = Checkpointer(workdir, c)
  try:
    restored = checkpointer.restore_latest(_abstract_portable(run.runner, run.runner.init()))
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f"{workdir} has no checkpoint yet: train first (cdpjax-train).")
  portable, meta = restored
  return run, run.runner.from_portable(portable), meta["step"]


def _abstract_portable(runner: Runner, state):
  """What a checkpoint restores into: the portable form of ``state``'s shapes and shardings."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, runner.to_portable(state))


def _on_host(tree):
  """Host numpy copies of ``tree``'s leaves, gathered where they are sharded over processes."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(get, tree)


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
