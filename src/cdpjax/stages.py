"""Stage partitioning: contiguous groups of a model's top-level units, in execution order.

A *unit* is a top-level key of a flax params tree (``conv_init``, ``block_0``,
..., ``head``): the parameters of one direct submodule of the root module. A
partition assigns every unit, and so every parameter leaf, to one of ``J``
contiguous stages following the order in which the model *calls* its units.
Flattening a dict sorts its keys (``Dense_10`` before ``Dense_2``), so pytree
order is never used.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from cdpjax.compiled import flops

PARTITIONS = ("params", "flops", "boundaries")


class UnitCost(NamedTuple):
  """Cost of one unit: its parameter count and the XLA FLOPs of its forward."""
  params: int
  flops: float


class _Call(NamedTuple):
  module: nn.Module
  method: str
  args_spec: Any  # (args, kwargs) with arrays replaced by ShapeDtypeStructs.


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _split_arrays(tree):
  """Array leaves (to trace) and a function that puts them back among the static leaves."""
  leaves, treedef = jax.tree.flatten(tree)
  mask = [_is_array(x) for x in leaves]

  def rebuild(arrays):
    it = iter(arrays)
    return treedef.unflatten([next(it) if m else x for x, m in zip(leaves, mask)])

  return [x for x, m in zip(leaves, mask) if m], rebuild


def _default_rngs(rngs):
  # A dropout stream too, so train-mode models trace without extra arguments.
  return {"params": jax.random.key(0), "dropout": jax.random.key(1)} if rngs is None else rngs


def _trace(model: nn.Module, args, kwargs, rngs):
  """Abstractly initialises ``model``, recording the calls of its direct children.

  Returns:
    ``(variables, calls)``: abstract variables, and ``calls[name]`` the list of
    outermost calls of unit ``name`` in call order (dict order = first call).
  """
  calls: dict[str, list[_Call]] = {}
  active: list[tuple[str, ...]] = []  # Paths of the intercepted calls in progress.

  def interceptor(next_fun, call_args, call_kwargs, context):
    path = context.module.path
    # Outermost calls only: a unit calling its own helper methods is one call.
    if context.method_name != "setup" and len(path) == 1 and path not in active:
      spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x,
                          (call_args, call_kwargs))
      calls.setdefault(path[0], []).append(_Call(context.module, context.method_name, spec))
    active.append(path)
    try:
      return next_fun(*call_args, **call_kwargs)
    finally:
      active.pop()

  arrays, rebuild = _split_arrays((args, kwargs))

  def init(arrays):
    call_args, call_kwargs = rebuild(arrays)
    return model.init(rngs, *call_args, **call_kwargs)

  with nn.intercept_methods(interceptor):
    variables = jax.eval_shape(init, arrays)
  if "params" not in variables:
    raise ValueError(f"{type(model).__name__} creates no 'params' collection to partition.")
  params = variables["params"]
  missing = [k for k in params if k not in calls]
  if missing:
    raise ValueError(
        f"Top-level params {missing} were not created by a call of a direct submodule of "
        f"{type(model).__name__}, so their execution order is unknown. Wrap parameters "
        "declared on the root module in a submodule.")
  return variables, {name: calls[name] for name in calls if name in params}


def execution_order(model: nn.Module, *args, rngs=None, **kwargs) -> list[str]:
  """Top-level parameter units of ``model`` in the order its forward calls them.

  Args:
    model: a flax.linen module.
    *args: sample inputs of ``model.__call__`` (arrays or ShapeDtypeStructs).
    rngs: rngs for ``model.init``; defaults to ``params`` and ``dropout`` keys.
    **kwargs: keyword arguments of ``model.__call__`` (e.g. ``train=True``).

  Returns:
    The top-level keys of ``variables["params"]``, each exactly once, ordered by
    the first call of the submodule that owns them.
  """
  return list(unit_calls(model, *args, rngs=rngs, **kwargs))


def unit_calls(model: nn.Module, *args, rngs=None, **kwargs) -> dict[str, int]:
  """``{unit: how many times the forward calls it}``, in `execution_order` (a unit called more
  than once shares its weights)."""
  return {name: len(c) for name, c in _trace(model, args, kwargs, _default_rngs(rngs))[1].items()}


def _unit_flops(variables, name: str, unit_calls: Sequence[_Call], rngs) -> float:
  """XLA FLOPs of replaying every recorded call of one unit on abstract inputs."""
  unit_vars = {col: tree[name] for col, tree in variables.items() if name in tree}
  arrays, rebuilds = zip(*(_split_arrays(c.args_spec) for c in unit_calls))

  def forward(unit_vars, arrays):
    outputs = []  # Returned, or XLA would drop the computation as dead.
    for call, rebuild, call_arrays in zip(unit_calls, rebuilds, arrays):
      call_args, call_kwargs = rebuild(call_arrays)
      # mutable=True so train-mode BatchNorm may update its statistics.
      outputs.append(call.module.clone(parent=None).apply(
          unit_vars, *call_args, **call_kwargs, method=call.method, mutable=True, rngs=rngs))
    return outputs

  return flops(jax.jit(forward).lower(unit_vars, arrays).compile())


def unit_costs(model: nn.Module, *args, rngs=None, **kwargs) -> dict[str, UnitCost]:
  """Parameter count and forward FLOPs of every unit, in execution order.

  FLOPs are XLA's ``cost_analysis()["flops"]`` of each unit's forward compiled
  alone, on the input shapes recorded while tracing ``model.init`` (summed over
  calls if a unit is called more than once). Arguments as in `execution_order`.
  """
  rngs = _default_rngs(rngs)
  variables, calls = _trace(model, args, kwargs, rngs)
  return {
      name: UnitCost(_num_params(variables["params"][name]),
                     _unit_flops(variables, name, unit_calls, rngs))
      for name, unit_calls in calls.items()}


def _num_params(tree) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _min_max_split(costs: Sequence[float], num_stages: int) -> list[int]:
  """Start indices of stages 1..J-1 minimising the largest stage sum, stages non-empty.

  Hand-written: no library does contiguous min-max partitioning, and with a few
  dozen units the exact O(J n^2) dynamic programme is instant.
  """
  n = len(costs)
  prefix = [0.0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  # best[j][k]: smallest max-stage cost splitting units[:k] into j + 1 stages.
  best = [[prefix[k] for k in range(n + 1)]]
  cut = [[0] * (n + 1)]
  for j in range(1, num_stages):
    best.append([math.inf] * (n + 1))
    cut.append([0] * (n + 1))
    for k in range(j + 1, n + 1):
      for m in range(j, k):
        value = max(best[j - 1][m], prefix[k] - prefix[m])
        if value < best[j][k]:
          best[j][k], cut[j][k] = value, m
  starts, k = [], n
  for j in range(num_stages - 1, 0, -1):
    k = cut[j][k]
    starts.append(k)
  return starts[::-1]


def partition(params, num_stages: int, *, order: Sequence[str], by: str = "params",
              costs: Mapping[str, float] | None = None,
              boundaries: Sequence[int | str] | None = None):
  """Assigns every leaf of ``params`` to one of ``num_stages`` contiguous stages.

  Args:
    params: the params tree whose top-level keys are the units
      (``variables["params"]``).
    num_stages: ``J >= 1``.
    order: the units in execution order, from `execution_order`.
    by: ``params`` balances parameter counts, ``flops`` balances
      ``costs``; both minimise the largest stage cost. ``boundaries`` uses
      ``boundaries`` as given.
    costs: per-unit cost for ``flops``, e.g. ``{k: c.flops for k, c in
      unit_costs(...).items()}``.
    boundaries: for ``boundaries``, the ``J - 1`` units (indices into
      ``order`` or names) where stages ``1..J-1`` begin.

  Returns:
    ``stage_ids``: a pytree with the structure of ``params`` holding the python
    int stage of every leaf.
  """
  if by not in PARTITIONS:
    raise ValueError(f"Unknown by={by!r}. Use one of {', '.join(PARTITIONS)}.")
  if int(num_stages) != num_stages or num_stages < 1:
    raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}.")
  if (costs is not None) != (by == "flops"):
    raise ValueError("Pass costs exactly when by='flops' (per-unit FLOPs from unit_costs).")
  if (boundaries is not None) != (by == "boundaries"):
    raise ValueError("Pass boundaries exactly when by='boundaries'.")
  order = list(order)
  if len(set(order)) != len(order) or set(order) != set(params):
    raise ValueError(
        f"order {order} must list every top-level key of params {sorted(params)} exactly once. "
        "Pass variables['params'] and the order from execution_order.")
  n = len(order)
  if num_stages > n:
    raise ValueError(
        f"Cannot split {n} units ({', '.join(order)}) into {num_stages} non-empty stages: use "
        f"at most {n} stages, or a model with more top-level blocks.")

  if by == "boundaries":
    if len(boundaries) != num_stages - 1:
      raise ValueError(
          f"{num_stages} stages need {num_stages - 1} boundaries (where stages 1..J-1 begin), "
          f"got {len(boundaries)}.")
    starts = []
    for b in boundaries:
      if isinstance(b, str):
        if b not in order:
          raise ValueError(f"Boundary {b!r} is not a unit; units are {order}.")
        b = order.index(b)
      starts.append(b)
    if any(not 1 <= s < n for s in starts) or any(a >= b for a, b in zip(starts, starts[1:])):
      raise ValueError(
          f"Boundaries {list(boundaries)} (indices {starts}) must be strictly increasing unit "
          f"indices in 1..{n - 1} so that every stage is non-empty.")
  else:
    if by == "params":
      unit_cost = {k: _num_params(params[k]) for k in order}
    else:
      if set(order) - set(costs):
        raise ValueError(f"costs lacks units {sorted(set(order) - set(costs))}.")
      unit_cost = costs
    starts = _min_max_split([unit_cost[k] for k in order], num_stages)

  stage_of = {name: sum(i >= s for s in starts) for i, name in enumerate(order)}
  return jax.tree_util.tree_map_with_path(lambda path, _: stage_of[path[0].key], params)


def model_stage_ids(model: nn.Module, params, num_stages: int, sample_input, *,
                    by: str = "params", boundaries: Sequence[int | str] | None = None,
                    **call_kwargs):
  """`partition` of ``params`` in the execution order of ``model`` on ``sample_input``.

  ``call_kwargs`` go to ``model.__call__`` (and ``rngs`` to ``model.init``).
  FLOPs are only compiled for ``by="flops"``.
  """
  costs = None
  if by == "flops":
    unit = unit_costs(model, sample_input, **call_kwargs)
    order, costs = list(unit), {k: c.flops for k, c in unit.items()}
  else:
    order = execution_order(model, sample_input, **call_kwargs)
  return partition(params, num_stages, order=order, by=by, costs=costs,
                   boundaries=boundaries)


def stage_sizes(params, stage_ids) -> list[int]:
  """Parameter count of each stage ``0..max(stage_ids)``."""
  pairs = jax.tree.map(lambda s, p: (s, math.prod(p.shape)), stage_ids, params)
  pairs = jax.tree.leaves(pairs, is_leaf=lambda x: isinstance(x, tuple))
  sizes = [0] * (max(s for s, _ in pairs) + 1)
  for stage, size in pairs:
    sizes[stage] += size
  return sizes


def grouped(stage_params):
  """Stage ids of parameters already grouped by stage: entry ``j`` is stage ``j``.

  ``stage_params`` is a sequence of ``J`` stage pytrees, or a mapping whose
  values are (in order), e.g. ``[{"w": ..., "b": ...}] * J`` gives
  ``[{"w": 0, "b": 0}, {"w": 1, "b": 1}, ...]``.
  """
  if isinstance(stage_params, Mapping):
    return {k: jax.tree.map(lambda _, j=j: j, v) for j, (k, v) in enumerate(stage_params.items())}
  return [jax.tree.map(lambda _, j=j: j, p) for j, p in enumerate(stage_params)]
