"""The quick start: scikit-learn's embedded 8x8 digits, offline, minutes on a laptop CPU.

The residual MLP by default (8 workers, 4 stages of one residual block each,
CDP-v2); ``model=resnet18`` runs a ResNet-18 with the CIFAR stem on the same
8x8x1 images, cut into 4 stages by FLOPs, with BatchNorm. ``parallelism=model``
and ``parallelism=zero`` run N = J = 4 workers (the executed timetables need
one micro-batch per stage); under them rule ``dp`` runs GPipe and ZeRO-3.
``--config.num_replicas=R`` runs ``R`` copies of them on a 2-D mesh
(``R*J`` devices, ``R*N*b`` rows a step); ``--config.devices_per_worker=F``
makes a ``parallelism=data`` worker ``F`` devices (``N*F``), its state sharded.
Each run picks its steps per compiled call ``K`` among the divisors of the eval
and checkpoint intervals (100, 200): 20 for the executed cyclic timetables
(idle fraction 0.036 at J = 4), 10 for the engine and GPipe; ``smoke`` takes
1, and ``--config.steps_per_call=1`` fills and drains the pipeline every step.

  cdpjax-train --config configs/digits.py --workdir runs/digits
  cdpjax-train --config configs/digits.py:rule=dp,smoke --workdir runs/digits-smoke
  cdpjax-train --config configs/digits.py:parallelism=model --workdir runs/digits-mp
  cdpjax-train --config configs/digits.py:parallelism=zero,model=resnet18,smoke --workdir runs/digits-zero
  cdpjax-train --config configs/digits.py:parallelism=zero,smoke --config.num_replicas=2 --workdir runs/digits-zero-r2
  cdpjax-train --config configs/digits.py:smoke --config.devices_per_worker=2 --workdir runs/digits-fsdp
"""
from cdpjax import config as config_lib


def get_config(arg: str | None = None):
  arg = config_lib.parse_arg(arg, rule="cdp-v2", parallelism="data", model="residual_mlp",
                             smoke=False)
  c = config_lib.base_config()
  c.rule = arg.rule
  c.parallelism = arg.parallelism
  if arg.parallelism in ("model", "zero"):
    c.num_workers = c.num_stages
  if arg.model == "resnet18":
    c.model = "resnet18"
    c.model_kwargs = config_lib.ml_collections.ConfigDict({"stem": "cifar", "width": 16})
    c.stages_by = "flops"
    c.learning_rate = 0.02
    c.weight_decay = 5e-4
    c.num_epochs = 10.0
  elif arg.model != "residual_mlp":
    raise ValueError(f"Unknown model {arg.model!r}: use model=residual_mlp or model=resnet18.")
  if arg.smoke:
    if arg.model == "resnet18":
      c.model_kwargs.width = 4
      c.per_worker_batch_size = 4
    else:
      c.model_kwargs.width = 32
      c.model_kwargs.hidden = 64
    config_lib.shrink_for_smoke(c, num_train_steps=4)
  c.lock()
  return c
