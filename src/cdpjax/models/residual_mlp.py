"""A residual MLP of identical blocks, plus pure functions for each part.

The blocks ``block_0`` ... ``block_{L-1}`` share one parameter structure, so
pipeline code can stack them on a leading axis and run them with
``block_apply`` under ``vmap`` or ``scan``. ``embed_apply``, ``block_apply``
and ``head_apply`` compute exactly what the flax module computes.
There is no BatchNorm, so the model has no state besides ``params``.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

_LN_EPSILON = 1e-6


def _layer_norm(params, x):
  """Flax ``LayerNorm(use_fast_variance=False)`` over the last axis."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + _LN_EPSILON) * _row(params["scale"], x) + _row(
      params["bias"], x)


def _dense(params, x):
  y = x @ params["kernel"]
  return y + _row(params["bias"], y)


def _row(v, like):
  """``v`` with leading unit axes to match ``like`` (rank promotion may be off)."""
  return jnp.reshape(v, (1,) * (like.ndim - 1) + v.shape)


def embed_apply(embed_params, x):
  """Flattens images ``[B, ...]`` and projects them to ``[B, width]``."""
  return _dense(embed_params, jnp.reshape(x, (x.shape[0], -1)))


def block_apply(block_params, h):
  """One residual block: ``h + Dense(gelu(Dense(LayerNorm(h))))``."""
  y = _layer_norm(block_params["norm"], h)
  y = jax.nn.gelu(_dense(block_params["dense_in"], y))
  return h + _dense(block_params["dense_out"], y)


def head_apply(head_params, h):
  """LayerNorm then the class logits ``[B, num_classes]``."""
  return _dense(head_params["dense"], _layer_norm(head_params["norm"], h))


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
