"""A run moves between parallelisms: checkpoints hold one portable state that every executor reads.

ResNet-18 of configs/digits.py (heterogeneous stages cut by FLOPs, BatchNorm
statistics), N = J = 2, cdp-v2, SGD with momentum and weight decay, one
checkpoint a step:

- the conversion is exact: `executed.pipeline.Trees` maps the engine's state
  of the transformer (AdamW, whose decay mask is a scalar per leaf) and of
  ResNet-18 (momentum, BatchNorm) to stage rows and back, bit for bit, in
  stage and in owner (ZeRO) row order, and into ZeRO-3's flat shards; a
  checkpoint restored under ``model`` or ``zero`` and converted back (`executor.Executor.to_portable`) is the checkpoint,
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

from cdpjax import engine, models, stages, train
from cdpjax.executed import pipeline, staged as staged_lib, zero
from test_executors import smoke_config

slow = pytest.mark.slow  # Not in the fast subset (README, Tests).

LEGS = ("data", "model", "zero", "data")


def config(parallelism, num_steps, **overrides):
  c = smoke_config("resnet18", parallelism, "cdp-v2", size=2)
  c.unlock()
  c.update(num_train_steps=num_steps, checkpoint_every_steps=1, **overrides)
  c.lock()
  return c


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.parametrize("name,optimizer", [("transformer", "adamw"), ("resnet18", "sgd")])
@pytest.mark.parametrize("layout", ["stages", "owners", "zero3"])
def test_trees_convert_the_engines_state_to_stage_rows_and_back_exactly(name, optimizer, layout):
  rng = np.random.default_rng(0)
  if name == "transformer":
    model = models.create_model(name, 32, vocab_size=32, num_layers=4, d_model=16, num_heads=2,
                                d_ff=32, seq_len=8, positions="learned", tie_embeddings=False)
    x = rng.integers(0, 32, size=(2, 8)).astype(np.int32)
  else:
    model = models.create_model(name, 10, width=4, stem="cifar")
    x = rng.normal(size=(2, 8, 8, 1)).astype(np.float32)
  variables = dict(model.init(jax.random.key(0), x, train=False))
  params = variables.pop("params")
  order = stages.execution_order(model, x, train=True)
  stage_ids = stages.partition(params, 4, order=order, by="params")
  staged = staged_lib.stage_model(model, params, stage_ids, x, model_state=variables or None,
                                  pad_to=4)
  c = smoke_config(name if name == "transformer" else "resnet18", "model", "cdp-v2", size=4)
  assert c.optimizer == optimizer
  tx = train.make_optimizer(c, lambda step: 1e-3)
  rule_delays = np.array([[1, 1, 0, 0]] * 4)  # Stages 2 and 3 read no stale version.
  state = engine.init_state(params, tx, rule="cdp-v2", model_state=variables or None)
  state = state._replace(  # Moved off theta_0, so that the versions and moments differ.
      stale_params=(jax.tree.map(lambda p: p - 0.5, state.params),),
      opt_state=jax.tree.map(lambda s: s + 0.25 if s.dtype == np.float32 else s + 3,
                             state.opt_state))
  if layout == "zero3":  # One flat row of 4 shards, each stage at its own size.
    trees = zero.trees(staged, tx, 4, "zero3")
    shape = (1, 4 * sum(zero.shard_sizes(staged, 4)))
  else:
    trees = pipeline.Trees(staged, tx, (lambda r: r[::-1]) if layout == "owners" else (lambda r: r))
    shape = (4, staged.param_size)
  rows = trees.from_trees(state)
  assert rows.params.shape == shape
  back = trees.to_trees(rows, rule_delays.max(axis=0))
  kept = jax.tree.leaves(back.stale_params, is_leaf=lambda v: v is None)
  assert any(v is None for v in kept) and any(v is not None for v in kept)
  want = state._replace(stale_params=jax.tree.map(
      lambda v, s: v if s is not None else None, state.stale_params, back.stale_params,
      is_leaf=lambda v: v is None))
  assert jax.tree.structure(back) == jax.tree.structure(want)
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


def move(workdir, **overrides):
  """Trains the run in ``workdir`` along ``LEGS``, one step each."""
  for step, parallelism in enumerate(LEGS, 1):
    train.train_and_evaluate(config(parallelism, step, **overrides), workdir)
  return workdir


def assert_same_losses(got_dir, want_dir):
  want, got = losses(want_dir), losses(got_dir)
  assert sorted(got) == sorted(want) == list(range(1, len(LEGS) + 1))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                             rtol=1e-5)


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
  """The workdir of the run moved along ``LEGS``, one step each."""
  return move(str(tmp_path_factory.mktemp("moved")))


@slow
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


@slow
def test_a_run_moved_through_every_parallelism_logs_the_straight_runs_losses(moved, tmp_path):
  straight = str(tmp_path / "straight")
  train.train_and_evaluate(config("data", len(LEGS)), straight)
  assert_same_losses(moved, straight)


@slow
def test_a_compensated_run_moves_through_every_parallelism(tmp_path):
  """Weight prediction's extra version, DC-ASGD and the delay-scaled rate survive each move:
  the moved run logs the straight compensated run's losses. DC-ASGD at 0.5: at 5, its
  g * g terms on the smoke ResNet amplify the executors' float32 rounding to 9e-4 of the loss
  at step 4 after data -> model -> zero (measured; data -> data -> zero and each leg alone
  agree to 1e-7); at 0.5 the moved run agrees to 1e-7."""
  keys = {"weight_prediction": True, "dc_lambda": 0.5, "lr_delay_scale": 1.0}
  moved_dir = move(str(tmp_path / "moved"), **keys)
  straight, plain = str(tmp_path / "straight"), str(tmp_path / "plain")
  train.train_and_evaluate(config("data", len(LEGS), **keys), straight)
  train.train_and_evaluate(config("data", len(LEGS)), plain)
  assert_same_losses(moved_dir, straight)
  last = len(LEGS)
  assert abs(losses(straight)[last] / losses(plain)[last] - 1) > 1e-5  # The keys change the run.
