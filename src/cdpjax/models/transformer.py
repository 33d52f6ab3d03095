"""A decoder-only (GPT-style) transformer language model of identical blocks.

The root module calls three kinds of top-level units, in this order:
``embed`` (token and, for learned positions, position embeddings),
``block_0`` ... ``block_{L-1}`` (identical pre-LayerNorm blocks: causal
self-attention, then an MLP, each added to the residual stream) and ``head``
(a final LayerNorm and the logits). `cdpjax.stages` cuts them into stages
of consecutive units, so the embedding is on the first stage and the head on
the last. Every unit is a flax module that can be applied on its own
(``Embed``, ``Block``, ``Head``), which is how a pipeline runs one stage.

With ``tie_embeddings`` the head multiplies by the transposed token table of
``embed`` instead of owning a kernel: that table then belongs to the first
stage, and the head's use of it reads the first stage's parameter version.

``dtype="bfloat16"`` computes matrix products in bfloat16 while parameters
(and so the optimizer state) stay float32; LayerNorm statistics, the
attention softmax and the logits are computed in float32.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

POSITIONS = ("learned", "rotary")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_INIT_STD = 0.02  # GPT-2's initialisation.
_LN_EPSILON = 1e-5


def _dense(features, dtype, name, std=_INIT_STD):
  return nn.Dense(features, dtype=dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=nn.initializers.normal(std))


def _layer_norm(name):
  # Statistics in float32 whatever the compute dtype (flax upcasts for them).
  return nn.LayerNorm(epsilon=_LN_EPSILON, dtype=jnp.float32, param_dtype=jnp.float32, name=name)


def rotary(x_BxTxHxK):
  """Rotary position embedding (RoFormer) of queries or keys, in float32."""
  _, t, _, k = x_BxTxHxK.shape
  if k % 2:
    raise ValueError(f"Rotary positions need an even head size, got d_model/num_heads = {k}.")
  freq_F = 1.0 / (10000.0 ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
  angle_TxF = jnp.arange(t, dtype=jnp.float32)[:, None] * freq_F[None, :]
  cos = jnp.cos(angle_TxF)[None, :, None, :]
  sin = jnp.sin(angle_TxF)[None, :, None, :]
  x = x_BxTxHxK.astype(jnp.float32)
  even, odd = x[..., 0::2], x[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return rotated.reshape(x.shape).astype(x_BxTxHxK.dtype)


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention where position ``t`` sees positions ``<= t``."""
  d_model: int
  num_heads: int
  num_layers: int
  positions: str
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, h_BxTxD):
    b, t, d = h_BxTxD.shape
    k = d // self.num_heads
    qkv = _dense(3 * d, self.dtype, "qkv")(h_BxTxD).reshape(b, t, 3, self.num_heads, k)
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.positions == "rotary":
      q_BxTxHxK, k_BxTxHxK = rotary(q_BxTxHxK), rotary(k_BxTxHxK)
    scores_BxHxTxT = jnp.einsum("bqhk,bshk->bhqs", q_BxTxHxK, k_BxTxHxK).astype(jnp.float32)
    scores_BxHxTxT = scores_BxHxTxT / math.sqrt(k)
    causal_TxT = jnp.tril(jnp.ones((t, t), bool))
    scores_BxHxTxT = jnp.where(causal_TxT[None, None], scores_BxHxTxT,
                               jnp.finfo(jnp.float32).min)
    probs_BxHxTxT = jax.nn.softmax(scores_BxHxTxT, axis=-1).astype(self.dtype)
    out_BxTxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxTxT, v_BxTxHxK)
    # GPT-2 scales the residual projections by 1/sqrt(2 L) so the stream's
    # variance does not grow with depth.
    return _dense(d, self.dtype, "out", _INIT_STD / math.sqrt(2 * self.num_layers))(
        out_BxTxHxK.reshape(b, t, d))


class Block(nn.Module):
  """Pre-LN block: ``h + attn(LN(h))``, then ``h + MLP(LN(h))`` (gelu)."""
  d_model: int
  num_heads: int
  d_ff: int
  num_layers: int
  positions: str = "learned"
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, h_BxTxD):
    y = _layer_norm("norm_attn")(h_BxTxD)
    h_BxTxD = h_BxTxD + CausalSelfAttention(
        self.d_model, self.num_heads, self.num_layers, self.positions, self.dtype,
        name="attn")(y).astype(h_BxTxD.dtype)
    y = jax.nn.gelu(_dense(self.d_ff, self.dtype, "mlp_in")(_layer_norm("norm_mlp")(h_BxTxD)))
    y = _dense(self.d_model, self.dtype, "mlp_out", _INIT_STD / math.sqrt(2 * self.num_layers))(y)
    return h_BxTxD + y.astype(h_BxTxD.dtype)


class Embed(nn.Module):
  """Token embedding plus, for learned positions, a position embedding; float32 out."""
  vocab_size: int
  d_model: int
  seq_len: int
  positions: str = "learned"
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    init = nn.initializers.normal(_INIT_STD)
    self.tokens = nn.Embed(self.vocab_size, self.d_model, embedding_init=init,
                           param_dtype=jnp.float32, dtype=self.dtype)
    if self.positions == "learned":
      # A submodule, read in __call__, so the table is looked up only when the
      # unit runs: the executed timetables run the model with one stage's
      # parameters, and a setup-time param of another stage would be missing.
      self.position = nn.Embed(self.seq_len, self.d_model, embedding_init=init,
                               param_dtype=jnp.float32)

  def __call__(self, tokens_BxT):
    t = tokens_BxT.shape[1]
    if t > self.seq_len:
      raise ValueError(f"Sequence of {t} tokens is longer than seq_len={self.seq_len}.")
    h_BxTxD = self.tokens(tokens_BxT).astype(jnp.float32)
    if self.positions == "learned":
      h_BxTxD = h_BxTxD + self.position.embedding[None, :t]
    return h_BxTxD

  def attend(self, h_BxTxD):
    """Logits with the transposed token table (weight tying)."""
    return self.tokens.attend(h_BxTxD.astype(self.dtype))


class Head(nn.Module):
  """Final LayerNorm, then float32 logits (from its own kernel or a tied table)."""
  vocab_size: int
  tied: bool = False
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, h_BxTxD, embed: Embed | None = None):
    y = _layer_norm("norm")(h_BxTxD)
    if self.tied:
      return embed.attend(y).astype(jnp.float32)
    return _dense(self.vocab_size, self.dtype, "dense")(y).astype(jnp.float32)


class Transformer(nn.Module):
  """Decoder-only transformer: ``embed``, ``num_layers`` identical blocks, ``head``.

  Called on int tokens ``[B, T]`` (``T <= seq_len``), it returns float32
  next-token logits ``[B, T, vocab_size]``.

  Attributes:
    vocab_size: number of token ids (256 for bytes).
    num_layers: number of blocks ``L``.
    d_model: residual stream width.
    num_heads: attention heads (``d_model`` must be a multiple).
    d_ff: MLP inner width.
    seq_len: the longest input (the size of the learned position table).
    positions: ``learned`` (a table added to the embedding) or ``rotary``.
    tie_embeddings: whether the head uses the token table instead of a kernel.
    dtype: compute dtype name, ``float32`` or ``bfloat16``; parameters are float32.
  """
  vocab_size: int = 256
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 4
  d_ff: int = 512
  seq_len: int = 128
  positions: str = "learned"
  tie_embeddings: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    if self.positions not in POSITIONS:
      raise ValueError(f"Unknown positions {self.positions!r}: use one of {POSITIONS}.")
    if self.dtype not in DTYPES:
      raise ValueError(f"Unknown dtype {self.dtype!r}: use one of {tuple(DTYPES)}.")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}.")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens_BxT, train: bool = False):
    del train  # No dropout; accepted so all models share one signature.
    dtype = DTYPES[self.dtype]
    embed = Embed(self.vocab_size, self.d_model, self.seq_len, self.positions, dtype, name="embed")
    h_BxTxD = embed(tokens_BxT)
    for i in range(self.num_layers):
      h_BxTxD = Block(self.d_model, self.num_heads, self.d_ff, self.num_layers, self.positions,
                      dtype, name=f"block_{i}")(h_BxTxD)
    head = Head(self.vocab_size, self.tie_embeddings, dtype, name="head")
    return head(h_BxTxD, embed if self.tie_embeddings else None)

