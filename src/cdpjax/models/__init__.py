"""Models by name: ResNet-18/50 for images, a residual MLP for the 8x8 digits, a transformer LM."""
from __future__ import annotations

import flax.linen as nn

from cdpjax.models.residual_mlp import ResidualMLP
from cdpjax.models.resnet import ResNet18, ResNet50
from cdpjax.models.transformer import Transformer

_MODELS = {"resnet18": ResNet18, "resnet50": ResNet50, "residual_mlp": ResidualMLP,
           "transformer": Transformer}
MODELS = tuple(_MODELS)
"""Valid names for ``create_model``."""


def create_model(name: str, num_classes: int, **kwargs) -> nn.Module:
  """Builds a model; every model is called as ``model.apply(variables, x, train=...)``.

  Args:
    name: one of ``MODELS``.
    num_classes: size of the output logits (the dataset's vocabulary for
      ``transformer``).
    **kwargs: model options, e.g. ``stem="imagenet"`` for the ResNets,
      ``width``, ``hidden``, ``num_blocks`` for ``residual_mlp``, or
      ``num_layers``, ``d_model``, ``num_heads``, ``d_ff``, ``seq_len``,
      ``vocab_size``, ``positions``, ``tie_embeddings``, ``dtype`` for
      ``transformer``.
  """
  _check_name(name)
  if name == "transformer":
    vocab_size = kwargs.pop("vocab_size", num_classes)
    if vocab_size < num_classes:
      raise ValueError(
          f"model_kwargs.vocab_size={vocab_size} is smaller than the dataset's {num_classes} "
          f"token ids: set --config.model_kwargs.vocab_size={num_classes}.")
    return Transformer(vocab_size=vocab_size, **kwargs)
  return _MODELS[name](num_classes=num_classes, **kwargs)


def is_convolutional(name: str) -> bool:
  """Whether the model is built of convolutions (the ResNets)."""
  _check_name(name)
  return name in ("resnet18", "resnet50")


def _check_name(name: str) -> None:
  if name not in _MODELS:
    raise ValueError(f"Unknown model {name!r}. Use one of {', '.join(MODELS)}.")
