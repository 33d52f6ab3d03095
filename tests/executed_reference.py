"""Shared by the executed-timetable tests: models, batches and the engine's reference runs.

``functools.cache`` keeps one engine run per configuration for the whole session,
so tests/test_pipeline.py and tests/test_zero.py compare against the same run.
"""
import functools

import jax
import numpy as np
import optax

from cdpjax import executor, executors, models, schedule, stages
from cdpjax.executed import staged as staged_lib

NUM_STEPS = 4
# All three delay compensations (`executor.RulePlan`), strong enough to move every leaf.
COMPENSATIONS = {"predict": True, "dc_lambda": 50.0, "lr_delay_scale": 1.0}
# Small steps: a width-4 ResNet with BatchNorm on 8-row micro-batches is badly
# conditioned, and larger ones amplify float32 rounding past 1e-5 in a few steps.
LEARNING_RATE = {"residual_mlp": 0.1, "resnet18": 3e-4}
PER_MICRO = {"residual_mlp": 2, "resnet18": 8}


def make_tx(name):
  return optax.sgd(LEARNING_RATE[name], momentum=0.9)


@functools.cache
def model_of(name, num_stages):
  """``(model, params, model_state, stage_ids)``: equal blocks per stage, or by FLOPs (ResNet)."""
  if name == "residual_mlp":
    model = models.create_model(name, 10, width=8, hidden=16, num_blocks=4)
  else:
    model = models.create_model(name, 10, width=4, stem="cifar")
  sample = np.zeros((1, 8, 8, 1), np.float32)
  variables = model.init(jax.random.key(0), sample, train=False)
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"} or None
  if name == "residual_mlp":
    stage_ids = stages.model_stage_ids(
        model, params, num_stages, sample, by="boundaries", train=False,
        boundaries=[f"block_{s * 4 // num_stages}" for s in range(1, num_stages)])
  else:
    stage_ids = stages.model_stage_ids(model, params, num_stages, sample, by="flops",
                                       train=False)
  return model, params, model_state, stage_ids


def staged_of(name, num_stages, pad_to=1):
  model, params, model_state, stage_ids = model_of(name, num_stages)
  return staged_lib.stage_model(model, params, stage_ids, np.zeros((1, 8, 8, 1), np.float32),
                                model_state=model_state, pad_to=pad_to)


def batches(name, num_micro, num_steps=NUM_STEPS, seed=0):
  """``{"image": [K, N*b, 8, 8, 1], "label": [K, N*b]}``."""
  rng = np.random.default_rng(seed)
  rows = num_micro * PER_MICRO[name]
  return {"image": rng.normal(size=(num_steps, rows, 8, 8, 1)).astype(np.float32),
          "label": rng.integers(0, 10, size=(num_steps, rows)).astype(np.int32)}


def step_batch(batch, k):
  return jax.tree.map(lambda x: x[k], batch)


@functools.cache
def engine_run(name, rule, num_workers, replicas=1, compensated=False, tied=False,
               reduction="all-reduce"):
  """Per-step metrics (host numpy) and final flax variables of the engine over NUM_STEPS.

  ``replicas``: the engine with ``R*N`` workers whose delay matrix is the
  rule's ``(N, N)`` matrix tiled ``R`` times, as ``R`` replicated executors run it.
  ``compensated``: with the delay compensations ``COMPENSATIONS``. ``tied``: the engine's
  tied backward (``tied_backward=True``). ``reduction``: the engine's ``gradient_reduction``.
  """
  model, params, model_state, stage_ids = model_of(name, num_workers)
  if replicas > 1:
    rule = np.tile(schedule.resolve(rule, num_workers, num_workers), (replicas, 1))
  if compensated:
    rule = executor.resolve(rule, "data", replicas * num_workers, num_workers, **COMPENSATIONS)
  ex = executors.engine_executor(model, make_tx(name), stage_ids=stage_ids, rule=rule,
                                mesh=jax.make_mesh((replicas * num_workers,), ("data",)),
                                loss_fn=staged_lib.cross_entropy,
                                with_model_state=model_state is not None, tied_backward=tied,
                                gradient_reduction=reduction,
                                params=params, model_state=model_state,
                                sample_input=np.zeros((1, 8, 8, 1), np.float32))
  state = ex.init(params, model_state)
  data, metrics = batches(name, replicas * num_workers), []
  for k in range(NUM_STEPS):
    state, m = ex.step(state, step_batch(data, k))
    metrics.append(jax.tree.map(np.asarray, m))
  return metrics, jax.tree.map(np.asarray, ex.variables(state))


def assert_matches_engine(metrics, variables, name, rule, num_workers, rtol=1e-5, replicas=1,
                          compensated=False):
  """Every metric of every step, and the final parameters and model state."""
  ref_metrics, ref_variables = engine_run(name, rule, num_workers, replicas, compensated)
  assert len(metrics) == len(ref_metrics)
  for k, (got, want) in enumerate(zip(metrics, ref_metrics)):
    assert set(got) == set(want) == {"loss", "grad_norm", "grad_norm_per_stage", "param_norm"}
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=rtol, err_msg=f"step {k} {key}")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6),
               variables, ref_variables)
