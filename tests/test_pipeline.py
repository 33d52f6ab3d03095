"""The executed pipeline timetables against the engine, the timeline and the compiled program."""
import functools
import importlib
import json
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

from cdpjax import compiled, executor, hlo, models, schedule, stages
from cdpjax.executed import pipeline, plan
from cdpjax.executed import staged as staged_lib

import executed_reference as ref

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

STEPS_PER_CALL = 2
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


REPLICAS = 2  # Of the pipeline on a (replica, stage) mesh.


@functools.cache
def executor_of(name, rule, num_stages, timetable=None, scan_steps=STEPS_PER_CALL, replicas=1,
                compensated=False, keep=False):
  if compensated:
    rule = executor.resolve(rule, "model", num_stages, num_stages, timetable,
                            **ref.COMPENSATIONS)
  if timetable == "dp+mp":
    mesh = jax.make_mesh((num_stages, num_stages), ("data", "stage"))
  elif replicas > 1:
    mesh = jax.make_mesh((replicas, num_stages), ("replica", "stage"))
  else:
    mesh = jax.make_mesh((num_stages,), ("stage",))
  return pipeline.make_executor(ref.staged_of(name, num_stages), ref.make_tx(name), rule=rule,
                                  mesh=mesh, timetable=timetable, scan_steps=scan_steps,
                                  keep_activations=keep)


def initial_state(ex, name, num_stages):
  _, params, model_state, _ = ref.model_of(name, num_stages)
  return ex.init(params, model_state)


@functools.cache
def pipeline_run(name, rule, num_stages, timetable=None, replicas=1, compensated=False,
                 keep=False):
  """Per-step metrics and final variables over NUM_STEPS steps, STEPS_PER_CALL per call."""
  ex = executor_of(name, rule, num_stages, timetable, replicas=replicas, compensated=compensated,
                   keep=keep)
  state = initial_state(ex, name, num_stages)
  data, metrics = ref.batches(name, replicas * num_stages), []
  for c in range(ref.NUM_STEPS // STEPS_PER_CALL):
    part = jax.tree.map(lambda x: x[c * STEPS_PER_CALL:(c + 1) * STEPS_PER_CALL], data)
    state, m = ex.step(state, part)
    metrics += [jax.tree.map(lambda x, k=k: np.asarray(x[k]), m) for k in range(STEPS_PER_CALL)]
  assert int(state.step) == ref.NUM_STEPS
  return metrics, jax.tree.map(np.asarray, ex.variables(state)), ex.plan


def test_residual_mlp_matches_engine():
  """K-step calls of the cyclic timetable. tests/test_executors.py runs every rule
  (dp as GPipe) through the launcher against the engine."""
  metrics, variables, plan_ = pipeline_run("residual_mlp", "cdp-v2", 2)
  assert plan_.timetable == "cyclic"
  ref.assert_matches_engine(metrics, variables, "residual_mlp", "cdp-v2", 2)


@pytest.mark.parametrize("rule, timetable, replicas", [
    ("cdp-v2", None, 1), ("cdp-v1", None, 2), ("cdp-v2", "gpipe", 1)])
def test_delay_compensations_match_the_engine(rule, timetable, replicas):
  """Weight prediction, DC-ASGD and the delay-scaled rate together, as the engine runs them
  (itself exact against the simulator), on the cyclic and the flushed timetables."""
  metrics, variables, plan_ = pipeline_run("residual_mlp", rule, 4, timetable, replicas, True)
  assert (plan_.predict, plan_.dc_lambda, plan_.lr_delay_scale) == tuple(
      ref.COMPENSATIONS.values())
  ref.assert_matches_engine(metrics, variables, "residual_mlp", rule, 4, replicas=replicas,
                            compensated=True)
  # The compensations move the run: the test sees a compensation that is dropped.
  _, plain = ref.engine_run("residual_mlp", rule, 4, replicas)
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b))), variables,
                       plain)
  assert min(jax.tree.leaves(moved)) > 1e-3, moved


@pytest.mark.parametrize("name, rule, timetable, compensated", [
    ("residual_mlp", "cdp-v2", None, True), ("resnet18", "cdp-v1", None, False),
    ("residual_mlp", "dp", "gpipe", False)])
def test_kept_activations_match_the_engine(name, rule, timetable, compensated):
  """Activations kept from the forward instead of recomputed: the engine's numbers (ResNet-18:
  BatchNorm; with the compensations: the kept activations are the predicted read's)."""
  metrics, variables, _ = pipeline_run(name, rule, 4, timetable, 1, compensated, keep=True)
  ref.assert_matches_engine(metrics, variables, name, rule, 4, compensated=compensated)


def test_dp_plus_mp_matches_engine_dp():
  """N = J = 2 replicas of 2 stages: 4 devices, the engine's dp numbers."""
  metrics, variables, _ = pipeline_run("residual_mlp", "dp", 2, "dp+mp")
  ref.assert_matches_engine(metrics, variables, "residual_mlp", "dp", 2)


@pytest.mark.parametrize("name, rule", [
    ("residual_mlp", "dp"), ("residual_mlp", "cdp-v1"), ("residual_mlp", "cdp-v2"),
    ("resnet18", "cdp-v2")])
def test_replicas_match_the_engine_with_tiled_delays(name, rule):
  """R = 2 pipelines of J = 2 stages on a (replica, stage) mesh, K-step calls: the engine with
  R*J workers and the delay matrix tiled R times.

  The ResNet has heterogeneous stages (cut by FLOPs) and BatchNorm statistics averaged over
  all R*J micro-batches, as the engine averages them; one pipeline (R = 1) runs the same
  program less the all-reduces over ``replica``.
  """
  metrics, variables, plan_ = pipeline_run(name, rule, 2, replicas=REPLICAS)
  assert plan_.timetable == ("gpipe" if rule == "dp" else "cyclic")
  if name == "resnet18":
    assert set(variables) == {"params", "batch_stats"}
  ref.assert_matches_engine(metrics, variables, name, rule, 2, replicas=REPLICAS)


def test_replicas_reduce_each_stage_once_per_step():
  """One all-reduce over the replicas, in the branch of the slot where a device updates its
  stage (once per step); activations and cotangents move by collective-permutes only (at
  J = 2 one swap: the odd slots' pair list is empty)."""
  ex = executor_of("residual_mlp", "cdp-v2", 2, replicas=REPLICAS)
  batch = ref.batches("residual_mlp", REPLICAS * 2, num_steps=STEPS_PER_CALL)
  counts = hlo.stablehlo_collectives(
      ex.lower(initial_state(ex, "residual_mlp", 2), batch).as_text())
  assert {k: n for k, n in counts.items() if n} == {"all-reduce": 1, "collective-permute": 1}


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_cyclic_events_are_the_timeline(rule, num_stages):
  """Slots, micro-batch = worker, steps and versions (cdp-v2: newest available) agree."""
  expected = [e._replace(slot=int(e.slot))
              for e in schedule.timeline(rule, num_stages, num_stages, 3)]
  assert plan.executed_events("cyclic", rule, num_stages, 3) == expected


@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_bubbles(num_stages):
  """Cyclic: no idle slot in steady state; GPipe idles (J-1)/(N+J-1) of every step."""
  num_steps = 3
  period = 2 * num_stages
  cyclic = plan.executed_events("cyclic", "cdp-v2", num_stages, num_steps)
  busy = {(e.slot, e.stage) for e in cyclic}
  assert len(busy) == len(cyclic)  # One event per device and slot.
  steady = range(period, num_steps * period)  # Fill ends, drain starts: steps 1 .. K-1.
  assert all((s, j) in busy for s in steady for j in range(num_stages))
  gpipe = plan.executed_events("gpipe", "dp", num_stages, num_steps)
  slots = 2 * (2 * num_stages - 1) * num_steps
  assert 1 - len(gpipe) / (slots * num_stages) == pytest.approx(
      (num_stages - 1) / (2 * num_stages - 1))


@functools.cache
def compiled_of(name, rule, num_stages, scan_steps=STEPS_PER_CALL):
  ex = executor_of(name, rule, num_stages, scan_steps=scan_steps)
  batch = ref.batches(name, num_stages, num_steps=scan_steps)
  return ex.lower(initial_state(ex, name, num_stages), batch).compile()


def test_only_collective_permutes():
  """Activations and cotangents only: no all-reduce or all-gather in the step.

  Metrics leave the step sharded and are gathered afterwards. At J = 2 the
  cyclic timetable swaps neighbours at even slots (and nobody at odd ones), GPipe
  shifts right in the forward phase and left in the backward phase.
  """
  act_bytes = ref.PER_MICRO["residual_mlp"] * 8 * 4  # b rows of width 8, float32.
  for rule, pairs in [("cdp-v2", [plan.swap_pairs(2, 0)]), ("dp", [[(0, 1)], [(1, 0)]])]:
    found = hlo.collectives(compiled_of("residual_mlp", rule, 2).as_text())
    assert {c.kind for c in found} == {"collective-permute"}
    assert sorted(sorted(c.source_target_pairs) for c in found) == sorted(map(sorted, pairs))
    assert all(c.bytes == act_bytes for c in found)


def test_slots_copy_no_parameter_sized_buffer():
  """Branches return only what an event computes: no version, accumulator or optimizer
  state passes through a conditional, which would copy it (issue 11)."""
  size = ref.staged_of("residual_mlp", 2).param_size
  for rule in ("cdp-v2", "dp"):
    text = compiled_of("residual_mlp", rule, 2).as_text()
    assert not re.findall(rf"= f32\[{size}\]\S* copy\(", text)


@functools.cache
def wide_compiled(timetable, model_name="residual_mlp", num_stages=2):
  """The compiled one-step call of a benchmark model cut one block per stage (the residual
  MLP at width 128, hidden 512; bench_pipeline's quick transformer) and one stage's
  parameter bytes.

  At the tests' width 8, XLA copies the version buffers ([2, P] twice on the cyclic
  timetable: it fuses the update's parameter norm with a re-read of the old version, which
  the in-place write then must not clobber); at these sizes it copies none.
  """
  if model_name == "transformer":
    size = dict(d_model=32, num_heads=2, d_ff=64, seq_len=16)
    model = models.create_model("transformer", 256, num_layers=num_stages, **size)
    sample = np.zeros((1, size["seq_len"]), np.int32)
    batch = {"image": np.zeros((num_stages * 2, size["seq_len"]), np.int32),
             "label": np.zeros((num_stages * 2, size["seq_len"]), np.int32)}
  else:
    model = models.create_model(model_name, 10, width=128, hidden=512, num_blocks=num_stages)
    sample = np.zeros((1, 8, 8, 1), np.float32)
    batch = {"image": np.zeros((num_stages * 4, 8, 8, 1), np.float32),
             "label": np.zeros((num_stages * 4,), np.int32)}
  params = model.init(jax.random.key(0), sample)["params"]
  stage_ids = stages.model_stage_ids(model, params, num_stages, sample, by="boundaries",
                                     boundaries=[f"block_{s}" for s in range(1, num_stages)])
  staged = staged_lib.stage_model(model, params, stage_ids, sample)
  ex = pipeline.make_executor(staged, ref.make_tx("residual_mlp"),
                                rule="cdp-v2" if timetable == "cyclic" else "dp",
                                mesh=jax.make_mesh((num_stages,), ("stage",)), timetable=timetable)
  return ex.lower(ex.init(params), batch).compile(), 4 * staged.param_size


@pytest.mark.parametrize("model_name", ["residual_mlp", "transformer"])
def test_cyclic_peak_less_its_stale_stage_is_at_most_gpipes(model_name):
  """CDP keeps one stale stage version more than GPipe and no other stage-sized buffer
  (issue 11): the read version is sliced inside the stage's branch, not copied into an
  operand of the stage switch, and the scan's ring of versions is the step's argument, not
  a stack of the state's versions made inside the step (held beside them: 1.04x on the
  transformer)."""
  cyclic, stage_bytes = wide_compiled("cyclic", model_name)
  gpipe, _ = wide_compiled("gpipe", model_name)
  cyclic_peak = compiled.memory(cyclic)["peak_bytes"]
  gpipe_peak = compiled.memory(gpipe)["peak_bytes"]
  assert cyclic_peak - stage_bytes <= gpipe_peak < cyclic_peak
  assert not re.findall(rf"= f32\[(?:\d+,)?{stage_bytes // 4}\]\S* copy\(", cyclic.as_text())


def test_memory_does_not_grow_with_steps():
  """A 2K-step call needs the temporaries of a K-step call, and the state is the same size.

  Only what is per step grows: the call's micro-batch layout of its batch, and
  three float32 metrics per step (in 64-byte aligned buffers); no activation,
  stash or parameter buffer does.
  """
  short = compiled.memory(compiled_of("residual_mlp", "cdp-v2", 2))
  long = compiled.memory(compiled_of("residual_mlp", "cdp-v2", 2, scan_steps=2 * STEPS_PER_CALL))
  extra_batch = sum(x.nbytes for x in jax.tree.leaves(
      ref.batches("residual_mlp", 2, num_steps=STEPS_PER_CALL)))
  assert 0 <= long["temp_bytes"] - short["temp_bytes"] <= extra_batch + 3 * 64
  ex = executor_of("residual_mlp", "cdp-v2", 2)
  state = initial_state(ex, "residual_mlp", 2)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  assert short["alias_bytes"] == long["alias_bytes"] == per_device


def test_state_round_trip_and_layout():
  ex = executor_of("resnet18", "cdp-v2", 2)
  _, params, model_state, _ = ref.model_of("resnet18", 2)
  state = ex.init(params, model_state)
  jax.tree.map(np.testing.assert_array_equal, ex.variables(state),
               {"params": params, **model_state})
  staged = ref.staged_of("resnet18", 2)
  assert len(state.stale_params) == 1
  assert state.params.shape == (2, staged.param_size)
  assert state.model_state.shape == (2, staged.state_size)
  assert state.params.sharding.spec == jax.P("stage")
  dp = executor_of("residual_mlp", "dp", 2)
  assert not dp.init(*ref.model_of("residual_mlp", 2)[1:3]).stale_params


class TestBadInput:

  def make(self, **kw):
    args = dict(rule="cdp-v2", mesh=jax.make_mesh((2,), ("stage",)))
    args.update(kw)
    return pipeline.make_executor(ref.staged_of("residual_mlp", 2), ref.make_tx("residual_mlp"),
                                    **args)

  def test_num_micro_batches_must_equal_stages(self):
    with pytest.raises(ValueError, match="N = J micro-batches.*num_workers equal to num_stages"):
      self.make(num_micro_batches=4)

  def test_stages_must_match_the_mesh(self):
    with pytest.raises(ValueError, match="cut into 2 stages.*has 4 devices"):
      self.make(mesh=jax.make_mesh((4,), ("stage",)))

  def test_dp_is_not_causal_on_the_cyclic_timetable(self):
    with pytest.raises(ValueError, match="no delays.*timetable='gpipe'"):
      self.make(rule="dp", timetable="cyclic")

  def test_mesh_and_timetable(self):
    with pytest.raises(ValueError, match="no axis 'stage'"):
      self.make(mesh=jax.make_mesh((2,), ("data",)))
    with pytest.raises(ValueError, match="Unknown timetable"):
      self.make(timetable="1f1b")
    with pytest.raises(ValueError, match="dp\\+mp needs a mesh"):
      self.make(timetable="dp+mp", rule="dp")
    with pytest.raises(ValueError, match="Unknown rule"):
      self.make(rule="cdp-v3")
    with pytest.raises(ValueError, match="\\('replica', 'stage'\\).*drop or rename \\['fsdp'\\]"):
      self.make(mesh=jax.make_mesh((2, 2), ("fsdp", "stage")))

  def test_state_of_another_rule(self):
    """A dp state (no stale version) stepped with cdp-v2 is refused, naming the fix."""
    dp_state = executor_of("residual_mlp", "dp", 2).init(*ref.model_of("residual_mlp", 2)[1:3])
    batch = ref.step_batch(ref.batches("residual_mlp", 2, num_steps=1), 0)
    with pytest.raises(ValueError, match="keeps 0 stale parameter versions.*needs 1"):
      self.make().step(dp_state, batch)

  def test_batch_not_divisible(self):
    ex = self.make()
    state = ex.init(*ref.model_of("residual_mlp", 2)[1:3])
    batch = jax.tree.map(lambda x: x[0, :3], ref.batches("residual_mlp", 2, num_steps=1))
    with pytest.raises(ValueError, match="not divisible by the N=2 micro-batches"):
      ex.step(state, batch)


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


def test_benchmark_compile_sweep_quick(tmp_path):
  """The README's compile-time sweep, at J = 2 and the quick sizes."""
  if str(EXPERIMENTS) not in sys.path:
    sys.path.insert(0, str(EXPERIMENTS))
  result = importlib.import_module("bench_pipeline").main(
      ["--quick", "--compile_sweep", "2", "--results_dir", str(tmp_path)])
  rows = result["compile_sweep"]
  assert {(r["executor"], r["num_stages"]) for r in rows} == {("pipeline", 2), ("zero", 2)}
  assert all(r["compile_s"] > 0 and r["hlo_chars"] > r["stablehlo_chars"] / 10 for r in rows)
  assert (tmp_path / "bench_pipeline_compile.json").is_file()
