"""A run moves between parallelisms: checkpoints hold one portable state that every executor reads.

ResNet-18 of configs/digits.py (heterogeneous stages cut by FLOPs, BatchNorm
statistics), N = J = 4, cdp-v2, SGD with momentum and weight decay, one
checkpoint a step:

- the conversion is exact: a checkpoint restored under ``model`` or ``zero``
  and converted back (`executor.Executor.to_portable`) is the checkpoint,
  bit for bit, as the engine restores it (every version kept, the optimizer
  state with its step count, the BatchNorm statistics);
- the run ``data -> model -> zero -> data``, one step each, logs the losses of
  the straight ``data`` run within the executors' tolerance (tests/test_executors.py).
"""
import json
import os

import jax
import numpy as np
import pytest

from cdpjax import train
from test_executors import smoke_config

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

LEGS = ("data", "model", "zero", "data")


def config(parallelism, num_steps, **overrides):
  c = smoke_config("resnet18", parallelism, "cdp-v2", size=4)
  c.unlock()
  c.update(num_train_steps=num_steps, checkpoint_every_steps=1, **overrides)
  c.lock()
  return c


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
  """The workdir of the run moved along ``LEGS``, one step each."""
  workdir = str(tmp_path_factory.mktemp("moved"))
  for step, parallelism in enumerate(LEGS, 1):
    train.train_and_evaluate(config(parallelism, step), workdir)
  return workdir


@pytest.mark.parametrize("parallelism", ["model", "zero"])
def test_a_checkpoint_converts_back_to_itself_bit_for_bit(moved, parallelism):
  _, portable, step = train.restore(config("data", len(LEGS)), moved)
  run, state, again = train.restore(config(parallelism, len(LEGS)), moved)
  assert again == step == len(LEGS)
  back = run.runner.to_portable(state)
  assert jax.tree.structure(back) == jax.tree.structure(portable)
  assert any(x is None for x in jax.tree.leaves(portable.stale_params, is_leaf=lambda x: x is None))
  paths = jax.tree_util.tree_flatten_with_path(portable)[0]
  for (path, want), got in zip(paths, jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))


def test_a_run_moved_through_every_parallelism_logs_the_straight_runs_losses(moved, tmp_path):
  straight = str(tmp_path / "straight")
  train.train_and_evaluate(config("data", len(LEGS)), straight)
  want, got = losses(straight), losses(moved)
  assert sorted(got) == sorted(want) == list(range(1, len(LEGS) + 1))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                             rtol=1e-5)
