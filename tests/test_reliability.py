"""The trainer under faults and misuse, through the launcher as a user runs it.

Real ``python -m cdpjax.main`` processes on the digits smoke config, in one
chain on one workdir whose results the asserts share: a run interrupted by
Ctrl-C while a second run tries its workdir; a resume with a changed seed
(refused); with the newest checkpoint corrupted, a resume (falls back to the
previous one) killed with -9 during a save; the resume of that; a rerun of the
finished run. Apart: a run whose parameters stop being finite at a
checkpoint step.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from cdpjax import config as config_lib
from cdpjax import engine
from cdpjax import train
from cdpjax.train import checkpoints, loop

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]


def launcher(workdir, *overrides, config="configs/digits.py:smoke"):
  return [sys.executable, "-m", "cdpjax.main", "--config", config, "--workdir", str(workdir),
          *[f"--config.{o}" for o in overrides]]


def run(workdir, *overrides, timeout=300):
  return subprocess.run(launcher(workdir, *overrides), cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def wait_for(predicate, what, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    time.sleep(0.02)
  raise AssertionError(f"Timed out waiting for {what}.")


def metric_rows(workdir):
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_losses(workdir):
  return [(m["step"], m["train/loss"]) for m in metric_rows(workdir) if "train/loss" in m]


def checkpoint_steps(workdir):
  return sorted(int(p) for p in os.listdir(pathlib.Path(workdir) / "checkpoints") if p.isdigit())


def last_line(stderr):
  return stderr.strip().splitlines()[-1]


# K = 4 steps per compiled call (the checkpoint interval allows it); the resume
# below runs K = 1 (checkpoints every step) and must replay the same losses: a
# constant learning rate, which does not depend on num_train_steps.
LONG = ("num_train_steps=100000", "eval_every_steps=100000", "checkpoint_every_steps=4",
        "steps_per_call=16", "lr_schedule=constant")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """A run stopped by Ctrl-C, and a second run started on its workdir meanwhile."""
  workdir = tmp_path_factory.mktemp("interrupted")
  first = subprocess.Popen(launcher(workdir, *LONG), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  try:
    wait_for(lambda: len(metric_rows(workdir)) >= 4, "four logged steps")
    second = run(workdir, *LONG)
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=300)
  finally:
    if first.poll() is None:
      first.kill()
  return dict(workdir=workdir, pid=first.pid, rc=first.returncode, stdout=out, stderr=err,
              second=second, losses=train_losses(workdir),
              summary=json.loads((workdir / "summary.json").read_text()))


def test_a_second_run_on_the_workdir_is_refused_naming_the_first(interrupted):
  second = interrupted["second"]
  assert second.returncode == 1
  assert f"is in use by pid {interrupted['pid']}" in second.stderr
  assert "Traceback" not in second.stderr


def test_ctrl_c_saves_a_checkpoint_and_exits_with_the_resumable_status(interrupted):
  assert interrupted["rc"] == train.EXIT_PREEMPTED, interrupted["stderr"][-3000:]
  assert "Rerun the same command to resume" in last_line(interrupted["stderr"])
  summary = interrupted["summary"]
  assert summary["preempted"] and summary["stopped_by"] == "SIGINT"
  final = summary["final_step"]
  assert final >= 8 and final % 4 == 0 and summary["steps_per_call"] == 4  # At a call's end.
  assert checkpoint_steps(interrupted["workdir"])[-1] == final
  assert "final_accuracy" not in summary  # No evaluation of the final parameters was made.


@pytest.fixture(scope="module")
def changed_seed(interrupted):
  workdir = interrupted["workdir"]
  out = run(workdir, *LONG, "seed=1")
  return out, json.loads((workdir / "config.json").read_text())


def test_resume_with_a_changed_seed_is_refused_naming_the_key(changed_seed):
  out, config = changed_seed
  assert out.returncode == 1
  assert "seed: checkpoint 0, config 1" in out.stderr
  assert "Traceback" not in out.stderr
  assert config["seed"] == 0  # config.json still describes the checkpoints.


@pytest.fixture(scope="module")
def resumed(interrupted, changed_seed):
  """The newest checkpoint corrupted; a resume killed with -9 during a save; resumed again."""
  del changed_seed  # Runs first: it must see the intact checkpoints.
  workdir = interrupted["workdir"]
  newest = checkpoint_steps(workdir)[-1]
  for data_file in (workdir / "checkpoints" / str(newest) / "state").rglob("*"):
    if data_file.is_file() and "METADATA" not in data_file.name:
      data_file.write_bytes(b"\0garbage")
  end = interrupted["summary"]["final_step"] + 6
  overrides = (f"num_train_steps={end}", "eval_every_steps=100000", "checkpoint_every_steps=1",
               "lr_schedule=constant")
  victim = subprocess.Popen(launcher(workdir, *overrides), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  checkpoints = workdir / "checkpoints"
  try:
    wait_for(lambda: any("tmp" in n for n in os.listdir(checkpoints)) or victim.poll() is not None,
             "a save in progress")
  finally:
    victim.kill()
    _, victim_err = victim.communicate()
  out = run(workdir, *overrides)
  summary_text = (workdir / "summary.json").read_text()
  again = run(workdir, *overrides)
  return dict(workdir=workdir, newest=newest, end=end, victim_rc=victim.returncode,
              victim_err=victim_err, out=out, again=again, summary_text=summary_text)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(resumed):
  err = resumed["victim_err"]
  assert f"checkpoints/{resumed['newest']} is unreadable" in err, err[-3000:]
  assert "resuming from the previous one" in err
  assert "num_train_steps changed: 100000 -> " in err
  assert (resumed["workdir"] / "unreadable_checkpoints").is_dir()


def test_kill_9_during_a_save_loses_nothing(interrupted, resumed):
  """The rerun takes over the dead run's lock, resumes and continues one trajectory."""
  assert resumed["victim_rc"] == -signal.SIGKILL, "the run ended before it could be killed"
  assert resumed["out"].returncode == 0, resumed["out"].stderr[-3000:]
  summary = json.loads(resumed["summary_text"])
  assert summary["final_step"] == resumed["end"] and not summary["preempted"]
  assert "final_accuracy" in summary
  # metrics.jsonl is one trajectory: every step once, the replayed steps as before.
  losses = train_losses(resumed["workdir"])
  assert [s for s, _ in losses] == list(range(1, resumed["end"] + 1))
  before = dict(interrupted["losses"])
  assert {s: l for s, l in losses if s in before} == before


def test_rerunning_a_finished_run_keeps_its_summary(resumed):
  assert resumed["again"].returncode == 0, resumed["again"].stderr[-3000:]
  assert "nothing to do" in resumed["again"].stderr
  assert (resumed["workdir"] / "summary.json").read_text() == resumed["summary_text"]


def test_parameters_that_stop_being_finite_are_never_checkpointed(tmp_path):
  # An infinite learning rate: the loss of step 1 is finite, the parameters after it are not.
  out = run(tmp_path, "learning_rate=1e39", "checkpoint_every_steps=1")
  assert out.returncode == 1
  assert "Traceback" not in out.stderr
  lines = out.stderr.strip().splitlines()
  assert "The parameters after step 1 are not finite" in lines[-2]
  assert "No checkpoint is left to resume from" in lines[-1]
  assert not os.listdir(tmp_path / "checkpoints")  # Not even a half-written one.


def test_a_finite_check_sees_every_leaf():
  ok = {"w": np.ones(3, np.float32), "steps": np.int32(3)}
  assert bool(checkpoints.all_finite(np.float32(1.0), ok))
  assert not bool(checkpoints.all_finite(np.float32(np.nan), ok))
  assert not bool(checkpoints.all_finite(np.float32(1.0), {**ok, "b": np.array([1.0, np.inf])}))


def _linear_step(rule, stage_ids):
  """A linear model's engine step on 8 workers, its parameters and a batch."""
  params = {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}
  step = engine.make_train_step(lambda p, b: ((b["x"] @ p["w"] + p["b"][None]) ** 2).mean(),
                                optax.sgd(0.1), stage_ids=stage_ids, rule=rule,
                                mesh=jax.make_mesh((8,), ("data",)))
  return step, params, {"x": np.arange(64, dtype=np.float32).reshape(16, 4) / 64}


def test_the_engine_does_not_replace_a_placed_state():
  """After the first step the state is already replicated: the step must not copy it."""
  step, params, batch = _linear_step("dp", {"w": 0, "b": 0})
  state, _ = step(engine.init_state(params, optax.sgd(0.1), rule="dp"), batch)
  placed, *_ = step.prepare(state, batch)
  assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(state)))


def test_only_the_state_a_step_returned_skips_its_checks():
  step, params, batch = _linear_step("cdp-v2", {"w": 0, "b": 1})
  state, _ = step(step.init(params), batch)
  host = jax.tree.map(np.asarray, state)  # The same numbers, not the step's arrays.
  assert step.is_returned(state) and not step.is_returned(host)
  own, own_metrics = step(state, batch)  # Neither checked nor placed again.
  checked, checked_metrics = step(host, batch)  # Placed and checked.
  for a, b in zip(jax.tree.leaves((own, own_metrics)), jax.tree.leaves((checked, checked_metrics))):
    np.testing.assert_array_equal(a, b)
  assert step.is_returned(checked) and not step.is_returned(own)
  with pytest.raises(ValueError, match="stage_ids do not match params"):
    step(checked._replace(params={"w": checked.params["w"]}), batch)


@pytest.mark.skipif(os.getuid() == 0, reason="root writes in read-only directories")
def test_a_read_only_workdir_is_a_clear_error(tmp_path):
  os.chmod(tmp_path, 0o500)
  try:
    with pytest.raises(train.WorkdirError, match="not writable"):
      train.train_and_evaluate(_smoke(), str(tmp_path))
  finally:
    os.chmod(tmp_path, 0o700)


def _smoke(**overrides):
  return config_lib.load(str(ROOT / "configs" / "digits.py"), "smoke", **overrides)


def test_a_workdir_that_is_a_file_is_a_clear_error(tmp_path):
  path = tmp_path / "file"
  path.write_text("")
  with pytest.raises(train.WorkdirError, match="is a file, not a directory"):
    train.train_and_evaluate(_smoke(), str(path))


def test_keep_checkpoints_zero_is_refused(tmp_path):
  with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
    train.train_and_evaluate(_smoke(keep_checkpoints=0), str(tmp_path))


def test_cifar10_preparation_runs_the_builder_on_a_local_extracted_archive(tmp_path):
  """The README's Data command, offline: tfds's real cifar10 builder on fake batch files."""
  extracted = tmp_path / "extracted" / "cifar-10-batches-bin"
  extracted.mkdir(parents=True)
  (extracted / "batches.meta.txt").write_text("\n".join(f"class{k}" for k in range(10)) + "\n")
  rng = np.random.default_rng(0)
  labels = {}
  for name, rows in [(f"data_batch_{k}.bin", 4) for k in range(1, 6)] + [("test_batch.bin", 8)]:
    label = rng.integers(0, 10, rows, dtype=np.uint8)
    pixels = rng.integers(0, 256, (rows, 3072), dtype=np.uint8)
    (extracted / name).write_bytes(np.concatenate([label[:, None], pixels], 1).tobytes())
    labels[name] = label
  # `python -m cdpjax.data.tfds_pipeline cifar10 --data_dir ... --extracted_dir ...`, in
  # this process (TensorFlow is imported once).
  from cdpjax import data  # pylint: disable=g-import-not-at-top
  from cdpjax.data import tfds_pipeline  # pylint: disable=g-import-not-at-top
  tfds_pipeline.main(["cifar10", "--data_dir", str(tmp_path / "tfds"),
                      "--extracted_dir", str(tmp_path / "extracted")])
  cifar = data.get_dataset("cifar10", data_dir=str(tmp_path / "tfds"))
  assert (cifar.num_train, cifar.num_eval) == (20, 8)
  batch = next(cifar.eval_batches(8))
  np.testing.assert_array_equal(np.sort(batch["label"]), np.sort(labels["test_batch.bin"]))
  assert batch["image"].shape == (8, 32, 32, 3)


def test_another_model_on_a_config_drops_the_options_it_does_not_take():
  c = _smoke(model="resnet18")  # `--config.model=resnet18` on the digits config.
  assert train.model_kwargs(c) == {"width": 32}  # Not the residual MLP's hidden, num_blocks.
  assert train.model_kwargs(_smoke()) == {"width": 32, "hidden": 64, "num_blocks": 4}


def test_a_second_ctrl_c_exits_at_once():
  """The first Ctrl-C asks for a save; it leaves SIGINT's default action (exit now) for the next."""
  before = signal.getsignal(signal.SIGINT)
  with loop.Interrupts() as interrupts:
    assert signal.getsignal(signal.SIGINT) not in (before, signal.SIG_DFL)  # Its own handler.
    os.kill(os.getpid(), signal.SIGINT)
    assert interrupts.requested == "SIGINT" and interrupts.stop_at(1)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
  assert signal.getsignal(signal.SIGINT) == before
