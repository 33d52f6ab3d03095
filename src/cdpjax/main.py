"""The launcher: ``cdpjax-train --config configs/digits.py --workdir runs/digits``.

Flags only; the work is ``cdpjax.train.train_and_evaluate``. JAX is imported
after the config is read, so that a CPU host can emulate the devices the run
needs (a device count already in ``XLA_FLAGS`` wins).
"""
import os
import re

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/digits.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summary.")
flags.mark_flags_as_required(["config", "workdir"])

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def emulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices unless ``XLA_FLAGS`` already sets a count.

  Only the CPU platform reads this flag, so it is harmless on GPU and TPU hosts.
  """
  flags_now = os.environ.get("XLA_FLAGS", "")
  if not re.search(_COUNT_FLAG + r"=\d+", flags_now):
    os.environ["XLA_FLAGS"] = f"{flags_now} {_COUNT_FLAG}={count}".strip()


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO.
    logging.set_verbosity(logging.WARNING)
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  config_lib.validate(config)
  emulate_cpu_devices(config_lib.num_devices(config))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from cdpjax import train  # pylint: disable=g-import-not-at-top  (JAX starts here)
  summary = train.train_and_evaluate(config, _WORKDIR.value)
  print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})


def run():
  """Console-script entry point."""
  app.run(main)


if __name__ == "__main__":
  run()
