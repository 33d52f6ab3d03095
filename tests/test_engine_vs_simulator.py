"""The engine against the event-by-event simulator of the timeline (the oracle)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import engine, executor, schedule, simulate, stages

WIDTH = 3
STEPS = 3


def stage_fn(p, h):
  return jnp.tanh(h @ p["w"] + p["b"][None, :])


def micro_loss(out, y):
  return jnp.mean(jnp.square(out - y))


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
@pytest.mark.parametrize("num_workers", [1, 2, 4, 8])
def test_engine_equals_simulator(num_workers, num_stages):
  rng = np.random.default_rng(num_workers * 10 + num_stages)
  stage_params, sim_batches, batches = _problem(rng, num_workers, num_stages, STEPS)
  stage_ids = stages.grouped(stage_params)
  mesh = jax.make_mesh((num_workers,), ("data",), devices=jax.devices()[:num_workers])
  # One compiled engine step serves SGD and SGD+momentum: momentum is a state
  # value, and momentum 0 is plain SGD exactly (g + 0 * trace == g).
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3, momentum=0.9)
  rules = ["dp", "cdp-v1", "cdp-v2"] + (["cdp-v2-paper"] if num_workers != num_stages else [])
  for rule in rules:
    step = engine.make_train_step(_chain_loss, tx, stage_ids=stage_ids, rule=rule, mesh=mesh,
                                  scan_steps=STEPS)
    for momentum in (None, 0.9):
      ref = simulate.simulate([stage_fn] * num_stages, micro_loss, stage_params,
                              optax.sgd(0.3, momentum=momentum), sim_batches, rule)
      state = engine.init_state(stage_params, tx, rule=rule)
      state.opt_state.hyperparams["momentum"] = jnp.float32(momentum or 0.0)
      state, metrics = step(state, batches)
      np.testing.assert_allclose(metrics["loss"], ref.losses, rtol=1e-5, err_msg=f"{rule} momentum={momentum}")
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                                           err_msg=rule), state.params, ref.params)


def test_engine_equals_simulator_with_unequal_workers():
  """A slow, jittered worker: the delays come from the timeline, step by step."""
  num_workers, num_stages, steps, bound = 4, 3, 6, 2
  speeds = [1.0, 1.25, 1.0, 0.5]
  rng = np.random.default_rng(7)
  jitter = rng.uniform(0, 0.5, size=(steps, num_workers))
  stage_params = [{"w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) * 0.7,
                   "b": rng.normal(size=(WIDTH,)).astype(np.float32) * 0.1}
                  for _ in range(num_stages)]
  xs = rng.normal(size=(steps, num_workers, 2, WIDTH)).astype(np.float32)
  ys = rng.normal(size=(steps, num_workers, 2, WIDTH)).astype(np.float32)
  ref = simulate.simulate(
      [stage_fn] * num_stages, micro_loss, stage_params, optax.sgd(0.3, momentum=0.9),
      [[(xs[t, i], ys[t, i]) for i in range(num_workers)] for t in range(steps)], "cdp-v2",
      speeds=speeds, jitter=jitter, max_delay=bound)

  def loss_fn(params, batch):
    h = batch["x"]
    for p in params:
      h = stage_fn(p, h)
    return micro_loss(h, batch["y"])

  rule = schedule.timeline_rule(speeds, num_stages, steps, jitter=jitter, max_delay=bound)
  assert rule.window(0, steps).max() == bound  # Not cdp-v2 in disguise.
  mesh = jax.make_mesh((num_workers,), ("data",), devices=jax.devices()[:num_workers])
  tx = optax.sgd(0.3, momentum=0.9)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stages.grouped(stage_params),
                                rule=rule, mesh=mesh, scan_steps=steps)
  state, metrics = step(engine.init_state(stage_params, tx, rule=rule),
                        {"x": xs.reshape(steps, -1, WIDTH), "y": ys.reshape(steps, -1, WIDTH)})
  np.testing.assert_allclose(metrics["loss"], ref.losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               state.params, ref.params)


def _problem(rng, num_workers, num_stages, steps):
  stage_params = [{"w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) * 0.7,
                   "b": rng.normal(size=(WIDTH,)).astype(np.float32) * 0.1}
                  for _ in range(num_stages)]
  xs = rng.normal(size=(steps, num_workers, 2, WIDTH)).astype(np.float32)
  ys = rng.normal(size=(steps, num_workers, 2, WIDTH)).astype(np.float32)
  sim_batches = [[(xs[t, i], ys[t, i]) for i in range(num_workers)] for t in range(steps)]
  batches = {"x": xs.reshape(steps, -1, WIDTH), "y": ys.reshape(steps, -1, WIDTH)}
  return stage_params, sim_batches, batches


def _chain_loss(params, batch):
  """The same network as one function of all stages."""
  h = batch["x"]
  for p in params:
    h = stage_fn(p, h)
  return micro_loss(h, batch["y"])


@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2", "two-step"])
@pytest.mark.parametrize("num_workers,num_stages", [(2, 2), (4, 4), (4, 3)])
def test_weight_prediction_equals_simulator(num_workers, num_stages, rule):
  """Stale reads extrapolate by the last known step: theta_v + d (theta_v - theta_{v-1})."""
  steps = 5
  rng = np.random.default_rng(num_workers * 10 + num_stages)
  stage_params, sim_batches, batches = _problem(rng, num_workers, num_stages, steps)
  if rule == "two-step":  # Delays of 2 on stage 0: theta_{t-3} is read for the step.
    rule = schedule.resolve("cdp-v2", num_workers, num_stages).copy()
    rule[:, 0] = 2
  mesh = jax.make_mesh((num_workers,), ("data",), devices=jax.devices()[:num_workers])
  tx = optax.sgd(0.3, momentum=0.9)
  plan = executor.resolve(rule, "data", num_workers, num_stages, predict=True)
  assert plan.num_stale == schedule.max_delay(rule) + 1
  step = engine.make_train_step(_chain_loss, tx, stage_ids=stages.grouped(stage_params),
                                rule=plan, mesh=mesh, scan_steps=steps)
  state, metrics = step(engine.init_state(stage_params, tx, rule=plan), batches)
  ref = simulate.simulate([stage_fn] * num_stages, micro_loss, stage_params, tx,
                          sim_batches, rule, weight_prediction=True)
  plain = simulate.simulate([stage_fn] * num_stages, micro_loss, stage_params, tx,
                            sim_batches, rule)
  assert np.abs(ref.losses - plain.losses).max() > 1e-3  # The option changes the run.
  np.testing.assert_allclose(metrics["loss"], ref.losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               state.params, ref.params)



def test_delay_compensations_resolve_for_every_parallelism():
  for parallelism in executor.PARALLELISMS:
    for key in ({"predict": True}, {"dc_lambda": 0.5}, {"lr_delay_scale": 0.5}):
      assert executor.resolve("cdp-v2", parallelism, 2, 2, **key)._asdict().items() >= key.items()


@pytest.mark.parametrize("rule,predict,scale", [
    ("cdp-v1", False, 0.0), ("cdp-v2", False, 0.0), ("cdp-v2", True, 0.0), ("cdp-v2", False, 1.0),
    ("cdp-v1", True, 1.0)])
def test_dc_asgd_correction_and_delay_scaled_lr_equal_simulator(rule, predict, scale):
  """Each worker's stale gradient g counts as g + lambda g^2 (theta_t - theta_read); with
  ``scale``, stage j's update is scaled by 1 / (1 + scale * mean_i d[i, j])."""
  num_workers, num_stages, steps, lam = 4, 4, 5, 2.0
  rng = np.random.default_rng(3)
  stage_params, sim_batches, batches = _problem(rng, num_workers, num_stages, steps)
  mesh = jax.make_mesh((num_workers,), ("data",), devices=jax.devices()[:num_workers])
  tx = optax.sgd(0.3, momentum=0.9)
  plan = executor.resolve(rule, "data", num_workers, num_stages, predict=predict, dc_lambda=lam,
                          lr_delay_scale=scale)
  step = engine.make_train_step(_chain_loss, tx, stage_ids=stages.grouped(stage_params),
                                rule=plan, mesh=mesh, scan_steps=steps)
  state, metrics = step(engine.init_state(stage_params, tx, rule=plan), batches)
  ref = simulate.simulate([stage_fn] * num_stages, micro_loss, stage_params, tx, sim_batches,
                          rule, weight_prediction=predict, dc_lambda=lam, lr_delay_scale=scale)
  plain = simulate.simulate([stage_fn] * num_stages, micro_loss, stage_params, tx, sim_batches,
                            rule, weight_prediction=predict)
  assert np.abs(ref.losses - plain.losses).max() > 1e-4  # The correction changes the run.
  np.testing.assert_allclose(metrics["loss"], ref.losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               state.params, ref.params)


@pytest.mark.parametrize("compensation", [{"predict": True}, {"lr_delay_scale": 0.5}],
                         ids=["prediction", "delay_scaled_lr"])
def test_compensation_with_delays_that_are_data(compensation):
  """A slow, jittered worker (a schedule.DelayRule): the compensations follow each step's
  delays (data, not constants)."""
  num_workers, num_stages, steps, bound = 4, 3, 6, 2
  speeds = [1.0, 1.25, 1.0, 0.5]
  rng = np.random.default_rng(7)
  jitter = rng.uniform(0, 0.5, size=(steps, num_workers))
  stage_params, sim_batches, batches = _problem(rng, num_workers, num_stages, steps)
  tx = optax.sgd(0.3, momentum=0.9)
  ref = simulate.simulate([stage_fn] * num_stages, micro_loss, stage_params, tx, sim_batches,
                          "cdp-v2", speeds=speeds, jitter=jitter, max_delay=bound,
                          weight_prediction=compensation.get("predict", False),
                          lr_delay_scale=compensation.get("lr_delay_scale", 0.0))
  rule = schedule.timeline_rule(speeds, num_stages, steps, jitter=jitter, max_delay=bound)
  plan = executor.resolve(rule, "data", num_workers, num_stages, **compensation)
  mesh = jax.make_mesh((num_workers,), ("data",), devices=jax.devices()[:num_workers])
  step = engine.make_train_step(_chain_loss, tx, stage_ids=stages.grouped(stage_params),
                                rule=plan, mesh=mesh, scan_steps=steps)
  state, metrics = step(engine.init_state(stage_params, tx, rule=plan), batches)
  np.testing.assert_allclose(metrics["loss"], ref.losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               state.params, ref.params)
