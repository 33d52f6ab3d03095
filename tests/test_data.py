"""Data: the digits split, exact resume, process sharding, tfds under mock_data."""
import itertools

import numpy as np
import pytest
import tensorflow_datasets as tfds

from cdpjax import data
from cdpjax.data import digits, tfds_pipeline


def _take(iterator, n):
  return list(itertools.islice(iterator, n))


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


@pytest.fixture(scope="module")
def digits_data():
  return data.get_dataset("digits")


def test_get_dataset_names_valid_datasets():
  with pytest.raises(ValueError, match="digits, cifar10, imagenet2012"):
    data.get_dataset("mnist")


def test_digits_split_and_normalisation(digits_data):
  assert (digits_data.num_train, digits_data.num_eval) == (1437, digits.NUM_TEST)
  assert digits_data.image_shape == (8, 8, 1) and digits_data.num_classes == 10
  (batch,) = _take(digits_data.train_batches(1437, seed=0), 1)
  assert batch["image"].shape == (1437, 8, 8, 1) and batch["image"].dtype == np.float32
  assert batch["label"].dtype == np.int32
  assert abs(batch["image"].mean()) < 1e-5 and abs(batch["image"].std() - 1) < 1e-5
  # Stratified: each class is about a tenth of the 360 test images.
  test_labels = np.concatenate([b["label"] for b in digits_data.eval_batches(360)])
  assert np.bincount(test_labels).min() >= 35


def test_digits_stream_is_a_function_of_seed_and_step(digits_data):
  # 1437 // 500 = 2 steps per epoch: seven steps cross three epoch boundaries.
  straight = _take(digits_data.train_batches(500, seed=3), 7)
  _assert_same_batches(straight, _take(digits_data.train_batches(500, seed=3), 7))
  for start in (1, 2, 5):
    _assert_same_batches(
        straight[start:], _take(digits_data.train_batches(500, seed=3, start_step=start), 7 - start))
  other_seed = _take(digits_data.train_batches(500, seed=4), 1)
  assert not np.array_equal(other_seed[0]["label"], straight[0]["label"])


def test_digits_process_shards_concatenate_to_the_global_batch(digits_data):
  global_batches = _take(digits_data.train_batches(64, seed=1, start_step=30), 3)
  shards = [_take(digits_data.train_batches(64, seed=1, start_step=30, process_index=p,
                                            process_count=2), 3) for p in range(2)]
  for step, batch in enumerate(global_batches):
    for key in batch:
      np.testing.assert_array_equal(
          batch[key], np.concatenate([shards[0][step][key], shards[1][step][key]]))
  with pytest.raises(ValueError, match="multiple of the process count"):
    next(digits_data.train_batches(63, seed=1, process_count=2))


def test_digits_eval_pads_the_last_batch(digits_data):
  batches = list(digits_data.eval_batches(100))
  assert [b["image"].shape for b in batches] == [(100, 8, 8, 1)] * 4
  assert [b["mask"].sum() for b in batches] == [100, 100, 100, 60]
  assert batches[-1]["mask"].dtype == np.float32
  shards = [list(digits_data.eval_batches(100, p, 2)) for p in range(2)]
  for i, batch in enumerate(batches):
    np.testing.assert_array_equal(batch["mask"], np.concatenate([s[i]["mask"] for s in shards]))


@pytest.fixture
def mock_tfds():
  """Random stand-in examples (train and eval alike); nothing is read or downloaded."""
  with tfds.testing.mock_data(num_examples=20):
    yield


def test_cifar10_stream_is_a_function_of_seed_and_step(mock_tfds, tmp_path):
  cifar = data.get_dataset("cifar10", data_dir=str(tmp_path))
  assert (cifar.num_train, cifar.num_classes, cifar.image_shape) == (20, 10, (32, 32, 3))
  # 20 // 8 = 2 steps per epoch: five steps cross two epoch boundaries.
  straight = _take(cifar.train_batches(8, seed=0), 5)
  batch = straight[0]
  assert batch["image"].shape == (8, 32, 32, 3) and batch["image"].dtype == np.float32
  assert batch["label"].shape == (8,) and batch["label"].dtype == np.int32
  assert np.isfinite(batch["image"]).all() and abs(batch["image"].mean()) < 1.5
  _assert_same_batches(straight, _take(cifar.train_batches(8, seed=0), 5))
  _assert_same_batches(straight[3:], _take(cifar.train_batches(8, seed=0, start_step=3), 2))
  assert not np.array_equal(_take(cifar.train_batches(8, seed=1), 1)[0]["image"], batch["image"])
  (shard,) = _take(cifar.train_batches(8, seed=0, process_index=1, process_count=2), 1)
  assert shard["image"].shape == (4, 32, 32, 3)


def test_cifar10_eval_pads_the_last_batch(mock_tfds, tmp_path):
  batches = list(data.get_dataset("cifar10", data_dir=str(tmp_path)).eval_batches(8))
  assert [b["image"].shape for b in batches] == [(8, 32, 32, 3)] * 3
  np.testing.assert_array_equal(batches[-1]["mask"], [1, 1, 1, 1, 0, 0, 0, 0])
  assert batches[-1]["mask"].dtype == np.float32 and batches[-1]["label"].dtype == np.int32
  assert not batches[-1]["image"][4:].any()


def test_imagenet2012_batches(mock_tfds, tmp_path):
  imagenet = data.get_dataset("imagenet2012", data_dir=str(tmp_path))
  assert imagenet.num_classes == 1000
  (train,) = _take(imagenet.train_batches(2, seed=0), 1)
  (evaluation,) = _take(imagenet.eval_batches(2), 1)
  for batch in (train, evaluation):
    assert batch["image"].shape == (2, 224, 224, 3) and batch["image"].dtype == np.float32
    assert np.isfinite(batch["image"]).all()


@pytest.mark.parametrize("name,fix", [
    ("cifar10", "python -m cdpjax.data.tfds_pipeline cifar10 --data_dir="),
    ("imagenet2012", "downloads/manual"),
])
def test_missing_dataset_says_how_to_fix_it(tmp_path, name, fix):
  with pytest.raises(tfds_pipeline.DatasetNotPreparedError) as error:
    data.get_dataset(name, data_dir=str(tmp_path), download=False)
  message = str(error.value)
  assert isinstance(error.value, FileNotFoundError)
  assert f"{name!r} is not prepared in {tmp_path}" in message
  assert "network" in message and fix in message and "--config.data_dir" in message
