"""Checkpoints, the resume policy and the workdir.

A checkpoint holds the portable state (`cdpjax.executor.Executor.to_portable`)
and the config; a resume refuses a config change that would change the
trajectory (``RESUMABLE_KEYS`` may change), falls back past an unreadable
checkpoint and sets aside the checkpoints of a diverged run. Process 0 locks
the workdir, whose paths must be of the kind the run writes (``WORKDIR_LAYOUT``).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from cdpjax import config as config_lib
from cdpjax.train.errors import CheckpointMismatchError, WorkdirError, first_line
from cdpjax.train.setup import Runner


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
                  "devices_per_worker", "parallelism", "tied_backward", "gradient_reduction")


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


all_finite = jax.jit(_finite)


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
      lines = "\n".join(f"  {self._where(s)}: {type(e).__name__}: {first_line(e)}"
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
                      first_line(e), step, os.path.join(self.workdir, "unreadable_checkpoints"))
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


def prepare_workdir(workdir: str) -> WorkdirLock | None:
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


def abstract_portable(runner: Runner, state):
  """What a checkpoint restores into: the portable form of ``state``'s shapes and shardings."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, runner.to_portable(state))
