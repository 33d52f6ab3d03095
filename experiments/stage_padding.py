"""What cutting the executed modes' ResNet stages by parameters instead of FLOPs trades (issue 34).

The executed timetables (``parallelism=model`` and ``zero``) keep every stage
as a buffer of the largest stage's size (one shape on every device of an SPMD
program), so a ResNet cut by FLOPs pads its light early stages: messages and
buffers hold ``J x largest / sum`` of the parameters. Cut by parameters
(``--config.stages_by=params``) the buffers nearly match, but the stages'
compute does not, and a slot of the cyclic timetables lasts as long as its
heaviest stage. For ResNet-18 of ``configs/digits.py:model=resnet18`` and
ResNet-50 of ``configs/imagenet_resnet50.py`` at ``J = 4``, per cut: that
padding and the stage FLOPs' max / mean (XLA's count of each unit's forward).

  python experiments/stage_padding.py          # results/stage_padding/stage_padding.json
  python experiments/stage_padding.py --quick  # ResNet-18 only
"""
from __future__ import annotations

import sys

import _common

CONFIGS = {"resnet18": "configs/digits.py:model=resnet18",
           "resnet50": "configs/imagenet_resnet50.py"}
CUTS = ("flops", "params")


def measure(config: str) -> dict:
  """Per cut: the padding of the executed stage buffers and the stages' FLOPs max / mean."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from cdpjax import aot, stages  # pylint: disable=g-import-not-at-top
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  path, _, arg = config.partition(":")
  c = config_lib.load(str(_common.REPO / path), arg or None)
  model, sample, _ = aot.model_and_batch(c)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), sample, train=False))["params"]
  costs = stages.unit_costs(model, sample, train=False)
  out = {"num_stages": c.num_stages}
  for by in CUTS:
    ids = stages.model_stage_ids(model, params, c.num_stages, sample, by=by, train=False)
    sizes = stages.stage_sizes(params, ids)
    unit_stage = {path[0].key: int(s) for path, s in jax.tree_util.tree_flatten_with_path(ids)[0]}
    flops = np.zeros(c.num_stages)
    for unit, cost in costs.items():
      flops[unit_stage[unit]] += cost.flops
    out[by] = {"stage_params": sizes, "padding": c.num_stages * max(sizes) / sum(sizes),
               "stage_flops": flops.tolist(), "flops_max_over_mean": flops.max() / flops.mean()}
  return out


def main(argv=None) -> dict:
  args = _common.parser("stage_padding", __doc__).parse_args(argv)
  out = _common.results_dir(args)
  names = ("resnet18",) if args.quick else tuple(CONFIGS)
  result = {"models": {name: measure(CONFIGS[name]) for name in names},
            "machine": _common.machine()}
  _common.write_json(out / "stage_padding.json", result)
  for name, r in result["models"].items():
    print(name, "; ".join(f"by {by}: padding {r[by]['padding']:.2f}, stage FLOPs max/mean "
                          f"{r[by]['flops_max_over_mean']:.2f}" for by in CUTS))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
