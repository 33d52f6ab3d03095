"""CIFAR-10 and ImageNet through tensorflow-datasets and tf.data.

Each process reads its own equal share of the train split
(``tfds.split_for_jax_process``), so a global batch is the concatenation of
the processes' local batches. Randomness is stateless and comes from the
arguments only: epoch ``e`` of process ``p`` shuffles files and examples with
a seed drawn from ``(seed, e, p)``, and the example at position ``i`` of that
epoch is augmented with stateless ops seeded by ``(that seed, i)``. A run that
resumes at ``start_step`` therefore rebuilds the current epoch and skips the
examples before the step (they are read and shuffled again, but not decoded
or augmented), and then yields exactly what a straight run yields.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, Iterator, NamedTuple
from unittest import mock

from etils import epath
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from cdpjax.data import Batch, local_batch_size

_AUTOTUNE = tf.data.AUTOTUNE


class DatasetNotPreparedError(FileNotFoundError):
  """The tfds dataset is not in ``data_dir`` and was not (or could not be) downloaded."""


class _Spec(NamedTuple):
  """What differs between the tfds datasets."""
  name: str
  eval_split: str
  num_classes: int
  image_shape: tuple[int, int, int]
  mean_rgb: tuple[float, float, float]
  std_rgb: tuple[float, float, float]
  shuffle_buffer: int
  decoders: dict | None
  train_image: Callable  # (stored image, stateless seed [2]) -> augmented image, 0..255.
  eval_image: Callable  # stored image -> image, 0..255.
  how_to_prepare: str  # Why it cannot be fetched here and the fix; ``{root}`` is the data_dir.


def _stateless_seeds(seed, num: int):
  return tf.unstack(tf.random.experimental.stateless_split(seed, num))


def _cifar_train_image(image, seed):
  """Zero-pad by 4, random 32x32 crop, random horizontal flip."""
  crop_seed, flip_seed = _stateless_seeds(seed, 2)
  image = tf.pad(image, [[4, 4], [4, 4], [0, 0]])
  image = tf.image.stateless_random_crop(image, [32, 32, 3], seed=crop_seed)
  return tf.image.stateless_random_flip_left_right(image, seed=flip_seed)


def _imagenet_train_image(jpeg, seed):
  """Inception-style crop (8%-100% of the area, aspect 3/4-4/3) to 224, random flip.

  Only the cropped window of the JPEG is decoded.
  """
  crop_seed, flip_seed = _stateless_seeds(seed, 2)
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.image.extract_jpeg_shape(jpeg), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
      seed=crop_seed, min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3),
      area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
  top, left, _ = tf.unstack(begin)
  height, width, _ = tf.unstack(size)
  image = tf.image.decode_and_crop_jpeg(jpeg, tf.stack([top, left, height, width]), channels=3)
  image = tf.image.resize(image, [224, 224], antialias=True)
  return tf.image.stateless_random_flip_left_right(image, seed=flip_seed)


def _imagenet_eval_image(jpeg):
  """Resize the shorter side to 256, then the central 224x224 crop."""
  image = tf.io.decode_jpeg(jpeg, channels=3)
  height_width = tf.cast(tf.shape(image)[:2], tf.float32)
  size = tf.cast(tf.round(height_width * 256.0 / tf.reduce_min(height_width)), tf.int32)
  image = tf.image.resize(image, size, antialias=True)
  return tf.image.resize_with_crop_or_pad(image, 224, 224)


_CIFAR10 = _Spec(
    name="cifar10", eval_split="test", num_classes=10, image_shape=(32, 32, 3),
    mean_rgb=(0.4914, 0.4822, 0.4465), std_rgb=(0.2470, 0.2435, 0.2616),
    shuffle_buffer=50_000, decoders=None,
    train_image=_cifar_train_image, eval_image=lambda image: image,
    how_to_prepare=(
        "tfds cannot download it without network access to the dataset host. To fix it, "
        "run `python -m cdpjax.data.tfds_pipeline cifar10 --data_dir={root}` (after "
        "`pip install -e \".[data]\"`; see the README's Data section) on a machine with "
        "network access and copy {root}/cifar10 here, or add --extracted_dir to that command "
        "to prepare it from a copy of the extracted archive; then pass "
        "--config.data_dir={root}."))

_IMAGENET2012 = _Spec(
    name="imagenet2012", eval_split="validation", num_classes=1000, image_shape=(224, 224, 3),
    mean_rgb=(0.485, 0.456, 0.406), std_rgb=(0.229, 0.224, 0.225),
    # JPEG bytes, about 110 KB each: roughly 1 GB of host memory per process.
    shuffle_buffer=10_000, decoders={"image": tfds.decode.SkipDecoding()},
    train_image=_imagenet_train_image, eval_image=_imagenet_eval_image,
    how_to_prepare=(
        "tfds never downloads ImageNet (and there may be no network to the dataset host "
        "here). To fix it, place ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar in "
        "{root}/downloads/manual, run `python -m cdpjax.data.tfds_pipeline imagenet2012 "
        "--data_dir={root}` (after `pip install -e \".[data]\"`; see the README's Data "
        "section) and pass --config.data_dir={root}."))


def _hide_accelerators_from_tf() -> None:
  """Keeps TensorFlow off the GPUs so that JAX gets all of their memory."""
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # TF already set up its devices; nothing can be hidden now.
    pass


class TfdsDataset:
  """A tfds image classification dataset; see ``cdpjax.data.Dataset``."""

  def __init__(self, spec: _Spec, data_dir: str | None = None, download: bool = False):
    """Opens the dataset and checks that it is prepared.

    Args:
      spec: which dataset and how to preprocess it.
      data_dir: the tfds data directory; ``None`` for the tfds default.
      download: try ``download_and_prepare`` first. Off by default: many
        processes must not download into one directory at once, and machines
        without network would only fail slowly.

    Raises:
      DatasetNotPreparedError: the data is not in ``data_dir`` (and the
        download, if asked for, failed). The message says how to fix it.
    """
    _hide_accelerators_from_tf()
    self._spec = spec
    self._builder = tfds.builder(spec.name, data_dir=data_dir)
    if download:
      try:
        self._builder.download_and_prepare()
      except Exception as e:  # Network, manual-download or disk errors alike.
        raise self._not_prepared(f"download_and_prepare failed ({type(e).__name__}: {e})") from e
    self.num_train = self._num_examples("train")
    self.num_eval = self._num_examples(spec.eval_split)
    self.num_classes = spec.num_classes
    self.image_shape = spec.image_shape

  def _not_prepared(self, why: str) -> DatasetNotPreparedError:
    root = epath.Path(self._builder.data_dir).parent.parent  # <root>/<name>/<version>
    return DatasetNotPreparedError(
        f"tfds dataset {self._spec.name!r} is not prepared in {self._builder.data_dir}: {why}. "
        + self._spec.how_to_prepare.format(root=root))

  def _read(self, split, shuffle_seed: int | None = None) -> tf.data.Dataset:
    try:
      return self._builder.as_dataset(
          split=split, shuffle_files=shuffle_seed is not None, decoders=self._spec.decoders,
          read_config=tfds.ReadConfig(shuffle_seed=shuffle_seed))
    except AssertionError as e:  # How tfds reports missing prepared files.
      raise self._not_prepared("no prepared files were found") from e

  def _num_examples(self, split) -> int:
    return int(self._read(split).cardinality())

  def _normalise(self, image):
    image = tf.cast(image, tf.float32) / 255.0
    return (image - tf.constant(self._spec.mean_rgb)) / tf.constant(self._spec.std_rgb)

  def train_batches(self, global_batch_size: int, seed: int, start_step: int = 0,
                    process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
    """Endless augmented training batches of this process, from ``start_step`` on.

    Every epoch drops its last partial batch; all processes have the same
    number of steps per epoch.
    """
    local = local_batch_size(global_batch_size, process_count)
    split = tfds.split_for_jax_process(
        "train", process_index=process_index, process_count=process_count, drop_remainder=True)
    steps_per_epoch = self._num_examples(split) // local
    if steps_per_epoch == 0:
      raise ValueError(
          f"Local batch size {local} exceeds this process's share of {self.num_train} images.")
    epoch, step_in_epoch = divmod(start_step, steps_per_epoch)
    while True:
      epoch_seed = int(np.random.SeedSequence([seed, epoch, process_index]).generate_state(1)[0])
      ds = self._read(split, shuffle_seed=epoch_seed)
      ds = ds.shuffle(self._spec.shuffle_buffer, seed=epoch_seed)
      ds = ds.take(steps_per_epoch * local).enumerate().skip(step_in_epoch * local)

      def prepare(index, example, epoch_seed=epoch_seed):
        example_seed = tf.stack([tf.constant(epoch_seed, tf.int64), index])
        image = self._spec.train_image(example["image"], example_seed)
        return {"image": self._normalise(image), "label": tf.cast(example["label"], tf.int32)}

      ds = ds.map(prepare, num_parallel_calls=_AUTOTUNE).batch(local, drop_remainder=True)
      yield from ds.prefetch(_AUTOTUNE).as_numpy_iterator()
      epoch, step_in_epoch = epoch + 1, 0

  def eval_batches(self, batch_size: int, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    """This process's share of the eval split, padded to whole local batches.

    Shards differ by at most one example; every process yields the same number
    of batches, padding (``mask`` 0) where its shard runs out.
    """
    local = local_batch_size(batch_size, process_count)
    split = tfds.split_for_jax_process(
        self._spec.eval_split, process_index=process_index, process_count=process_count,
        drop_remainder=False)
    largest_shard = -(-self.num_eval // process_count)
    num_rows = -(-largest_shard // local) * local

    def prepare(example):
      return {"image": self._normalise(self._spec.eval_image(example["image"])),
              "label": tf.cast(example["label"], tf.int32), "mask": tf.constant(1.0)}

    padding = {"image": tf.zeros(self._spec.image_shape), "label": tf.constant(0, tf.int32),
               "mask": tf.constant(0.0)}
    ds = self._read(split).map(prepare, num_parallel_calls=_AUTOTUNE)
    ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat()).take(num_rows)
    return ds.batch(local).prefetch(_AUTOTUNE).as_numpy_iterator()


def cifar10(data_dir: str | None = None, download: bool = False) -> TfdsDataset:
  """CIFAR-10: pad-and-crop and flip for training, per-channel normalisation."""
  return TfdsDataset(_CIFAR10, data_dir, download)


def imagenet2012(data_dir: str | None = None, download: bool = False) -> TfdsDataset:
  """ImageNet-1k: inception crop and flip for training, resize 256 + center 224 for eval."""
  return TfdsDataset(_IMAGENET2012, data_dir, download)


PREPARABLE = ("cifar10", "imagenet2012", "tiny_shakespeare", "lm1b")
"""The tfds datasets the trainer reads, which `prepare` prepares."""


def prepare(name: str, data_dir: str | None = None, extracted_dir: str | None = None) -> None:
  """Downloads and prepares a tfds dataset in ``data_dir`` (what ``tfds build`` does).

  The tfds command line imports ``apache_beam`` for every command (tfds
  4.9), which no plain install brings; this is the same preparation
  without it. ``download_and_prepare`` itself needs ``importlib_resources``:
  ``pip install -e ".[data]"``.

  Args:
    name: one of `PREPARABLE`: ``cifar10``, ``imagenet2012`` or a text set of
      ``cdpjax.data.text`` (``tiny_shakespeare``, ``lm1b``).
    data_dir: the tfds data directory; ``None`` for the tfds default.
    extracted_dir: for a machine without network access: a directory that
      holds what the dataset's archive extracts to (for CIFAR-10,
      ``cifar-10-batches-bin/``), used instead of downloading it.
  """
  if name not in PREPARABLE:
    raise ValueError(f"Unknown dataset {name!r}: prepare one of {', '.join(PREPARABLE)}.")
  builder = tfds.builder(name, data_dir=data_dir)
  if extracted_dir is None:
    builder.download_and_prepare()
    return
  if not os.path.isdir(extracted_dir):
    raise FileNotFoundError(f"--extracted_dir {extracted_dir} is not a directory.")
  # The builder asks its download manager for the extracted archive: hand it ours.
  with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                         lambda self, url: os.path.abspath(extracted_dir)):
    builder.download_and_prepare()


def main(argv=None) -> None:
  """``python -m cdpjax.data.tfds_pipeline cifar10 --data_dir DIR [--extracted_dir DIR]``."""
  parser = argparse.ArgumentParser(description=prepare.__doc__.splitlines()[0])
  parser.add_argument("name", choices=PREPARABLE)
  parser.add_argument("--data_dir", default=None, help="tfds data directory (default: tfds's).")
  parser.add_argument("--extracted_dir", default=None,
                      help="the extracted archive, instead of downloading it")
  args = parser.parse_args(argv)
  prepare(args.name, args.data_dir, args.extracted_dir)
  print(f"Prepared {args.name} in {tfds.builder(args.name, data_dir=args.data_dir).data_dir}.")


if __name__ == "__main__":
  main()
