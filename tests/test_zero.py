"""CDP-ZeRO and ZeRO-3 against the replicated engine, their HLO, memory and plan."""
import importlib.util
import json
import os
from collections import Counter

import jax
import numpy as np
import optax
import pytest

from cdpjax import compiled, engine, schedule, zero
from cdpjax.models.residual_mlp import ResidualMLP

RTOL = 1e-5
PER_WORKER = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(num_workers, width=16, hidden=32, blocks_per_stage=1):
  """A ResidualMLP and random params of its shapes (numpy: no compile needed)."""
  num_blocks = num_workers * blocks_per_stage
  model = ResidualMLP(num_classes=10, width=width, hidden=hidden, num_blocks=num_blocks)
  shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))
  rng = np.random.default_rng(0)

  def init(path, leaf):
    name = path[-1].key
    if name == "scale":
      return np.ones(leaf.shape, np.float32)
    scale = leaf.shape[0] ** -0.5 if name == "kernel" else 0.1
    return (rng.normal(size=leaf.shape) * scale).astype(np.float32)
  return model, jax.tree_util.tree_map_with_path(init, shapes["params"]), num_blocks


def batches_of(num_workers, steps):
  rng = np.random.default_rng(1)
  n = num_workers * PER_WORKER
  return [{"image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, n).astype(np.int32)} for _ in range(steps)]


def mesh_of(n):
  return jax.make_mesh((n,), ("data",))


def run_engine(model, params, rule, batches, tx, num_workers, blocks_per_stage=1):
  def loss_fn(p, batch):
    logits = model.apply({"params": p}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  def stage_of(unit):
    if unit == "embed":
      return 0
    return num_workers - 1 if unit == "head" else int(unit.split("_")[1]) // blocks_per_stage
  stage_ids = {u: jax.tree.map(lambda _, s=stage_of(u): s, params[u]) for u in params}
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule,
                                mesh=mesh_of(num_workers))
  state, losses = engine.init_state(params, tx, rule=rule), []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state.params, losses


_STEPS = {}


def step_for(num_workers, rule):
  """One step per configuration for the module: jit compiles it once, and
  ``lower(...).compile()`` then reuses that compilation."""
  if (num_workers, rule) not in _STEPS:
    _STEPS[num_workers, rule] = zero.make_train_step(
        optax.adam(1e-2), rule=rule, mesh=mesh_of(num_workers), num_blocks=num_workers)
  return _STEPS[num_workers, rule]


def hlo_for(num_workers, rule):
  _, params, num_blocks = make_model(num_workers)
  state = zero.init_state(params, optax.adam(1e-2), rule=rule, mesh=mesh_of(num_workers),
                          num_blocks=num_blocks)
  return step_for(num_workers, rule).lower(state, batches_of(num_workers, 1)[0]).compile()


@pytest.mark.parametrize("num_workers,rule", [(2, "dp"), (2, "cdp-v1"), (4, "cdp-v2")])
def test_losses_and_params_match_engine(num_workers, rule):
  model, params, num_blocks = make_model(num_workers)
  tx = optax.adam(1e-2)
  batches = batches_of(num_workers, 3)
  step = step_for(num_workers, rule)
  assert step.schedule == ("zero3" if rule == "dp" else "cyclic")  # dp runs ZeRO-3.
  state = zero.init_state(params, tx, rule=rule, mesh=mesh_of(num_workers),
                          num_blocks=num_blocks)
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    assert metrics["loss_per_worker"].shape == (num_workers,)
    np.testing.assert_allclose(metrics["loss"], np.mean(metrics["loss_per_worker"]), rtol=1e-6)
    losses.append(float(metrics["loss"]))
  ref_params, ref_losses = run_engine(model, params, rule, batches, tx, num_workers)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6),
               zero.current_params(state), jax.tree.map(np.asarray, ref_params))
  assert int(state.step) == 3


def test_cyclic_step_has_only_collective_permutes_matching_the_plan():
  found = compiled.collectives(hlo_for(4, "cdp-v2").as_text())
  assert {c.kind for c in found} == {"collective-permute"}
  pairs = Counter(p for c in found for p in c.source_target_pairs)
  plan = zero.cyclic_transfers(schedule.delay_matrix("cdp-v2", 4, 4))
  assert pairs == Counter((t.src, t.dst) for t in plan)


def test_zero3_gathers_at_use_and_reduce_scatters():
  summary = compiled.collective_summary(hlo_for(2, "dp").as_text())
  assert summary["all-gather"]["count"] == 4  # Each stage, in the forward and the backward.
  assert summary["reduce-scatter"]["count"] == 2
  assert summary["all-reduce"]["count"] == summary["collective-permute"]["count"] == 0


def test_plan_sends_each_stage_once_per_use_and_lands_gradients_at_owners():
  num_workers = 4
  for rule in ("cdp-v1", "cdp-v2"):
    plan = zero.cyclic_transfers(schedule.delay_matrix(rule, num_workers, num_workers))
    params = [t for t in plan if t.kind == "param"]
    # Every worker receives every stage it does not own once forward, once backward.
    assert Counter((t.dst, t.stage) for t in params) == Counter(
        {(i, j): 2 for i in range(num_workers) for j in range(num_workers)
         if i != num_workers - 1 - j})
    assert all(t.src == t.dst - 1 for t in params if t.route == "ring")
    assert {t.dst for t in params if t.route == "owner"} == {0}
    grads = [t for t in plan if t.kind == "grad"]
    # Each non-owner sends one gradient buffer per stage; chains end at the owner.
    assert Counter((t.src, t.stage) for t in grads) == Counter(
        {(i, j): 1 for i in range(num_workers) for j in range(num_workers)
         if i != num_workers - 1 - j})
    for j in range(num_workers):
      senders = {t.src for t in grads if t.stage == j}
      targets = {t.dst for t in grads if t.stage == j}
      assert targets - senders == {num_workers - 1 - j}


def test_model_states_are_one_nth_of_the_replicated_engine():
  num_workers = 4
  _, params, num_blocks = make_model(num_workers, width=64, hidden=256)
  tx = optax.adam(1e-3)
  state = zero.init_state(params, tx, rule="cdp-v2", mesh=mesh_of(num_workers),
                          num_blocks=num_blocks)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  replicated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      jax.eval_shape(lambda: engine.init_state(params, tx, rule="cdp-v2"))))
  assert per_device <= 1.2 * replicated / num_workers


def test_current_params_round_trips():
  _, params, num_blocks = make_model(4, blocks_per_stage=2)
  state = zero.init_state(params, optax.sgd(0.1), rule="cdp-v2", mesh=mesh_of(4),
                          num_blocks=num_blocks)
  jax.tree.map(np.testing.assert_array_equal, zero.current_params(state), params)


class TestBadInput:

  def setup_method(self):
    _, self.params, self.num_blocks = make_model(2)
    self.tx = optax.sgd(0.1)

  def test_blocks_not_a_multiple_of_workers(self):
    with pytest.raises(ValueError, match="num_blocks=2 is not a positive multiple of the 4"):
      zero.make_train_step(self.tx, rule="cdp-v2", mesh=mesh_of(4), num_blocks=2)

  def test_num_stages_must_equal_num_workers(self):
    with pytest.raises(ValueError, match=r"needs \(N, J\) = \(2, 2\).*engine"):
      zero.make_train_step(self.tx, rule=np.ones((2, 3), int), mesh=mesh_of(2), num_blocks=2)

  def test_params_of_another_model(self):
    with pytest.raises(ValueError, match="expected embed, block_0..block_3, head"):
      zero.init_state(self.params, self.tx, rule="cdp-v2", mesh=mesh_of(2), num_blocks=4)

  def test_unknown_schedule_and_rule(self):
    with pytest.raises(ValueError, match="Unknown schedule 'gpipe'"):
      zero.make_train_step(self.tx, rule="cdp-v2", mesh=mesh_of(2), num_blocks=2,
                           schedule="gpipe")
    with pytest.raises(ValueError, match="Unknown rule"):
      zero.make_train_step(self.tx, rule="cdp-v9", mesh=mesh_of(2), num_blocks=2)

  def test_mesh_without_data_axis(self):
    with pytest.raises(ValueError, match="no axis 'data'"):
      zero.init_state(self.params, self.tx, rule="cdp-v2",
                      mesh=jax.make_mesh((2,), ("stage",)), num_blocks=2)

  def test_batch_not_divisible_and_state_rule_mismatch(self):
    state = zero.init_state(self.params, self.tx, rule="cdp-v2", mesh=mesh_of(2), num_blocks=2)
    step = zero.make_train_step(self.tx, rule="cdp-v2", mesh=mesh_of(2), num_blocks=2)
    batch = {"image": np.zeros((3, 8, 8, 1), np.float32), "label": np.zeros(3, np.int32)}
    with pytest.raises(ValueError, match="num_workers \\* b rows"):
      step(state, batch)
    dp_step = zero.make_train_step(self.tx, rule="dp", mesh=mesh_of(2), num_blocks=2)
    with pytest.raises(ValueError, match="keeps 1 stale versions, rule 'dp' needs 0"):
      dp_step(state, batches_of(2, 1)[0])


def test_benchmark_quick_writes_json(tmp_path):
  spec = importlib.util.spec_from_file_location(
      "bench_zero", os.path.join(ROOT, "experiments", "bench_zero.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)  # Keeps the 8 devices conftest set up.
  bench.main(["--quick", "--results_dir", str(tmp_path)])
  (path,) = tmp_path.glob("*.json")
  result = json.loads(path.read_text())
  assert {r["schedule"] for r in result["runs"]} == {"cyclic", "zero3", "engine"}
  for row in result["runs"]:
    for key in ("num_workers", "schedule", "rule", "memory", "collectives",
                "bytes_per_device_per_step", "max_slot_bytes", "step_time_ratio"):
      assert key in row
    assert set(row["memory"]) >= {"parameters", "optimizer", "temporaries"}
  assert result["goals"]["2"]["only_point_to_point"]
