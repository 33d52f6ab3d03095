"""The quick start: a residual MLP on scikit-learn's embedded 8x8 digits.

8 workers, 4 stages (one residual block each), CDP-v2, offline, minutes on a
laptop CPU:

  cdpjax-train --config configs/digits.py --workdir runs/digits
  cdpjax-train --config configs/digits.py:rule=dp,smoke --workdir runs/digits-smoke
  cdpjax-train --config configs/digits.py:parallelism=model --workdir runs/digits-mp
"""
from cdpjax import config as config_lib


def get_config(arg: str | None = None):
  arg = config_lib.parse_arg(arg, rule="cdp-v2", parallelism="data", smoke=False)
  c = config_lib.base_config()
  c.rule = arg.rule
  c.parallelism = arg.parallelism
  if arg.smoke:
    c.model_kwargs.width = 32
    c.model_kwargs.hidden = 64
    config_lib.shrink_for_smoke(c, num_train_steps=4)
  c.lock()
  return c
