"""The executed pipeline schedules against the engine, the timeline and the compiled program."""
import functools
import importlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import compiled, engine, pipeline, schedule
from cdpjax.models.residual_mlp import ResidualMLP

RTOL = 1e-5
ATOL = 1e-6
STEPS_PER_CALL = 2
CALLS = 2
PER_MICRO = 2
TXS = {"dp": optax.sgd(0.2, momentum=0.9), "cdp-v1": optax.sgd(0.2, momentum=0.9),
       "cdp-v2": optax.sgd(0.2, momentum=0.9)}
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def make_model(num_blocks):
  model = ResidualMLP(num_classes=10, width=8, hidden=16, num_blocks=num_blocks)
  return model, model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]


def make_batches(num_micro, num_steps, seed=0):
  rng = np.random.default_rng(seed)
  rows = num_micro * PER_MICRO
  return {"image": rng.normal(size=(num_steps, rows, 8, 8, 1)).astype(np.float32),
          "label": rng.integers(0, 10, size=(num_steps, rows)).astype(np.int32)}


def stage_ids_of(params, num_stages, num_blocks):
  """embed on stage 0, block l on stage l // k, head on stage J-1: the pipeline's layout."""
  k = num_blocks // num_stages
  stage = {"embed": 0, "head": num_stages - 1}
  stage.update({f"block_{l}": l // k for l in range(num_blocks)})
  return {name: jax.tree.map(lambda _, s=stage[name]: s, tree) for name, tree in params.items()}


@functools.cache
def engine_run(rule, num_micro, num_stages, num_blocks):
  """Losses and final params of the engine over CALLS * STEPS_PER_CALL steps."""
  model, params = make_model(num_blocks)

  def loss_fn(p, batch):
    logits = model.apply({"params": p}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  tx = TXS[rule]
  step = engine.make_train_step(
      loss_fn, tx, stage_ids=stage_ids_of(params, num_stages, num_blocks), rule=rule,
      mesh=jax.make_mesh((num_micro,), ("data",)), scan_steps=CALLS * STEPS_PER_CALL)
  state, metrics = step(engine.init_state(params, tx, rule=rule),
                        make_batches(num_micro, CALLS * STEPS_PER_CALL))
  return np.asarray(metrics["loss"]), state.params


@functools.cache
def compiled_step(rule, schedule_name, num_stages, num_blocks, scan_steps=STEPS_PER_CALL):
  """``(step, executable, state)``: one compile serves the run, the HLO and memory checks."""
  mesh = (jax.make_mesh((num_stages, num_stages), ("data", "stage")) if schedule_name == "dp+mp"
          else jax.make_mesh((num_stages,), ("stage",)))
  _, params = make_model(num_blocks)
  tx = TXS[rule]
  step = pipeline.make_train_step(tx, rule=rule, mesh=mesh, num_blocks=num_blocks,
                                  schedule=schedule_name, scan_steps=scan_steps)
  state = pipeline.init_state(params, tx, rule=rule, mesh=mesh, num_blocks=num_blocks)
  batch = make_batches(num_stages, scan_steps)
  return step, step.lower(state, batch).compile(), state


def pipeline_run(rule, schedule_name, num_stages, num_blocks):
  step, executable, state = compiled_step(rule, schedule_name, num_stages, num_blocks)
  state = jax.tree.map(jnp.copy, state)  # The executable donates its input.
  batches = make_batches(num_stages, CALLS * STEPS_PER_CALL)
  losses = []
  for c in range(CALLS):
    part = jax.tree.map(lambda x: x[c * STEPS_PER_CALL:(c + 1) * STEPS_PER_CALL], batches)
    state, raw = executable(*step.prepare(state, part))
    losses.append(np.asarray(step.finish(raw)["loss"]))
  return np.concatenate(losses), state


CASES = [("dp", "gpipe"), ("cdp-v1", "cyclic"), ("cdp-v2", "cyclic")]


@pytest.mark.parametrize("num_stages,num_blocks", [(2, 4), (4, 4)])
@pytest.mark.parametrize("rule,schedule_name", CASES)
def test_matches_engine(rule, schedule_name, num_stages, num_blocks):
  ref_losses, ref_params = engine_run(rule, num_stages, num_stages, num_blocks)
  losses, state = pipeline_run(rule, schedule_name, num_stages, num_blocks)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
               pipeline.current_params(state), ref_params)
  assert int(state.step) == CALLS * STEPS_PER_CALL


def test_dp_plus_mp_matches_engine_dp():
  """N = J = 2 replicas of 2 stages: 4 devices, the engine's dp numbers."""
  ref_losses, ref_params = engine_run("dp", 2, 2, 4)
  losses, state = pipeline_run("dp", "dp+mp", 2, 4)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
               pipeline.current_params(state), ref_params)
  assert compiled_step("dp", "dp+mp", 2, 4)[0].devices == 4


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_cyclic_events_are_the_timeline(rule, num_stages):
  """Slots, micro-batch = worker, steps and versions (cdp-v2: newest available) agree."""
  expected = [e._replace(slot=int(e.slot))
              for e in schedule.timeline(rule, num_stages, num_stages, 3)]
  assert pipeline.executed_events("cyclic", rule, num_stages, 3) == expected


@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_bubbles(num_stages):
  """Cyclic: no idle slot in steady state; GPipe idles (J-1)/(N+J-1) of every step."""
  num_steps = 3
  period = 2 * num_stages
  cyclic = pipeline.executed_events("cyclic", "cdp-v2", num_stages, num_steps)
  busy = {(e.slot, e.stage) for e in cyclic}
  assert len(busy) == len(cyclic)  # One event per device and slot.
  steady = range(period, num_steps * period)  # Fill ends, drain starts: steps 1 .. K-1.
  assert all((s, j) in busy for s in steady for j in range(num_stages))
  gpipe = pipeline.executed_events("gpipe", "dp", num_stages, num_steps)
  slots = 2 * (2 * num_stages - 1) * num_steps
  assert 1 - len(gpipe) / (slots * num_stages) == pytest.approx(
      (num_stages - 1) / (2 * num_stages - 1))


def test_only_collective_permutes():
  """Activations and cotangents only: the step holds no all-reduce or all-gather.

  Metrics leave the step sharded and are gathered afterwards, so nothing else
  communicates. Cyclic: one permute per slot parity (neighbour swaps); GPipe:
  one per phase (shift right for activations, left for cotangents).
  """
  width = 8
  for schedule_name, pairs in [("cyclic", [pipeline.swap_pairs(4, 0), pipeline.swap_pairs(4, 1)]),
                               ("gpipe", [[(0, 1), (1, 2), (2, 3)], [(1, 0), (2, 1), (3, 2)]])]:
    rule = "cdp-v2" if schedule_name == "cyclic" else "dp"
    found = compiled.collectives(compiled_step(rule, schedule_name, 4, 4)[1].as_text())
    assert {c.kind for c in found} == {"collective-permute"}
    assert sorted(sorted(c.source_target_pairs) for c in found) == sorted(map(sorted, pairs))
    assert all(c.bytes == PER_MICRO * width * 4 for c in found)


def test_memory_does_not_grow_with_steps():
  """A 2K-step call needs the temporaries of a K-step call, and the state is the same size.

  Only the per-step metrics (loss and gradient norms, 8 bytes a step, in 64-byte
  aligned buffers) grow; no activation, stash or parameter buffer does.
  """
  short = compiled_step("cdp-v2", "cyclic", 2, 4)
  long = compiled_step("cdp-v2", "cyclic", 2, 4, scan_steps=2 * STEPS_PER_CALL)
  short_mem, long_mem = compiled.memory(short[1]), compiled.memory(long[1])
  assert 0 <= long_mem["temp_bytes"] - short_mem["temp_bytes"] <= 64 + 8 * 2 * STEPS_PER_CALL
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(short[2][1:])) // 2 + 4  # Per device + step.
  assert short_mem["alias_bytes"] == long_mem["alias_bytes"] == state_bytes


def test_state_round_trip_and_layout():
  _, params = make_model(4)
  mesh = jax.make_mesh((2,), ("stage",))
  state = pipeline.init_state(params, optax.adam(0.1), rule="cdp-v2", mesh=mesh, num_blocks=4)
  jax.tree.map(np.testing.assert_array_equal, pipeline.current_params(state), params)
  assert len(state.stale_params) == 1
  assert state.params["blocks"]["dense_in"]["kernel"].shape == (2, 2, 8, 16)
  assert state.params["blocks"]["dense_in"]["kernel"].sharding.spec == jax.P("stage")
  np.testing.assert_array_equal(np.asarray(state.params["blocks"]["norm"]["scale"])[1, 0],
                                params["block_2"]["norm"]["scale"])
  assert not pipeline.init_state(params, optax.sgd(0.1), rule="dp", mesh=mesh,
                                 num_blocks=4).stale_params


class TestBadInput:

  def setup_method(self):
    self.mesh = jax.make_mesh((2,), ("stage",))
    self.tx = optax.sgd(0.1)

  def make(self, **kw):
    args = dict(rule="cdp-v2", mesh=self.mesh, num_blocks=4)
    args.update(kw)
    return pipeline.make_train_step(self.tx, **args)

  def test_num_micro_batches_must_equal_stages(self):
    with pytest.raises(ValueError, match="N = J micro-batches.*num_workers = 2"):
      self.make(num_micro_batches=4)

  def test_num_blocks_multiple_of_stages(self):
    with pytest.raises(ValueError, match="num_blocks=3 is not a multiple of the 2"):
      self.make(num_blocks=3)
    with pytest.raises(ValueError, match="not a multiple"):
      pipeline.init_state(make_model(3)[1], self.tx, rule="cdp-v2", mesh=self.mesh, num_blocks=3)

  def test_params_must_match_num_blocks(self):
    with pytest.raises(ValueError, match=r"missing \['block_2', 'block_3'\]"):
      pipeline.init_state(make_model(2)[1], self.tx, rule="cdp-v2", mesh=self.mesh, num_blocks=4)

  def test_dp_is_not_causal_on_the_cyclic_schedule(self):
    with pytest.raises(ValueError, match="not causal.*schedule='gpipe'"):
      self.make(rule="dp")

  def test_mesh_and_schedule(self):
    with pytest.raises(ValueError, match="no axis 'stage'"):
      self.make(mesh=jax.make_mesh((2,), ("data",)))
    with pytest.raises(ValueError, match="Unknown schedule"):
      self.make(schedule="1f1b")
    with pytest.raises(ValueError, match="dp\\+mp needs a mesh"):
      self.make(schedule="dp+mp", rule="dp")
    with pytest.raises(ValueError, match="Unknown rule"):
      self.make(rule="cdp-v3")

  def test_batch_not_divisible(self):
    step = self.make()
    state = pipeline.init_state(make_model(4)[1], self.tx, rule="cdp-v2", mesh=self.mesh,
                                num_blocks=4)
    batch = jax.tree.map(lambda x: x[0, :3], make_batches(2, 1))
    with pytest.raises(ValueError, match="not divisible by the N=2 micro-batches"):
      step(state, batch)


def test_benchmark_quick(tmp_path):
  if str(EXPERIMENTS) not in sys.path:
    sys.path.insert(0, str(EXPERIMENTS))
  importlib.import_module("bench_pipeline").main(["--quick", "--results_dir", str(tmp_path)])
  result = json.loads(next(tmp_path.glob("*.json")).read_text())
  row = result["rows"][0]
  for key in ("schedule", "num_stages", "devices", "peak_bytes_per_device", "temp_bytes_per_device",
              "argument_bytes_per_device", "total_bytes", "slots_per_step", "idle_slots_per_step",
              "collectives", "step_time_ratio_vs_gpipe", "analytic"):
    assert key in row
  assert {r["schedule"] for r in result["rows"]} >= {"cyclic", "gpipe", "dp+mp"}
