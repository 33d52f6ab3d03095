"""Every leaf of the executed stage backward equals ``jax.grad`` of the unstaged model.

The executed schedules (``parallelism=model`` and ``zero``) differentiate each
stage of a `StagedModel` on its own, over one flat buffer per stage, with the
stage a traced index (a ``lax.switch``), compiled with the executors' XLA
options. Here that backward is chained over all ``J`` stages on one
micro-batch and compared, leaf by leaf, with
``jax.grad`` of the flax model's own loss: every model the trainer builds,
every way of cutting it, ``J = 2`` and ``4`` (ResNet-50: two cuts). A dropped or
misplaced gradient of any one leaf fails (XLA:CPU once zeroed ``block_4.bn2.bias``
of ResNet-18, docs/xla_cpu_miscompile.md).
"""
import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from cdpjax import compiled, models, train
from cdpjax.executed import staged as staged_lib

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Model options: ResNet-18 as configs/digits.py builds it, the others at smoke
# widths; units block_0..block_{L-1}.
MODELS = {
    "residual_mlp": dict(width=16, hidden=32, num_blocks=4),
    "resnet18": dict(width=16, stem="cifar"),
    "resnet50": dict(width=4, stem="cifar"),
    "transformer": dict(vocab_size=32, num_layers=4, d_model=32, num_heads=2, d_ff=64,
                        seq_len=16, positions="learned", tie_embeddings=False),
}
# Every cut at 2 and 4 stages; ResNet-50, the longest to compile, at the plan's cut (by FLOPs
# into 4) and one more (by parameters into 2).
CASES = [(name, by, num_stages) for name in MODELS for by in ("blocks", "params", "flops")
         for num_stages in (2, 4)
         if name != "resnet50" or (by, num_stages) in (("flops", 4), ("params", 2))]
ROWS = 16
# The XLA options of every train step (jaxlib 0.10.2's CPU fusion that dropped a
# gradient is off), for the staged backward and the reference alike.
OPTIONS = compiled.compiler_options(jax.make_mesh((1,), ("data",)))


@functools.cache
def model_and_batch(name):
  """``(model, params, model_state, x, labels)`` at initialisation, one micro-batch."""
  rng = np.random.default_rng(0)
  if name == "transformer":
    model = models.create_model(name, 32, **MODELS[name])
    x = rng.integers(0, 32, size=(ROWS, 16)).astype(np.int32)
    labels = rng.integers(0, 32, size=(ROWS, 16)).astype(np.int32)
  else:
    model = models.create_model(name, 10, **MODELS[name])
    x = rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 10, size=(ROWS,)).astype(np.int32)
  variables = dict(jax.jit(lambda k: model.init(k, x[:1], train=False))(jax.random.key(0)))
  params = variables.pop("params")
  # Non-zero biases and BatchNorm offsets, as after some training: at init equal
  # gradients of distinct leaves are what a merged fusion got wrong.
  params = jax.tree.map(lambda p: p + 0.1 * rng.normal(size=p.shape).astype(np.float32), params)
  return model, params, variables or None, x, labels


@functools.cache
def reference_grads(name):
  """``jax.grad`` of the unstaged model's mean loss (BatchNorm in train mode)."""
  model, params, model_state, x, labels = model_and_batch(name)

  def loss(p):
    if model_state:
      logits, _ = model.apply({"params": p, **model_state}, x, train=True,
                              mutable=list(model_state))
    else:
      logits = model.apply({"params": p}, x, train=True)
    return staged_lib.cross_entropy(logits, labels)
  return jax.device_get(jax.jit(jax.grad(loss)).lower(params).compile(OPTIONS)(params))


def staged_grads(staged, params, model_state, x, labels):
  """The stage backward of the executed schedules, chained over the stages: ``{unit: grads}``.

  One program, compiled with the executors' XLA options, with the stage a
  traced index as in the executed timetables. The miscompile showed in a
  program of all stages even where one program per stage came out right.
  """
  params_JxP, state_JxM = staged.pack(params, model_state)
  size = staged.act_size(jax.ShapeDtypeStruct(x.shape, x.dtype))

  def chain(params_JxP, state_JxM):
    inputs, h = [], jnp.zeros((size,), jnp.float32)
    for j in range(staged.num_stages):
      inputs.append(h)
      h = staged.apply(jnp.int32(j), params_JxP[j], state_JxM[j], h, x, labels)[0]
    grads, cot = [None] * staged.num_stages, jnp.zeros((size,), jnp.float32)
    for j in reversed(range(staged.num_stages)):
      grads[j], cot = staged.vjp(jnp.int32(j), params_JxP[j], state_JxM[j], inputs[j], x,
                                 labels, cot)
    return jnp.stack(grads)
  grads = jax.jit(chain).lower(params_JxP, state_JxM).compile(OPTIONS)(params_JxP, state_JxM)
  return staged.unpack(jax.device_get(grads), state_JxM)["params"]


@pytest.mark.parametrize("name,by,num_stages", CASES)
def test_every_leaf_of_the_stage_backward_is_jax_grad(name, by, num_stages):
  model, params, model_state, x, labels = model_and_batch(name)
  c = ml_collections.ConfigDict(dict(model=name, stages_by=by, num_stages=num_stages))
  stage_ids = train.model_stage_ids(c, model, params, x[:1])
  staged = staged_lib.stage_model(model, params, stage_ids, x[:1], model_state=model_state)
  got = staged_grads(staged, params, model_state, x, labels)
  want = reference_grads(name)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    where = f"{name} by={by} J={num_stages} {jax.tree_util.keystr(path)}"
    scale = float(np.abs(w).max())
    assert scale > 0, f"{where}: the reference gradient is zero"
    # Float32 rounding of two summation orders: measured at most 3e-6 of the scale.
    np.testing.assert_allclose(g, w, atol=2e-5 * scale, rtol=0, err_msg=where)


def test_the_documented_reproduction_runs():
  """docs/xla_cpu_miscompile.md's script: with YNN fusion off, as the train steps compile, correct."""
  script = [sys.executable, str(ROOT / "docs" / "xla_cpu_miscompile.py")]
  # As a user runs it: without the suite's XLA flags and rank-promotion check.
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUMPY_RANK_PROMOTION")}
  fixed = subprocess.run([*script, "--no-ynn"], capture_output=True, text=True, env=env,
                         timeout=300)
  assert fixed.returncode == 0 and fixed.stdout.strip().splitlines()[-1] == "correct", fixed
  default = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)
  assert default.returncode == 0
  assert default.stdout.strip().splitlines()[-1] in ("correct", "MISCOMPILED"), default
