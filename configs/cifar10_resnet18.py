"""ResNet-18 on cifar10 with the paper's recipe (8 workers, 4 stages split by FLOPs).

``parallelism=model`` and ``zero`` run 4 workers of twice the rows (`config.paper_config`).

  cdpjax-train --config configs/cifar10_resnet18.py:rule=cdp-v2 --workdir runs/cifar10_r18
  cdpjax-train --config configs/cifar10_resnet18.py:rule=dp --workdir runs/cifar10_r18_dp
  cdpjax-train --config configs/cifar10_resnet18.py:smoke --workdir /tmp/smoke
  cdpjax-train --config configs/cifar10_resnet18.py:parallelism=zero,smoke --workdir /tmp/smoke-zero

The data must be prepared for tensorflow-datasets (see README, "Data").
"""
from cdpjax import config as config_lib


def get_config(arg: str | None = None):
  return config_lib.paper_config("cifar10", "resnet18", arg)
