"""Stability of delayed gradient descent: closed form, companion matrix, engine runs."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import engine, schedule, stability, stages

N, J, FEATURES, ROWS = 4, 2, 6, 12
STEPS = 300


def problem(seed=0):
  """Least squares with each worker's own rows: H_i = X_i^T X_i / m_i."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N * ROWS, FEATURES)) * np.linspace(0.3, 1.5, FEATURES)
  y = rng.normal(size=(N * ROWS, 1))
  hessians = np.stack([xi.T @ xi / ROWS for xi in np.split(x, N)])
  stage_of_coord = np.repeat(np.arange(J), FEATURES // J)
  return x.astype(np.float32), y.astype(np.float32), hessians, stage_of_coord


def test_levin_may_closed_form():
  assert stability.fixed_delay_limit(0) == pytest.approx(2.0)
  assert stability.fixed_delay_limit(1) == pytest.approx(1.0)
  assert stability.fixed_delay_limit(2) == pytest.approx((np.sqrt(5) - 1) / 2)
  with pytest.raises(ValueError, match="tau must be an integer >= 0"):
    stability.fixed_delay_limit(-1)


@pytest.mark.parametrize("tau", [0, 1, 2, 3])
def test_companion_matrix_agrees_with_the_closed_form(tau):
  _, _, hessians, stage_of_coord = problem()
  limit = stability.stability_limit(hessians, stage_of_coord, np.full((N, J), tau), tol=1e-5)
  assert limit == pytest.approx(stability.fixed_delay_limit(tau), abs=1e-4)
  # The expected-iterate limit of a rule that is always tau late is the same number.
  probs = np.eye(tau + 1)[tau]
  assert stability.mean_delay_limit(probs, tol=1e-5) == pytest.approx(
      stability.fixed_delay_limit(tau), abs=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9])
def test_heavy_ball_limits_are_jurys(beta):
  """With momentum beta, lr * L < 2 (1 + beta) without delay and < 1 - beta one step late."""
  _, _, hessians, stage_of_coord = problem()
  for tau, closed in ((0, 2 * (1 + beta)), (1, 1 - beta)):
    limit = stability.stability_limit(hessians, stage_of_coord, np.full((N, J), tau), tol=1e-6,
                                      momentum=beta)
    assert limit == pytest.approx(closed, abs=1e-4), (tau, beta)


@pytest.mark.parametrize("tau", [1, 2])
def test_weight_prediction_limit_is_that_of_its_characteristic_polynomial(tau):
  """Every read tau late and extrapolated: x_{t+1} = x_t - a ((1 + tau) x_{t-tau} - tau
  x_{t-tau-1}); its limit from the roots of z^{tau+2} - z^{tau+1} + a (1 + tau) z - a tau."""
  def radius(a):
    coeffs = np.zeros(tau + 3)
    coeffs[0], coeffs[1] = 1.0, -1.0
    coeffs[tau + 1] += a * (1 + tau)
    coeffs[tau + 2] -= a * tau
    return np.abs(np.roots(coeffs)).max()
  lo, hi = 0.0, 2.0
  while hi - lo > 1e-6:
    lo, hi = (lo, 0.5 * (lo + hi)) if radius(0.5 * (lo + hi)) >= 1 else (0.5 * (lo + hi), hi)
  _, _, hessians, stage_of_coord = problem()
  limit = stability.stability_limit(hessians, stage_of_coord, np.full((N, J), tau), tol=1e-6,
                                    predict=True)
  assert limit == pytest.approx(lo, abs=1e-4)
  assert limit < stability.fixed_delay_limit(tau)  # Extrapolation costs stability on a quadratic.


@pytest.mark.parametrize("predict", [False, True])
def test_dc_asgd_limit_is_that_of_its_characteristic_polynomial(predict):
  """One coordinate, h = 1, read one step late, DC-ASGD linearized with dc = 0.3:
  x_{t+1} = x_t - lr (h x_read + dc (x_t - x_read)), x_read = x_{t-1} or, predicted,
  2 x_{t-1} - x_{t-2}."""
  h, dc = 1.0, 0.3

  def radius(a):  # lr = a / h.
    read = np.array([1.0, 0.0]) if not predict else np.array([2.0, -1.0])  # x_{t-1}, x_{t-2}.
    coeffs = np.array([1.0, -(1 - a * dc), *(a * (h - dc) * read)])
    return np.abs(np.roots(coeffs)).max()
  lo, hi = 0.0, 4.0
  while hi - lo > 1e-6:
    lo, hi = (lo, 0.5 * (lo + hi)) if radius(0.5 * (lo + hi)) >= 1 else (0.5 * (lo + hi), hi)
  limit = stability.stability_limit(np.array([[[h]]]), np.array([0]), np.array([[1]]), tol=1e-6,
                                    predict=predict, dc=np.array([[dc]]))
  assert limit == pytest.approx(lo, abs=1e-4)
  plain = stability.stability_limit(np.array([[[h]]]), np.array([0]), np.array([[1]]),
                                    tol=1e-6, predict=predict)
  assert abs(limit - plain) > 1e-2  # The correction moves the limit.


def test_delay_scaled_lr_moves_the_limit_by_its_factor():
  _, _, hessians, stage_of_coord = problem()
  for c in (0.5, 2.0):
    limit = stability.stability_limit(hessians, stage_of_coord, np.ones((N, J), int), tol=1e-6,
                                      lr_delay_scale=c)
    assert limit == pytest.approx((1 + c) * stability.fixed_delay_limit(1), abs=1e-4)


def test_random_rule_limit_by_simulation_brackets_a_fixed_rule():
  _, _, hessians, stage_of_coord = problem()
  always_one = schedule.function_rule(lambda t, n, j: np.ones((n, j), np.int32), N, J, 1)
  assert stability.random_rule_limit(hessians, stage_of_coord, always_one, num_steps=200) == (
      pytest.approx(1.0, abs=0.02))


@pytest.fixture(scope="module")
def engine_runs():
  """``run(rule, lr_times_L) -> losses`` of full-batch SGD on the problem, one compile per rule."""
  x, y, hessians, stage_of_coord = problem()
  big_l = stability.lipschitz(hessians)
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  half = FEATURES // J
  sgd = optax.inject_hyperparams(optax.sgd)

  def loss_fn(params, b):
    pred = b["x"][:, :half] @ params[0] + b["x"][:, half:] @ params[1]
    return 0.5 * jnp.mean(jnp.sum(jnp.square(pred - b["y"]), axis=1))

  batch = {"x": np.stack([x] * STEPS), "y": np.stack([y] * STEPS)}
  init = [np.zeros((half, 1), np.float32)] * J
  steps = {}

  def run(rule, lr_times_l, momentum=None):
    kind = (rule, momentum is not None)  # Momentum, a hyperparameter of the state: one compile.
    if kind not in steps:
      steps[kind] = engine.make_train_step(
          loss_fn, sgd(learning_rate=0.0, momentum=momentum), stage_ids=stages.grouped(init),
          rule=rule, mesh=mesh, scan_steps=STEPS)
    state = engine.init_state(init, sgd(learning_rate=lr_times_l / big_l, momentum=momentum),
                              rule=rule)
    _, metrics = steps[kind](state, batch)
    return np.asarray(metrics["loss"], np.float64)

  return run, hessians, stage_of_coord


def diverges(losses):
  """The loss grows over the run's second half (late peaks above the earlier ones)."""
  quarter = len(losses) // 4
  return not np.all(np.isfinite(losses)) or losses[3 * quarter:].max() > losses[quarter:2 * quarter].max()


@pytest.mark.parametrize("rule", ["dp", "cdp-v1", "cdp-v2"])
def test_engine_diverges_where_theory_says(engine_runs, rule):
  run, hessians, stage_of_coord = engine_runs
  limit = stability.stability_limit(hessians, stage_of_coord, schedule.delay_matrix(rule, N, J))
  if rule == "cdp-v1":
    assert limit == pytest.approx(1.0, abs=1e-3)  # lr * L < 1 with one step of delay.
  assert not diverges(run(rule, 0.9 * limit))
  assert diverges(run(rule, 1.1 * limit))


@pytest.mark.parametrize("rule, beta", [("dp", 0.5), ("cdp-v1", 0.5), ("cdp-v2", 0.9)])
def test_engine_with_momentum_diverges_where_theory_says(engine_runs, rule, beta):
  """optax.sgd's momentum on the engine: stable below the companion matrix's limit, not above
  (cdp-v1's is 1 - beta: momentum narrows a delayed rule's steps as it widens dp's)."""
  run, hessians, stage_of_coord = engine_runs
  limit = stability.stability_limit(hessians, stage_of_coord, schedule.delay_matrix(rule, N, J),
                                    momentum=beta)
  if rule == "cdp-v1":
    assert limit == pytest.approx(1 - beta, abs=1e-3)
  assert not diverges(run(rule, 0.9 * limit, momentum=beta))
  assert diverges(run(rule, 1.1 * limit, momentum=beta))
