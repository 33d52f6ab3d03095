"""A residual MLP of identical blocks (``block_0`` ... ``block_{L-1}``, one parameter structure).

There is no BatchNorm, so the model has no state besides ``params``.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

_LN_EPSILON = 1e-6


def _layer_norm_module(name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=_LN_EPSILON, use_fast_variance=False, name=name)


class ResidualBlock(nn.Module):
  """Pre-norm residual block: LayerNorm -> Dense(hidden) -> gelu -> Dense(width)."""
  width: int
  hidden: int

  @nn.compact
  def __call__(self, h):
    y = _layer_norm_module("norm")(h)
    y = jax.nn.gelu(nn.Dense(self.hidden, name="dense_in")(y))
    return h + nn.Dense(self.width, name="dense_out")(y)


class Head(nn.Module):
  """LayerNorm then a Dense layer to the logits."""
  num_classes: int

  @nn.compact
  def __call__(self, h):
    return nn.Dense(self.num_classes, name="dense")(_layer_norm_module("norm")(h))


class ResidualMLP(nn.Module):
  """``embed`` (flatten + Dense), ``num_blocks`` identical blocks, ``head``.

  Attributes:
    num_classes: size of the output logits.
    width: residual stream width.
    hidden: inner width of each block.
    num_blocks: number of residual blocks.
  """
  num_classes: int
  width: int = 128
  hidden: int = 512
  num_blocks: int = 4

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train  # No dropout or BatchNorm; accepted so all models share one signature.
    h = nn.Dense(self.width, name="embed")(jnp.reshape(x, (x.shape[0], -1)))
    for i in range(self.num_blocks):
      h = ResidualBlock(self.width, self.hidden, name=f"block_{i}")(h)
    return Head(self.num_classes, name="head")(h)
