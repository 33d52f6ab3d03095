"""CDP-ZeRO and ZeRO-3 against the replicated engine, their HLO, memory and plan."""
import dataclasses
import functools
import importlib.util
import json
import os
from collections import Counter

import jax
import numpy as np
import pytest

from cdpjax import engine, executor, hlo, schedule
from cdpjax.executed import plan, zero
from cdpjax.executed import staged as staged_lib

import executed_reference as ref

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mesh_of(n, replicas=None):
  if replicas:
    return jax.make_mesh((replicas, n), ("replica", "data"))
  return jax.make_mesh((n,), ("data",))


@functools.cache
def executor_of(name, rule, num_workers, timetable=None, scan_steps=None, replicas=None,
                flat=False, compensated=False):
  """The executor as the launcher builds it (ZeRO-3's stages padded to TPU tiles), or ``flat``:
  stage buffers padded to a multiple of N only; ``compensated``: with ``ref.COMPENSATIONS``."""
  plan_ = executor.resolve(rule, "zero", num_workers, num_workers, timetable,
                           **(ref.COMPENSATIONS if compensated else {}))
  pad_to = num_workers if flat else zero.pad_to(num_workers, plan_.timetable)
  return zero.make_executor(ref.staged_of(name, num_workers, pad_to=pad_to), ref.make_tx(name),
                            rule=plan_, mesh=mesh_of(num_workers, replicas), scan_steps=scan_steps)


def initial_state(ex, name, num_workers):
  _, params, model_state, _ = ref.model_of(name, num_workers)
  return ex.init(params, model_state)


def zero_run(name, rule, num_workers, scan_steps=None, replicas=None, flat=False,
             timetable=None, compensated=False):
  """NUM_STEPS steps, ``scan_steps`` per call: per-step metrics and the final variables."""
  ex = executor_of(name, rule, num_workers, timetable, scan_steps=scan_steps, replicas=replicas,
                   flat=flat, compensated=compensated)
  state = initial_state(ex, name, num_workers)
  data, metrics = ref.batches(name, num_workers * (replicas or 1)), []
  per_call = scan_steps or 1
  for k in range(0, ref.NUM_STEPS, per_call):
    batch = jax.tree.map(lambda x: x[k:k + per_call], data)
    state, m = ex.step(state, batch if scan_steps else ref.step_batch(batch, 0))
    m = jax.tree.map(np.asarray, m)
    metrics += [jax.tree.map(lambda x: x[i], m) for i in range(per_call)] if scan_steps else [m]
  assert int(state.step) == ref.NUM_STEPS
  return metrics, jax.tree.map(np.asarray, ex.variables(state)), ex.plan


@pytest.mark.parametrize("rule,timetable,num_workers,scan_steps,flat", [
    ("dp", "zero3", 2, None, False), ("dp", "zero3", 2, None, True),
    ("cdp-v1", "cyclic", 2, None, False), ("cdp-v2", "cyclic", 2, 2, False)])
def test_residual_mlp_matches_engine(rule, timetable, num_workers, scan_steps, flat):
  """tests/test_executors.py runs every rule through the launcher against the engine; ZeRO-3
  here with its stages as TPU tiles and as flat buffers."""
  metrics, variables, plan_ = zero_run("residual_mlp", rule, num_workers, scan_steps, flat=flat)
  assert plan_.timetable == timetable  # dp runs ZeRO-3, the cdp rules the cyclic ring.
  ref.assert_matches_engine(metrics, variables, "residual_mlp", rule, num_workers)


@pytest.mark.parametrize("rule, timetable, scan_steps, replicas", [
    ("cdp-v2", None, 2, None), ("cdp-v1", None, None, 2), ("cdp-v2", "zero3", 2, None)])
def test_delay_compensations_match_the_engine(rule, timetable, scan_steps, replicas):
  """Weight prediction (the owner sends the extrapolated read), DC-ASGD (the chains carry the
  sum of g * g per delay; the owner adds its correction against theta_t) and the delay-scaled
  rate, together, as the engine runs them, on the ring and on ZeRO-3's lockstep."""
  metrics, variables, plan_ = zero_run("residual_mlp", rule, 4, scan_steps, replicas,
                                       timetable=timetable, compensated=True)
  assert (plan_.predict, plan_.dc_lambda, plan_.lr_delay_scale) == tuple(
      ref.COMPENSATIONS.values())
  ref.assert_matches_engine(metrics, variables, "residual_mlp", rule, 4,
                            replicas=replicas or 1, compensated=True)


def test_message_classes_with_replicas_and_compensations_match_the_engine():
  """ResNet-18 at N = 2: two message classes (`zero.message_classes`), each owner's replica
  all-reduce at its class's size, DC-ASGD's squares and weight prediction at it."""
  metrics, variables, _ = zero_run("resnet18", "cdp-v2", 2, 2, 2, compensated=True)
  ref.assert_matches_engine(metrics, variables, "resnet18", "cdp-v2", 2, replicas=2,
                            compensated=True)


@pytest.mark.parametrize("scan_steps", [None, 2])
def test_three_versions_of_the_owned_stage_match_the_engine(scan_steps):
  """Delays of 1 and 2 steps: three buffers per owner, relabelled by age after 1 and 2 steps."""
  delays = schedule.resolve("cdp-v2", 2, 2) + 1
  rule = tuple(map(tuple, delays.tolist()))  # Hashable, for the cached executors.
  metrics, variables, _ = zero_run("residual_mlp", rule, 2, scan_steps)
  ref.assert_matches_engine(metrics, variables, "residual_mlp", rule, 2)


@pytest.mark.parametrize("rule", ["cdp-v2", "dp"])
def test_resnet18_with_batchnorm_matches_engine(rule):
  """Heterogeneous stages; new statistics travel the forward ring, across steps and calls;
  ZeRO-3 gathers each stage at its own size from its shards (`zero.shard_columns`)."""
  metrics, variables, _ = zero_run("resnet18", rule, 2, scan_steps=2)
  ref.assert_matches_engine(metrics, variables, "resnet18", rule, 2)


def test_zero3_gathers_and_scatters_each_stage_at_its_own_size():
  """Stages of unequal size (ResNet-18 cut by FLOPs): ZeRO-3's collectives move each stage's
  shards, not the largest stage's."""
  num_workers = 2
  ex = executor_of("resnet18", "dp", num_workers, scan_steps=2)
  batch = ref.batches("resnet18", num_workers, num_steps=2)
  found = hlo.collectives(ex.lower(initial_state(ex, "resnet18", num_workers),
                                   batch).compile().as_text())
  staged = ref.staged_of("resnet18", num_workers, pad_to=zero.pad_to(num_workers, "zero3"))
  sizes = zero.shard_sizes(staged, num_workers)
  assert max(sizes) * num_workers == staged.param_size > 2 * min(sizes) * num_workers
  gathered = sorted(c.bytes // 4 for c in found if c.kind == "all-gather")
  assert gathered == sorted(2 * [num_workers * q for q in sizes])
  scattered = sum(c.bytes // 4 for c in found if c.kind == "reduce-scatter")
  assert scattered == sum(sizes)


@pytest.mark.parametrize("rule,num_workers", [("dp", 2), ("cdp-v2", 4)])
def test_replicated_rings_match_the_engine_with_tiled_delays(rule, num_workers):
  """Mesh (replica, data) = (2, N), 2 steps per call: two rings (or ZeRO-3 groups), one psum
  per stage and step over replica."""
  metrics, variables, _ = zero_run("residual_mlp", rule, num_workers, 2, replicas=2)
  ref.assert_matches_engine(metrics, variables, "residual_mlp", rule, num_workers, replicas=2)


@functools.cache
def hlo_for(num_workers, rule, scan_steps=2, replicas=None):
  """The compiled step of an executor the equality tests already compiled."""
  ex = executor_of("residual_mlp", rule, num_workers, scan_steps=scan_steps, replicas=replicas)
  batch = ref.batches("residual_mlp", num_workers * (replicas or 1), num_steps=scan_steps or 1)
  batch = batch if scan_steps else ref.step_batch(batch, 0)
  return ex.lower(initial_state(ex, "residual_mlp", num_workers), batch).compile().as_text()


def test_cyclic_step_has_only_collective_permutes_matching_the_plan():
  found = hlo.collectives(hlo_for(2, "cdp-v2"))
  assert {c.kind for c in found} == {"collective-permute"}
  pairs = {p for c in found for p in c.source_target_pairs}
  transfers = plan.zero_plan(schedule.delay_matrix("cdp-v2", 2, 2), 2).transfers
  # The messages, and the owners' own uses as pairs (o, o) of the stage permute.
  assert pairs == {(t.src, t.dst) for t in transfers} | {(0, 0), (1, 1)}


def test_replicated_ring_adds_one_all_reduce_over_replicas():
  """The update's psum, in the loop body once: it runs once per stage and step."""
  found = hlo.collectives(hlo_for(4, "cdp-v2", 2, replicas=2))
  (reduce,) = [c for c in found if c.kind == "all-reduce"]
  assert sorted(map(sorted, reduce.replica_groups)) == [[i, 4 + i] for i in range(4)]
  assert {c.kind for c in found} == {"all-reduce", "collective-permute"}


def test_one_collective_permute_per_route_and_pair_list():
  """A slot's stage messages are one ppermute a message class, its gradient messages another:
  the loop body holds one collective-permute per route, class and pair list (the replicated
  fixture)."""
  zero_plan = plan.zero_plan(schedule.delay_matrix("cdp-v2", 4, 4), 2)
  text = hlo_for(4, "cdp-v2", 2, replicas=2)
  found = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
  classes = zero.message_classes(
      ref.staged_of("residual_mlp", 4, pad_to=zero.pad_to(4, "cyclic")), 4)
  lists = [zero_plan.routes(*route, stages)[1]  # No model state.
           for route in plan.ROUTES[:2] for _, stages in classes]
  assert len(found) == sum(len(pair_lists) - 1 for pair_lists in lists)


@pytest.mark.parametrize("num_workers", [3, 4, 8])
@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_each_use_gets_its_version_from_the_owner_and_each_gradient_goes_to_it(rule,
                                                                              num_workers):
  """Per slot: a stage has one user at most; its owner sends it the version it reads, and
  its backward's gradient goes back to the owner; the owner's own uses are no message, but
  pairs (o, o) of the stage permute."""
  delays = schedule.delay_matrix(rule, num_workers, num_workers)
  zero_plan = plan.zero_plan(delays, 3)
  expected = Counter()
  for s, i in zip(*np.nonzero(zero_plan.kind != plan.IDLE)):
    j = zero_plan.stage[s, i]
    o = zero.owner(j, num_workers)
    assert (zero_plan.serve_version[s, o], zero_plan.serve_delay[s, o]) == (
        zero_plan.version[s, i], delays[i, j])
    if i != o:
      expected[s, "param", o, i, j, zero_plan.version[s, i]] += 1
      if zero_plan.kind[s, i] == plan.BWD:
        expected[s, "grad", i, o, j, 0] += 1
  sent = Counter((t.slot, t.kind, t.src, t.dst, t.stage, t.delay)
                 for t in zero_plan.transfers if t.kind != "state")
  assert sent == expected
  # The stage permute also carries each of the owner's own uses, as a pair (o, o).
  index, pair_lists = zero_plan.routes("param", "owner")
  for s, i in zip(*np.nonzero(zero_plan.kind != plan.IDLE)):
    pairs = pair_lists[index[s]]
    assert (zero_plan.source[s, i] == plan.LOCAL) == ((i, i) in pairs)
    assert sum(dst == i for _, dst in pairs) == 1
  for route in plan.ROUTES:  # One permutation a slot and route (`routes` asserts it).
    index, pair_lists = zero_plan.routes(*route)
    assert len(pair_lists) > 1 and (index > 0).any()


@pytest.mark.parametrize("num_workers", [2, 3, 4, 5, 8])
def test_a_first_stage_backward_shares_its_slot_with_a_full_stash(num_workers):
  """The premise of the one-program floor (report.py, `_cyclic_floor_row`): in the steady
  step, wherever a worker runs the first stage's backward, another has stashed all J - 1 stage
  inputs (it runs the last stage: the forward, after which the stash holds its input, or the
  backward, which reads it)."""
  zero_plan = plan.zero_plan(schedule.delay_matrix("cdp-v2", num_workers, num_workers), 3)
  steady = zero_plan.step == 1
  slots = sorted({s for s, i in zip(*np.nonzero(steady & (zero_plan.kind == plan.BWD)
                                                & (zero_plan.stage == 0)))})
  assert len(slots) == num_workers
  for s in slots:
    assert (zero_plan.kind[s] != plan.IDLE).all()
    assert (zero_plan.stage[s] == num_workers - 1).any()


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_plan_is_the_timeline_without_flush(rule, num_workers):
  """Slots, workers, steps and versions (cdp-v2: newest available) over 3 steps; 2J slots a step."""
  delays = schedule.delay_matrix(rule, num_workers, num_workers)
  expected = [e._replace(slot=int(e.slot))
              for e in schedule.timeline(rule, num_workers, num_workers, 3)]
  zero_plan = plan.zero_plan(delays, 3)
  assert zero_plan.events() == expected
  assert zero_plan.num_slots == 2 * num_workers * 4 - 1  # 3 steps, a fill, a drain, 1 update.
  assert (zero_plan.update.sum(axis=0) == 3).all()  # Each owner updates once a step.


def test_zero3_gathers_at_use_and_reduce_scatters():
  summary = hlo.collective_summary(hlo_for(2, "dp", None))
  assert summary["all-gather"]["count"] == 4  # Each stage, in the forward and the backward.
  assert summary["reduce-scatter"]["count"] == 2
  assert summary["all-reduce"]["count"] == summary["collective-permute"]["count"] == 0


def test_zero3_reduce_scatters_a_large_stage_in_pieces(monkeypatch):
  """Pieces of `zero.TPU_SCATTER_ROWS` rows a shard (here 8 of each stage's 16): one
  reduce-scatter a piece, and the engine's numbers."""
  monkeypatch.setattr(zero, "TPU_SCATTER_ROWS", 8)
  executor_of.cache_clear()  # Built afresh with the pieces, and dropped after.
  try:
    metrics, variables, _ = zero_run("residual_mlp", "dp", 2)
    ref.assert_matches_engine(metrics, variables, "residual_mlp", "dp", 2)
    summary = hlo.collective_summary(hlo_for.__wrapped__(2, "dp", None))  # Not the cached HLO.
  finally:
    executor_of.cache_clear()
  assert summary["reduce-scatter"]["count"] == 2 * 2, summary


def test_plan_sends_each_stage_once_per_use_and_lands_gradients_at_owners():
  num_workers = 4
  for rule in ("cdp-v1", "cdp-v2"):
    transfers = plan.cyclic_transfers(schedule.delay_matrix(rule, num_workers, num_workers))
    params = [t for t in transfers if t.kind == "param"]
    # Every worker receives every stage it does not own once forward, once backward.
    assert Counter((t.dst, t.stage) for t in params) == Counter(
        {(i, j): 2 for i in range(num_workers) for j in range(num_workers)
         if i != num_workers - 1 - j})
    assert all(t.src == zero.owner(t.stage, num_workers) for t in params)
    grads = [t for t in transfers if t.kind == "grad"]
    # Each non-owner sends one gradient buffer per stage, to the owner.
    assert Counter((t.src, t.dst, t.stage) for t in grads) == Counter(
        {(i, num_workers - 1 - j, j): 1 for i in range(num_workers) for j in range(num_workers)
         if i != num_workers - 1 - j})


@pytest.mark.parametrize("name,num_workers,num_classes",
                         [("resnet18", 4, 3), ("resnet18", 2, 2), ("residual_mlp", 4, 1)])
def test_message_classes_pad_their_stages_by_at_most_five_percent(name, num_workers, num_classes):
  """Each stage in one class; a class's messages are its largest stage's (in whole tiles) and
  at most 5% over its stages' own; stages of like size share a permute."""
  staged = ref.staged_of(name, num_workers, pad_to=zero.pad_to(num_workers, "cyclic"))
  tiled = [min(-(-p // 1024) * 1024, staged.param_size) for p in staged.stage_param_sizes()]
  classes = zero.message_classes(staged, num_workers)
  assert sorted(j for _, stages in classes for j in stages) == list(range(num_workers))
  for size, stages in classes:
    assert size == max(tiled[j] for j in stages)
    assert size * len(stages) <= 1.05 * sum(tiled[j] for j in stages)
  assert len(classes) == num_classes


def test_the_stash_holds_each_stage_input_at_its_own_size():
  """ResNet-18 cut by FLOPs at N = 4: the stages' inputs end to end, the largest last, so a
  whole boundary buffer read at any input stays in the stash, which is less than J-1 rows of
  the largest."""
  staged = ref.staged_of("resnet18", 4, pad_to=zero.pad_to(4, "cyclic"))
  x_spec = jax.ShapeDtypeStruct((ref.PER_MICRO["resnet18"], 8, 8, 1), np.float32)
  boundaries, largest = staged.boundary_sizes(x_spec), staged.act_size(x_spec)
  offsets, sizes = zero.stash_layout(boundaries)
  assert list(sizes) == [0] + boundaries  # Stage 0 reads the batch.
  spans = sorted((offsets[j], offsets[j] + sizes[j]) for j in range(1, 4))
  assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
  total = spans[-1][1]
  assert all(offsets[j] + largest <= total for j in range(4))
  assert len(set(boundaries)) > 1 and total < 3 * largest


def test_each_message_class_travels_at_its_own_size():
  """ResNet-18 cut by FLOPs: the stage and gradient permutes of the compiled step are each as
  long as their class (its stage and the model state), not the largest stage."""
  ex = executor_of("resnet18", "cdp-v2", 2, scan_steps=2)
  batch = ref.batches("resnet18", 2, num_steps=2)
  text = ex.lower(initial_state(ex, "resnet18", 2), batch).compile().as_text()
  staged = ref.staged_of("resnet18", 2, pad_to=zero.pad_to(2, "cyclic"))
  sizes = {4 * (size + staged.state_size) for size, _ in zero.message_classes(staged, 2)}
  found = Counter(c.bytes for c in hlo.collectives(text) if c.kind == "collective-permute")
  assert len(sizes) == 2 and sizes <= set(found)
  assert set(found) <= sizes | {4 * 2 * staged.state_size}  # And the model-state ring.


def test_model_states_are_one_nth_of_the_replicated_engine():
  num_workers = 2
  ex = executor_of("resnet18", "cdp-v2", num_workers)
  state = initial_state(ex, "resnet18", num_workers)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  _, params, model_state, _ = ref.model_of("resnet18", num_workers)
  replicated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
      lambda: engine.init_state(params, ref.make_tx("resnet18"), rule="cdp-v2",
                                model_state=model_state))))
  # Stages cut by FLOPs differ in size; every row is padded to the largest.
  padding = ref.staged_of("resnet18", 2).param_size * 2 / sum(
      ref.staged_of("resnet18", 2).stage_param_sizes())
  assert per_device <= 1.05 * padding * replicated / num_workers


def test_zero3_shards_hold_each_stage_without_padding():
  """FSDP's flat shard: each worker holds 1/N of every stage, not of the largest stage J times."""
  num_workers = 2
  ex = executor_of("resnet18", "dp", num_workers, flat=True)
  state = initial_state(ex, "resnet18", num_workers)
  sizes = ref.staged_of("resnet18", num_workers).stage_param_sizes()
  for leaf in (state.params, *jax.tree.leaves(state.opt_state)):
    if leaf.ndim == 2:
      assert leaf.addressable_shards[0].data.shape == (1, sum(-(-p // num_workers) for p in sizes))


@pytest.mark.parametrize("rule", ["cdp-v2", "dp"])
def test_variables_round_trip(rule):
  ex = executor_of("resnet18", rule, 2)
  _, params, model_state, _ = ref.model_of("resnet18", 2)
  jax.tree.map(np.testing.assert_array_equal, ex.variables(ex.init(params, model_state)),
               {"params": params, **model_state})


class TestBadInput:

  def test_stages_must_equal_workers(self):
    with pytest.raises(ValueError, match="cut into 2 stages for 4 workers"):
      zero.make_executor(ref.staged_of("residual_mlp", 2), ref.make_tx("residual_mlp"),
                           rule="cdp-v2", mesh=mesh_of(4))

  def test_padding_must_split_over_workers(self):
    staged = ref.staged_of("residual_mlp", 2)
    odd = dataclasses.replace(staged, param_size=2 * staged.param_size + 1)
    with pytest.raises(ValueError, match="pad_to=2"):
      zero.make_executor(odd, ref.make_tx("residual_mlp"), rule="cdp-v2", mesh=mesh_of(2))

  def test_delay_matrix_shape_and_unknown_names(self):
    staged = ref.staged_of("residual_mlp", 2, pad_to=2)
    tx = ref.make_tx("residual_mlp")
    with pytest.raises(ValueError, match=r"needs \(N, J\) = \(2, 2\).*engine"):
      zero.make_executor(staged, tx, rule=np.ones((2, 3), int), mesh=mesh_of(2))
    with pytest.raises(ValueError, match="Unknown timetable 'gpipe'"):
      zero.make_executor(staged, tx, rule="cdp-v2", mesh=mesh_of(2), timetable="gpipe")
    with pytest.raises(ValueError, match="Unknown rule"):
      zero.make_executor(staged, tx, rule="cdp-v9", mesh=mesh_of(2))
    with pytest.raises(ValueError, match="has axes \\('stage',\\).*'replica', 'data'"):
      zero.make_executor(staged, tx, rule="cdp-v2", mesh=jax.make_mesh((2,), ("stage",)))

  def test_batch_not_divisible_and_state_rule_mismatch(self):
    ex = executor_of("residual_mlp", "cdp-v2", 2)
    state = initial_state(ex, "residual_mlp", 2)
    batch = {"image": np.zeros((3, 8, 8, 1), np.float32), "label": np.zeros(3, np.int32)}
    with pytest.raises(ValueError, match="num_workers \\* b rows"):
      ex.step(state, batch)
    scanned = executor_of("residual_mlp", "cdp-v2", 2, scan_steps=2)
    with pytest.raises(ValueError, match=r"scan_steps=2 batch leaves need shape \[2, "):
      scanned.step(state, ref.step_batch(ref.batches("residual_mlp", 2, num_steps=1), 0))
    with pytest.raises(ValueError, match="scan_steps must be a positive int"):
      zero.make_executor(ref.staged_of("residual_mlp", 2, pad_to=2), ref.make_tx("residual_mlp"),
                           rule="cdp-v2", mesh=mesh_of(2), scan_steps=0)
    dp = executor_of("residual_mlp", "dp", 2)
    good = ref.step_batch(ref.batches("residual_mlp", 2, num_steps=1), 0)
    with pytest.raises(ValueError, match="keeps 1 stale parameter versions.*'dp' needs 0"):
      dp.step(state, good)


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
  low, high = result["goals"]["2"]["step_time_vs_zero3_range"]  # Over 2 repeats in --quick.
  assert 0 < low <= high
  # The ablations are timed beside it, and bench_zero's patch is undone.
  goals = result["goals"]["2"]
  assert {f"{name}_vs_zero3" for name in bench.FLOORS} <= set(goals)
  split = goals["split"]
  assert set(split) == {"cyclic", "zero3"}
  # Differences of the timed programs: each timetable's parts add up to its step time.
  assert sum(split["zero3"].values()) == pytest.approx(1.0)
  assert sum(split["cyclic"].values()) == pytest.approx(goals["step_time_vs_zero3"])
  assert (zero.Ring.route.__qualname__, zero.Ring.permute.__qualname__) == (
      "Ring.route", "Ring.permute")
  assert (staged_lib.StagedModel.apply.__qualname__, staged_lib.StagedModel.vjp.__qualname__) == (
      "StagedModel.apply", "StagedModel.vjp")
