"""Input data as host numpy batches: the embedded digits set, tfds images, byte-level text.

Every dataset has ``num_train``, ``num_eval``, ``num_classes``,
``image_shape``, ``train_batches`` and ``eval_batches`` (see ``Dataset``);
the text sets (``TEXT_DATASETS``, `cdpjax.data.text`) yield ``"tokens"``
windows instead of images and labels.
The training stream is a pure function of ``(seed, step)``, so a resumed run
that passes ``start_step`` sees exactly the batches a straight run would.
"""
from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

TEXT_DATASETS = ("python_stdlib", "tiny_shakespeare", "lm1b")
"""Byte-level language-modelling corpora (`cdpjax.data.text`)."""
DATASETS = ("digits", "cifar10", "imagenet2012") + TEXT_DATASETS
"""Valid names for ``get_dataset``."""

Batch = dict[str, np.ndarray]


class Dataset(Protocol):
  """What the trainer needs from a dataset."""
  num_train: int
  num_eval: int
  num_classes: int
  image_shape: tuple[int, int, int]

  def train_batches(self, global_batch_size: int, seed: int, start_step: int = 0,
                    process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
    """Endless ``{"image": f32[b, H, W, C], "label": i32[b]}``, ``b = global // processes``."""

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    """One pass with ``"mask"`` (f32, 0 on padding rows); every batch is full size."""


def local_batch_size(global_batch_size: int, process_count: int) -> int:
  """The rows of a global batch that one process loads."""
  if global_batch_size < 1 or global_batch_size % process_count:
    raise ValueError(
        f"Batch size {global_batch_size} must be a positive multiple of the "
        f"process count {process_count}.")
  return global_batch_size // process_count


def get_dataset(name: str, data_dir: str | None = None, **kwargs) -> Dataset:
  """Builds a dataset by name.

  Args:
    name: one of ``DATASETS``.
    data_dir: tfds data directory (``None``: the tfds default); unused by digits.
    **kwargs: passed to the tfds datasets, e.g. ``download=True``; the text
      sets require ``seq_len`` and take ``eval_windows``.
  """
  # Imported here so that the digits path never pays for importing TensorFlow.
  if name == "digits":
    from cdpjax.data import digits
    return digits.Digits()
  if name in ("cifar10", "imagenet2012"):
    from cdpjax.data import tfds_pipeline
    return getattr(tfds_pipeline, name)(data_dir=data_dir, **kwargs)
  if name in TEXT_DATASETS:
    from cdpjax.data import text
    return text.get_text_dataset(name, data_dir=data_dir, **kwargs)
  raise ValueError(f"Unknown dataset {name!r}. Use one of {', '.join(DATASETS)}.")
