"""The executor of each parallelism: the table that `train` and `aot` build from.

``build(parallelism, model, tx, ...)`` gives the `cdpjax.executor.Executor`
of a flax model cut into stages: ``data`` the update-rule engine
(`cdpjax.engine`), ``model`` the executed pipeline and ``zero`` executed
CDP-ZeRO (`cdpjax.executed`). Every factory takes the arguments of `build`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cdpjax import engine
from cdpjax import executor as executor_lib
from cdpjax.executed import device, pipeline, plan as plan_lib, staged as staged_lib, zero


def engine_executor(model, tx: optax.GradientTransformation, *, stage_ids, rule, mesh,
                    loss_fn: Callable, with_model_state: bool, backend: str = "shard_map",
                    scan_steps: int | None = None, tied_backward: bool = False,
                    gradient_reduction: str = "all-reduce", params=None,
                    model_state=None, sample_input=None, **_) -> executor_lib.Executor:
  """The update-rule engine (``cdpjax.engine``) behind the executor contract.

  ``loss_fn(outputs, labels)`` is applied to ``model.apply(variables, image,
  train=True)``; with model state, new states are averaged over workers.
  ``tied_backward``: the backward runs stage by stage, each stage's gradient
  all-reduced right after it (``engine.make_train_step(staged=)``; needs
  ``params``, ``model_state`` and ``sample_input`` to cut the model).
  """
  if with_model_state:
    def worker_loss(p, state, batch):
      outputs, new_state = model.apply({"params": p, **state}, batch["image"], train=True,
                                       mutable=list(state))
      return loss_fn(outputs, batch["label"]), new_state
  else:
    def worker_loss(p, batch):
      return loss_fn(model.apply({"params": p}, batch["image"], train=True), batch["label"])

  num_workers = int(mesh.shape["data"]) if "data" in mesh.axis_names else 0
  plan = executor_lib.resolve(rule, "data", num_workers, engine.num_stages_of(stage_ids))
  staged = (_staged(model, params, model_state, stage_ids, sample_input, loss_fn)
            if tied_backward else None)
  train_step = engine.make_train_step(worker_loss, tx, stage_ids=stage_ids, rule=plan, mesh=mesh,
                                      backend=backend, with_model_state=with_model_state,
                                      scan_steps=scan_steps, staged=staged,
                                      gradient_reduction=gradient_reduction)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def init(params, model_state=None):
    # A copy: the step donates the state, which must not delete the caller's arrays.
    model_state = jax.tree.map(jnp.array, model_state)
    return jax.device_put(train_step.init(params, model_state), replicated)

  return executor_lib.Executor(  # The engine's step checks the state's versions itself.
      init=init, step=lambda state, batch, norms=True: train_step(state, batch, norms=norms),
      variables=lambda s: {"params": s.params, **(s.model_state or {})},
      lower=train_step.lower, plan=plan, to_portable=lambda s: s,
      from_portable=lambda s: jax.device_put(s, replicated))


def _staged(model, params, model_state, stage_ids, sample_input, loss_fn, pad_to=1):
  return staged_lib.stage_model(model, params, stage_ids, sample_input,
                                model_state=model_state, loss_fn=loss_fn, pad_to=pad_to)


def pipeline_executor(model, tx, *, params, model_state, stage_ids, sample_input, rule, mesh,
                      loss_fn: Callable, scan_steps: int | None = None,
                      keep_activations: bool = False, **_) -> executor_lib.Executor:
  """The executed pipeline (``cdpjax.executed.pipeline``) of ``model`` cut at ``stage_ids``."""
  staged = _staged(model, params, model_state, stage_ids, sample_input, loss_fn,
                   pad_to=device.TPU_TILE)
  return pipeline.make_executor(staged, tx, rule=rule, mesh=mesh, scan_steps=scan_steps,
                                keep_activations=keep_activations)


def zero_executor(model, tx, *, params, model_state, stage_ids, sample_input, rule, mesh,
                  loss_fn: Callable, scan_steps: int | None = None,
                  **_) -> executor_lib.Executor:
  """Executed CDP-ZeRO or ZeRO-3 (``cdpjax.executed.zero``) of ``model`` cut at ``stage_ids``."""
  num_workers = int(mesh.shape["data"])
  plan = executor_lib.resolve(rule, "zero", num_workers, engine.num_stages_of(stage_ids))
  staged = _staged(model, params, model_state, stage_ids, sample_input, loss_fn,
                   pad_to=zero.pad_to(num_workers, plan.timetable))
  return zero.make_executor(staged, tx, rule=plan, mesh=mesh, scan_steps=scan_steps)


EXECUTORS = {"data": engine_executor, "model": pipeline_executor, "zero": zero_executor}
"""``parallelism -> factory``; every factory takes the arguments of `build`."""


def build(parallelism: str, model, tx: optax.GradientTransformation, *, params, model_state,
          stage_ids, sample_input, rule, mesh, loss_fn: Callable,
          backend: str = "shard_map", scan_steps: int | None = None,
          tied_backward: bool = False, keep_activations: bool = False,
          gradient_reduction: str = "all-reduce") -> executor_lib.Executor:
  """The executor of ``parallelism`` for a flax ``model`` cut into stages by ``stage_ids``.

  Args:
    parallelism: ``data`` (the engine), ``model`` (the executed pipeline) or
      ``zero`` (executed CDP-ZeRO).
    model: a flax module called as ``model.apply(variables, x, train=...)``.
    tx: the optimizer (elementwise for ``model`` and ``zero``).
    params: ``variables["params"]``, to lay out the stages.
    model_state: the other variable collections, or None.
    stage_ids: an int stage per parameter leaf (`cdpjax.stages`).
    sample_input: an input batch, to trace the model's execution order.
    rule: a name of ``schedule.RULES``, a delay matrix or a ``schedule.DelayRule``
      (``data`` only), or the `executor.RulePlan` a run resolved it into once.
    mesh: the mesh of ``parallelism``: axis ``data``, or ``stage`` for ``model``;
      ``(replica, stage)`` or ``(replica, data)`` for replicas of ``model`` or
      ``zero``; ``(data, fsdp)`` for an engine worker of several devices.
    loss_fn: ``loss_fn(outputs, labels)`` of the model's outputs.
    backend: the engine's backend (``shard_map`` or ``pmap``).
    scan_steps: ``K``: one ``step`` call runs ``K`` steps (see the module
      docstring); None: one step, batch and metrics without the ``[K]`` axis.
    tied_backward: ``data`` only: each stage's gradient all-reduced right after
      its backward, the ``J`` all-reduces kept apart (`engine_executor`).
    keep_activations: ``model`` only: forwards keep the activations their backward
      needs instead of its recomputing them (`cdpjax.executed.pipeline`).
    gradient_reduction: ``data`` only: ``all-reduce`` or ``permutes``
      (`engine.make_train_step`).
  """
  if parallelism not in EXECUTORS:
    raise ValueError(f"Unknown parallelism {parallelism!r}: use one of "
                     f"{executor_lib.PARALLELISMS}.")
  if keep_activations and parallelism != "model":
    raise ValueError(f"Kept activations are the executed pipeline's (parallelism='model'), not "
                     f"parallelism={parallelism!r}'s.")
  if gradient_reduction != "all-reduce" and parallelism != "data":
    raise ValueError(f"gradient_reduction={gradient_reduction!r} is the engine's "
                     f"(parallelism='data'); parallelism={parallelism!r} reduces each stage where "
                     "it runs.")
  if tied_backward and parallelism != "data":
    raise ValueError(f"A tied backward is the engine's (parallelism='data'); parallelism="
                     f"{parallelism!r} already reduces each stage where it runs.")
  return EXECUTORS[parallelism](
      model, tx, params=params, model_state=model_state, stage_ids=stage_ids,
      sample_input=sample_input, rule=rule, mesh=mesh, loss_fn=loss_fn, backend=backend,
      with_model_state=model_state is not None, scan_steps=scan_steps,
      tied_backward=tied_backward, keep_activations=keep_activations,
      gradient_reduction=gradient_reduction)


def idle_fraction(plan: executor_lib.RulePlan, num_steps: int) -> float:
  """Idle device-slots / all device-slots of the executed timetable of ``plan`` in a call of
  ``num_steps`` steps; 0 in lockstep (the engine, ZeRO-3: every device works in every slot)."""
  if plan.timetable in ("lockstep", "zero3"):
    return 0.0
  if plan.parallelism == "zero":
    return float(np.mean(plan_lib.zero_plan(plan.delays, num_steps).kind == plan_lib.IDLE))
  num_micro, num_stages = plan.delays.shape
  return plan_lib.idle_fraction(plan.timetable, num_stages, num_steps, num_micro)
