"""Faults injected into a workdir, through the launcher: a one-line error naming the fix, and
the workdir still resumes exactly.

Real ``python -m cdpjax.main`` processes on the digits smoke config: a path
of the workdir made the wrong kind (a file where a directory belongs, or the
reverse), a ``metrics.jsonl`` line that is JSON but not an object, SIGHUP,
and a diverged run, which must leave no checkpoint whose loss is not known
finite and name one from which a smaller learning rate resumes finite.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import serialization

from cdpjax import train
from test_reliability import (LONG, checkpoint_steps, last_line, launcher, run, train_losses,
                              wait_for)

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]
# 6 steps, a checkpoint every 2, a constant learning rate (a resume replays the same losses).
SHORT = ("num_train_steps=6", "checkpoint_every_steps=2", "eval_every_steps=6",
         "lr_schedule=constant")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The 6 steps in one run, for the resumes to equal."""
  workdir = tmp_path_factory.mktemp("straight")
  result = run(workdir, *SHORT)
  assert result.returncode == 0, result.stderr
  return train_losses(workdir)


# name -> (make it the wrong kind, undo it).
def _dir(path):
  if path.exists():
    path.unlink()
  path.mkdir()


def _file(path):
  if path.exists():
    shutil.rmtree(path)
  path.write_text("not a directory\n")


FAULTS = {
    "config.json": (_dir, lambda p: p.rmdir()),
    "lock": (_dir, lambda p: p.rmdir()),
    "metrics.jsonl": (_dir, None),
    "tensorboard": (_file, None),
    "checkpoints": (_file, None),
}


def test_a_path_of_the_wrong_kind_names_it_and_the_workdir_resumes(tmp_path, straight):
  """Each fault in turn on a run stopped at step 2: the error, then the resume to 6."""
  first = run(tmp_path, *SHORT[1:], "num_train_steps=2")
  assert first.returncode == 0, first.stderr
  for name, (wrong, _) in FAULTS.items():
    path = tmp_path / name
    kept = tmp_path.parent / f"kept-{name}"
    if path.exists():
      os.replace(path, kept)
    wrong(path)
    result = run(tmp_path, *SHORT)
    message = last_line(result.stderr)
    assert result.returncode == 1, result.stderr
    assert message.startswith("cdpjax-train: error: ") and str(path) in message, result.stderr
    assert "move it out of --workdir" in message and "Traceback" not in result.stderr
    (shutil.rmtree if path.is_dir() else os.remove)(path)
    if kept.exists():
      os.replace(kept, path)
  result = run(tmp_path, *SHORT)
  assert result.returncode == 0, result.stderr
  assert train_losses(tmp_path) == straight


def test_a_metrics_line_that_is_not_an_object_is_dropped(tmp_path, straight):
  first = run(tmp_path, *SHORT[1:], "num_train_steps=2")
  assert first.returncode == 0, first.stderr
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write("5\n")
  result = run(tmp_path, *SHORT)
  assert result.returncode == 0, result.stderr
  assert "is not a JSON object of metrics: dropping it" in result.stderr
  assert train_losses(tmp_path) == straight


def test_sighup_saves_and_the_run_resumes(tmp_path):
  """A closed terminal: SIGHUP checkpoints and stops like SIGTERM."""
  process = subprocess.Popen(launcher(tmp_path, *LONG), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  try:
    wait_for(lambda: len(train_losses(tmp_path)) >= 2, "two logged steps")
    process.send_signal(signal.SIGHUP)
    _, stderr = process.communicate(timeout=300)
  finally:
    process.kill()
  assert process.returncode == train.EXIT_PREEMPTED, stderr
  assert "Stopped by SIGHUP" in stderr
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["preempted"] and summary["stopped_by"] == "SIGHUP"
  assert checkpoint_steps(tmp_path)[-1] == summary["final_step"]


def test_divergence_sets_unsafe_checkpoints_aside_and_names_one_that_resumes_finite(tmp_path):
  """The issue's case: the checkpoint of step 2 has a non-finite loss at its parameters."""
  diverge = ("learning_rate=1e6", "checkpoint_every_steps=1", "lr_schedule=constant",
             "num_train_steps=12", "eval_every_steps=12")
  result = run(tmp_path, *diverge)
  assert result.returncode == 1, result.stderr
  assert "Non-finite training loss" in result.stderr and "Traceback" not in result.stderr
  bad_step = int(result.stderr.split("Non-finite training loss")[1].split("at step ")[1]
                 .split(".")[0])
  steps = checkpoint_steps(tmp_path)
  assert steps and steps[-1] == bad_step - 2, (steps, result.stderr)
  assert str(tmp_path / "checkpoints" / str(bad_step - 2)) in result.stderr
  assert "--config.resume_step=N" in result.stderr
  assert sorted(int(p.split("-")[0]) for p in os.listdir(tmp_path / "diverged_checkpoints")) == [
      bad_step - 1]
  resumed = run(tmp_path, *diverge[1:], "learning_rate=0.05")
  assert resumed.returncode == 0, resumed.stderr
  losses = train_losses(tmp_path)
  assert [s for s, _ in losses] == list(range(1, 13))
  assert np.all(np.isfinite([loss for _, loss in losses]))


def test_resume_step_starts_from_an_older_checkpoint_and_keeps_the_newer(tmp_path, straight):
  result = run(tmp_path, *SHORT)
  assert result.returncode == 0, result.stderr
  (tmp_path / "summary.json").unlink()  # Not finished any more: it resumes.
  missing = run(tmp_path, *SHORT, "resume_step=3")
  assert missing.returncode == 1 and "no checkpoint" in last_line(missing.stderr)
  again = run(tmp_path, *SHORT, "resume_step=2")
  assert again.returncode == 0, again.stderr
  assert train_losses(tmp_path) == straight
  assert sorted(int(p.split("-")[0]) for p in os.listdir(tmp_path / "superseded_checkpoints")) == [
      4, 6]


def test_export_writes_theta_t_of_a_workdir_as_plain_msgpack(tmp_path):
  """cdpjax-export: the newest checkpoint's theta_t, readable without cdpjax's types.

  The run is started as a user would, without the suite's JAX_PLATFORMS: on
  this CPU host, with libtpu installed (the test extra's jax[tpu]), it prints
  nothing of libtpu's.
  """
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  result = subprocess.run(launcher(tmp_path, "num_train_steps=2"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "libtpu" not in result.stderr and "E0000" not in result.stderr, result.stderr
  out = tmp_path / "exported"
  export = subprocess.run(
      [sys.executable, "-m", "cdpjax.export", "--workdir", str(tmp_path), "--out", str(out),
       "--mean_view"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert export.returncode == 0, export.stderr
  assert sorted(os.listdir(out)) == ["mean_view.msgpack", "params.msgpack"]
  read = lambda path: serialization.msgpack_restore(path.read_bytes())  # pylint: disable=unnecessary-lambda-assignment
  exported, final = read(out / "params.msgpack"), read(tmp_path / "final_params.msgpack")
  assert jax.tree.structure(exported) == jax.tree.structure(final)
  for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(final)):
    np.testing.assert_array_equal(a, b)
  missing = subprocess.run([sys.executable, "-m", "cdpjax.export", "--workdir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert missing.returncode == 1 and "config.json does not exist" in missing.stderr


def test_a_run_moves_from_one_device_a_worker_to_two(tmp_path, straight):
  """devices_per_worker only places the same state: the resume reshards the checkpoint.

  Losses within 1e-6 of the straight run (measured: 1.2e-7 at step 6, the
  sharded program's rounding).
  """
  first = run(tmp_path, *SHORT[1:], "num_train_steps=2")
  assert first.returncode == 0, first.stderr
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
      "device_count=8", "device_count=16"))  # N = 8 workers of 2 devices.
  moved = subprocess.run(launcher(tmp_path, *SHORT, "devices_per_worker=2"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
  assert moved.returncode == 0, moved.stderr
  assert "devices_per_worker changed: 1 -> 2" in moved.stderr
  got = train_losses(tmp_path)
  assert [s for s, _ in got] == [s for s, _ in straight]
  np.testing.assert_allclose([l for _, l in got], [l for _, l in straight], rtol=1e-6)
