"""What differs between image classification and language modelling, for the trainer.

A ``Task`` bundles the dataset and model of a config with pure functions on
a batch: the model input, one worker's mean loss, and the sums an evaluation
accumulates. The trainer (`cdpjax.train`) is the same for both.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cdpjax import data, models


class Task(NamedTuple):
  """The data, model and per-batch functions of one kind of training."""
  dataset: Any                              # cdpjax.data.Dataset.
  model: Any                                # flax module, ``apply(variables, x, train=...)``.
  sample_input: Any                         # A batch of one model input, for init and stages.
  inputs: Callable[[dict], Any]             # batch -> model input.
  loss: Callable[[Any, dict], Any]          # (logits, batch) -> mean loss of the batch.
  pairs: Callable[[dict], dict]             # train batch -> {"image": input, "label": target}.
  eval_sums: Callable[[Any, dict], tuple]   # (logits, masked batch) -> sums to accumulate.
  eval_metrics: Callable[[np.ndarray], dict]  # accumulated sums -> ``eval/...`` metrics.
  tokens_per_example: int                   # For tokens per second; 0 for images.
  baseline: dict                            # Metrics to log once, before training.


def build(c: ml_collections.ConfigDict, model_kwargs: dict | None = None) -> Task:
  """The task of ``c.dataset``: language modelling for text sets, else classification.

  ``model_kwargs`` (default ``c.model_kwargs``) are the options of ``c.model``.
  """
  kwargs = dict(c.model_kwargs if model_kwargs is None else model_kwargs)
  if c.dataset in data.TEXT_DATASETS:
    return _language_model(c, kwargs)
  return _classification(c, kwargs)


def _cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy over every position: ``[b, C]`` images, ``[b, L, V]`` text.

  The loss every executor applies to the ``{"image", "label"}`` pairs of `Task.pairs`.
  """
  return _cross_entropy(logits, labels).mean()


def _classification(c, model_kwargs: dict) -> Task:
  dataset = data.get_dataset(c.dataset, data_dir=c.data_dir or None)

  def eval_sums(logits, batch):
    m = batch["mask"]
    correct = jnp.argmax(logits, -1) == batch["label"]
    return (jnp.sum(correct * m), jnp.sum(_cross_entropy(logits, batch["label"]) * m),
            jnp.sum(m))

  def eval_metrics(totals):
    correct, loss, count = totals
    return {"eval/accuracy": float(correct / count), "eval/loss": float(loss / count)}

  return Task(
      dataset=dataset,
      model=models.create_model(c.model, dataset.num_classes, **model_kwargs),
      sample_input=jnp.zeros((1,) + tuple(dataset.image_shape), jnp.float32),
      inputs=lambda batch: batch["image"],
      loss=lambda logits, batch: cross_entropy(logits, batch["label"]),
      pairs=lambda batch: {"image": batch["image"], "label": batch["label"]},
      eval_sums=eval_sums, eval_metrics=eval_metrics, tokens_per_example=0, baseline={})


def _language_model(c, model_kwargs: dict) -> Task:
  """Next-byte prediction on windows ``tokens[:, :seq_len + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
  if c.model != "transformer":
    raise ValueError(f"dataset={c.dataset!r} is text: set --config.model=transformer "
                     "(or use configs/lm.py).")
  seq_len = c.model_kwargs.seq_len
  dataset = data.get_dataset(c.dataset, data_dir=c.data_dir or None, seq_len=seq_len,
                             eval_windows=c.get("eval_windows", 0))

  def eval_sums(logits, batch):
    losses = _cross_entropy(logits, batch["tokens"][:, 1:]) * batch["mask"][:, None]
    return jnp.sum(losses), jnp.sum(batch["mask"]) * seq_len

  def eval_metrics(totals):
    loss = float(totals[0] / totals[1])
    return {"eval/loss": loss, "eval/bits_per_byte": loss / math.log(2)}

  bigram = dataset.bigram_baseline()
  return Task(
      dataset=dataset,
      model=models.create_model(c.model, dataset.num_classes, **model_kwargs),
      sample_input=jnp.zeros((1, seq_len), jnp.int32),
      inputs=lambda batch: batch["tokens"][:, :-1],
      loss=lambda logits, batch: cross_entropy(logits, batch["tokens"][:, 1:]),
      pairs=lambda batch: {"image": batch["tokens"][:, :-1], "label": batch["tokens"][:, 1:]},
      eval_sums=eval_sums, eval_metrics=eval_metrics, tokens_per_example=seq_len,
      baseline={"baseline/bigram_loss": bigram["loss"],
                "baseline/bigram_bits_per_byte": bigram["bits_per_byte"]})
