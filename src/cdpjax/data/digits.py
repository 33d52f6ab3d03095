"""scikit-learn's bundled 8x8 digits: the offline default dataset.

1,797 images of 10 classes, split once (stratified, seed 0) into 1,437 train
and 360 test images, normalised with the train pixels' mean and std. No
augmentation, so a batch depends only on the epoch's permutation.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
from sklearn import datasets, model_selection

from cdpjax.data import Batch, local_batch_size

NUM_TEST = 360
_SPLIT_SEED = 0


class Digits:
  """The digits split held in host memory; see ``cdpjax.data.Dataset``."""
  num_classes = 10
  image_shape = (8, 8, 1)

  def __init__(self):
    images, labels = datasets.load_digits(return_X_y=True)
    train_x, test_x, self._train_y, self._test_y = model_selection.train_test_split(
        images, labels.astype(np.int32), test_size=NUM_TEST, stratify=labels,
        random_state=_SPLIT_SEED)
    mean, std = train_x.mean(), train_x.std()
    self._train_x = self._as_images((train_x - mean) / std)
    self._test_x = self._as_images((test_x - mean) / std)
    self.num_train = len(self._train_y)
    self.num_eval = len(self._test_y)

  def _as_images(self, rows) -> np.ndarray:
    return rows.reshape(-1, *self.image_shape).astype(np.float32)

  def train_batches(self, global_batch_size: int, seed: int, start_step: int = 0,
                    process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
    """Endless training batches from ``start_step`` on.

    Epoch ``e`` visits the train set in the permutation drawn from
    ``(seed, e)`` and drops its last partial batch. Process ``p`` gets rows
    ``p*b:(p+1)*b`` of each global batch, ``b = global_batch_size // process_count``.
    """
    local = local_batch_size(global_batch_size, process_count)
    steps_per_epoch = self.num_train // global_batch_size
    if steps_per_epoch == 0:
      raise ValueError(
          f"Batch size {global_batch_size} exceeds the {self.num_train} training images.")
    epoch, step_in_epoch = divmod(start_step, steps_per_epoch)
    while True:
      order = np.random.default_rng([seed, epoch]).permutation(self.num_train)
      for step in range(step_in_epoch, steps_per_epoch):
        rows = order[step * global_batch_size:(step + 1) * global_batch_size]
        rows = rows[process_index * local:(process_index + 1) * local]
        yield {"image": self._train_x[rows], "label": self._train_y[rows]}
      epoch, step_in_epoch = epoch + 1, 0

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    """The test set in a fixed order, zero-padded to whole global batches."""
    local = local_batch_size(batch_size, process_count)
    num_batches = -(-self.num_eval // batch_size)
    padding = num_batches * batch_size - self.num_eval
    images = np.concatenate([self._test_x, np.zeros((padding, *self.image_shape), np.float32)])
    labels = np.concatenate([self._test_y, np.zeros(padding, np.int32)])
    mask = np.concatenate([np.ones(self.num_eval, np.float32), np.zeros(padding, np.float32)])
    for i in range(num_batches):
      start = i * batch_size + process_index * local
      rows = slice(start, start + local)
      yield {"image": images[rows], "label": labels[rows], "mask": mask[rows]}
