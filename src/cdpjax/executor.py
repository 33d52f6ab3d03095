"""One contract for every way of running a rule: the engine, the pipeline and ZeRO.

An ``Executor`` is a NamedTuple of pure functions, in optax's style:

- ``init(params, model_state=None) -> state``: the state at ``t = 0``;
- ``step(state, batch, norms=True) -> (state, metrics)``, metrics ``loss``,
  ``grad_norm``, ``grad_norm_per_stage`` ``[J]`` and ``param_norm`` (of
  ``theta_{t+1}``); with ``norms=False`` an executor may skip the norms (NaN),
  as the engine does: a caller asks for them on the steps it logs;
- built with ``scan_steps=K`` (`cdpjax.executors.build`), one ``step`` call runs ``K`` steps:
  batch leaves are ``[K, N*b, ...]``, every metric gains a leading ``[K]``
  axis and ``norms`` is a bool or ``K`` bools, one per step (a logged step
  gets real norms, the others may skip them);
- ``variables(state)``: ``{"params": theta_t, **model_state}``, plain flax
  variables readable on every process (evaluation, export);
- ``lower(state, batch)``: the lowered step (StableHLO, memory, cost);
- ``to_portable(state)`` and ``from_portable(portable)``: the state in the one
  form every executor of the same rule, N and J reads: the engine's
  ``CyclicState`` of flax trees (``theta_t``, the stale versions with None
  where no worker reads a stage at that age, the optimizer state of the
  parameter tree, the model state). Checkpoints hold it, so a run resumes
  under another parallelism, backend or mesh; ``from_portable`` places it on
  this executor's devices. The executed schedules convert with one program
  each way (the portable arrays spread over the mesh, `spread`).

``plan`` says what runs: the rule resolved once (`resolve`) into the delay
matrix, the number of stale versions the state keeps and the executed
timetable. Every state keeps ``step``, ``params``, ``stale_params`` and
``opt_state``; a state whose stale versions do not fit the plan is refused by
`check_versions`.

This module is the contract, below its implementations (`cdpjax.engine`,
`cdpjax.executed`); the table that builds one per parallelism is
`cdpjax.executors`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from cdpjax import schedule

PARALLELISMS = ("data", "model", "zero")
TIMETABLES = {
    # parallelism -> (timetable of rule dp, timetable of a cdp rule).
    "data": ("lockstep", "lockstep"),
    "model": ("gpipe", "cyclic"),
    "zero": ("zero3", "cyclic"),
}
# The timetables an executed parallelism can be asked for (`resolve`'s ``timetable``).
EXECUTED_TIMETABLES = {"model": ("cyclic", "gpipe", "dp+mp"), "zero": ("cyclic", "zero3")}
DESCRIPTIONS = {
    ("data", "lockstep"): "the update-rule engine (data parallelism, replicated state)",
    ("model", "gpipe"): "executed GPipe on the stage devices (all forwards, all backwards, flush)",
    ("model", "cyclic"): "executed CDP + model parallelism (cyclic pipeline, no flush)",
    ("model", "dp+mp"): "executed DP + MP (N replicas of the J-stage pipeline, all-reduce)",
    ("zero", "zero3"): "executed ZeRO-3 (all-gather at use, reduce-scatter)",
    ("zero", "cyclic"): "executed CDP + ZeRO (stages and gradients to and from their owners "
                        "by collective-permutes)",
}


class State(NamedTuple):
  """Everything that shapes the trajectory of CDP training, in every mode.

  The engine keeps flax trees (``engine.CyclicState``, the portable form); the
  executed timetables flat stage rows (``executed.pipeline.StagedState``).

  Attributes:
    step: int32 scalar, the number of updates applied so far (``t``).
    params: ``theta_t``, the current parameters.
    stale_params: ``(theta_{t-1}, ..., theta_{t-D})``; empty for ``dp``.
    opt_state: the optax state of ``params``.
    model_state: non-trained state such as BatchNorm statistics, or ``None``.
  """
  step: jax.Array
  params: Any
  stale_params: tuple
  opt_state: Any
  model_state: Any = None

  @property
  def versions(self) -> tuple:
    """``(theta_t, theta_{t-1}, ..., theta_{t-D})``."""
    return (self.params,) + tuple(self.stale_params)


class RulePlan(NamedTuple):
  """A rule resolved once for one parallelism.

  Attributes:
    rule: the rule as given (a name of ``schedule.RULES`` or a delay matrix).
    parallelism: ``data``, ``model`` or ``zero``.
    delays: ``d``, int ``(N, J)``: worker ``i`` reads ``theta^j_{t - d[i, j]}``;
      ``None`` for a ``schedule.DelayRule``, whose matrix changes every step.
    num_stale: ``D``, the stale versions the state keeps.
    timetable: what is executed: ``lockstep`` (the engine), ``gpipe`` or
      ``zero3`` (the flushed baselines, for a rule without delays) or ``cyclic``;
      ``dp+mp`` only when asked for by name.
    predict: weight prediction: a stale read of ``theta_{t-d}`` uses
      ``theta_{t-d} + d * (theta_{t-d} - theta_{t-d-1})``, an estimate of
      ``theta_t`` from the last step known at the read (PipeMare's, for CDP's
      per-(worker, stage) delays). A stage read stale keeps one more version.
    dc_lambda: DC-ASGD's gradient correction (Zheng et al., 2017): a worker's
      gradient ``g`` of a stage it read as ``theta_read`` counts as
      ``g + dc_lambda * g * g * (theta_t - theta_read)`` in the update of
      ``theta_t`` (a first-order Taylor step with the diagonal ``g * g`` for
      the Hessian); 0 is off.
    lr_delay_scale: a delay-aware learning rate: stage ``j``'s update is scaled
      by ``1 / (1 + lr_delay_scale * mean_i min(d[i, j], t))`` (the staleness of the
      step's reads: ``theta_0`` is read fresh at first); 0 is off.
  """
  rule: Any
  parallelism: str
  delays: np.ndarray
  num_stale: int
  timetable: str
  predict: bool = False
  dc_lambda: float = 0.0
  lr_delay_scale: float = 0.0

  def describe(self) -> str:
    """One line for the log: the rule and what runs it."""
    if isinstance(self.rule, schedule.DelayRule):
      name, (n, j) = self.rule.name, (self.rule.num_workers, self.rule.num_stages)
    else:
      name = self.rule if isinstance(self.rule, str) else "a custom delay matrix"
      n, j = self.delays.shape
    compensations = [what for what, on in (
        ("weight prediction", self.predict), (f"DC-ASGD correction {self.dc_lambda:g}",
                                              self.dc_lambda),
        (f"delay-scaled learning rate {self.lr_delay_scale:g}", self.lr_delay_scale)) if on]
    with_prediction = f" with {', '.join(compensations)}" if compensations else ""
    return (f"rule {name} (N={n}, J={j}){with_prediction} runs as "
            f"{DESCRIPTIONS[self.parallelism, self.timetable]}")


def resolve(rule, parallelism: str, num_workers: int, num_stages: int,
            timetable: str | None = None, predict: bool = False,
            dc_lambda: float = 0.0, lr_delay_scale: float = 0.0) -> RulePlan:
  """Resolves ``rule`` for ``parallelism``: delays, stale versions and timetable.

  A rule without delays (``dp``) runs GPipe under ``model`` and ZeRO-3 under
  ``zero``: the cyclic timetable has no causal ``dp``. A delayed rule runs the
  cyclic timetable there, which must be able to realise it (causal).
  ``timetable`` asks for another of the parallelism's timetables
  (``EXECUTED_TIMETABLES``): a flushed one runs any rule, and ``N`` micro-batches
  for any ``J``.

  The one place a rule is resolved: a run resolves it once and hands the plan
  on; given a ``RulePlan``, this checks that it is for ``parallelism``, ``N``
  and ``J`` and returns it. ``predict``, ``dc_lambda`` and ``lr_delay_scale``:
  the delay compensations of `RulePlan` (`compensation`), which the engine
  and every executed timetable run.
  """
  if isinstance(rule, RulePlan):
    shape = ((rule.rule.num_workers, rule.rule.num_stages) if rule.delays is None
             else tuple(rule.delays.shape))
    if rule.parallelism != parallelism or shape != (num_workers, num_stages):
      raise ValueError(
          f"The rule's plan is for parallelism={rule.parallelism!r} with (N, J) = {shape}, not "
          f"{parallelism!r} with ({num_workers}, {num_stages}): resolve the rule for this run "
          "(executor.resolve).")
    if (timetable in (None, rule.timetable) and predict in (False, rule.predict)
        and dc_lambda in (0.0, rule.dc_lambda) and lr_delay_scale in (0.0, rule.lr_delay_scale)):
      return rule
    predict, dc_lambda = predict or rule.predict, dc_lambda or rule.dc_lambda
    lr_delay_scale, rule = lr_delay_scale or rule.lr_delay_scale, rule.rule
  if parallelism not in PARALLELISMS:
    raise ValueError(f"Unknown parallelism {parallelism!r}: use one of {PARALLELISMS}.")
  compensation = dict(predict=bool(predict), dc_lambda=float(dc_lambda),
                      lr_delay_scale=float(lr_delay_scale))
  if isinstance(rule, schedule.DelayRule):  # New delays every step: only the engine runs them.
    if parallelism != "data":
      schedule.resolve(rule, num_workers, num_stages)  # Raises the error naming the fix.
    return RulePlan(rule, parallelism, None, rule.max_delay + bool(predict), "lockstep",
                    **compensation)
  delays = schedule.resolve(rule, num_workers, num_stages)
  num_stale = schedule.max_delay(rule)
  if predict and num_stale:
    num_stale += 1  # theta_{t-d-1}, for the last step known at a read d steps stale.
  flushed, cyclic = TIMETABLES[parallelism]
  default = flushed if delays.max(initial=0) == 0 else cyclic
  if timetable not in (None, default):
    known = EXECUTED_TIMETABLES.get(parallelism, (default,))
    if timetable not in known:
      raise ValueError(f"Unknown timetable {timetable!r}: use one of {known}.")
    if timetable == "cyclic":
      raise ValueError(f"Rule {rule!r} has no delays and is not causal on the cyclic timetable: "
                       f"use timetable={flushed!r} (or leave timetable unset) for dp.")
    return RulePlan(rule, parallelism, delays, num_stale, timetable, **compensation)
  if parallelism != "data" and num_workers != num_stages:
    raise ValueError(
        f"parallelism={parallelism!r} runs N = J micro-batches; got N={num_workers}, "
        f"J={num_stages}. Set num_workers equal to num_stages, or use parallelism='data'.")
  if default == "cyclic" and not schedule.is_causal(rule, num_workers, num_stages):
    raise ValueError(
        f"Rule {rule!r} is not causal on the cyclic timetable: some forward would read a stage "
        "version that is not updated yet. Use cdp-v1 or cdp-v2, dp (which runs "
        f"{flushed}), or parallelism='data'.")
  return RulePlan(rule, parallelism, delays, num_stale, default, **compensation)


def check_versions(state, plan: RulePlan) -> None:
  """Refuses a state whose stale versions do not fit ``plan`` (ValueError naming the fix)."""
  kept = len(state.stale_params)
  if kept != plan.num_stale:
    raise ValueError(
        f"The state keeps {kept} stale parameter versions, but rule {plan.rule!r} needs "
        f"{plan.num_stale}: build the state with the init of this executor (the same rule), "
        "or use a fresh --workdir.")


def place(tree, sharding):
  """``jax.device_put(tree, sharding)``; abstract inputs (``jax.ShapeDtypeStruct``) get the sharding.

  Abstract inputs let ``Executor.lower`` compile ahead of time for devices
  this host does not have (`cdpjax.aot`). ``sharding`` is one sharding or a
  tree of them matching ``tree``.
  """
  if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
    return jax.device_put(tree, sharding)
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      sharding)


def spread(tree, mesh):
  """Shardings of ``tree``: each leaf split over all of ``mesh`` on its first axis of a size the
  device count divides, else replicated. Where the portable state lives (`Executor`)."""
  def sharding(x):
    for axis, size in enumerate(np.shape(x)):
      if size % mesh.size == 0:
        return jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*(None,) * axis, tuple(mesh.axis_names)))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(sharding, tree)


class Executor(NamedTuple):
  """How one parallelism runs one rule; see the module docstring."""
  init: Callable[..., Any]
  step: Callable[..., tuple]
  variables: Callable[[Any], dict]
  lower: Callable[[Any, Any], Any]
  plan: RulePlan
  to_portable: Callable[[Any], Any]
  from_portable: Callable[[Any], Any]
