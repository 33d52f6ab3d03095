"""The training loop: resume, ``K`` steps a call, eval, checkpoints, signals, export.

``train_and_evaluate(config, workdir)`` is the framework's main job; see the
package docstring (`cdpjax.train`).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm
from absl import logging
from jax.experimental import multihost_utils

from cdpjax import config as config_lib
from cdpjax import engine
from cdpjax.train.checkpoints import Checkpointer, abstract_portable, all_finite, prepare_workdir
from cdpjax.train.errors import NonFiniteError
from cdpjax.train.metrics import MetricsLog, StepLog, logged
from cdpjax.train.setup import Run, build_run, model_stage_ids


class Interrupts:
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


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains per ``c``, resuming from ``workdir``; returns the summary.

  Raises:
    TrainError: a user error or a diverged run; the message says what to do.
  """
  config_lib.validate(c)
  lock = prepare_workdir(workdir)
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
  run = build_run(c)
  state = run.runner.init()
  start = 0
  restored = checkpointer.restore_latest(abstract_portable(run.runner, state), c.resume_step)
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


def _loop(c, run: Run, state, start: int, checkpointer: Checkpointer,
          log: MetricsLog) -> tuple[dict, Any]:
  """Steps ``start`` to ``num_steps``, ``K`` per call; returns the summary and the last state.

  A call ends at the next multiple of ``K`` (so at every eval and checkpoint
  step, which ``K`` divides) or at ``num_steps``.
  """
  dataset, runner, num_steps, task = run.dataset, run.runner, run.num_steps, run.task
  num = runner.steps_per_call
  check_and_log = StepLog(c, run, log, start)
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
    with Interrupts() as interrupts:
      while step < num_steps:
        k = min(num - step % num, num_steps - step)
        # The health norms are passes over the parameters: only on logged steps.
        norms = [logged(c, s, num_steps) for s in range(step + 1, step + k + 1)]
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
          if not bool(all_finite(metrics["loss"][-1], runner.variables(state))):
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


def export_models(c, run: Run, state, directory: str, prefix: str = "final_",
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


def restore(c, workdir: str) -> tuple[Run, Any, int]:
  """``(run, state, step)``: the run of ``c`` rebuilt, at the newest checkpoint in ``workdir``."""
  run = build_run(c)
  checkpointer = Checkpointer(workdir, c)
  try:
    restored = checkpointer.restore_latest(abstract_portable(run.runner, run.runner.init()))
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f"{workdir} has no checkpoint yet: train first (cdpjax-train).")
  portable, meta = restored
  return run, run.runner.from_portable(portable), meta["step"]


def _on_host(tree):
  """Host numpy copies of ``tree``'s leaves, gathered where they are sharded over processes."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(get, tree)
