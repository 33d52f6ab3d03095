"""The engine's update rules against closed forms and single-device references."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import compiled, engine, executor, hlo, schedule

RTOL = 1e-5
ATOL = 1e-6


def make_problem(num_workers, num_stages, per_worker=2, width=4, seed=0):
  """A J-stage tanh MLP; stage j is the dict entry Dense_j."""
  rng = np.random.default_rng(seed)
  params = {f"Dense_{j}": {"w": rng.normal(size=(width, width)).astype(np.float32) * 0.6,
                           "b": rng.normal(size=(width,)).astype(np.float32) * 0.1}
            for j in range(num_stages)}
  stage_ids = {f"Dense_{j}": {"w": j, "b": j} for j in range(num_stages)}
  n = num_workers * per_worker
  batch = {"x": rng.normal(size=(n, width)).astype(np.float32),
           "y": rng.normal(size=(n, width)).astype(np.float32)}
  return params, stage_ids, batch


def loss_fn(params, batch):
  h = batch["x"]
  for j in range(len(params)):
    h = jnp.tanh(h @ params[f"Dense_{j}"]["w"] + params[f"Dense_{j}"]["b"][None, :])
  return jnp.mean(jnp.square(h - batch["y"]))


def mesh_of(n):
  return jax.make_mesh((n,), ("data",))


def run_engine(rule, params, stage_ids, batches, tx, num_workers, mesh=None, **kw):
  state = engine.init_state(params, tx, rule=rule)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule,
                                mesh=mesh or mesh_of(num_workers), **kw)
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, losses


def reference(rule, params, stage_ids, batches, tx, num_workers):
  """Single-device loop over workers: each differentiates at its mixed view."""
  num_stages = engine.num_stages_of(stage_ids)
  delays = schedule.resolve(rule, num_workers, num_stages)
  versions = [params] * (1 + schedule.max_delay(rule))
  opt_state = tx.init(params)
  losses = []
  for batch in batches:
    grads, loss = [], 0.0
    for i in range(num_workers):
      view = jax.tree.map(lambda s, *vs: vs[delays[i, s]], stage_ids, *versions)
      part = jax.tree.map(lambda x: np.split(x, num_workers)[i], batch)
      value, g = jax.value_and_grad(loss_fn)(view, part)
      grads.append(g)
      loss += value / num_workers
    mean = jax.tree.map(lambda *g: sum(g) / num_workers, *grads)
    updates, opt_state = tx.update(mean, opt_state, versions[0])
    versions = [optax.apply_updates(versions[0], updates)] + versions[:-1]
    losses.append(float(loss))
  return versions[0], losses


def assert_tree_close(a, b, rtol=RTOL, atol=ATOL):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def batches_of(num_workers, steps, **kw):
  return [make_problem(num_workers, 1, seed=100 + t, **kw)[2] for t in range(steps)]


@pytest.mark.parametrize("rule", ["dp", "cdp-v1", "cdp-v2", "cdp-v2-paper"])
@pytest.mark.parametrize("num_workers,num_stages", [(4, 3), (2, 5)])
def test_engine_matches_per_worker_reference(rule, num_workers, num_stages):
  params, stage_ids, _ = make_problem(num_workers, num_stages)
  batches = batches_of(num_workers, 3)
  tx = optax.sgd(0.2, momentum=0.9)
  state, losses = run_engine(rule, params, stage_ids, batches, tx, num_workers)
  ref_params, ref_losses = reference(rule, params, stage_ids, batches, tx, num_workers)
  assert_tree_close(state.params, ref_params)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert int(state.step) == 3


def test_dp_equals_single_device_large_batch_sgd():
  params, stage_ids, _ = make_problem(8, 3)
  batches = batches_of(8, 3)
  tx = optax.sgd(0.3)
  state, _ = run_engine("dp", params, stage_ids, batches, tx, 8)
  expected = params
  for batch in batches:  # One device, one big batch: the textbook step.
    expected = jax.tree.map(lambda p, g: p - 0.3 * g, expected, jax.grad(loss_fn)(expected, batch))
  assert_tree_close(state.params, expected)


def test_cdp_v1_closed_form():
  """theta_{t+1} = theta_t - lr * g(theta_{t-1}), with theta_{-1} = theta_0."""
  params, stage_ids, _ = make_problem(4, 2)
  batches = batches_of(4, 4)
  lr = 0.3
  state, _ = run_engine("cdp-v1", params, stage_ids, batches, optax.sgd(lr), 4)
  prev, cur = params, params
  for batch in batches:
    g = jax.grad(loss_fn)(prev, batch)
    prev, cur = cur, jax.tree.map(lambda p, d: p - lr * d, cur, g)
  assert_tree_close(state.params, cur)
  assert_tree_close(state.stale_params[0], prev)


def test_gradient_is_mean_over_workers_not_sum():
  """A loss linear in w: the mean gradient is the mean of x over all rows."""
  mesh = mesh_of(8)
  x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3) / 10
  params = {"w": np.zeros(3, np.float32)}
  tx = optax.sgd(1.0)
  step = engine.make_train_step(lambda p, b: jnp.mean(b @ p["w"]), tx,
                                stage_ids={"w": 0}, rule="dp", mesh=mesh)
  state, metrics = step(engine.init_state(params, tx, rule="dp"), x)
  np.testing.assert_allclose(state.params["w"], -x.mean(0), rtol=RTOL)
  np.testing.assert_allclose(metrics["grad_norm"], np.linalg.norm(x.mean(0)), rtol=RTOL)


@pytest.mark.parametrize("rule", ["dp", "cdp-v1", "cdp-v2"])
def test_shard_map_equals_pmap(rule):
  params, stage_ids, _ = make_problem(4, 3)
  batches = batches_of(4, 3)
  tx = optax.adam(0.05)
  a, la = run_engine(rule, params, stage_ids, batches, tx, 4, backend="shard_map")
  b, lb = run_engine(rule, params, stage_ids, batches, tx, 4, backend="pmap")
  assert_tree_close(a.params, b.params, rtol=1e-6)
  np.testing.assert_allclose(la, lb, rtol=1e-6)


def test_scan_of_k_steps_equals_k_single_steps():
  params, stage_ids, _ = make_problem(4, 3)
  batches = batches_of(4, 3)
  tx = optax.sgd(0.2, momentum=0.9)
  single, losses = run_engine("cdp-v2", params, stage_ids, batches, tx, 4)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2",
                                mesh=mesh_of(4), scan_steps=3)
  stacked = jax.tree.map(lambda *x: np.stack(x), *batches)
  scanned, metrics = step(engine.init_state(params, tx, rule="cdp-v2"), stacked)
  assert_tree_close(scanned.params, single.params)
  assert_tree_close(scanned.stale_params, single.stale_params)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=RTOL)
  assert metrics["grad_norm_per_stage"].shape == (3, 3)


def test_general_staleness_keeps_d_plus_one_versions():
  delays = np.array([[2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 2, 2]])
  params, stage_ids, _ = make_problem(4, 3)
  batches = batches_of(4, 4)
  tx = optax.sgd(0.2)
  state, losses = run_engine(delays, params, stage_ids, batches, tx, 4)
  assert len(state.stale_params) == 2
  ref_params, ref_losses = reference(delays, params, stage_ids, batches, tx, 4)
  assert_tree_close(state.params, ref_params)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)


def test_model_state_is_averaged_over_workers():
  """A BatchNorm-like running mean: workers' statistics are averaged."""
  mesh = mesh_of(4)
  x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)

  def loss_with_state(params, model_state, batch):
    return jnp.mean(batch @ params["w"]), {"mean": 0.5 * model_state["mean"] + 0.5 * batch.mean(0)}

  tx = optax.sgd(0.1)
  step = engine.make_train_step(loss_with_state, tx, stage_ids={"w": 0}, rule="cdp-v1",
                                mesh=mesh, with_model_state=True)
  state = engine.init_state({"w": np.ones(3, np.float32)}, tx, rule="cdp-v1",
                            model_state={"mean": np.ones(3, np.float32)})
  state, _ = step(state, x)
  np.testing.assert_allclose(state.model_state["mean"], 0.5 + 0.5 * x.mean(0), rtol=RTOL)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
def test_stablehlo_has_one_all_reduce_per_stage(num_stages):
  params, stage_ids, batch = make_problem(4, num_stages)
  tx = optax.sgd(0.1)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh_of(4))
  lowered = step.lower(engine.init_state(params, tx, rule="cdp-v2"), batch)
  counts = hlo.stablehlo_collectives(lowered.as_text())
  assert counts["all-reduce"] == num_stages


def workers_of_two(num_workers):
  """Workers of 2 devices each: the state is sharded over ``fsdp`` inside a worker."""
  return jax.make_mesh((num_workers, 2), ("data", "fsdp"))


@pytest.mark.parametrize("rule", ["dp", "cdp-v1", "cdp-v2", "cdp-v2 compensated"])
def test_state_sharded_inside_workers_equals_one_device_per_worker(rule):
  """"compensated": weight prediction, DC-ASGD and a delay-scaled rate, whose corrections read
  theta_t beside the gathered view."""
  if rule == "cdp-v2 compensated":
    rule = executor.resolve("cdp-v2", "data", 4, 3, predict=True, dc_lambda=0.5,
                            lr_delay_scale=1.0)
  params, stage_ids, _ = make_problem(4, 3)
  batches = batches_of(4, 3)
  tx = optax.sgd(0.2, momentum=0.9)
  state, losses = run_engine(rule, params, stage_ids, batches, tx, 4, mesh=workers_of_two(4))
  ref_state, ref_losses = run_engine(rule, params, stage_ids, batches, tx, 4)
  assert_tree_close(state.params, ref_state.params)
  assert_tree_close(state.stale_params, ref_state.stale_params)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  # Parameters and optimizer state stay split over fsdp (width 4 = 2 x 2 rows).
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    assert leaf.sharding.spec[0] == "fsdp" and leaf.addressable_shards[0].data.shape[0] == 2


def test_sharded_workers_with_model_state_and_scan():
  """K = 2 steps per call, a model state averaged over the workers."""
  params, stage_ids, _ = make_problem(4, 2)
  stacked = jax.tree.map(lambda *x: np.stack(x), *batches_of(4, 2))
  tx = optax.adam(0.05)

  def loss_with_state(params, model_state, batch):
    return loss_fn(params, batch), {"mean": 0.5 * model_state["mean"] + 0.5 * batch["x"].mean(0)}

  out = []
  for mesh in (mesh_of(4), workers_of_two(4)):
    step = engine.make_train_step(loss_with_state, tx, stage_ids=stage_ids, rule="cdp-v2",
                                  mesh=mesh, with_model_state=True, scan_steps=2)
    state = step.init(params, {"mean": np.ones(4, np.float32)})
    out.append(step(state, stacked))
  (state, metrics), (ref_state, ref_metrics) = out[1], out[0]
  assert_tree_close((state.params, state.stale_params, state.model_state),
                    (ref_state.params, ref_state.stale_params, ref_state.model_state))
  assert_tree_close(metrics, ref_metrics)
  assert state.model_state["mean"].sharding.spec == jax.P("fsdp")


def test_sharded_workers_reduce_each_stage_once_over_the_workers():
  """Exactly J all-reduces in StableHLO, each over the workers (the data axis); what the
  compiler adds inside a worker comes later."""
  params, stage_ids, batch = make_problem(4, 3)
  tx = optax.sgd(0.1)
  mesh = workers_of_two(4)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh)
  text = step.lower(step.init(params), batch).as_text()
  assert hlo.stablehlo_collectives(text)["all-reduce"] == 3
  data_groups = sorted(sorted(d.id for d in column) for column in mesh.devices.T)
  groups = re.findall(r"all_reduce.*?replica_groups = dense<(\[\[.*?\]\])>", text)
  assert len(groups) == 3 and all(json.loads(g) == data_groups for g in groups)


def test_state_is_donated():
  params, stage_ids, batch = make_problem(2, 2)
  tx = optax.sgd(0.1)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh_of(2))
  state = jax.device_put(engine.init_state(params, tx, rule="cdp-v2"),
                         jax.sharding.NamedSharding(mesh_of(2), jax.sharding.PartitionSpec()))
  step(state, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(state.params))


def _parameter_copies(hlo_text: str, params) -> int:
  """``copy`` instructions that copy a program input (or loop-carried value) of a parameter's shape.

  Copies of computed values (a transposed convolution kernel's gradient, say)
  are layout changes, not copies of a parameter version.
  """
  shapes = {f"f32[{','.join(map(str, np.shape(x)))}]" for x in jax.tree.leaves(params)}
  return sum(1 for line in hlo_text.splitlines()
             if re.search(r" copy\(%(param|get-tuple-element)", line)
             and line.split("=")[1].split("{")[0].strip() in shapes)


@pytest.mark.parametrize("rule, num_workers, stale_stages", [
    ("cdp-v1", 4, 3),  # Every worker reads every stage stale.
    ("cdp-v2", 3, 2),  # N = J = 3: the last stage is always fresh.
])
def test_cdp_keeps_only_the_stale_stages_and_copies_nothing(rule, num_workers, stale_stages):
  params, stage_ids, batch = make_problem(num_workers, 3, width=64)
  stage_bytes = params["Dense_0"]["w"].nbytes + params["Dense_0"]["b"].nbytes
  tx = optax.sgd(0.1, momentum=0.9)
  memory = {}
  for r in ("dp", rule):
    step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=r,
                                  mesh=mesh_of(num_workers))
    state = step.init(params)
    program = step.lower(state, batch).compile()
    memory[r] = compiled.memory(program)
    # Versions rotate: theta_{t+1} is written into the dead version's buffer.
    assert _parameter_copies(program.as_text(), params) == 0
  assert len(jax.tree.leaves(state.stale_params)) == 2 * stale_stages
  extra = stale_stages * stage_bytes
  assert memory[rule]["argument_bytes"] - memory["dp"]["argument_bytes"] == extra
  assert memory[rule]["alias_bytes"] - memory["dp"]["alias_bytes"] == extra
  assert abs(memory[rule]["peak_bytes"] - memory["dp"]["peak_bytes"] - extra) <= 0.05 * extra


def test_rotated_versions_come_back_in_state_order():
  """Odd and even steps leave theta_t in different buffers; the state's order never changes."""
  params, stage_ids, batch = make_problem(4, 2)
  tx = optax.sgd(0.1)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v1", mesh=mesh_of(4))
  state = step.init(params)
  for _ in range(3):
    previous = jax.tree.map(np.asarray, state.params)
    state, _ = step(state, batch)
    assert_tree_close(state.stale_params[0], previous)


def test_worker_views_of_a_compact_state():
  """cdp-v2 at N = J = 2 keeps no stale copy of stage 1; worker 0 reads stage 0 stale."""
  params, stage_ids, batch = make_problem(2, 2)
  tx = optax.sgd(0.1)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh_of(2))
  state, _ = step(step.init(params), batch)
  delays = schedule.delay_matrix("cdp-v2", 2, 2)
  views = engine.worker_views(state, stage_ids, delays)
  assert_tree_close(views[0]["Dense_0"], state.stale_params[0]["Dense_0"])
  assert_tree_close(views[0]["Dense_1"], state.params["Dense_1"])
  assert_tree_close(views[1], state.params)
  with pytest.raises(ValueError, match="keeps no such version"):
    engine.worker_views(state, stage_ids, np.ones((2, 2), int))


def test_init_state_of_another_rule_is_refused_or_trimmed():
  params, stage_ids, batch = make_problem(4, 2)
  tx = optax.sgd(0.1)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=np.full((4, 2), 2),
                                mesh=mesh_of(4))
  with pytest.raises(ValueError, match="keeps 1 stale parameter versions but this rule reads 2"):
    step(engine.init_state(params, tx, rule="cdp-v2"), batch)
  # cdp-v2 at N = J = 2 reads stage 1 fresh only: init_state's copy of it is dropped.
  params, stage_ids, batch = make_problem(2, 2)
  v2 = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2", mesh=mesh_of(2))
  state, _ = v2(engine.init_state(params, tx, rule="cdp-v2"), batch)
  assert state.stale_params[0]["Dense_1"] == {"w": None, "b": None}
  trimmed = state._replace(stale_params=({"Dense_0": {"w": None, "b": None},
                                          "Dense_1": {"w": None, "b": None}},))
  with pytest.raises(ValueError, match="lacks stale parameters this rule reads"):
    v2(trimmed, batch)


class TestBadInput:

  def setup_method(self):
    self.params, self.stage_ids, self.batch = make_problem(4, 2)
    self.tx = optax.sgd(0.1)

  def make(self, **kw):
    args = dict(stage_ids=self.stage_ids, rule="cdp-v2", mesh=mesh_of(4))
    args.update(kw)
    return engine.make_train_step(loss_fn, self.tx, **args)

  def test_unknown_rule(self):
    with pytest.raises(ValueError, match="Unknown rule 'cdp-v3'.*cdp-v2"):
      self.make(rule="cdp-v3")
    with pytest.raises(ValueError, match="Unknown rule"):
      engine.init_state(self.params, self.tx, rule="cdpv2")

  def test_batch_not_divisible(self):
    step = self.make()
    bad = jax.tree.map(lambda x: x[:6], self.batch)
    with pytest.raises(ValueError, match="not divisible by the 4 workers"):
      step(engine.init_state(self.params, self.tx, rule="cdp-v2"), bad)

  def test_stage_ids_do_not_match_params(self):
    step = self.make(stage_ids={"Dense_0": 0, "Dense_1": 1})
    with pytest.raises(ValueError, match="stage_ids do not match params"):
      step(engine.init_state(self.params, self.tx, rule="cdp-v2"), self.batch)

  def test_stage_id_out_of_range(self):
    ids = {"Dense_0": {"w": 0, "b": 0}, "Dense_1": {"w": 1, "b": -1}}
    with pytest.raises(ValueError, match="out of range"):
      self.make(stage_ids=ids)
    with pytest.raises(ValueError, match="out of range"):
      self.make(stage_ids={"Dense_0": {"w": 0, "b": 0}, "Dense_1": {"w": 2, "b": 2}},
                rule=np.zeros((4, 2), int))
    with pytest.raises(ValueError, match=r"Stages \[1\] hold no parameters"):
      self.make(stage_ids={"Dense_0": {"w": 0, "b": 0}, "Dense_1": {"w": 2, "b": 2}})

  def test_mesh_without_axis(self):
    with pytest.raises(ValueError, match="no axis 'data'.*make_mesh"):
      self.make(mesh=jax.make_mesh((4,), ("workers",)))

  def test_delay_matrix_shape(self):
    with pytest.raises(ValueError, match=r"shape \(3, 2\), expected"):
      self.make(rule=np.zeros((3, 2), int))
    with pytest.raises(ValueError, match=">= 0"):
      self.make(rule=-np.ones((4, 2), int))

  def test_axes_inside_a_worker_must_be_explicit(self):
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    with pytest.raises(ValueError, match="inside a worker.*must be Explicit.*jax.make_mesh"):
      self.make(mesh=jax.sharding.Mesh(devices, ("data", "fsdp")))
    with pytest.raises(ValueError, match="pmap backend needs a 1-D mesh"):
      self.make(mesh=jax.make_mesh((4, 2), ("data", "fsdp")), backend="pmap")

  def test_unknown_backend(self):
    with pytest.raises(ValueError, match="Unknown backend"):
      self.make(backend="pjit")

  def test_scan_batch_shape(self):
    step = self.make(scan_steps=2)
    with pytest.raises(ValueError, match="scan_steps=2"):
      step(engine.init_state(self.params, self.tx, rule="cdp-v2"), self.batch)


@pytest.mark.parametrize("name, rule, num_workers, compensated", [
    ("residual_mlp", "cdp-v2", 2, False), ("residual_mlp", "cdp-v1", 4, True),
    ("resnet18", "cdp-v2", 4, False)])
def test_tied_backward_matches_the_engines_backward(name, rule, num_workers, compensated):
  """Stage by stage, each stage reduced right after its backward: the same numbers, every
  leaf and the model state (ResNet-18: BatchNorm, stages cut by FLOPs), over several steps;
  with DC-ASGD corrected per stage, weight prediction and the delay-scaled rate."""
  import executed_reference as ref  # pylint: disable=g-import-not-at-top
  metrics, variables = ref.engine_run(name, rule, num_workers, compensated=compensated,
                                      tied=True)
  ref.assert_matches_engine(metrics, variables, name, rule, num_workers,
                            compensated=compensated)


@pytest.mark.parametrize("name, rule, num_workers, compensated, tied", [
    ("residual_mlp", "cdp-v2", 3, False, False), ("resnet18", "cdp-v1", 4, True, False),
    ("residual_mlp", "dp", 4, False, True)])
def test_permuted_reduction_matches_the_all_reduce(name, rule, num_workers, compensated, tied):
  """``gradient_reduction="permutes"``: the engine's numbers over several steps, every leaf and
  the model state (ResNet-18's BatchNorm), with 3 workers (chunks padded), DC-ASGD and the
  other compensations, and with the tied backward."""
  import executed_reference as ref  # pylint: disable=g-import-not-at-top
  metrics, variables = ref.engine_run(name, rule, num_workers, compensated=compensated,
                                      tied=tied, reduction="permutes")
  ref.assert_matches_engine(metrics, variables, name, rule, num_workers,
                            compensated=compensated)


@pytest.mark.parametrize("backend", engine.BACKENDS)
def test_permuted_reduction_in_a_scan_and_its_collectives(backend):
  """Scanned steps (the carried views) under both backends equal the all-reduce's; the
  program sums each stage by N-1 collective-permutes and one all-gather, no all-reduce."""
  params, stage_ids, batch = make_problem(4, 3, width=8)
  tx = optax.sgd(0.1, momentum=0.9)
  batches = jax.tree.map(lambda x: np.stack([x, x[::-1]]), batch)
  runs = {}
  for reduction in engine.REDUCTIONS:
    step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2",
                                  mesh=mesh_of(4), backend=backend, scan_steps=2,
                                  gradient_reduction=reduction)
    state = step.init(params)
    for _ in range(2):
      state, metrics = step(state, batches)
    runs[reduction] = state, metrics
  (got, got_m), (want, want_m) = runs["permutes"], runs["all-reduce"]
  assert_tree_close((got.params, got.stale_params, got.opt_state, got_m),
                    (want.params, want.stale_params, want.opt_state, want_m))
  if backend == "shard_map":
    step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule="cdp-v2",
                                  mesh=mesh_of(4), gradient_reduction="permutes")
    found = hlo.stablehlo_collectives(step.lower(step.init(params), batch).as_text())
    num_stages = engine.num_stages_of(stage_ids)
    assert (found["all-reduce"], found["collective-permute"], found["all-gather"]) == (
        0, num_stages * 3, num_stages)


def test_permuted_reduction_refuses_what_it_cannot_run():
  _, stage_ids, _ = make_problem(4, 2)
  make = lambda **kw: engine.make_train_step(loss_fn, optax.sgd(0.1), stage_ids=stage_ids,
                                             rule="dp", **kw)
  with pytest.raises(ValueError, match="Unknown gradient_reduction 'ring'.*permutes"):
    make(mesh=mesh_of(4), gradient_reduction="ring")
  with pytest.raises(ValueError, match="1-D mesh of workers.*devices_per_worker=1"):
    make(mesh=jax.make_mesh((4, 2), ("data", "fsdp")), gradient_reduction="permutes")


def test_tied_backward_emits_one_all_reduce_per_stage_between_the_stages_backwards():
  """J all-reduces, each stage's before the backward of the stage below it: the program's
  order is forward, then per stage (last first) its backward's dots, its all-reduce, a barrier."""
  import executed_reference as ref  # pylint: disable=g-import-not-at-top
  from cdpjax import executors  # pylint: disable=g-import-not-at-top
  model, params, model_state, stage_ids = ref.model_of("residual_mlp", 4)
  ex = executors.engine_executor(
      model, ref.make_tx("residual_mlp"), stage_ids=stage_ids, rule="dp", mesh=mesh_of(2),
      loss_fn=ref.staged_lib.cross_entropy, with_model_state=False, tied_backward=True,
      params=params, model_state=model_state, sample_input=np.zeros((1, 8, 8, 1), np.float32))
  batch = ref.step_batch(ref.batches("residual_mlp", 2), 0)
  text = ex.lower(ex.init(params), batch).as_text()
  assert hlo.stablehlo_collectives(text)["all-reduce"] == 4
  ops = re.findall(r"stablehlo\.(all_reduce|optimization_barrier|dot_general)", text)
  backward = ops[ops.index("all_reduce"):]  # From the last stage's all-reduce on.
  # Stage 0's barrier ties nothing (no stage below it): JAX drops it.
  assert [op for op in backward if op != "dot_general"] == [
      "all_reduce", "optimization_barrier"] * 3 + ["all_reduce"]
  barriers = [k for k, op in enumerate(backward) if op == "optimization_barrier"]
  assert all("dot_general" in backward[k:backward.index("all_reduce", k)] for k in barriers)
