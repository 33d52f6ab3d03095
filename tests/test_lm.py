"""The transformer language model: model, byte corpus, optimizer pieces and the trainer end to end."""
import collections
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds

from cdpjax import config as config_lib
from cdpjax import data, sample, stages, tasks, train
from cdpjax.data import text, tfds_pipeline
from cdpjax.models.transformer import Transformer

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=256, num_layers=2, d_model=32, num_heads=4, d_ff=64, seq_len=16)


def lm_config(arg="smoke", **overrides):
  return config_lib.load(str(ROOT / "configs" / "lm.py"), arg, **overrides)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _init(model, batch=2):
  tokens = jax.random.randint(jax.random.key(1), (batch, model.seq_len), 0, model.vocab_size)
  return model.init(jax.random.key(0), tokens)["params"], tokens


# The model.

@pytest.mark.parametrize("positions,tie", [("learned", False), ("rotary", True)])
def test_transformer_is_causal(positions, tie):
  """Changing tokens after position t leaves the logits at positions <= t unchanged."""
  model = Transformer(**TINY, positions=positions, tie_embeddings=tie)
  params, tokens = _init(model)
  logits = model.apply({"params": params}, tokens)
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 256)
  other = model.apply({"params": params}, changed)
  np.testing.assert_allclose(other[:, :9], logits[:, :9], rtol=1e-5, atol=1e-6)
  assert np.abs(other[:, 9:] - logits[:, 9:]).max() > 1e-3  # The future does matter there.
  assert ("dense" in params["head"]) != tie  # A tied head owns no kernel.


def test_transformer_units_and_blocks_stages():
  """embed, block_0..3, head in call order; blocks put embed on stage 0 and head on the last."""
  model = Transformer(**{**TINY, "num_layers": 4})
  params, tokens = _init(model, batch=1)
  assert stages.execution_order(model, tokens) == ["embed", "block_0", "block_1", "block_2",
                                                   "block_3", "head"]
  c = lm_config(num_stages=2, num_workers=2)
  ids = train.model_stage_ids(c, model, params, tokens)
  by_unit = {k: set(jax.tree.leaves(v)) for k, v in ids.items()}
  assert by_unit == {"embed": {0}, "block_0": {0}, "block_1": {0}, "block_2": {1},
                     "block_3": {1}, "head": {1}}
  # Parameter count: embedding, positions, 4 blocks of 12 d^2 + 13 d, head.
  d, f = 32, 64
  block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
  assert sum(x.size for x in jax.tree.leaves(params)) == 256 * d + 16 * d + 4 * block + (
      d * 256 + 256 + 2 * d)


def test_bfloat16_compute_agrees_with_float32():
  """bfloat16 matmuls, float32 params: logits within 2e-2 relative (8 mantissa bits, 2 blocks)."""
  f32 = Transformer(**TINY)
  params, tokens = _init(f32)
  bf16 = Transformer(**TINY, dtype="bfloat16")
  assert jax.tree.map(lambda x: x.dtype, bf16.init(jax.random.key(0), tokens)["params"]) == \
      jax.tree.map(lambda x: x.dtype, params)  # float32 parameters either way.
  want = f32.apply({"params": params}, tokens)
  got = bf16.apply({"params": params}, tokens)
  assert got.dtype == jnp.float32
  rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert 1e-5 < rel < 2e-2  # Really bfloat16 (not float32), and close.
  loss = lambda logits: optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], tokens[:, 1:]).mean()
  assert float(loss(got)) == pytest.approx(float(loss(want)), rel=2e-3)


def test_transformer_rejects_bad_sizes():
  with pytest.raises(ValueError, match="multiple of num_heads"):
    Transformer(**{**TINY, "num_heads": 5})
  with pytest.raises(ValueError, match="positions"):
    Transformer(**TINY, positions="sinusoidal")
  model = Transformer(**TINY)
  with pytest.raises(ValueError, match="seq_len=16"):
    model.init(jax.random.key(0), jnp.zeros((1, 17), jnp.int32))


# The data.

def test_stdlib_split_ignores_listing_order(monkeypatch):
  train_files, eval_files = text.python_stdlib_files()
  assert eval_files and len(train_files) > 5 * len(eval_files)
  assert not set(train_files) & set(eval_files)
  listdir = os.listdir
  monkeypatch.setattr(os, "listdir", lambda path: listdir(path)[::-1])
  assert text.python_stdlib_files() == (train_files, eval_files)


@pytest.fixture(scope="module")
def stdlib():
  return data.get_dataset("python_stdlib", seq_len=32, eval_windows=10)


def test_text_stream_is_a_function_of_seed_and_step(stdlib):
  take = lambda it, n: [next(it)["tokens"] for _ in range(n)]
  straight = take(stdlib.train_batches(8, seed=3), 4)
  assert straight[0].shape == (8, 33) and straight[0].dtype == np.int32
  np.testing.assert_array_equal(np.stack(straight[2:]),
                                np.stack(take(stdlib.train_batches(8, seed=3, start_step=2), 2)))
  shards = [take(stdlib.train_batches(8, seed=3, process_index=p, process_count=2), 4)
            for p in range(2)]
  np.testing.assert_array_equal(np.stack(straight),
                                np.concatenate([np.stack(shards[0]), np.stack(shards[1])], 1))
  assert not np.array_equal(take(stdlib.train_batches(8, seed=4), 1)[0], straight[0])
  # Every window is a contiguous piece of the train bytes.
  row = straight[1][5]
  start = bytes(stdlib.train_bytes).find(bytes(row.astype(np.uint8)))
  assert start >= 0


def test_text_eval_windows_and_padding(stdlib):
  windows = stdlib.eval_windows()
  assert windows.shape == (10, 33) == (stdlib.num_eval, 33)
  total = (len(stdlib.eval_bytes) - 32 + 31) // 32  # Windows at stride seq_len.
  starts = np.linspace(0, total - 1, 10).round().astype(int) * 32
  np.testing.assert_array_equal(windows[3], stdlib.eval_bytes[starts[3]:starts[3] + 33])
  batches = list(stdlib.eval_batches(8))
  assert [b["mask"].tolist() for b in batches] == [[1.0] * 8, [1.0] * 2 + [0.0] * 6]
  np.testing.assert_array_equal(batches[1]["tokens"][:2], windows[8:])


def test_bigram_baseline_equals_counting_by_hand():
  rng = np.random.default_rng(0)
  train_bytes = rng.integers(97, 101, 500).astype(np.uint8)
  eval_bytes = rng.integers(97, 102, 50).astype(np.uint8)
  ds = text.TextDataset(train_bytes, eval_bytes, seq_len=8)
  pairs = collections.Counter(zip(train_bytes[:-1].tolist(), train_bytes[1:].tolist()))
  firsts = collections.Counter(train_bytes[:-1].tolist())
  nll = [-math.log((pairs[(a, b)] + 1) / (firsts[a] + 256))
         for w in ds.eval_windows().tolist() for a, b in zip(w[:-1], w[1:])]
  assert len(nll) == 6 * 8  # (50 - 8) // 8 + 1 windows at stride 8.
  got = ds.bigram_baseline()
  assert got["loss"] == pytest.approx(np.mean(nll), rel=1e-12)
  assert got["bits_per_byte"] == pytest.approx(np.mean(nll) / math.log(2), rel=1e-12)


def test_tiny_shakespeare_under_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=3):
    ds = data.get_dataset("tiny_shakespeare", data_dir=str(tmp_path), seq_len=8)
  assert ds.num_classes == 256 and len(ds.train_bytes) > 9
  assert next(ds.train_batches(4, seed=0))["tokens"].shape == (4, 9)
  assert np.isfinite(ds.bigram_baseline()["loss"])


@pytest.mark.parametrize("name", ["tiny_shakespeare", "lm1b"])
def test_missing_text_dataset_names_the_preparation_command(tmp_path, name):
  with pytest.raises(tfds_pipeline.DatasetNotPreparedError) as error:
    data.get_dataset(name, data_dir=str(tmp_path), seq_len=8)
  assert f"python -m cdpjax.data.tfds_pipeline {name} --data_dir {tmp_path}" in str(error.value)
  assert "python_stdlib" in str(error.value)


# Optimizer pieces.

def test_global_norm_clip_and_adamw_mask():
  c = ml_collections.ConfigDict(dict(optimizer="sgd", momentum=0.0, weight_decay=0.0,
                                     grad_clip_norm=1.0, adam_b1=0.9, adam_b2=0.999))
  tx = train.make_optimizer(c, optax.constant_schedule(1.0))
  params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
  grads = {"a": jnp.full(3, 4.0), "b": jnp.full((2, 2), 3.0)}  # Global norm sqrt(48 + 36).
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["a"], -4.0 / math.sqrt(84), rtol=1e-6)
  np.testing.assert_allclose(updates["b"], -3.0 / math.sqrt(84), rtol=1e-6)

  c.update(optimizer="adamw", weight_decay=0.5, grad_clip_norm=0.0)
  tx = train.make_optimizer(c, optax.constant_schedule(0.1))
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  np.testing.assert_allclose(updates["a"], 0.0)  # Vectors (biases, norms) are not decayed.
  np.testing.assert_allclose(updates["b"], -0.1 * 0.5, rtol=1e-6)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.95)])
def test_adamw_is_optaxs_bit_for_bit(betas):
  """AdamW with the decay mask in the state (a scalar per leaf) against optax.adamw, masked to
  matrices, over several steps, with the config's moment decays."""
  c = ml_collections.ConfigDict(dict(optimizer="adamw", momentum=0.0, weight_decay=0.1,
                                     grad_clip_norm=0.0, adam_b1=betas[0], adam_b2=betas[1]))
  tx = train.make_optimizer(c, optax.constant_schedule(1e-2))
  ref = optax.adamw(1e-2, b1=betas[0], b2=betas[1], weight_decay=0.1,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
  key = jax.random.key(0)
  params = {"bias": jax.random.normal(key, (5,)), "kernel": jax.random.normal(key, (5, 3))}
  got = want = params
  state, ref_state = tx.init(params), ref.init(params)
  for step in range(3):
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.fold_in(key, step), x.shape),
                         params)
    updates, state = tx.update(grads, state, got)
    ref_updates, ref_state = ref.update(grads, ref_state, want)
    got, want = optax.apply_updates(got, updates), optax.apply_updates(want, ref_updates)
  for k in params:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert not np.array_equal(got["kernel"], params["kernel"])


def test_warmup_steps_then_cosine():
  c = lm_config("", num_train_steps=100, warmup_steps=10, learning_rate=1.0)
  lr = train.learning_rate_schedule(c, steps_per_epoch=7, num_steps=100)
  assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0) and float(lr(55)) == pytest.approx(0.5, abs=1e-6)


def test_executed_modes_refuse_a_global_clip():
  with pytest.raises(ValueError, match="grad_clip_norm"):
    config_lib.validate(lm_config("smoke,parallelism=model", grad_clip_norm=1.0))


def test_every_command_in_the_config_docstring_loads():
  """The launcher commands of configs/lm.py: each config argument parses and validates."""
  module_doc = (ROOT / "configs" / "lm.py").read_text().split('"""')[1]
  args = [line.split("configs/lm.py")[1].split()[0] for line in module_doc.splitlines()
          if line.strip().startswith("cdpjax-train")]
  args = [a[1:] if a.startswith(":") else "" for a in args]
  assert args == ["", "rule=dp,smoke", "parallelism=model,smoke", "size=small",
                  "dataset=tiny_shakespeare"]
  for arg in args:
    c = lm_config(arg)
    config_lib.validate(c)
    assert c.model == "transformer" and c.num_train_steps > 0
  with pytest.raises(ValueError, match="Unknown size"):
    lm_config("size=huge")


# The trainer end to end (one straight run shared by the tests below).

RESUME = dict(lr_schedule="constant", checkpoint_every_steps=3, eval_every_steps=3)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """Six cdp-v2 smoke steps, evaluated at steps 3 and 6."""
  workdir = tmp_path_factory.mktemp("lm_straight")
  summary = train.train_and_evaluate(lm_config(num_train_steps=6, **RESUME), str(workdir))
  return summary, read_metrics(workdir), str(workdir)


def test_lm_smoke_trains_and_logs(straight_run):
  summary, metrics, _ = straight_run
  baseline = [m for m in metrics if "baseline/bigram_bits_per_byte" in m]
  assert len(baseline) == 1 and baseline[0]["step"] == 0
  assert summary["bigram_bits_per_byte"] == baseline[0]["baseline/bigram_bits_per_byte"]
  train_rows = [m for m in metrics if "train/loss" in m]
  assert [m["step"] for m in train_rows] == [1, 2, 3, 4, 5, 6]
  assert {"train/tokens_per_second", "train/grad_norm_stage0", "train/grad_norm_stage3",
          "train/learning_rate"} <= set(train_rows[-1])
  evals = [m for m in metrics if "eval/bits_per_byte" in m]
  assert [m["step"] for m in evals] == [3, 6]
  assert evals[-1]["eval/bits_per_byte"] == pytest.approx(evals[-1]["eval/loss"] / math.log(2))
  # Six tiny steps from a near-uniform start (8 bits per byte): the loss falls.
  assert train_rows[-1]["train/loss"] < train_rows[0]["train/loss"] < math.log(256) + 0.1
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
  assert summary["tokens_per_second"] > 0 and summary["final_bits_per_byte"] < 8.1


def test_weight_prediction_departs_from_the_straight_run_at_step_four(straight_run, tmp_path,
                                                                      capsys):
  """Steps 1 and 2 read theta_0 (theta_{-1} = theta_0: nothing to extrapolate), and step 3's
  extrapolation theta_1 - theta_0 is 0 (the warm-up's first learning rate is 0); from step 4 a
  stale read is theta_{t-1} + (theta_{t-1} - theta_{t-2}). A resume may not switch it."""
  _, metrics, workdir = straight_run
  train.train_and_evaluate(lm_config(num_train_steps=4, weight_prediction=True, **RESUME),
                           str(tmp_path))
  assert "with weight prediction runs as the update-rule engine" in capsys.readouterr().out
  plain = [m["train/loss"] for m in metrics if "train/loss" in m][:4]
  predicted = [m["train/loss"] for m in read_metrics(tmp_path) if "train/loss" in m]
  np.testing.assert_allclose(predicted[:3], plain[:3], rtol=1e-6)
  assert abs(predicted[3] - plain[3]) > 1e-4, (predicted, plain)
  with pytest.raises(ValueError, match="weight_prediction"):
    train.train_and_evaluate(lm_config(num_train_steps=6, weight_prediction=True, **RESUME),
                             workdir)
  with pytest.raises(ValueError, match="dc_lambda must be >= 0"):
    config_lib.validate(lm_config("smoke", dc_lambda=-1.0))
  with pytest.raises(ValueError, match="lr_delay_scale must be >= 0"):
    config_lib.validate(lm_config("smoke", lr_delay_scale=-0.5))
  with pytest.raises(ValueError, match="adam_b2 is a decay rate in"):
    config_lib.validate(lm_config("smoke", adam_b2=1.0))


def test_a_saved_config_from_before_a_key_was_added_reads_as_it_ran(tmp_path):
  """`cdpjax-export` and `cdpjax-sample` rebuild a run from its config.json: a key added to the
  configs since reads as the value the run ran with (`config.ADDED_KEYS`)."""
  old = {k: v for k, v in json.loads(lm_config("smoke").to_json_best_effort()).items()
         if k not in ("adam_b1", "adam_b2")}
  (tmp_path / "config.json").write_text(json.dumps(old))
  saved = config_lib.saved(str(tmp_path))
  assert (saved.adam_b1, saved.adam_b2) == (0.9, 0.999) and saved.model == "transformer"


def test_lm_resume_three_plus_three_equals_six_straight_steps(straight_run, tmp_path):
  """AdamW moments, the stale version and the data position all come back exactly."""
  train.train_and_evaluate(lm_config(num_train_steps=3, **RESUME), str(tmp_path))
  train.train_and_evaluate(lm_config(num_train_steps=6, **RESUME), str(tmp_path))
  losses = lambda metrics: {m["step"]: m["train/loss"] for m in metrics if "train/loss" in m}
  resumed = read_metrics(tmp_path)
  assert losses(resumed) == losses(straight_run[1])
  assert len([m for m in resumed if "baseline/bigram_loss" in m]) == 1  # Not again on resume.


def test_sample_restores_the_checkpoint_and_slides_the_window(straight_run, tmp_path):
  """cdpjax-sample's pieces: the newest checkpoint's parameters, then bytes drawn one at a time."""
  summary, _, workdir = straight_run
  model, params = sample.restore_params(sample.load_config(workdir), workdir)
  apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
  # The restored parameters are the final ones: they give the final eval loss.
  windows = data.get_dataset("python_stdlib", seq_len=16, eval_windows=16).eval_windows()
  loss = tasks.cross_entropy(apply(windows[:, :-1]), windows[:, 1:])
  assert float(loss) == pytest.approx(summary["final_loss"], rel=1e-5)
  # Greedy decoding past seq_len (16) is the argmax after the unpadded last 16 bytes.
  prompt = b"def add(a, b):"
  greedy = sample.sample(model, params, prompt, 4, temperature=0.0, seed=0)
  want = list(prompt)
  for _ in range(4):
    want.append(int(jnp.argmax(apply(jnp.asarray(want[-16:])[None])[0, -1])))
  assert greedy == bytes(want)
  drawn = [sample.sample(model, params, prompt, 4, temperature=1.0, seed=s) for s in (0, 0, 1)]
  assert drawn[0] == drawn[1] != drawn[2] and drawn[0].startswith(prompt) and len(drawn[0]) == 18
  with pytest.raises(ValueError, match="config.json"):
    sample.load_config(str(tmp_path))
