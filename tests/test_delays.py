"""Delays that change every step: rules, the engine's dynamic path, the launcher."""
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import config as config_lib
from cdpjax import engine, schedule, stages, train

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]
N, J, D = 4, 3, 2


def loss_fn(params, batch):
  h = batch["x"]
  for j in range(len(params)):
    h = jnp.tanh(h @ params[j]["w"] + params[j]["b"][None, :])
  return jnp.mean(jnp.square(h - batch["y"]))


def problem(num_steps, width=4, per_worker=2, seed=0):
  rng = np.random.default_rng(seed)
  params = [{"w": rng.normal(size=(width, width)).astype(np.float32) * 0.6,
             "b": rng.normal(size=(width,)).astype(np.float32) * 0.1} for _ in range(J)]
  batches = [{"x": rng.normal(size=(N * per_worker, width)).astype(np.float32),
              "y": rng.normal(size=(N * per_worker, width)).astype(np.float32)}
             for _ in range(num_steps)]
  return params, stages.grouped(params), batches


def reference(params, batches, delays_TxNxJ, tx):
  """Single device: worker i differentiates at theta^j_{t - d_t[i, j]} (theta_{<0} = theta_0)."""
  history, opt_state, losses = [params], tx.init(params), []
  for t, batch in enumerate(batches):
    grads, loss = [], 0.0
    for i in range(N):
      view = [history[max(t - int(delays_TxNxJ[t, i, j]), 0)][j] for j in range(J)]
      part = jax.tree.map(lambda x: np.split(x, N)[i], batch)
      value, grad = jax.value_and_grad(loss_fn)(view, part)
      grads.append(grad)
      loss += float(value) / N
    mean = jax.tree.map(lambda *g: sum(g) / N, *grads)
    updates, opt_state = tx.update(mean, opt_state, history[-1])
    history.append(optax.apply_updates(history[-1], updates))
    losses.append(loss)
  return history[-1], losses


def assert_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                       rtol=1e-5, atol=1e-6), a, b)


# Rules.


def test_random_rule_is_a_pure_function_of_seed_and_step():
  rule = schedule.random_rule(N, J, D, seed=3)
  np.testing.assert_array_equal(rule(7), schedule.random_rule(N, J, D, seed=3)(7))
  assert not np.array_equal(rule.window(0, 5), schedule.random_rule(N, J, D, seed=4).window(0, 5))
  draws = rule.window(0, 2000)
  assert draws.dtype == np.int32 and draws.min() == 0 and draws.max() == D
  np.testing.assert_allclose(np.bincount(draws.ravel()) / draws.size, [1 / 3] * 3, atol=0.01)


def test_geometric_rule_follows_the_truncated_law():
  probs = schedule.delay_probabilities("geometric", 3, p=0.5)
  np.testing.assert_allclose(probs, np.array([8, 4, 2, 1]) / 15)
  draws = schedule.random_rule(N, J, 3, distribution="geometric", p=0.5).window(0, 2000)
  np.testing.assert_allclose(np.bincount(draws.ravel(), minlength=4) / draws.size, probs,
                             atol=0.01)


def test_straggler_rule_rows():
  rule = schedule.straggler_rule(N, J, 3, stragglers=1)
  expected = schedule.delay_matrix("cdp-v2", N, J)
  expected[-1] = 3
  np.testing.assert_array_equal(rule(0), expected)
  np.testing.assert_array_equal(schedule.straggler_rule(N, J, 2, stragglers=[0])(5)[0], [2] * J)


@pytest.mark.parametrize("make, match", [
    (lambda: schedule.random_rule(N, J, -1), "max_delay must be an integer >= 0"),
    (lambda: schedule.random_rule(N, J, 2, distribution="zipf"), "Unknown delay distribution"),
    (lambda: schedule.straggler_rule(N, J, 2, stragglers=5), "stragglers=5 must be in"),
    (lambda: schedule.function_rule(lambda t, n, j: np.full((n, j), 3), N, J, 2)(0),
     "gave delay 3 at step 0, above its max_delay 2"),
    (lambda: schedule.make_rule("cdp-v3", N, J), "Unknown rule 'cdp-v3'"),
])
def test_rule_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# The engine's dynamic path.


@pytest.fixture(scope="module")
def random_steps():
  """One compiled single step and one 3-step scan for a random D=2 rule, shared by the tests."""
  rule = schedule.random_rule(N, J, D, seed=1)
  tx = optax.sgd(0.3, momentum=0.9)
  _, stage_ids, _ = problem(1)
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  single = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule, mesh=mesh)
  scanned = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule, mesh=mesh,
                                   scan_steps=3)
  return rule, tx, single, scanned


def test_engine_follows_the_per_step_delays_without_recompiling(random_steps):
  rule, tx, single, scanned = random_steps
  params, _, batches = problem(6)
  ref_params, ref_losses = reference(params, batches, rule.window(0, 6), tx)
  state, losses = engine.init_state(params, tx, rule=rule), []
  assert len(state.stale_params) == D
  for batch in batches:
    state, metrics = single(state, batch)  # Delays read from the rule at the state's step.
    losses.append(float(metrics["loss"]))
  assert int(state.step) == 6
  assert single.run._cache_size() == 1  # Six different matrices, one compiled program.
  assert_close(state.params, ref_params)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  # K steps in one scan take a [K, N, J] block of matrices.
  state = engine.init_state(params, tx, rule=rule)
  for k in (0, 3):
    stacked = jax.tree.map(lambda *x: np.stack(x), *batches[k:k + 3])
    state, metrics = scanned(state, stacked)
    np.testing.assert_allclose(metrics["loss"], ref_losses[k:k + 3], rtol=1e-5)
    np.testing.assert_allclose(metrics["mean_delay"], rule.window(k, 3).mean(axis=(1, 2)))
  assert_close(state.params, ref_params)


def test_explicit_delays_and_a_fixed_matrix_agree(random_steps):
  """Passing cdp-v2's matrix every step gives the static cdp-v2 path's numbers."""
  _, tx, single, _ = random_steps
  params, stage_ids, batches = problem(3, seed=1)
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  static = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh)
  a = engine.init_state(params, tx, rule=schedule.random_rule(N, J, D))
  b = engine.init_state(params, tx, rule="cdp-v2")
  for batch in batches:
    a, _ = single(a, batch, schedule.delay_matrix("cdp-v2", N, J))
    b, _ = static(b, batch)
  assert_close(a.params, b.params)
  with pytest.raises(ValueError, match=r"delays must lie in 0..2"):
    single(a, batches[0], np.full((N, J), 3))
  with pytest.raises(ValueError, match=r"this step needs \(4, 3\)"):
    single(a, batches[0], np.zeros((J, N), np.int32))
  with pytest.raises(ValueError, match="delays are fixed"):
    static(b, batches[0], np.zeros((N, J), np.int32))


def test_user_function_rule_and_pmap():
  def every_other_step_stale(step, n, j):  # A user rule: (step, N, J) -> matrix.
    return np.full((n, j), step % 2, np.int32)
  rule = schedule.function_rule(every_other_step_stale, N, J, max_delay=1)
  tx = optax.sgd(0.3)
  params, stage_ids, batches = problem(4, seed=2)
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule, mesh=mesh,
                                backend="pmap")
  state = engine.init_state(params, tx, rule=rule)
  for batch in batches:
    state, _ = step(state, batch)
  assert_close(state.params, reference(params, batches, rule.window(0, 4), tx)[0])


# The launcher.


def load_config(arg, **overrides):
  return config_lib.load(str(ROOT / "configs" / "digits.py"), arg, **overrides)


@pytest.mark.parametrize("rule", ["random", "straggler"])
def test_launcher_trains_and_resumes_exactly(rule, tmp_path):
  """4 straight steps; then a run resumed from the straight run's step-2 checkpoint."""
  c = load_config(f"rule={rule},smoke", num_train_steps=4, lr_schedule="constant",
                  checkpoint_every_steps=2, eval_every_steps=100, max_delay=3,
                  delay_distribution="geometric")
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train.train_and_evaluate(c, str(straight))
  shutil.copytree(straight / "checkpoints" / "2", resumed / "checkpoints" / "2")
  assert train.train_and_evaluate(c, str(resumed))["final_step"] == 4

  def logged(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return {m["step"]: (m["train/loss"], m["train/mean_delay"])
              for m in map(json.loads, f) if "train/loss" in m}

  a, b = logged(straight), logged(resumed)
  assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
  assert b == {t: a[t] for t in (3, 4)}  # Bit for bit: the same delays, versions and momentum.
  # The delays are derivable from the config: the logged mean is the rule's.
  delay_rule = config_lib.delay_rule(c)
  assert [a[t][1] for t in (1, 2, 3, 4)] == pytest.approx([delay_rule(t).mean() for t in range(4)])
  assert len({a[t][1] for t in a}) > 1 or rule == "straggler"  # random: a new matrix every step.


def test_dynamic_rules_need_the_engine(tmp_path):
  with pytest.raises(ValueError, match="only the update-rule engine runs"):
    config_lib.validate(load_config("rule=random,parallelism=model,smoke"))
  with pytest.raises(ValueError, match="Unknown delay distribution"):
    config_lib.validate(load_config("rule=random,smoke", delay_distribution="zipf"))


# The authors' final model.


def test_mean_worker_view():
  tx = optax.sgd(0.3)
  params, stage_ids, batches = problem(3, seed=4)
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh)
  state = engine.init_state(params, tx, rule="cdp-v2")
  for batch in batches:
    state, _ = step(state, batch)
  delays = schedule.delay_matrix("cdp-v2", N, J)
  views = engine.worker_views(state, stage_ids, delays)
  for i in range(N):
    for j in range(J):
      assert_close(views[i][j], state.versions[delays[i, j]][j])
  assert_close(engine.mean_worker_view(state, stage_ids, delays),
               jax.tree.map(lambda *v: sum(v) / N, *views))
  # cdp-v1: every worker holds theta_{t-1}; dp: theta_t.
  assert_close(engine.mean_worker_view(state, stage_ids, np.ones((N, J), int)), state.stale_params[0])
  assert_close(engine.mean_worker_view(state, stage_ids, np.zeros((N, J), int)), state.params)
  with pytest.raises(ValueError, match="keeps 1 stale versions"):
    engine.worker_views(state, stage_ids, np.full((N, J), 2))


def test_trainer_exports_the_mean_view(tmp_path):
  from flax import serialization  # pylint: disable=g-import-not-at-top
  c = load_config("rule=cdp-v1,smoke", num_train_steps=2, final_mean_view=True)
  summary = train.train_and_evaluate(c, str(tmp_path))
  assert 0 <= summary["final_mean_view_accuracy"] <= 1
  final = serialization.msgpack_restore((tmp_path / "final_params.msgpack").read_bytes())
  mean_view = serialization.msgpack_restore((tmp_path / "final_mean_view.msgpack").read_bytes())
  # For cdp-v1 the mean view is theta_{T-1}: theta_T of the same run one step shorter.
  train.train_and_evaluate(load_config("rule=cdp-v1,smoke", num_train_steps=1,
                                       final_mean_view=True), str(tmp_path / "one"))
  previous = serialization.msgpack_restore((tmp_path / "one" / "final_params.msgpack").read_bytes())
  jax.tree.map(np.testing.assert_array_equal, mean_view, previous)
  assert any(not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(mean_view)))


def test_fixed_rule_consumers_refuse_a_delay_rule():
  with pytest.raises(ValueError, match=r"new delay matrix every step.*rule\(step\)"):
    schedule.resolve(schedule.random_rule(N, J, 2), N, J)
