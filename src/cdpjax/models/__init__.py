"""Models by name: ResNet-18/50 for images, a residual MLP for the 8x8 digits."""
from __future__ import annotations

import flax.linen as nn

from cdpjax.models.residual_mlp import ResidualMLP
from cdpjax.models.resnet import ResNet18, ResNet50

_MODELS = {"resnet18": ResNet18, "resnet50": ResNet50, "residual_mlp": ResidualMLP}
MODELS = tuple(_MODELS)
"""Valid names for ``create_model``."""


def create_model(name: str, num_classes: int, **kwargs) -> nn.Module:
  """Builds a model; every model is called as ``model.apply(variables, x, train=...)``.

  Args:
    name: one of ``MODELS``.
    num_classes: size of the output logits.
    **kwargs: model options, e.g. ``stem="imagenet"`` for the ResNets, or
      ``width``, ``hidden``, ``num_blocks`` for ``residual_mlp``.
  """
  _check_name(name)
  return _MODELS[name](num_classes=num_classes, **kwargs)


def has_batch_stats(name: str) -> bool:
  """Whether the model keeps BatchNorm statistics in ``batch_stats``."""
  _check_name(name)
  return name != "residual_mlp"


def _check_name(name: str) -> None:
  if name not in _MODELS:
    raise ValueError(f"Unknown model {name!r}. Use one of {', '.join(MODELS)}.")
