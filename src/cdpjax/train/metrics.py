"""The metrics a run logs: ``metrics.jsonl``, TensorBoard, and the check that losses are finite."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import logging

from cdpjax.train.errors import NonFiniteError
from cdpjax.train.setup import Run


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


def logged(c, step: int, num_steps: int) -> bool:
  """Whether ``step`` (counting from 1) is written to the metrics."""
  return step % c.log_every_steps == 0 or step == num_steps


class StepLog:
  """Checks a finished call's losses and writes its logged steps."""

  def __init__(self, c, run: Run, log: MetricsLog, start: int):
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
             if logged(self.c, first + i, self.run.num_steps)]
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
