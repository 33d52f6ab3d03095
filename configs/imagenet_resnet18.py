"""ResNet-18 on imagenet2012 with the paper's recipe (8 workers, 4 stages split by FLOPs).

  cdpjax-train --config configs/imagenet_resnet18.py:rule=cdp-v2 --workdir runs/imagenet_r18
  cdpjax-train --config configs/imagenet_resnet18.py:rule=dp --workdir runs/imagenet_r18_dp
  cdpjax-train --config configs/imagenet_resnet18.py:smoke --workdir /tmp/smoke

The data must be prepared for tensorflow-datasets (see README, "Data").
"""
from cdpjax import config as config_lib


def get_config(arg: str | None = None):
  return config_lib.paper_config("imagenet2012", "resnet18", arg)
