"""Byte-level text for language modelling: the Python standard library offline, tfds text sets.

Every corpus is two byte streams, train and eval; tokens are bytes (vocabulary
256), so the eval loss in nats per token divided by ln 2 is bits per byte.

- ``python_stdlib``: the top-level ``*.py`` files of the running Python's
  standard library (``sysconfig.get_paths()["stdlib"]``), which every
  installation has. A file goes to eval when the CRC-32 of its name is 0
  modulo 10, so the split depends neither on file-system order nor on which
  other files exist. CPython 3.11.7: 168 files, 4,698,388 bytes; 4,186,571
  train bytes (152 files) and 511,817 eval bytes (16 files).
- ``tiny_shakespeare`` (train / validation) and ``lm1b`` (train / test)
  through tensorflow-datasets, once prepared: the examples' ``text`` joined
  by newlines and held in host memory (lm1b's train split is about 4 GB).

A training batch is ``{"tokens": int32[b, seq_len + 1]}``: windows starting at
offsets drawn uniformly from ``(seed, step)``, so the stream is a pure
function of the step and a resumed run sees exactly the straight run's
batches. Worker ``i`` of a step takes rows ``i*b:(i+1)*b`` of the global
batch. Evaluation uses fixed windows at stride ``seq_len`` (every eval token
is predicted once), evenly thinned to ``eval_windows``.
"""
from __future__ import annotations

import math
import os
import sysconfig
import zlib
from typing import Iterator

import numpy as np

from cdpjax.data import Batch, local_batch_size

VOCAB_SIZE = 256
TFDS_SPLITS = {"tiny_shakespeare": ("train", "validation"), "lm1b": ("train", "test")}
"""tfds text sets: (train split, eval split)."""
EVAL_EVERY_NTH = 10  # Files with crc32(name) % 10 == 0 are eval files.


def python_stdlib_files(root: str | None = None) -> tuple[list[str], list[str]]:
  """Sorted names of the train and eval files of the ``python_stdlib`` corpus."""
  root = root or sysconfig.get_paths()["stdlib"]
  names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
  if not names:
    raise FileNotFoundError(
        f"No *.py files in the Python standard library folder {root}: this Python ships without "
        "its sources. Use --config.dataset=tiny_shakespeare with a prepared tfds data_dir.")
  is_eval = [zlib.crc32(n.encode()) % EVAL_EVERY_NTH == 0 for n in names]
  return ([n for n, e in zip(names, is_eval) if not e], [n for n, e in zip(names, is_eval) if e])


def python_stdlib_corpus(root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The train and eval byte streams (uint8) of the ``python_stdlib`` corpus."""
  root = root or sysconfig.get_paths()["stdlib"]

  def read(names):
    chunks = []
    for name in names:
      with open(os.path.join(root, name), "rb") as f:
        chunks.append(f.read())
    return np.frombuffer(b"".join(chunks), np.uint8)

  train, evaluation = python_stdlib_files(root)
  return read(train), read(evaluation)


def tfds_corpus(name: str, data_dir: str | None = None,
                download: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """The train and eval byte streams of a tfds text set (``TFDS_SPLITS``)."""
  # Imported here: the offline corpus never pays for TensorFlow.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from cdpjax.data.tfds_pipeline import DatasetNotPreparedError  # pylint: disable=g-import-not-at-top
  builder = tfds.builder(name, data_dir=data_dir)
  if download:
    builder.download_and_prepare()

  def read(split):
    try:
      ds = builder.as_dataset(split=split, shuffle_files=False)
    except AssertionError as e:  # How tfds reports missing prepared files.
      root = os.path.dirname(os.path.dirname(str(builder.data_dir)))  # <root>/<name>/<version>
      raise DatasetNotPreparedError(
          f"tfds dataset {name!r} is not prepared in {builder.data_dir}. To fix it, on a machine "
          f"with network access run `python -m cdpjax.data.tfds_pipeline {name} --data_dir {root}` "
          f"(see the README's Data section), copy {root}/{name} "
          f"here and pass --config.data_dir={root}; or use the offline "
          "--config.dataset=python_stdlib.") from e
    return np.frombuffer(b"\n".join(ex["text"] for ex in ds.as_numpy_iterator()), np.uint8)

  train_split, eval_split = TFDS_SPLITS[name]
  return read(train_split), read(eval_split)


class TextDataset:
  """Byte windows of a train and an eval stream; see ``cdpjax.data.Dataset``.

  ``num_train`` counts non-overlapping training windows (one "epoch" reads
  about every train byte once); ``num_eval`` counts eval windows.
  """
  num_classes = VOCAB_SIZE

  def __init__(self, train_bytes: np.ndarray, eval_bytes: np.ndarray, *, seq_len: int,
               eval_windows: int = 0):
    """Holds the streams.

    Args:
      train_bytes, eval_bytes: uint8 streams.
      seq_len: tokens the model reads; windows hold ``seq_len + 1`` tokens.
      eval_windows: evaluate this many windows, evenly spread over the eval
        stream (0: all of them).
    """
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    for split, stream in (("train", train_bytes), ("eval", eval_bytes)):
      if len(stream) < seq_len + 1:
        raise ValueError(f"The {split} text has {len(stream)} bytes, fewer than seq_len + 1 = "
                         f"{seq_len + 1}: lower --config.model_kwargs.seq_len.")
    self.train_bytes, self.eval_bytes = train_bytes, eval_bytes
    self.seq_len = seq_len
    self.image_shape = (seq_len,)  # The model input of one example.
    starts = np.arange(0, len(eval_bytes) - seq_len, seq_len)
    if 0 < eval_windows < len(starts):
      starts = starts[np.linspace(0, len(starts) - 1, eval_windows).round().astype(int)]
    self._eval_starts = starts
    self.num_train = len(train_bytes) // (seq_len + 1)
    self.num_eval = len(starts)

  def _windows(self, stream: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return stream[starts[:, None] + np.arange(self.seq_len + 1)[None, :]].astype(np.int32)

  def train_batches(self, global_batch_size: int, seed: int, start_step: int = 0,
                    process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
    """Endless ``{"tokens": int32[b, seq_len + 1]}`` from ``start_step`` on (this process's rows)."""
    local = local_batch_size(global_batch_size, process_count)
    step = start_step
    while True:
      starts = np.random.default_rng([seed, step]).integers(
          0, len(self.train_bytes) - self.seq_len, size=global_batch_size)
      rows = starts[process_index * local:(process_index + 1) * local]
      yield {"tokens": self._windows(self.train_bytes, rows)}
      step += 1

  def eval_windows(self) -> np.ndarray:
    """The eval windows ``int32[num_eval, seq_len + 1]``, in order."""
    return self._windows(self.eval_bytes, self._eval_starts)

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    """The eval windows zero-padded to whole global batches, with ``mask`` 0 on padding."""
    local = local_batch_size(batch_size, process_count)
    num_batches = -(-self.num_eval // batch_size)
    padding = num_batches * batch_size - self.num_eval
    tokens = np.concatenate([self.eval_windows(),
                             np.zeros((padding, self.seq_len + 1), np.int32)])
    mask = np.concatenate([np.ones(self.num_eval, np.float32), np.zeros(padding, np.float32)])
    for i in range(num_batches):
      start = i * batch_size + process_index * local
      rows = slice(start, start + local)
      yield {"tokens": tokens[rows], "mask": mask[rows]}

  def bigram_baseline(self) -> dict[str, float]:
    """A bigram model of the train bytes on the eval targets: the floor a LM must beat.

    Counts of ``(byte, next byte)`` over the whole train stream, add-one
    smoothed, scored on exactly the (input, target) pairs the eval loss
    averages over. Returns ``loss`` (nats per byte) and ``bits_per_byte``.
    """
    pairs = self.train_bytes[:-1].astype(np.int64) * VOCAB_SIZE + self.train_bytes[1:]
    counts = np.bincount(pairs, minlength=VOCAB_SIZE * VOCAB_SIZE).reshape(VOCAB_SIZE, VOCAB_SIZE)
    log_probs = np.log(counts + 1.0) - np.log(counts.sum(1, keepdims=True) + VOCAB_SIZE)
    windows = self.eval_windows()
    loss = float(-log_probs[windows[:, :-1], windows[:, 1:]].mean())
    return {"loss": loss, "bits_per_byte": loss / math.log(2)}


def get_text_dataset(name: str, *, seq_len: int, eval_windows: int = 0,
                     data_dir: str | None = None, download: bool = False) -> TextDataset:
  """``python_stdlib`` (offline) or a tfds text set, as byte windows of ``seq_len + 1``."""
  if name == "python_stdlib":
    train, evaluation = python_stdlib_corpus()
  elif name in TFDS_SPLITS:
    train, evaluation = tfds_corpus(name, data_dir, download)
  else:
    raise ValueError(f"Unknown text dataset {name!r}: use python_stdlib or one of "
                     f"{', '.join(TFDS_SPLITS)}.")
  return TextDataset(train, evaluation, seq_len=seq_len, eval_windows=eval_windows)
