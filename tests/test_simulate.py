"""The event-by-event simulator against closed forms computed directly with jax.grad."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import schedule
from cdpjax.simulate import simulate, simulate_async

WIDTH, BATCH, STEPS, LR = 3, 2, 3, 0.1


def dense(p, h):
  return jnp.tanh(h @ p["w"] + p["b"][None])


def mse(out_BxD, y_BxD):
  return 0.5 * jnp.mean((out_BxD - y_BxD)**2)


def model_loss(params, x, y):
  for p in params:
    x = dense(p, x)
  return mse(x, y)


def setup(num_workers, num_stages, seed=0):
  """``theta_0`` for ``J`` tanh dense stages and ``STEPS`` steps of micro-batches."""
  rng = np.random.default_rng(seed)
  params = [{"w": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)), jnp.float32),
             "b": jnp.asarray(rng.normal(size=WIDTH) * 0.1, jnp.float32)}
            for _ in range(num_stages)]
  batches = [[tuple(jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32) for _ in "xy")
              for _ in range(num_workers)] for _ in range(STEPS)]
  return params, batches


def full_batch(step):
  return jnp.concatenate([x for x, _ in step]), jnp.concatenate([y for _, y in step])


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
               actual, expected)


def run(params, batches, tx, rule):
  return simulate([dense] * len(params), mse, params, tx, batches, rule)


def reference(params, batches, tx, delays):
  """``theta_{t+1} = tx(theta_t, mean_i grad f(theta~_{t,i}))`` with one global optimizer state."""
  history, losses, state = [params], [], tx.init(params)
  for t, step in enumerate(batches):
    views = [[history[max(t - d, 0)][j] for j, d in enumerate(row)] for row in delays]
    values, grads = zip(*(jax.value_and_grad(model_loss)(view, x, y)
                          for view, (x, y) in zip(views, step)))
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    updates, state = tx.update(mean, state, history[-1])
    history.append(optax.apply_updates(history[-1], updates))
    losses.append(np.mean(values))
  return history, np.array(losses)


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_dp_is_full_batch_gradient_descent(momentum):
  params, batches = setup(num_workers=3, num_stages=2)
  result = run(params, batches, optax.sgd(LR, momentum=momentum), "dp")
  theta, velocity = params, jax.tree.map(jnp.zeros_like, params)
  for t, step in enumerate(batches):
    loss, grad = jax.value_and_grad(model_loss)(theta, *full_batch(step))
    np.testing.assert_allclose(result.losses[t], loss, rtol=1e-5)
    velocity = jax.tree.map(lambda m, g: (momentum or 0.0) * m + g, velocity, grad)
    theta = jax.tree.map(lambda p, m: p - LR * m, theta, velocity)
    assert_trees_close(result.history[t + 1], theta)
  assert_trees_close(result.params, theta)


def test_cdp_v1_is_one_step_delayed_gradient_descent():
  params, batches = setup(num_workers=2, num_stages=3)
  result = run(params, batches, optax.sgd(LR), "cdp-v1")
  history = [params]
  for t, step in enumerate(batches):
    grad = jax.grad(model_loss)(history[max(t - 1, 0)], *full_batch(step))
    history.append(jax.tree.map(lambda p, g: p - LR * g, history[-1], grad))
  assert_trees_close(result.history, history)


def test_cdp_v2_linear_stages_by_hand():
  # N = J = 2: worker 0 reads stage 0 one step late, everything else is fresh.
  np.testing.assert_array_equal(schedule.delay_matrix("cdp-v2", 2, 2), [[1, 0], [0, 0]])
  rng = np.random.default_rng(1)
  x = rng.normal(size=(STEPS, 2, 4))
  y = rng.normal(size=(STEPS, 2, 4))
  batches = [[(jnp.float32(x[t, i]), jnp.float32(y[t, i])) for i in range(2)]
             for t in range(STEPS)]
  result = simulate([lambda w, h: w * h] * 2, lambda out, y: 0.5 * jnp.mean((out - y)**2),
                    [jnp.float32(0.9), jnp.float32(-1.2)], optax.sgd(LR), batches, "cdp-v2")
  # Loss 0.5 * mean((b*a*x - y)^2) at the view (a, b): dL/da = mean(r*b*x), dL/db = mean(r*a*x).
  w = [np.array([0.9, -1.2])]
  for t in range(STEPS):
    grad = np.zeros(2)
    for i in range(2):
      a = w[max(t - 1, 0)][0] if i == 0 else w[t][0]
      b = w[t][1]
      r = b * a * x[t, i] - y[t, i]
      grad += np.array([np.mean(r * b * x[t, i]), np.mean(r * a * x[t, i])]) / 2
    w.append(w[t] - LR * grad)
  np.testing.assert_allclose(np.array(result.history, dtype=np.float64), np.array(w), rtol=1e-5)


@pytest.mark.parametrize("rule,num_workers,num_stages", [
    ("cdp-v2", 3, 2),
    ("cdp-v2", 2, 3),
    ("cdp-v2-paper", 4, 2),  # Not causal on the cyclic timeline: runs in lockstep.
    (np.array([[2, 0], [1, 0], [0, 1]]), 3, 2),
])
def test_matches_the_update_rule_with_adam(rule, num_workers, num_stages):
  params, batches = setup(num_workers, num_stages, seed=2)
  tx = optax.adam(0.05)
  result = run(params, batches, tx, rule)
  history, losses = reference(params, batches, tx, schedule.resolve(rule, num_workers, num_stages))
  assert_trees_close(result.history, history)
  np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
  np.testing.assert_allclose(result.losses, result.worker_losses.mean(axis=1))
  assert result.worker_losses.shape == (STEPS, num_workers)


@pytest.mark.parametrize("timetable,rule,num_workers,num_stages", [
    ("cyclic", "cdp-v2", 3, 3),
    ("cyclic", "cdp-v1", 2, 2),
    ("gpipe", "dp", 4, 3),
    ("dp+mp", "dp", 2, 3),
])
def test_executed_timetables_run_the_update_rule(timetable, rule, num_workers, num_stages):
  # The executors' slot plan, run event by event, realises the rule's update.
  params, batches = setup(num_workers, num_stages, seed=3)
  tx = optax.adam(0.05)
  result = simulate([dense] * num_stages, mse, params, tx, batches, rule, timetable=timetable)
  history, losses = reference(params, batches, tx, schedule.resolve(rule, num_workers, num_stages))
  assert_trees_close(result.history, history)
  np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


def test_errors():
  params, batches = setup(num_workers=2, num_stages=2)
  with pytest.raises(ValueError, match="one parameter pytree per stage"):
    simulate([dense] * 3, mse, params, optax.sgd(LR), batches, "dp")
  with pytest.raises(ValueError, match="one per worker"):
    run(params, batches + [batches[0][:1]], optax.sgd(LR), "dp")
  with pytest.raises(ValueError, match="at least one step"):
    run(params, [], optax.sgd(LR), "dp")
  with pytest.raises(ValueError, match="Unknown rule"):
    run(params, batches, optax.sgd(LR), "cdp")
  with pytest.raises(ValueError, match="equal speeds"):
    simulate([dense] * 2, mse, params, optax.sgd(LR), batches, "cdp-v2", speeds=[1, 2],
             timetable="cyclic")


# Asynchronous updates.


def test_async_with_one_worker_is_plain_sgd():
  params, batches = setup(1, 2)
  out = simulate_async([dense] * 2, mse, params, optax.sgd(LR), batches)
  history, losses = reference(params, batches, optax.sgd(LR), [[0, 0]])
  assert_trees_close(out.params, history[-1])
  np.testing.assert_allclose(out.losses, losses, rtol=1e-5)
  assert not out.staleness.any()


def test_async_two_workers_one_stage_by_hand():
  """Offsets 0 and 1, one slot per event: theta_{k+1} = theta_k - lr/2 grad(theta_{k-1})."""
  params, batches = setup(2, 1)
  out = simulate_async([dense], mse, params, optax.sgd(LR), batches)
  thetas = [params[0], params[0]]  # theta_{-1} := theta_0.
  for t, step in enumerate(batches):
    for x, y in step:  # Updates arrive worker 0, worker 1, worker 0, ...
      grad = jax.grad(lambda p: mse(dense(p, x), y))(thetas[-2])
      thetas.append(jax.tree.map(lambda p, g: p - LR / 2 * g, thetas[-1], grad))
  assert_trees_close(out.params[0], thetas[-1])
  np.testing.assert_array_equal(out.staleness[:, :, 0], [[0, 1], [1, 1], [1, 1]])
