"""Multi-process runs with real processes on 127.0.0.1: 2 processes x 4 CPU devices (gloo).

``parallelism=data`` (8 devices) and the executed schedules ``model`` and
``zero`` (4 devices, N = J = 4) give the per-step losses of one process; so do
the 2-D meshes (the replicated pipeline, the engine with sharded workers), run
by tests/multihost_2d.py.

Each launched process is bounded by a timeout and killed if a test fails.
"""
import collections
import contextlib
import itertools
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pytest

from cdpjax import config as config_lib
from cdpjax import distributed
from cdpjax import train

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
RUN_TIMEOUT_S = 240  # One launched process, start to exit, on a loaded 2-core machine.
_RUNS = itertools.count()


def load_config(arg, **overrides):
  return config_lib.load(str(ROOT / "configs" / "digits.py"), arg, **overrides)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Processes:
  """The launcher started as ``num_processes`` processes; kills what is left on exit."""

  # A heartbeat once went missing for over 60 s on the loaded 2 cores (multihost_2d): runs
  # that must not fail wait 200 s; the tests of failures pass their own timeout_s.
  def __init__(self, workdir, *args, num_processes=2, started=None, timeout_s=200):
    workdir = pathlib.Path(workdir)
    port = free_port()
    # The launcher sets each process's device count; the test session's 8 would win.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    self.procs, self.logs = [], []
    for i in range(num_processes) if started is None else started:
      self.logs.append(workdir.parent / f"{workdir.name}.{next(_RUNS)}.process{i}.log")
      with open(self.logs[-1], "w") as out:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "cdpjax.main", f"--workdir={workdir}",
             f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
             f"--process_id={i}", f"--distributed_timeout_s={timeout_s}", *args],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))

  def output(self, k) -> str:
    """Process ``k``'s stdout and stderr."""
    return self.logs[k].read_text()

  def wait(self, k=None, timeout_s=RUN_TIMEOUT_S) -> list:
    """Exit codes of every process (or process ``k``), each within ``timeout_s``."""
    procs = self.procs if k is None else [self.procs[k]]
    deadline = time.time() + timeout_s
    return [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def metric_values(workdir, key="train/loss") -> dict:
  """``{step: [value, ...]}``, every line (a resumed run logs some steps twice)."""
  out = collections.defaultdict(list)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for m in map(json.loads, f):
      if key in m:
        out[m["step"]].append(m[key])
  return out


def reference_losses(workdir, **overrides) -> dict:
  """Per-step losses of 1 process x 8 devices (this test session's devices)."""
  train.train_and_evaluate(load_config("smoke", **overrides), str(workdir))
  return {step: values[-1] for step, values in metric_values(workdir).items()}


class Crash(NamedTuple):
  workdir: pathlib.Path
  survivor_code: int
  survivor_output: str
  seconds_to_fail: float  # From the kill to the survivor's exit.
  resume_from: int
  lines_before_resume: int  # In metrics.jsonl.
  resumed_codes: list
  resumed_outputs: list
  reference: dict  # 1 process x 8 devices, straight.


@pytest.fixture(scope="module")
def crash(tmp_path_factory) -> Crash:
  """2 processes x 4 devices; process 1 SIGKILLed after a checkpoint; both restarted from it.

  One scenario (4 launches) serves the equivalence, failure and resume tests.
  """
  tmp_path = tmp_path_factory.mktemp("crash")
  workdir = tmp_path / "two_processes"
  args = ["--config=configs/digits.py:smoke", "--config.lr_schedule=constant",
          "--config.eval_every_steps=2", "--config.checkpoint_every_steps=2"]
  # 10 s once let a heartbeat go missing on the loaded 2 cores (both processes were
  # declared dead before the first checkpoint); the survivor still fails well within 90 s.
  with Processes(workdir, *args, "--config.num_train_steps=1000000", timeout_s=20) as run:
    deadline = time.time() + RUN_TIMEOUT_S
    while not any(p.isdigit() for p in _listdir(workdir / "checkpoints")):
      assert time.time() < deadline and run.procs[0].poll() is None, run.output(0)[-3000:]
      time.sleep(0.1)
    run.procs[1].kill()
    killed = time.time()
    (survivor_code,) = run.wait(0, timeout_s=90)
    seconds_to_fail = time.time() - killed
    survivor_output = run.output(0)

  resume_from = max(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  num_steps = resume_from + 2
  lines_before_resume = len((workdir / "metrics.jsonl").read_text().splitlines())
  with Processes(workdir, *args, f"--config.num_train_steps={num_steps}") as run:
    resumed_codes = run.wait()
    resumed_outputs = [run.output(0), run.output(1)]
  reference = reference_losses(tmp_path / "one_process", lr_schedule="constant",
                               eval_every_steps=2, num_train_steps=num_steps)
  return Crash(workdir, survivor_code, survivor_output, seconds_to_fail, resume_from,
               lines_before_resume, resumed_codes, resumed_outputs, reference)


def test_two_processes_match_one_process(crash):
  """Every logged step, before the crash and after the resume, within TOLERANCE."""
  assert crash.resumed_codes == [0, 0], crash.resumed_outputs[0][-3000:]
  num_steps = crash.resume_from + 2
  losses = {s: v for s, v in metric_values(crash.workdir).items() if s <= num_steps}
  assert sorted(losses) == list(range(1, num_steps + 1)) == sorted(crash.reference)
  difference = max(abs(v - crash.reference[s]) for s, vs in losses.items() for v in vs)
  print(f"max |loss(2x4) - loss(1x8)| = {difference:.3g} over {num_steps} steps")
  assert difference < TOLERANCE


def test_a_killed_process_fails_the_other_in_bounded_time(crash):
  assert crash.survivor_code != 0
  assert "process 0/2" in crash.survivor_output or "another task died" in crash.survivor_output
  assert crash.seconds_to_fail < 90


def test_the_resumed_run_continues_from_the_last_checkpoint(crash):
  assert crash.resumed_codes == [0, 0], crash.resumed_outputs[0][-3000:]
  num_steps = crash.resume_from + 2
  checkpoints = sorted(int(p) for p in os.listdir(crash.workdir / "checkpoints") if p.isdigit())
  assert checkpoints[-1] == num_steps  # Written collectively, by both processes.
  assert json.load(open(crash.workdir / "summary.json"))["final_step"] == num_steps
  # Process 0 alone reports: one summary line, one metrics line per step after the resume.
  assert f"'final_step': {num_steps}" in crash.resumed_outputs[0]
  assert "'final_step'" not in crash.resumed_outputs[1]
  # The resume cut metrics.jsonl back to its step: one trajectory, every step once.
  lines = (crash.workdir / "metrics.jsonl").read_text().splitlines()
  steps = [m["step"] for m in map(json.loads, lines) if "train/loss" in m]
  assert steps == list(range(1, num_steps + 1))


def test_a_process_that_never_joins_fails_the_run_in_bounded_time(tmp_path):
  start = time.time()
  with Processes(tmp_path / "alone", "--config=configs/digits.py:smoke", started=[0],
                 timeout_s=5) as run:
    (code,) = run.wait(timeout_s=60)
  assert code != 0
  assert "process 0/2: not every process joined" in run.output(0)
  assert "--distributed_timeout_s" in run.output(0)
  assert time.time() - start < 60


def _listdir(path) -> list:
  return os.listdir(path) if os.path.isdir(path) else []


EXECUTED = ("model", "zero")


class ExecutedRun(NamedTuple):
  codes: list
  output: str  # Process 0's.
  losses: dict  # {step: [train/loss] + [eval/loss] where evaluated}, 2 processes.
  reference: dict  # The same, 1 process (the first 4 of this session's 8 devices).


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
  """``{parallelism: ExecutedRun}`` at N = J = 4 for 2 steps, evaluating after the second.

  Both 2-process runs start at once and the 1-process references run meanwhile.
  """
  tmp_path = tmp_path_factory.mktemp("executed")
  overrides = dict(num_workers=4, num_stages=4, num_train_steps=2)
  args = [f"--config.{k}={v}" for k, v in overrides.items()]
  with contextlib.ExitStack() as stack:
    runs = {p: stack.enter_context(Processes(
        tmp_path / p, f"--config=configs/digits.py:smoke,parallelism={p}", *args,
        timeout_s=RUN_TIMEOUT_S)) for p in EXECUTED}
    references = {}
    for p in EXECUTED:
      train.train_and_evaluate(load_config("smoke", parallelism=p, **overrides),
                               str(tmp_path / f"{p}_one_process"))
      references[p] = _losses(tmp_path / f"{p}_one_process")
    codes = {p: run.wait() for p, run in runs.items()}
    return {p: ExecutedRun(codes[p], run.output(0), _losses(tmp_path / p), references[p])
            for p, run in runs.items()}


def _losses(workdir) -> dict:
  train_loss, eval_loss = metric_values(workdir), metric_values(workdir, "eval/loss")
  return {s: train_loss[s] + eval_loss.get(s, []) for s in train_loss}


@pytest.mark.parametrize("parallelism", EXECUTED)
def test_executed_modes_on_two_processes_match_one_process(parallelism, executed):
  run = executed[parallelism]
  assert run.codes == [0, 0], run.output[-3000:]
  lengths = lambda losses: {s: len(v) for s, v in losses.items()}
  assert lengths(run.losses) == lengths(run.reference) == {1: 1, 2: 2}
  difference = max(abs(a - b) for s in run.losses for a, b in zip(run.losses[s], run.reference[s]))
  print(f"{parallelism}: max |loss(2 processes) - loss(1)| = {difference:.3g} over 2 steps and "
        "1 evaluation")
  assert difference < TOLERANCE


def test_two_dimensional_meshes_on_two_processes_match_one_process(tmp_path):
  """The replicated pipeline (replica, stage), the replicated ZeRO ring (replica, data) and the
  engine with 2-device workers (data, fsdp), all 4 x 2, stepped by tests/multihost_2d.py on 2
  processes x 4 devices; and the launcher with num_replicas=2, one replica per process."""
  import multihost_2d  # pylint: disable=g-import-not-at-top
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  with contextlib.ExitStack() as stack:
    procs = []
    for i, out in enumerate(outs):
      log = stack.enter_context(open(tmp_path / f"process{i}.log", "w"))
      procs.append(subprocess.Popen(
          [sys.executable, multihost_2d.__file__, str(out), f"127.0.0.1:{port}", "2", str(i)],
          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
      stack.callback(lambda p=procs[-1]: p.poll() is None and (p.kill(), p.wait()))
    reference = multihost_2d.run(str(tmp_path / "one_process"))  # Meanwhile, on 8 devices.
    codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
  assert codes == [0, 0], (tmp_path / "process0.log").read_text()[-3000:]
  for out in outs:
    got = json.loads(out.read_text())
    assert set(got) == set(reference)
    for key in reference:
      np.testing.assert_allclose(np.asarray(got[key], dtype=float),
                                 np.asarray(reference[key], dtype=float), rtol=TOLERANCE,
                                 atol=1e-6, err_msg=key)


class TestWhenToJoin:

  @pytest.fixture(autouse=True)
  def no_cluster(self, monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "SLURM_STEP_NODELIST",
                "OMPI_COMM_WORLD_SIZE"):
      monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_join", self.fail_join)

  @staticmethod
  def fail_join(*args):
    raise AssertionError(f"joined: {args}")

  def test_a_plain_run_does_not_join(self, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--foo")
    assert distributed.initialize(8) == distributed.Processes(0, 1)
    assert os.environ["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=8"

  def test_flags_or_a_cluster_join(self, monkeypatch):
    monkeypatch.setattr(distributed, "_join", lambda *a: distributed.Processes(1, 2))
    monkeypatch.setenv("XLA_FLAGS", "--foo")
    assert distributed.initialize(8, num_processes=2) == distributed.Processes(1, 2)
    assert os.environ["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-2]")
    assert distributed.multi_process_launch() is None
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert distributed.multi_process_launch() == "SLURM"

  def test_off_refuses_flags(self):
    assert distributed.initialize(8, mode="off") == distributed.Processes(0, 1)
    with pytest.raises(ValueError, match="--distributed=off contradicts --process_id"):
      distributed.initialize(8, mode="off", process_id=1)
