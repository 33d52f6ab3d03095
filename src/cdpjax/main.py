"""The launcher: ``cdpjax-train --config configs/digits.py --workdir runs/digits``.

Flags only; the work is ``cdpjax.train.train_and_evaluate``. Before any device
is touched, the launcher joins the other processes of a multi-host run (see
``cdpjax.distributed`` and docs/multihost.md) and lets a CPU host emulate its
share of the devices the run needs (a device count already in ``XLA_FLAGS``
wins). Several processes on one or more hosts:

  cdpjax-train --config configs/digits.py --workdir /shared/runs/digits \
    --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0  # and =1

Exit status, for schedulers: 0 when the run reached its last step; 1 on an
error (a user error prints its message and the fix, without a traceback);
75 (``train.EXIT_PREEMPTED``) when SIGTERM or Ctrl-C stopped it after saving a
checkpoint: rerunning the same command resumes.
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from cdpjax import distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/digits.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summary "
                               "(shared by all processes of a multi-host run).")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", distributed.MODES,
    "Join a multi-process run with jax.distributed.initialize: 'auto' when any of the three "
    "flags below is given or under SLURM, Open MPI or a Cloud TPU VM; 'on' always (JAX detects "
    "unset values); 'off' never.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0, reachable from every process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0-based.",
                                   lower_bound=0)
_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout_s", 300, "Seconds to wait for every process to join, and after which a "
    "process that stopped answering (died) fails the others.", lower_bound=1)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO.
    logging.set_verbosity(logging.WARNING)
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  try:
    config_lib.validate(config)
  except ValueError as e:
    _fail(str(e))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  processes = distributed.initialize(
      config_lib.num_devices(config), mode=_DISTRIBUTED.value,
      coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value, timeout_s=_TIMEOUT.value)
  from cdpjax import train  # pylint: disable=g-import-not-at-top  (after the device count)
  who = f"process {processes.index}/{processes.count}: " if processes.count > 1 else ""
  try:
    summary = train.train_and_evaluate(config, _WORKDIR.value)
  except Exception as e:
    if _names_the_fix(e) and not flags.FLAGS["verbosity"].present:
      _fail(who + "\n".join([str(e), *getattr(e, "__notes__", [])]) +
            ("" if isinstance(e, train.TrainError) else
             "\n(--verbosity=0 shows where it was raised.)"))
    if processes.count == 1:
      raise
    raise RuntimeError(f"{who}{type(e).__name__}: {e}") from e
  if processes.index == 0:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
  if summary["preempted"]:
    sys.stderr.write(
        f"Stopped by {summary['stopped_by']} after step {summary['final_step']} of "
        f"{summary['num_train_steps']}, with a checkpoint. Rerun the same command to resume "
        f"(exit status {train.EXIT_PREEMPTED}).\n")
    sys.exit(train.EXIT_PREEMPTED)


def _names_the_fix(e: Exception) -> bool:
  """A user error or a diverged run, whose message says what to do: no traceback.

  cdpjax raises ValueError for bad input, with a message naming the fix; a
  missing tfds dataset is a FileNotFoundError that says how to prepare it.
  """
  from cdpjax import train  # pylint: disable=g-import-not-at-top
  return (isinstance(e, (train.TrainError, ValueError))
          or type(e).__name__ == "DatasetNotPreparedError")


def _fail(message: str):
  """Ends the launcher on a user error: the message, no traceback, exit status 1."""
  sys.stderr.write(f"cdpjax-train: error: {message}\n")
  sys.exit(1)


def run():
  """Console-script entry point."""
  app.run(main)


if __name__ == "__main__":
  run()
