"""The compile-only launcher: plan a TPU run without a TPU (`cdpjax.aot`).

  cdpjax-compile --config configs/imagenet_resnet50.py:rule=cdp-v2 \\
    --config.num_workers=256 --topology v5e:16x16 --workdir runs/plan-r50

Builds the step ``cdpjax-train`` would run for the config (same flags, same
``--config.KEY=VALUE`` overrides), lowers it from abstract inputs on the
topology's chips, compiles it with the TPU compiler, prints a short table and
writes ``compile.json`` to ``--workdir``. ``--baseline`` compiles the config
under rule dp too (DP, GPipe or ZeRO-3) and prints the two side by side;
``--hbm_only`` places no buffer in on-chip VMEM, so that HBM shows all a
step holds. Needs ``pip install -e ".[tpu]"``.
Exit status 0 when the step fits the chip's HBM, 2 when it does not, 1 on an
error.
"""
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm.py.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology CHIP:SHAPE, e.g. v5e:2x4, "
                                "v5e:16x16, v5p:8x8x4.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for compile.json.")
_HBM_ONLY = flags.DEFINE_bool(
    "hbm_only", False, "Compile with XLA's memory-space assignment off: no buffer in the chip's "
    "on-chip VMEM, so HBM shows all the step holds (a small step's buffers otherwise sit in "
    "VMEM, where the HBM figure does not see them).")
_BASELINE = flags.DEFINE_bool(
    "baseline", False, "Also compile the config under rule dp (DP, GPipe or ZeRO-3: the same "
    "parallelism, mesh and batch) and print the two side by side; compile.json gets its "
    "report under 'baseline'.")
flags.mark_flags_as_required(["config", "topology", "workdir"])
EXIT_DOES_NOT_FIT = 2


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  try:
    aot.quiet_libtpu(_TOPOLOGY.value)  # Before JAX starts a backend.
    baseline = _BASELINE.value and aot.baseline_config(_CONFIG.value)
    result = aot.compile_config(_CONFIG.value, _TOPOLOGY.value, hbm_only=_HBM_ONLY.value)
    if baseline:
      result["baseline"] = aot.compile_config(baseline, _TOPOLOGY.value, hbm_only=_HBM_ONLY.value)
  except (ValueError, RuntimeError) as e:
    sys.stderr.write(f"cdpjax-compile: error: {e}\n")
    sys.exit(1)
  path = aot.write(result, _WORKDIR.value)
  print(aot.summary(result))
  if baseline:
    print(aot.comparison(result, result["baseline"]))
  print(f"wrote {path}")
  if not result["fits"]:
    sys.exit(EXIT_DOES_NOT_FIT)


def run():
  """Console-script entry point."""
  app.run(main)


if __name__ == "__main__":
  run()
