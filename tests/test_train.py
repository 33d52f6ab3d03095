"""The trainer end to end: configs, data, checkpoints, resume, metrics, errors."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from cdpjax import config as config_lib
from cdpjax import distributed, engine
from cdpjax import executor, executors
from cdpjax import schedule
from cdpjax import train

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name, arg=None, **overrides):
  return config_lib.load(str(ROOT / "configs" / f"{name}.py"), arg, **overrides)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(workdir):
  return {m["step"]: m["train/loss"] for m in read_metrics(workdir) if "train/loss" in m}


@pytest.mark.parametrize("rule,parallelism", [("dp", "data"), ("cdp-v2", "data"),
                                               ("cdp-v2", "zero")])
def test_cifar10_resnet18_two_steps_under_mock_data(rule, parallelism, tmp_path):
  c = load_config("cifar10_resnet18", f"rule={rule},parallelism={parallelism},smoke")
  with tfds.testing.mock_data(num_examples=64):
    summary = train.train_and_evaluate(c, str(tmp_path))
  assert summary["final_step"] == 2
  metrics = read_metrics(tmp_path)
  losses = [m["train/loss"] for m in metrics if "train/loss" in m]
  assert len(losses) == 2 and all(np.isfinite(losses))
  assert {"train/learning_rate", "train/grad_norm_stage3", "train/param_norm"} <= set(metrics[0])
  assert 0.0 <= metrics[-1]["eval/accuracy"] <= 1.0
  assert json.load(open(tmp_path / "config.json"))["rule"] == rule
  assert os.listdir(tmp_path / "tensorboard")
  assert (tmp_path / "checkpoints" / "2").is_dir()


def test_digits_quick_start_learns(tmp_path):
  summary = train.train_and_evaluate(load_config("digits"), str(tmp_path))
  assert summary["final_accuracy"] >= 0.95
  written = json.load(open(tmp_path / "summary.json"))
  assert written["final_accuracy"] == pytest.approx(summary["final_accuracy"])
  assert written["steps_per_second"] > 0


def test_resume_three_plus_three_equals_six_straight_steps(tmp_path):
  """cdp-v2 reads stale versions and momentum: all must come back exactly, for any K.

  The straight run takes one step per call; the resumed run 3 steps in one call
  (K = 4, cut by the end), then from step 3 (not a multiple of its K = 2) one
  step, then 2 in one call.
  """
  overrides = dict(lr_schedule="constant")
  straight = tmp_path / "straight"
  train.train_and_evaluate(load_config("digits", "smoke", num_train_steps=6, steps_per_call=1,
                                       checkpoint_every_steps=3, **overrides), str(straight))
  resumed = tmp_path / "resumed"
  summary = train.train_and_evaluate(
      load_config("digits", "smoke", num_train_steps=3, steps_per_call=4, eval_every_steps=4,
                  checkpoint_every_steps=4, **overrides), str(resumed))
  assert summary["steps_per_call"] == 4
  summary = train.train_and_evaluate(
      load_config("digits", "smoke", num_train_steps=6, steps_per_call=2, **overrides),
      str(resumed))
  assert summary["final_step"] == 6 and summary["steps_per_call"] == 2
  a, b = train_losses(straight), train_losses(resumed)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  assert a == b  # Bit-for-bit: same data position, parameters, stale version, momentum.


def test_resume_under_the_other_gradient_reduction(tmp_path):
  """3 steps summing gradients by all-reduce, then 3 more by collective-permutes
  (``--config.gradient_reduction=permutes``, a key a resume may change): the straight run's
  losses, to float rounding (the sums are added in another order)."""
  overrides = dict(lr_schedule="constant", steps_per_call=1, checkpoint_every_steps=3)
  straight = tmp_path / "straight"
  train.train_and_evaluate(load_config("digits", "smoke", num_train_steps=6, **overrides),
                           str(straight))
  resumed = tmp_path / "resumed"
  train.train_and_evaluate(load_config("digits", "smoke", num_train_steps=3, **overrides),
                           str(resumed))
  summary = train.train_and_evaluate(
      load_config("digits", "smoke", num_train_steps=6, gradient_reduction="permutes",
                  **overrides), str(resumed))
  assert summary["final_step"] == 6
  a, b = train_losses(straight), train_losses(resumed)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([b[k] for k in range(1, 7)], [a[k] for k in range(1, 7)],
                             rtol=1e-5)


@pytest.mark.parametrize("requested, eval_every, checkpoint_every, expected", [
    (16, 100, 200, 10), (16, 64, 32, 16), (16, 6, 4, 2), (3, 12, 12, 3), (16, 7, 100, 1)])
def test_steps_per_call_divides_the_eval_and_checkpoint_intervals(requested, eval_every,
                                                                  checkpoint_every, expected):
  c = load_config("digits", steps_per_call=requested, eval_every_steps=eval_every,
                  checkpoint_every_steps=checkpoint_every)
  assert train.steps_per_call(c) == (expected, "")


@pytest.mark.parametrize("config, parallelism, rule, expected, idle", [
    ("digits", "data", "cdp-v2", 10, 0.0),      # Lockstep: the largest K <= 16 dividing 100.
    ("digits", "model", "cdp-v2", 20, 0.036),   # 10 would idle 0.070.
    ("digits", "zero", "cdp-v2", 20, 0.042),    # 10 would idle 0.080.
    ("digits", "model", "dp", 10, 0.429),       # GPipe flushes every step whatever K is.
    ("lm", "model", "cdp-v2", 25, 0.029)])      # Intervals 50 and 100.
def test_the_default_steps_per_call_keeps_the_idle_fraction_under_the_goal(
    config, parallelism, rule, expected, idle):
  c = load_config(config, f"parallelism={parallelism},rule={rule}")
  assert c.steps_per_call == 0
  plan = executor.resolve(rule, parallelism, c.num_workers, c.num_stages)
  assert train.steps_per_call(c, "tpu", plan) == (expected, "")
  assert executors.idle_fraction(plan, expected) == pytest.approx(idle, abs=5e-4)


@pytest.mark.parametrize("platform, parallelism, expected", [
    ("cpu", "data", 1), ("cpu", "model", 16), ("tpu", "data", 16), ("gpu", "data", 16)])
def test_the_engine_runs_a_convolutional_model_one_step_per_call_on_the_cpu(
    platform, parallelism, expected):
  c = load_config("cifar10_resnet18", steps_per_call=16, eval_every_steps=64,
                  checkpoint_every_steps=64, parallelism=parallelism)
  k, why = train.steps_per_call(c, platform)
  assert k == expected and bool(why) == (expected == 1)
  mlp = load_config("digits", steps_per_call=16, eval_every_steps=64, checkpoint_every_steps=64)
  assert train.steps_per_call(mlp, "cpu") == (16, "")  # Not convolutional: the scan stays.


@pytest.mark.parametrize("num_stages", [2, 4, 8])
@pytest.mark.parametrize("num_steps", [1, 2, 16])
def test_idle_fraction_counted_on_the_plan_is_the_closed_form(num_stages, num_steps):
  """Cyclic: J K busy slots of J (K + 1) - 1 per device; GPipe flushes: J of 2J - 1."""
  j, k = num_stages, num_steps
  assert executors.idle_fraction(executor.resolve("cdp-v2", "model", j, j), k) == pytest.approx(
      1 - j * k / (j * (k + 1) - 1), rel=1e-12)
  # CDP-ZeRO: 2J K busy slots of 2J (K + 1) - 1 (stage 0's owner updates one slot later).
  assert executors.idle_fraction(executor.resolve("cdp-v2", "zero", j, j), k) == pytest.approx(
      1 - 2 * j * k / (2 * j * (k + 1) - 1), rel=1e-12)
  assert executors.idle_fraction(executor.resolve("dp", "model", j, j), k) == pytest.approx(
      (j - 1) / (2 * j - 1), rel=1e-12)
  for parallelism in ("data", "zero"):
    assert executors.idle_fraction(executor.resolve("dp", parallelism, j, j), k) == 0.0
  assert executors.idle_fraction(executor.resolve("cdp-v2", "data", j, j), k) == 0.0


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
  """With K = 16 steps per call: the stop comes at the end of a call; every 3rd step logs."""
  c = load_config("digits", "smoke", num_train_steps=100_000, eval_every_steps=100_000,
                  checkpoint_every_steps=100_000, log_every_steps=3, steps_per_call=16)
  metrics_file = tmp_path / "metrics.jsonl"

  def preempt():  # Like a TPU VM's maintenance event, once training is under way.
    deadline = time.time() + 300
    while time.time() < deadline:
      if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.05)

  threading.Thread(target=preempt, daemon=True).start()
  summary = train.train_and_evaluate(c, str(tmp_path))
  assert summary["preempted"] and summary["steps_per_call"] == 16
  assert 16 <= summary["final_step"] < 100_000 and summary["final_step"] % 16 == 0
  saved = sorted(int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit())
  assert saved == [summary["final_step"]]
  rows = read_metrics(tmp_path)
  assert [m["step"] for m in rows] == list(range(3, summary["final_step"] + 1, 3))
  # A logged step has its norms (the engine skips them on the others).
  assert all(np.isfinite(m["train/grad_norm"]) and np.isfinite(m["train/param_norm"]) for m in rows)


class TestBadConfig:

  def test_unknown_rule(self, tmp_path):
    with pytest.raises(ValueError, match="Unknown rule 'cdp-v9'.*--config.rule"):
      train.train_and_evaluate(load_config("digits", "smoke", rule="cdp-v9"), str(tmp_path))
    with pytest.raises(ValueError, match="Unknown config argument 'rul'"):
      load_config("digits", "rul=dp")

  def test_locked_config_rejects_typos(self):
    with pytest.raises(AttributeError):
      load_config("digits").learning_rte = 0.1

  def test_batch_not_divisible(self, tmp_path):
    c = load_config("digits", "smoke", eval_batch_size=100)
    with pytest.raises(ValueError, match="eval_batch_size=100 must be a multiple of the 8 devices"):
      train.train_and_evaluate(c, str(tmp_path))

  def test_more_stages_than_the_model_has(self, tmp_path):
    c = load_config("digits", "smoke", num_stages=7, stages_by="params")
    with pytest.raises(ValueError, match="Cannot split 6 units.*into 7 non-empty stages"):
      train.train_and_evaluate(c, str(tmp_path))
    c = load_config("digits", "smoke", num_stages=3)
    with pytest.raises(ValueError, match="multiple of num_stages .3.; .residual_mlp. has 4"):
      train.train_and_evaluate(c, str(tmp_path))

  def test_incompatible_checkpoint_is_refused(self, tmp_path):
    train.train_and_evaluate(load_config("digits", "smoke", num_train_steps=2), str(tmp_path))
    with pytest.raises(train.CheckpointMismatchError, match="rule: checkpoint 'cdp-v2', config 'dp'"):
      train.train_and_evaluate(load_config("digits", "rule=dp,smoke"), str(tmp_path))

  def test_non_finite_loss_names_the_step(self, tmp_path):
    c = load_config("digits", "smoke", learning_rate=1e12, num_train_steps=30)
    with pytest.raises(FloatingPointError,
                       match="Non-finite training loss .* at step|parameters after step .* are not finite"):
      train.train_and_evaluate(c, str(tmp_path))


def test_launcher_keeps_a_device_count_the_user_set(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=16 --foo")
  distributed.emulate_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=16 --foo"
  monkeypatch.setenv("XLA_FLAGS", "--foo")
  distributed.emulate_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=8"


def test_console_launcher_runs_both_backends_alike(tmp_path):
  """The README's command, with no XLA_FLAGS (the launcher sets up 8 CPU devices), and pmap."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  losses = {}
  for backend in ("shard_map", "pmap"):
    out = subprocess.run(
        [sys.executable, "-m", "cdpjax.main", "--config", "configs/digits.py:smoke",
         "--workdir", str(tmp_path / backend), f"--config.backend={backend}"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.load(open(tmp_path / backend / "summary.json"))
    assert summary["final_step"] == 4 and 0 <= summary["final_accuracy"] <= 1
    losses[backend] = train_losses(tmp_path / backend)
  assert sorted(losses["pmap"]) == [1, 2, 3, 4]
  np.testing.assert_allclose([losses["pmap"][k] for k in range(1, 5)],
                             [losses["shard_map"][k] for k in range(1, 5)], rtol=1e-5)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
  """The reference: the update-rule engine on the N = J = 4 digits smoke run."""
  workdir = tmp_path_factory.mktemp("engine")
  train.train_and_evaluate(load_config("digits", "smoke", **EXECUTED), str(workdir))
  return train_losses(workdir)


EXECUTED = dict(num_workers=4, num_stages=4)


@pytest.mark.parametrize("parallelism", ["model", "zero"])
def test_executed_schedules_log_the_engines_losses(parallelism, engine_run, tmp_path):
  """K = 2 steps per call against the engine's one, with the idle fraction of the plan."""
  c = load_config("digits", f"smoke,parallelism={parallelism}", steps_per_call=2, **EXECUTED)
  summary = train.train_and_evaluate(c, str(tmp_path))
  losses = train_losses(tmp_path)
  assert sorted(losses) == sorted(engine_run) == [1, 2, 3, 4]
  np.testing.assert_allclose([losses[k] for k in sorted(losses)],
                             [engine_run[k] for k in sorted(engine_run)], rtol=1e-5)
  j, k = EXECUTED["num_stages"], summary["steps_per_call"]
  assert k == 2
  slots = 2 * j * (k + 1) - 2 + (parallelism == "zero")  # Per device, in a K-step call.
  assert summary["idle_fraction"] == pytest.approx(1 - 2 * j * k / slots)  # 0.27 (0.30 zero)
  assert summary["idle_fraction"] < (j - 1) / (2 * j - 1)  # GPipe's, 0.43.


@pytest.fixture(scope="module")
def engine_four_workers(tmp_path_factory):
  """The reference of the 2-D meshes: rule dp on the engine, N = 4 workers, J = 2 stages."""
  workdir = tmp_path_factory.mktemp("engine4")
  train.train_and_evaluate(load_config("digits", "rule=dp,smoke", **TWO_D), str(workdir))
  return train_losses(workdir)


TWO_D = dict(num_train_steps=2, num_workers=4, num_stages=2)


@pytest.mark.parametrize("overrides", [
    dict(parallelism="model", num_workers=2, num_replicas=2),  # (replica, stage) = 2 x 2.
    dict(parallelism="zero", num_workers=2, num_replicas=2),   # (replica, data) = 2 x 2.
    dict(devices_per_worker=2)],                               # (data, fsdp) = 4 x 2.
    ids=["model-replicas", "zero-replicas", "data-fsdp"])
def test_two_dimensional_meshes_log_the_engines_losses(overrides, engine_four_workers, tmp_path):
  """R = 2 copies of GPipe / ZeRO-3 on N = 2 micro-batches each are the engine's N = 4 workers
  (dp: tiling the delay matrix changes nothing), on R*N*b rows per step; a worker of 2 devices
  computes what a worker of one does."""
  c = load_config("digits", "rule=dp,smoke", **{**TWO_D, **overrides})
  assert config_lib.num_devices(c) == (8 if "devices_per_worker" in overrides else 4)
  assert config_lib.global_batch_size(c) == 4 * c.per_worker_batch_size
  train.train_and_evaluate(c, str(tmp_path))
  losses = train_losses(tmp_path)
  assert sorted(losses) == sorted(engine_four_workers) == [1, 2]
  np.testing.assert_allclose([losses[k] for k in (1, 2)],
                             [engine_four_workers[k] for k in (1, 2)], rtol=1e-5)


def test_replicated_cdp_v2_pipeline_is_the_engine_with_the_tiled_matrix(monkeypatch, tmp_path):
  """R = 2 cyclic pipelines of N = J = 2 under cdp-v2 are the engine with 4 workers reading the
  cdp-v2 matrix of 2 workers tiled twice (not cdp-v2 of 4 workers). The launcher has no key for
  a custom matrix, so the engine run gets it through `config.delay_rule`."""
  c = load_config("digits", "smoke,parallelism=model", **{**TWO_D, "num_workers": 2},
                  num_replicas=2)
  train.train_and_evaluate(c, str(tmp_path / "replicas"))
  tiled = np.tile(schedule.delay_matrix("cdp-v2", 2, 2), (2, 1))
  assert not np.array_equal(tiled, schedule.delay_matrix("cdp-v2", 4, 2))
  monkeypatch.setattr(config_lib, "delay_rule", lambda _: tiled)
  train.train_and_evaluate(load_config("digits", "smoke", **TWO_D), str(tmp_path / "engine"))
  a, b = train_losses(tmp_path / "replicas"), train_losses(tmp_path / "engine")
  assert sorted(a) == sorted(b) == [1, 2]
  np.testing.assert_allclose([a[k] for k in (1, 2)], [b[k] for k in (1, 2)], rtol=1e-5)


class TestBadMeshKeys:

  @pytest.mark.parametrize("arg, overrides, match", [
      ("", dict(num_replicas=2), r"num_replicas=2 copies an executed schedule.*num_replicas=1"),
      ("parallelism=model", dict(devices_per_worker=2),
       r"devices_per_worker=2 shards the engine's state.*devices_per_worker=1"),
      ("parallelism=zero", dict(num_replicas=0), r"num_replicas must be >= 1, got 0"),
      ("", dict(devices_per_worker=2, eval_batch_size=8),
       r"eval_batch_size=8 must be a multiple of the 16 devices"),
      ("parallelism=zero", dict(tied_backward=True),
       r"tied_backward=True ties the engine's.*parallelism='data'"),
      ("", dict(tied_backward=True, devices_per_worker=2),
       r"tied_backward=True .*devices_per_worker=1"),
      ("parallelism=model", dict(gradient_reduction="permutes"),
       r"gradient_reduction=permutes sums the engine's.*parallelism='data'"),
      ("", dict(gradient_reduction="permutes", devices_per_worker=2),
       r"gradient_reduction=permutes .*devices_per_worker=1"),
      ("", dict(gradient_reduction="ring"), r"Unknown gradient_reduction 'ring'.*permutes"),
      ("parallelism=zero", dict(keep_activations=True),
       r"keep_activations=True .*parallelism='model'"),
  ])
  def test_refused_with_the_fix(self, arg, overrides, match):
    with pytest.raises(ValueError, match=match):
      config_lib.validate(load_config("digits", arg + ",smoke", **overrides))

  def test_more_devices_than_visible(self):
    c = load_config("digits", "parallelism=zero,smoke", num_replicas=4)  # 4 x 4 devices.
    with pytest.raises(ValueError, match=r"mesh \{'replica': 4, 'data': 4\} needs 16 devices"):
      train.make_mesh(c)

  def test_the_config_knows_the_engines_reductions(self):
    assert config_lib.GRADIENT_REDUCTIONS == engine.REDUCTIONS

  def test_resume_refuses_a_new_mesh_key_but_not_a_new_placement(self):
    refused, _ = train.config_changes({"num_replicas": 1}, {"num_replicas": 2})
    assert set(refused) == {"num_replicas"}
    # A checkpoint written before the key existed ran with one replica, on one device a worker.
    refused, allowed = train.config_changes({}, {"num_replicas": 2, "devices_per_worker": 2})
    assert set(refused) == {"num_replicas"} and set(allowed) == {"devices_per_worker"}
    assert train.config_changes({}, {"num_replicas": 1, "devices_per_worker": 1}) == ({}, {})


def test_old_stage_strategy_key_is_named(tmp_path):
  """A config that still sets stage_strategy is refused; an old checkpoint's value still counts."""
  c = load_config("digits", "smoke")
  c.unlock()
  c.stage_strategy = "params"
  with pytest.raises(ValueError, match="'stage_strategy' is now 'stages_by'.*--config.stages_by"):
    config_lib.validate(c)
  refused, _ = train.config_changes({"stage_strategy": "flops"}, {"stages_by": "blocks"})
  assert refused == {"stages_by": ("flops", "blocks")}
  assert train.config_changes({"stage_strategy": "blocks"}, {"stages_by": "blocks"}) == ({}, {})
