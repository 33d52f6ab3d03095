"""ResNet-50 on cifar10 with the paper's recipe (8 workers, 4 stages split by FLOPs).

  cdpjax-train --config configs/cifar10_resnet50.py:rule=cdp-v2 --workdir runs/cifar10_r50
  cdpjax-train --config configs/cifar10_resnet50.py:rule=dp --workdir runs/cifar10_r50_dp
  cdpjax-train --config configs/cifar10_resnet50.py:smoke --workdir /tmp/smoke

The data must be prepared for tensorflow-datasets (see README, "Data").
"""
from cdpjax import config as config_lib


def get_config(arg: str | None = None):
  return config_lib.paper_config("cifar10", "resnet50", arg)
