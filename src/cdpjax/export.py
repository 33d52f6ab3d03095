"""A run's parameters as plain flax msgpack files: ``cdpjax-export --workdir runs/digits``.

Restores the newest checkpoint of a cdpjax-train workdir (any parallelism,
rule and backend: the run is rebuilt from the config it saved, as a resume
does) and writes into ``--out`` (default ``<workdir>/export/step_<t>``)
files that ``flax.serialization.msgpack_restore`` reads without cdpjax:

- ``params.msgpack``: ``theta_t``'s parameters;
- ``model_state.msgpack``: its model state (BatchNorm statistics), for a
  model with one;
- with ``--mean_view``, ``mean_view.msgpack``: the authors' final model, the
  mean over workers of each worker's view (any parallelism), and its eval
  metrics on stdout.

  cdpjax-export --workdir runs/digits
  cdpjax-export --workdir runs/digits --mean_view --out runs/digits-export
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging

from cdpjax import distributed

_WORKDIR = flags.DEFINE_string("workdir", None, "A cdpjax-train run's workdir.")
_OUT = flags.DEFINE_string("out", None, "Where to write (default: <workdir>/export/step_<t>).")
_MEAN_VIEW = flags.DEFINE_bool("mean_view", False, "Also write (and evaluate) the mean worker "
                               "view, the authors' final model.")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    c = config_lib.saved(_WORKDIR.value)
    distributed.emulate_cpu_devices(config_lib.num_devices(c))  # The run's mesh, as it trained.
    from cdpjax import train  # pylint: disable=g-import-not-at-top  (after the device count)
    run, state, step = train.restore(c, _WORKDIR.value)
    out = _OUT.value or os.path.join(_WORKDIR.value, "export", f"step_{step}")
    os.makedirs(out, exist_ok=True)
    metrics = train.export_models(c, run, state, out, prefix="", mean_view=_MEAN_VIEW.value)
  except (ValueError, OSError) as e:
    sys.exit(f"cdpjax-export: error: {e}")
  print(f"Wrote theta_{step} of {_WORKDIR.value} to {out}: {sorted(os.listdir(out))}"
        + (f"; mean view: {metrics}" if metrics else ""))


def run():
  """Console-script entry point."""
  flags.mark_flag_as_required("workdir")
  app.run(main)


if __name__ == "__main__":
  run()
