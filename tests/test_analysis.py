"""The cost model: closed forms, the schedule's profiles, and compiled programs on 8 CPU devices.

Compiled checks use a tiny ResidualMLP; every ratio predicted/measured is
asserted exactly where the model counts the same bytes as XLA.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import analysis, compiled, engine, hlo, schedule
from cdpjax.executed import pipeline, plan, zero
from cdpjax.executed import staged as staged_lib
from cdpjax.models.residual_mlp import ResidualMLP

N, J = 4, 4
UNIT = analysis.workload(1.0, 1.0, J)  # Psi_P = Psi_A = 1: results read in units of Psi.


def test_workload_splits_totals_and_checks_lengths():
  w = analysis.workload(8.0, [1, 2, 3, 2], 4, optimizer_factor=2)
  assert w.stage_param_bytes == (2.0,) * 4 and w.activation_bytes == 8.0
  assert w.boundary_bytes == (2.0, 3.0, 2.0)  # Default: the next stage's input.
  with pytest.raises(ValueError, match="one per stage"):
    analysis.workload(1.0, [1, 2], 4)
  with pytest.raises(ValueError, match="J - 1"):
    analysis.workload(1.0, 1.0, 4, boundary_bytes=[1, 2])


def test_alpha_beta_formulas():
  net = analysis.Network(alpha=1.0, beta=0.5)
  assert analysis.p2p_time(10, net) == 1 + 5
  assert analysis.all_reduce_time(4, 8, net) == 2 * 3 * 1 + 2 * 3 / 4 * 0.5 * 8
  assert analysis.all_gather_time(4, 8, net) == 3 * 1 + 3 / 4 * 0.5 * 8
  assert analysis.all_reduce_time(1, 8, net) == 0


@pytest.mark.parametrize("n, j", [(4, 4), (8, 4), (3, 5), (2, 1)])
def test_activation_closed_forms(n, j):
  w = analysis.workload(1.0, 1.0, j)
  mean = n * (j + 1) / (2 * j)  # Stage s lives 2(j - s) of the 2j slots of a step.
  d, v1, v2 = (analysis.cost(s, n, w) for s in ("dp", "cdp-v1", "cdp-v2"))
  assert d.total.activations_peak == pytest.approx(n)  # All forwards end together.
  assert d.total.activations_mean == pytest.approx(mean)
  for c in (v1, v2):  # Cyclic: flat, about half DP's peak.
    assert c.total.activations_peak == pytest.approx(mean, abs=1 / j)
    assert c.total.activations_mean == pytest.approx(mean)
    assert c.per_device.activations_peak == pytest.approx(1.0)
  g, f = analysis.cost("gpipe", n, w), analysis.cost("1f1b", n, w)
  assert g.per_device.activations_peak == pytest.approx(n / j)
  assert f.per_device.activations_peak == pytest.approx(min(n, j) / j)
  assert g.bubble == f.bubble == pytest.approx((j - 1) / (n + j - 1))
  assert g.step_slots == 2 * (n + j - 1)
  # A pipeline device holds a boundary and two stash rows in flight; data parallelism none.
  flight = max(w.boundary_bytes, default=0.0) + 2 * max(w.stage_activation_bytes)
  assert g.per_device.messages == f.per_device.messages == pytest.approx(flight)
  assert g.per_device.peak == pytest.approx(g.per_device.model_states + n / j + flight)
  assert d.per_device.messages == v1.per_device.messages == 0.0


def test_inputs_boundaries_and_gradients_held_per_device():
  """A pipeline device holds its pipeline's N micro-batches of rows, a worker its own; a
  ZeRO-3 backward holds a cotangent, a CDP+ZeRO worker its boundary carry and a stash row; a
  gradient counted in a calibrated transient is not counted again as a ZeRO buffer."""
  w = analysis.workload(8.0, 4.0, J, boundary_bytes=2.0, recompute_bytes=16.0, input_bytes=3.0)
  costs = {s: analysis.cost(s, N, w).per_device for s in ("dp", "gpipe", "cdp+mp", "zero-3",
                                                         "cdp+zero")}
  assert costs["dp"].inputs == costs["zero-3"].inputs == costs["cdp+zero"].inputs == 3.0
  assert costs["gpipe"].inputs == costs["cdp+mp"].inputs == N * 3.0
  assert (costs["dp"].messages, costs["zero-3"].messages, costs["cdp+zero"].messages) == (
      0.0, 2.0, 2.0 + 1.0)
  assert costs["gpipe"].peak == pytest.approx(
      sum(costs["gpipe"][:4]) + costs["gpipe"].activations_peak + costs["gpipe"].messages + N * 3)
  calibrated = w._replace(transient_gradient=True)
  for strategy, stage_buffers in (("zero-3", 1), ("cdp+zero", 2)):
    assert costs[strategy].buffers == (stage_buffers + 1) * 2.0  # A stage is 8 / J = 2.
    assert analysis.cost(strategy, N, calibrated).per_device.buffers == stage_buffers * 2.0


def test_weighted_profile_matches_schedule_activation_profile():
  events = schedule.timeline("cdp-v2", 4, 3, 3)
  counted = schedule.activation_profile(events, 4, 3)
  prof = analysis.activation_bytes_profile(events, [1.0] * 3, lambda e: 0, 1, (6, 12), 4)
  steady = counted.alive[6 * 4:12 * 4]
  assert prof.total_peak == steady.max() and prof.total_mean == pytest.approx(steady.mean())


def test_gradient_readiness_is_spread_by_cdp():
  assert analysis.cost("dp", N, UNIT).grad_ready_peak == pytest.approx(1 / J)
  assert analysis.cost("cdp-v2", N, UNIT).grad_ready_peak == pytest.approx(1 / (2 * J))
  assert analysis.cost("cdp+zero", N, UNIT).grad_ready_peak == pytest.approx(1 / (2 * J))
  assert analysis.cost("gpipe", N, UNIT).grad_ready_peak is None


def test_devices_staleness_and_model_states():
  costs = {c.strategy: c for c in analysis.compare(N, analysis.workload(1.0, 1.0, J,
                                                                          optimizer_factor=2))}
  assert set(costs) == set(analysis.STRATEGIES)
  assert {s: c.devices for s, c in costs.items()} == {
      "dp": N, "dp+mp": N * J, "gpipe": J, "1f1b": J, "zero-1": N, "zero-2": N, "zero-3": N,
      "cdp-v1": N, "cdp-v2": N, "cdp+mp": J, "cdp+zero": N}
  assert costs["cdp-v1"].stale_fraction == 1.0
  assert costs["cdp-v2"].stale_fraction == np.mean(schedule.delay_matrix("cdp-v2", N, J))
  assert {s for s, c in costs.items() if c.max_staleness} == {"cdp-v1", "cdp-v2", "cdp+mp",
                                                              "cdp+zero"}
  m = {s: c.per_device for s, c in costs.items()}
  assert (m["dp"].params, m["dp"].grads, m["dp"].optimizer) == (1, 1, 2)
  # The engine's compact state: cdp-v2 at N = J reads stage J-1 fresh on every worker, so
  # keeps (J-1)/J of a stale copy; the executed pipeline and ring keep whole versions.
  assert (m["cdp-v1"].params, m["cdp-v2"].params) == (2, 1 + (J - 1) / J)
  assert (m["cdp+mp"].params, m["cdp+zero"].params) == (2 / J, 2 / J)
  assert (m["zero-1"].optimizer, m["zero-2"].grads, m["zero-3"].params) == (2 / N, 1 / N, 1 / N)
  # ZeRO-3 and CDP+ZeRO send the same volume: 3(N-1)/N Psi_P; DP 2(N-1)/N Psi_P.
  assert costs["zero-3"].comm_sent_bytes == pytest.approx(3 * (N - 1) / N)
  assert costs["cdp+zero"].comm_sent_bytes == pytest.approx(3 * (N - 1) / N)
  assert costs["dp"].comm_sent_bytes == pytest.approx(2 * (N - 1) / N)


def test_square_only_strategies_and_table():
  assert {c.strategy for c in analysis.compare(8, UNIT)} == set(analysis.STRATEGIES) - {
      "cdp+mp", "cdp+zero"}
  with pytest.raises(ValueError, match="N = J"):
    analysis.cost("cdp+mp", 8, UNIT)
  with pytest.raises(ValueError, match="Unknown strategy"):
    analysis.cost("fsdp", 4, UNIT)
  table = analysis.markdown_table(analysis.compare(N, UNIT), UNIT, N)
  assert "Derived" in table and table.count("\n| ") == 1 + len(analysis.STRATEGIES)


# -- Against compiled programs --------------------------------------------------------

WIDTH, HIDDEN, B = 8, 16, 2  # Tiny: compile time, not size, is what matters here.


def _f32_bytes(tree) -> int:
  return sum(4 * int(np.size(x)) for x in jax.tree.leaves(tree))


def _batch(n):
  return {"image": np.zeros((n * B, 8, 8, 1), np.float32), "label": np.zeros((n * B,), np.int32)}


BATCH_BYTES_PER_ROW = 8 * 8 * 4 + 4


@pytest.fixture(scope="module")
def params():
  model = ResidualMLP(10, WIDTH, HIDDEN, num_blocks=J)  # Shapes matter, values do not.
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


@pytest.fixture(scope="module")
def stage_ids(params):
  stage_of = {"embed": 0, "head": J - 1, **{f"block_{j}": j for j in range(J)}}
  return {name: jax.tree.map(lambda _, s=s: s, params[name]) for name, s in stage_of.items()}


def test_engine_memory_and_all_reduce_bytes(params, stage_ids):
  rule, tx, k = "cdp-v2", optax.adam(1e-3), 2  # One stale version; Adam's mu and nu.
  stage_bytes = [_f32_bytes([p for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(stage_ids))
                             if s == j]) for j in range(J)]
  workers = N  # N = J: stage J-1 is read fresh by every worker and keeps no stale copy.
  model = ResidualMLP(10, WIDTH, HIDDEN, num_blocks=J)

  def loss_fn(p, batch):
    logits = model.apply({"params": p}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule,
                                mesh=jax.make_mesh((workers,), ("data",)))
  lowered = step.lower(step.init(params), _batch(workers))
  program = lowered.compile()
  predicted = analysis.cost(rule, workers, analysis.workload(stage_bytes, 1.0, J,
                                                             optimizer_factor=k))
  # The compact state: a stale copy only of the stages some worker reads stale.
  depths = schedule.delay_matrix(rule, workers, J).max(axis=0)
  assert list(depths) == [1] * (J - 1) + [0]
  assert predicted.per_device.params == sum((1 + d) * p for d, p in zip(depths, stage_bytes))
  mem = compiled.memory(program)
  scalars = 4 + 4  # The step counter; Adam's count.
  state_bytes = predicted.per_device.params + predicted.per_device.optimizer + scalars
  norms_flag = 1  # step(..., norms=) rides into the program as a bool scalar.
  assert mem["argument_bytes"] / (state_bytes + B * BATCH_BYTES_PER_ROW + norms_flag) == 1.0
  assert mem["alias_bytes"] / state_bytes == 1.0  # The donated state.
  (reduce,) = predicted.communication
  assert hlo.stablehlo_collectives(lowered.as_text())["all-reduce"] == reduce.ops == J
  measured = hlo.collective_summary(program.as_text())["all-reduce"]["bytes"]
  assert measured / (reduce.payload_bytes + 4) == 1.0  # + the loss, riding in the last bucket.


def _staged(params, stage_ids, pad_to=1):
  model = ResidualMLP(10, WIDTH, HIDDEN, num_blocks=J)
  return staged_lib.stage_model(model, params, stage_ids, np.zeros((1, 8, 8, 1), np.float32),
                                pad_to=pad_to)


def test_cdp_mp_pipeline_memory_and_messages(params, stage_ids):
  tx = optax.sgd(0.1, momentum=0.9)
  mesh = jax.make_mesh((J,), ("stage",), devices=jax.devices()[:J])
  staged = _staged(params, stage_ids)
  ex = pipeline.make_executor(staged, tx, rule="cdp-v2", mesh=mesh)
  program = ex.lower(ex.init(params), _batch(N)).compile()
  # Every stage is one flat buffer padded to the largest (staged.param_size): that is P_j
  # here. The activation buffer is padded to the largest boundary.
  act_bytes = 4 * staged.act_size(jax.ShapeDtypeStruct((B, 8, 8, 1), jnp.float32))
  w = analysis.workload(J * 4 * staged.param_size, 1.0, J, boundary_bytes=act_bytes)
  predicted = analysis.cost("cdp+mp", N, w)
  mem = compiled.memory(program)
  state_bytes = predicted.per_device.params + predicted.per_device.optimizer + 4
  assert mem["alias_bytes"] / state_bytes == 1.0
  # The whole (small) batch is replicated to every stage device.
  assert mem["argument_bytes"] / (state_bytes + N * B * BATCH_BYTES_PER_ROW) == 1.0
  found = hlo.collectives(program.as_text())
  assert {c.kind for c in found} == {"collective-permute"}  # Gradients stay on their device.
  (p2p,) = predicted.communication
  assert all(c.bytes / (p2p.payload_bytes / p2p.ops) == 1.0 for c in found)  # One boundary each.
  # Per step (one step per call), the program permutes at every slot with neighbours to swap.
  per_step = hlo.collectives_per_step(compiled.hlo_text(program))["collective-permute"]
  slots = plan.cyclic_slots(J, 1)
  swaps = sum(bool(plan.swap_pairs(J, s % 2)) for s in range(slots))
  assert per_step["bytes_min"] == per_step["bytes_max"] == swaps * act_bytes


@pytest.mark.parametrize("timetable", ["cyclic", "zero3"])
def test_zero_memory_and_traffic(params, stage_ids, timetable):
  tx = optax.sgd(0.1, momentum=0.9)
  rule = "cdp-v2" if timetable == "cyclic" else "dp"
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  staged = _staged(params, stage_ids, pad_to=N)
  ex = zero.make_executor(staged, tx, rule=rule, mesh=mesh)
  assert ex.plan.timetable == timetable
  program = ex.lower(ex.init(params), _batch(N)).compile()
  stage_bytes = 4 * staged.param_size  # Every stage is one padded flat buffer on the ring;
  shards = [4 * N * q for q in zero.shard_sizes(staged, N)]  # ZeRO-3 moves its own size.
  w = analysis.workload(J * stage_bytes if timetable == "cyclic" else shards, 1.0, J)
  predicted = analysis.cost("cdp+zero" if timetable == "cyclic" else "zero-3", N, w)
  mem = compiled.memory(program)
  state_bytes = predicted.per_device.params + predicted.per_device.optimizer + 4
  assert mem["alias_bytes"] / state_bytes == 1.0
  assert mem["argument_bytes"] / (state_bytes + B * BATCH_BYTES_PER_ROW) == 1.0
  found = hlo.collectives(program.as_text())
  if timetable == "cyclic":
    assert {c.kind for c in found} == {"collective-permute"}
    assert {c.bytes for c in found} == {stage_bytes}  # Each message one stage buffer.
    # The messages sit in a loop over slots: one step's are counted from its slot plan.
    moved = stage_bytes * len(plan.cyclic_transfers(ex.plan.delays))
    (ring,) = predicted.communication
    assert moved / ring.total_bytes == 1.0  # 3(N-1) stage messages per stage.
    # Per step, a permute runs on every device for each slot and route with messages.
    sends = plan.zero_plan(ex.plan.delays).num_permutes(model_states=False)
    per_step = hlo.collectives_per_step(compiled.hlo_text(program))["collective-permute"]
    assert per_step["bytes_min"] == per_step["bytes_max"] == sends * stage_bytes
  else:
    summary = hlo.collective_summary(program.as_text())
    scatter, gather = predicted.communication
    assert (summary["all-gather"]["count"], summary["reduce-scatter"]["count"]) == (
        gather.ops, scatter.ops)
    assert summary["all-gather"]["bytes"] / gather.payload_bytes == 1.0
    assert summary["reduce-scatter"]["bytes"] / scatter.payload_bytes == 1.0


def test_async_profile_against_the_simulator_and_cdp():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from cdpjax import simulate  # pylint: disable=g-import-not-at-top
  n, j, steps = 3, 2, 4
  speeds = [1.0, 1.0, 0.5]
  rng = np.random.default_rng(0)
  params = [{"w": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)} for _ in range(j)]
  batches = [[(rng.normal(size=(1, 2)).astype(np.float32),) * 2 for _ in range(n)]
             for _ in range(steps)]
  sim = simulate.simulate_async([lambda p, h: jnp.tanh(h @ p["w"])] * j,
                                lambda out, y: jnp.mean((out - y) ** 2), params,
                                optax.sgd(0.1), batches, speeds=speeds)
  profile = analysis.async_profile(n, j, steps, [10.0, 30.0], speeds=speeds)
  np.testing.assert_allclose(profile.async_staleness, sim.staleness / n)
  assert profile.async_staleness.max() > 1  # The slow worker's gradients come late...
  assert profile.cdp_staleness.max() <= 1   # ...where CDP's barrier bounds the delay.
  # Async moves 2 P_j per (worker, stage, step); the ring all-reduce 2 (N-1) P_j per (stage, step).
  assert profile.async_bytes.sum() == pytest.approx(2 * n * steps * 40.0)
  assert profile.cdp_bytes.sum() == pytest.approx(2 * (n - 1) * steps * 40.0)
  # Equal speeds: stage j's gradient waits 2(J-j) slots between read and update, while the
  # other workers' updates come every 2J/N slots: ceil(N(J-j)/J) - 1 of them in steady state.
  equal = analysis.async_profile(n, j, steps, 40.0)
  np.testing.assert_allclose(equal.async_staleness[1:], np.broadcast_to([2 / 3, 1 / 3], (3, n, j)))


def test_replicas_add_one_gradient_all_reduce_and_recompute_adds_to_the_peak():
  w = analysis.workload([1.0, 2.0, 3.0, 2.0], 1.0, J, recompute_bytes=[0.0, 0.0, 5.0, 0.0])
  for name in analysis.REPLICATED:
    one, three = analysis.cost(name, N, w), analysis.cost(name, N, w, replicas=3)
    assert three.communication[:-1] == one.communication and three.devices == 3 * one.devices
    assert three.per_device == one.per_device and three.total.params == 3 * one.total.params
    reduce = three.communication[-1]
    assert (reduce.kind, reduce.group) == ("all-reduce", 3)
    assert reduce.total_bytes == 2 * 2 * w.param_bytes  # 2 Psi_P over all devices.
  gpipe = analysis.cost("gpipe", N, w, replicas=3).communication[-1]
  assert (gpipe.ops, gpipe.payload_bytes) == (1, 3.0)  # The largest stage, once a step.
  zero3 = analysis.cost("zero-3", N, w, replicas=3).communication[-1]
  assert (zero3.ops, zero3.payload_bytes) == (J, w.param_bytes / N)  # Every stage's shard.
  with pytest.raises(ValueError, match="takes no replicas"):
    analysis.cost("dp", N, w, replicas=2)
  # A pipeline device holds its own stage's recomputed residuals, a ZeRO worker the largest.
  plain = w._replace(stage_recompute_bytes=(0.0,) * J)
  even = analysis.workload(w.param_bytes, 1.0, J, recompute_bytes=4 * 5.0)
  for name in ("gpipe", "cdp+mp"):
    assert (analysis.cost(name, N, even).per_device.activations_peak
            == analysis.cost(name, N, even._replace(stage_recompute_bytes=())).per_device
            .activations_peak + 5.0)
  for name in ("zero-3", "cdp+zero", "dp"):
    assert (analysis.cost(name, N, w).per_device.activations_peak
            == analysis.cost(name, N, plain).per_device.activations_peak + 5.0)


def test_replicated_zero3_all_reduces_each_shard_over_the_replicas(params, stage_ids):
  """The compiled replica all-reduce, per step, is the cost model's."""
  mesh = jax.make_mesh((2, N), ("replica", "data"))
  staged = _staged(params, stage_ids, pad_to=N)
  ex = zero.make_executor(staged, optax.sgd(0.1), rule="dp", mesh=mesh)
  program = ex.lower(ex.init(params), _batch(2 * N)).compile()
  w = analysis.workload([4 * N * q for q in zero.shard_sizes(staged, N)], 1.0, J)
  reduce = analysis.cost("zero-3", N, w, replicas=2).communication[-1]
  found = [c for c in hlo.collectives(program.as_text()) if c.kind == "all-reduce"
           and c.replica_groups and len(c.replica_groups[0]) == 2]
  assert sum(c.bytes for c in found) / reduce.payload_bytes == 1.0
