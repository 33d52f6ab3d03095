"""ResNet-18 and ResNet-50 (He et al., 2016) in flax, laid out as torchvision's.

Every top-level unit is its own top-level submodule: ``stem_conv``,
``stem_bn``, ``block_0`` ... ``block_{K-1}`` and ``head``. Stage partitioners
group these names; the execution order is the order listed here.
BatchNorm statistics live in the ``batch_stats`` collection.
"""
from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

# torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu").
_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def _conv(features: int, kernel: int, strides: int = 1, name: str | None = None) -> nn.Conv:
  """A bias-free conv with torchvision's symmetric padding ``kernel // 2``."""
  pad = kernel // 2
  return nn.Conv(
      features, (kernel, kernel), (strides, strides), padding=((pad, pad), (pad, pad)),
      use_bias=False, kernel_init=_conv_init, name=name)


def _batch_norm(train: bool, name: str) -> nn.BatchNorm:
  # torchvision's momentum 0.1 is flax's 0.9 (the weight of the old average).
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)


class BasicBlock(nn.Module):
  """Two 3x3 convs with a residual connection (ResNet-18/34)."""
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(_batch_norm(train, "bn1")(_conv(self.filters, 3, self.strides, "conv1")(x)))
    y = _batch_norm(train, "bn2")(_conv(self.filters, 3, name="conv2")(y))
    return nn.relu(y + _shortcut(x, y.shape[-1], self.strides, train))


class Bottleneck(nn.Module):
  """1x1 reduce, 3x3 (strided, as torchvision's v1.5) and 1x1 expand by 4."""
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(_batch_norm(train, "bn1")(_conv(self.filters, 1, name="conv1")(x)))
    y = nn.relu(_batch_norm(train, "bn2")(_conv(self.filters, 3, self.strides, "conv2")(y)))
    y = _batch_norm(train, "bn3")(_conv(4 * self.filters, 1, name="conv3")(y))
    return nn.relu(y + _shortcut(x, y.shape[-1], self.strides, train))


def _shortcut(x, features: int, strides: int, train: bool):
  """Identity, or a strided 1x1 conv + BatchNorm where the shape changes.

  Called from inside a block's compact ``__call__``, so the layers become that
  block's ``proj_conv`` and ``proj_bn``.
  """
  if x.shape[-1] == features and strides == 1:
    return x
  return _batch_norm(train, "proj_bn")(_conv(features, 1, strides, "proj_conv")(x))


class ResNet(nn.Module):
  """A ResNet classifier on NHWC images.

  Attributes:
    block_cls: ``BasicBlock`` or ``Bottleneck``.
    stage_sizes: number of blocks in each of the four stages.
    num_classes: size of the output logits.
    stem: ``"cifar"`` (3x3 conv, stride 1, no max-pool) or ``"imagenet"``
      (7x7 conv, stride 2, then a 3x3 stride-2 max-pool).
    width: filters of the stem and first stage (64 in the paper); smoke
      configs shrink it to keep tests fast.
  """
  block_cls: type[nn.Module]
  stage_sizes: Sequence[int]
  num_classes: int
  stem: str = "cifar"
  width: int = 64

  @nn.compact
  def __call__(self, x, train: bool):
    if self.stem == "cifar":
      x = _conv(self.width, 3, name="stem_conv")(x)
    elif self.stem == "imagenet":
      x = _conv(self.width, 7, 2, name="stem_conv")(x)
    else:
      raise ValueError(f"Unknown stem {self.stem!r}. Use 'cifar' or 'imagenet'.")
    x = nn.relu(_batch_norm(train, "stem_bn")(x))
    if self.stem == "imagenet":
      x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    index = 0
    for stage, num_blocks in enumerate(self.stage_sizes):
      for i in range(num_blocks):
        strides = 2 if stage > 0 and i == 0 else 1
        x = self.block_cls(self.width * 2**stage, strides, name=f"block_{index}")(x, train)
        index += 1
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="head")(x)


ResNet18 = functools.partial(ResNet, BasicBlock, (2, 2, 2, 2))
ResNet50 = functools.partial(ResNet, Bottleneck, (3, 4, 6, 3))
