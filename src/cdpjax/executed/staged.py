"""A flax model cut into ``J`` stage functions over flat per-stage buffers.

The executed schedules run one stage per device and slot, choosing the stage
at run time (SPMD: every device runs one program). Stages of a ResNet differ
in parameter and activation shapes, so every stage is given one common form:

- its parameters (the units ``stage_ids`` puts on it) as one flat float32
  vector, zero-padded to ``param_size``;
- its model state (BatchNorm statistics) likewise, padded to ``state_size``;
- the activation it hands to the next stage as one flat vector, padded to the
  largest boundary, ``act_size(b)`` for micro-batches of ``b`` rows.

A stage function is the flax model's own ``__call__``, run with a method
interceptor (no copy of any layer): units of earlier stages are not run (the
last one returns the incoming activation, the others placeholders whose
results are dead code), units of later stages are not run, and the stage's
output is what its last unit returned. The glue code between units (a
reshape, a pooling, a ReLU) runs where the model puts it, in the stage of the
unit that follows it. ``apply`` with a traced stage index is a ``lax.switch``
over the ``J`` stage functions.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from cdpjax import stages as stages_lib
from cdpjax.executed.device import vary, varying
from cdpjax.tasks import cross_entropy  # The trainer's loss, the default here.


class _Layout:
  """Offsets of a stage's leaves in its flat buffer (leaves in sorted-key order)."""

  def __init__(self, tree):
    leaves, self.treedef = jax.tree.flatten(tree)
    self.shapes = [tuple(np.shape(x)) for x in leaves]
    for x in leaves:
      if jnp.result_type(x) != jnp.float32:
        raise ValueError(
            f"The executed schedules keep stages as flat float32 buffers, but a leaf has dtype "
            f"{jnp.result_type(x)}: use float32 parameters and states, or parallelism=data.")
    self.size = sum(math.prod(s) for s in self.shapes)

  def pack(self, tree, size: int) -> np.ndarray:
    if _traced(tree):  # Under jax.eval_shape (ahead-of-time compiling): shapes, no host copy.
      return _flatten_act(tree, size) if self.shapes else jnp.zeros((size,), jnp.float32)
    flat = np.zeros((size,), np.float32)
    offset = 0
    for leaf, shape in zip(jax.tree.leaves(tree), self.shapes):
      flat[offset:offset + math.prod(shape)] = np.ravel(np.asarray(leaf, np.float32))
      offset += math.prod(shape)
    return flat

  def unpack(self, flat):
    return jax.tree.unflatten(self.treedef, _split(flat, self.shapes))


def _split(flat, shapes) -> list:
  """The leaves of ``shapes`` laid end to end at the start of ``flat`` (numpy or jax).

  One split of the whole buffer (the padding its last, unused part), whose
  transpose is one concatenate into a buffer of ``flat``'s size. A slice per
  leaf would transpose to a pad to the whole buffer and an add per leaf, a
  chain that XLA:CPU's fusion compiled wrong (docs/xla_cpu_miscompile.md), and
  that costs a full-length pass per leaf; a slice of the leaves' span first
  would transpose to a pad, which the TPU compiler gives a second buffer of
  the stage's size (the 1B transformer's last stage, BENCHMARKS.md).
  """
  if not shapes:
    return []
  sizes = [math.prod(s) for s in shapes]
  xp = np if isinstance(flat, np.ndarray) else jnp
  parts = xp.split(flat, np.cumsum(sizes))[:-1]
  return [part.reshape(shape) for part, shape in zip(parts, shapes)]


def _to_float32(x):
  """``x`` as float32 elements: 32-bit types bit cast, narrower ones converted (exactly)."""
  if x.dtype == jnp.float32:
    return x
  if jnp.dtype(x.dtype).itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.float32)
  return x.astype(jnp.float32)


def _from_float32(flat, like):
  """The inverse of `_to_float32`, shaped and typed as ``like``."""
  x = flat.reshape(like.shape)
  if like.dtype == jnp.float32:
    return x
  if jnp.dtype(like.dtype).itemsize == 4:
    return jax.lax.bitcast_convert_type(x, like.dtype)
  return x.astype(like.dtype)


def _traced(tree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _flatten_act(tree, size: int):
  """Leaves of an activation pytree, raveled, concatenated and zero-padded to ``size``."""
  flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])
  return jnp.pad(flat, (0, size - flat.size))


def _unflatten_act(flat, spec):
  leaves, treedef = jax.tree.flatten(spec)
  parts = _split(flat, [s.shape for s in leaves])
  return jax.tree.unflatten(treedef, [x.astype(s.dtype) for x, s in zip(parts, leaves)])


@dataclasses.dataclass(frozen=True, eq=False)
class StagedModel:
  """``model`` cut into ``J`` stages; see the module docstring.

  Built by `stage_model`. Hashed by identity, so it can be a static argument.

  Attributes:
    model: the flax module.
    units: ``units[j]``, the top-level units of stage ``j`` in execution order.
    param_size: ``P``, the flat length of every stage's parameters.
    state_size: ``M``, the flat length of every stage's model state (0 if none).
    loss_fn: ``loss_fn(outputs, labels) -> scalar``, on the model's outputs.
    collections: the model-state collections (e.g. ``("batch_stats",)``).
  """
  model: nn.Module
  units: tuple
  param_size: int
  state_size: int
  loss_fn: Callable
  collections: tuple
  _param_layouts: tuple
  _state_layouts: tuple
  _kept_cache: dict = dataclasses.field(default_factory=dict)  # `_kept_leaves`, by operand types.

  @property
  def num_stages(self) -> int:
    return len(self.units)

  def stage_param_sizes(self) -> list[int]:
    """Unpadded parameter count of each stage."""
    return [layout.size for layout in self._param_layouts]

  # -- Host-side packing. -----------------------------------------------------

  def pack(self, params, model_state=None) -> tuple[np.ndarray, np.ndarray]:
    """``([J, P], [J, M])`` float32 host arrays in stage order (traced under ``jax.eval_shape``)."""
    stack = jnp.stack if _traced((params, model_state)) else np.stack
    s = stack([layout.pack(self._stage_state(model_state, units), self.state_size)
               for layout, units in zip(self._state_layouts, self.units)])
    return self.pack_params(params), s

  def pack_params(self, params):
    """``[J, P]``: the parameters of ``pack`` alone."""
    stack = jnp.stack if _traced(params) else np.stack
    return stack([layout.pack({u: params[u] for u in units}, self.param_size)
                  for layout, units in zip(self._param_layouts, self.units)])

  def unpack(self, params_JxP, state_JxM=None) -> dict:
    """The flax variables ``{"params": ..., **model_state}`` of ``[J, P]`` (and ``[J, M]``).

    Host arrays give host arrays; traced ones (under ``jax.jit``) traced leaves.
    """
    as_array = (lambda x: x) if _traced((params_JxP, state_JxM)) else np.asarray
    params_JxP = as_array(params_JxP)
    params = {}
    for j in range(self.num_stages):
      params.update(self.stage_params_tree(j, params_JxP[j]))
    state = ({c: {} for c in self.collections} if state_JxM is None
             else self.model_state_tree(as_array(state_JxM)))
    return {"params": params, **state}

  # -- One stage's buffers, traced (the engine's tied backward). ----------------

  def stage_params_flat(self, stage: int, params):
    """Stage ``stage``'s leaves of the ``params`` tree as one flat vector, unpadded."""
    layout = self._param_layouts[stage]
    return layout.pack({u: params[u] for u in self.units[stage]}, layout.size)

  def stage_params_tree(self, stage: int, flat) -> dict:
    """``{unit: tree}`` of stage ``stage`` from its flat vector (padded or not)."""
    return self._param_layouts[stage].unpack(flat)

  def stage_state_flat(self, stage: int, model_state):
    """Stage ``stage``'s model state as a flat vector of ``M`` (zeros of none)."""
    if model_state is None:
      return jnp.zeros((self.state_size,), jnp.float32)
    return self._state_layouts[stage].pack(self._stage_state(model_state, self.units[stage]),
                                           self.state_size)

  def model_state_tree(self, states_JxM) -> dict:
    """The model-state collections of the stages' flat states (rows in stage order)."""
    state = {c: {} for c in self.collections}
    for j in range(self.num_stages if self.state_size else 0):
      for c, tree in self._state_layouts[j].unpack(states_JxM[j]).items():
        state[c].update(tree)
    return state

  def _stage_state(self, model_state, units) -> dict:
    return {c: {u: model_state[c][u] for u in units if u in model_state[c]}
            for c in self.collections}

  # -- Stage functions. -------------------------------------------------------

  def boundary_specs(self, x_spec: jax.ShapeDtypeStruct) -> tuple:
    """``specs[j]``: the activation stage ``j`` hands on (``None`` for the last stage)."""
    outputs = self._unit_outputs(x_spec)
    specs = tuple(outputs[units[-1]] for units in self.units[:-1])
    for units, spec in zip(self.units, specs):
      if any(leaf.dtype != jnp.float32 for leaf in jax.tree.leaves(spec)):
        raise ValueError(
            f"Unit {units[-1]!r} ends a stage with a non-float32 output {spec}; stage boundaries "
            "must be float32 activations. Cut the stages elsewhere (another stage_ids).")
    return specs + (None,)

  def boundary_sizes(self, x_spec: jax.ShapeDtypeStruct) -> list[int]:
    """The flat size of each boundary activation (stage ``j``'s output, ``j < J-1``)."""
    return [sum(math.prod(s.shape) for s in jax.tree.leaves(spec))
            for spec in self.boundary_specs(x_spec)[:-1]]

  def act_size(self, x_spec: jax.ShapeDtypeStruct) -> int:
    """``A``: the largest boundary activation (flat), for micro-batches shaped ``x_spec``."""
    return max(self.boundary_sizes(x_spec), default=1)

  def _stage_fn(self, stage: int, x_spec):
    """``f(params_P, state_M, h_A, x, labels) -> (h_A, loss, state_M)`` of stage ``stage``."""
    specs = self.boundary_specs(x_spec)
    size = self.act_size(x_spec)
    position = {u: (j, k) for j, units in enumerate(self.units) for k, u in enumerate(units)}
    first, last = stage == 0, stage == self.num_stages - 1
    param_layout, state_layout = self._param_layouts[stage], self._state_layouts[stage]

    def f(params_P, state_M, h_A, x, labels):
      h_in = None if first else _unflatten_act(h_A, specs[stage - 1])
      captured = []
      active = []

      def intercept(next_fun, args, kwargs, context):
        path = context.module.path
        unit = path[0] if len(path) == 1 and path[0] in position else None
        if unit is None or context.method_name == "setup" or path in active:
          return next_fun(*args, **kwargs)
        j, k = position[unit]
        if j < stage or captured:
          # Not this stage's: the stage input stands in for the previous stage's last unit;
          # anything else is a placeholder whose uses are dead code.
          if j == stage - 1 and k == len(self.units[j]) - 1:
            return h_in
          return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._unit_output(unit, x))
        active.append(path)
        try:
          out = next_fun(*args, **kwargs)
        finally:
          active.pop()
        if not last and k == len(self.units[stage]) - 1:
          captured.append(out)
        return out

      variables = {"params": param_layout.unpack(params_P), **state_layout.unpack(state_M)}
      with nn.intercept_methods(intercept):
        if self.collections:
          outputs, new_state = self.model.apply(variables, x, train=True,
                                                mutable=list(self.collections))
          new_state_M = (_flatten_act(new_state, self.state_size) if state_layout.size
                         else state_M)
        else:
          outputs = self.model.apply(variables, x, train=True)
          new_state_M = state_M
      if last:
        return jnp.zeros((size,), jnp.float32), self.loss_fn(outputs, labels), new_state_M
      return _flatten_act(captured[0], size), jnp.zeros((), jnp.float32), new_state_M

    return f

  def _unit_output(self, unit, x):
    return self._unit_outputs(jax.ShapeDtypeStruct(x.shape, x.dtype))[unit]

  @functools.lru_cache(maxsize=None)
  def _unit_outputs(self, x_spec) -> dict:
    """Each top-level unit's output spec on inputs ``x_spec`` (an abstract run of the model)."""
    outputs = {}

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      path = context.module.path
      if context.method_name == "__call__" and len(path) == 1:
        outputs.setdefault(path[0], jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out))
      return out

    def run(x):
      variables = self.model.init(jax.random.key(0), x, train=False)
      with nn.intercept_methods(record):
        return self.model.apply(variables, x, train=True, mutable=list(self.collections) or False)

    jax.eval_shape(run, x_spec)
    return outputs

  def apply(self, stage, params_P, state_M, h_A, x, labels):
    """Stage ``stage``'s forward: ``(h_A, loss, new_state_M)``.

    ``loss`` is the mean loss of the micro-batch on the last stage, 0 elsewhere;
    ``new_state_M`` the model state after the micro-batch (BatchNorm's running
    averages), or ``state_M`` unchanged without model state. ``stage`` is a
    Python int or a traced index (then a ``lax.switch`` over the stages).
    """
    x_spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if isinstance(stage, (int, np.integer)):
      return self._stage_fn(int(stage), x_spec)(params_P, state_M, h_A, x, labels)
    operands = (params_P, state_M, h_A, x, labels)
    axes = varying(operands) | varying(stage)

    def branch(j):
      return lambda *ops: vary(self._stage_fn(j, x_spec)(*ops), axes)
    return jax.lax.switch(stage, [branch(j) for j in range(self.num_stages)], *operands)

  # -- Activations kept from the forward for the backward (``keep_activations``). ---

  def _vjp_of(self, stage: int, params_P, state_M, h_A, x, labels):
    """``((h_A, loss), vjp, new_state_M)`` of stage ``stage`` (``jax.vjp`` in ``params_P, h_A``)."""
    x_spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    axes = varying((params_P, state_M, h_A, x, labels))

    def f(p, h):
      h_out, loss, new_state = self._stage_fn(stage, x_spec)(p, state_M, h, x, labels)
      return vary((h_out, loss), axes), new_state  # Typed as the cotangents will be.
    return jax.vjp(f, params_P, h_A, has_aux=True)

  def _kept_leaves(self, stage: int, ops) -> tuple[tuple[int, ...], int]:
    """Which leaves of stage ``stage``'s vjp depend on its input or the batch (kept from the
    forward; the others are functions of the parameters and state, recomputed by the
    backward), and their size as float32 elements, for the operands ``ops`` of `_vjp_of`
    (arrays or tracers: inside ``shard_map`` the vjp has leaves of its own). A dependence is
    followed through the jaxpr, every output of an equation taken to depend on all its
    inputs (erring towards keeping a leaf)."""
    key = (stage, tuple(str(jax.typeof(o)) for o in ops))
    if key not in self._kept_cache:
      jaxpr = jax.make_jaxpr(lambda *o: jax.tree.leaves(self._vjp_of(stage, *o)[1]))(*ops).jaxpr
      found = set(jaxpr.invars[2:])  # h_A, x, labels (params_P and state_M come first).
      for eqn in jaxpr.eqns:
        if any(not isinstance(v, jax_core.Literal) and v in found for v in eqn.invars):
          found.update(eqn.outvars)
      kept = tuple(k for k, v in enumerate(jaxpr.outvars)
                   if not isinstance(v, jax_core.Literal) and v in found)
      self._kept_cache[key] = (kept, sum(math.prod(jaxpr.outvars[k].aval.shape) for k in kept))
    return self._kept_cache[key]

  def kept_size(self, params_P, state_M, h_A, x, labels) -> int:
    """``R``: the most float32 elements a stage after the first keeps from a forward with
    operands typed as these (the first stage recomputes: its input is the batch, which
    stays)."""
    ops = (params_P, state_M, h_A, x, labels)
    return max([self._kept_leaves(j, ops)[1] for j in range(1, self.num_stages)], default=1) or 1

  def apply_keeping(self, stage: int, params_P, state_M, h_A, x, labels, size: int):
    """`apply`, and the vjp's leaves that depend on the input or the batch packed as ``size``
    float32 elements (`vjp_kept` takes them; bit casts and exact conversions)."""
    ops = (params_P, state_M, h_A, x, labels)
    (h_out, loss), vjp, new_state = self._vjp_of(stage, *ops)
    kept, kept_size = self._kept_leaves(stage, ops)
    if kept_size > size:
      raise ValueError(f"Stage {stage} keeps {kept_size} elements, the stash holds {size}: size "
                       "it with kept_size() of operands typed as these.")
    leaves = jax.tree.leaves(vjp)
    packed = [jnp.ravel(_to_float32(leaves[k])) for k in kept]
    flat = jnp.concatenate(vary(packed, varying(packed))) if packed else jnp.zeros((0,))
    return h_out, loss, new_state, jnp.pad(flat, (0, size - flat.size))

  def vjp_kept(self, stage: int, params_P, state_M, x, labels, kept_R, cot_h_A):
    """``(grad_P, cot_h_in_A)`` of stage ``stage`` from what `apply_keeping` kept: the leaves
    that depend on the parameters only are recomputed here (the rest of that trace is dead)."""
    h_A = jnp.zeros_like(cot_h_A)
    ops = (params_P, state_M, h_A, x, labels)
    (_, loss), vjp, _ = self._vjp_of(stage, *ops)
    kept, _ = self._kept_leaves(stage, ops)
    leaves, treedef = jax.tree.flatten(vjp)
    offset = 0
    for k in kept:
      n = math.prod(leaves[k].shape)
      leaves[k] = _from_float32(kept_R[offset:offset + n], leaves[k])
      offset += n
    axes = varying((params_P, state_M, x, labels, kept_R, cot_h_A))
    return jax.tree.unflatten(treedef, leaves)(vary((cot_h_A, jnp.ones_like(loss)), axes))

  def vjp(self, stage, params_P, state_M, h_A, x, labels, cot_h_A):
    """``(grad_P, cot_h_in_A)``: a stage's backward (recomputing its forward).

    The loss enters with cotangent 1; ``cot_h_A`` is the cotangent of the
    stage output (ignored on the last stage). A traced ``stage`` switches over
    the stages' own vjps: the vjp of one switch would carry every stage's
    residuals, zeros but one, through each backward.
    """
    if not isinstance(stage, (int, np.integer)):
      operands = (params_P, state_M, h_A, x, labels, cot_h_A)
      axes = varying(operands) | varying(stage)
      branches = [lambda *ops, j=j: vary(self.vjp(j, *ops), axes) for j in range(self.num_stages)]
      return jax.lax.switch(stage, branches, *operands)

    axes = varying((params_P, state_M, h_A, x, labels, cot_h_A))

    def f(p, h):
      h_out, loss, _ = self.apply(stage, p, state_M, h, x, labels)
      return vary((h_out, loss), axes)  # Typed as the cotangents, below.
    (h_out, loss), vjp = jax.vjp(f, params_P, h_A)
    return vjp(vary((cot_h_A, jnp.ones_like(loss)), axes))


def stage_model(model: nn.Module, params, stage_ids, sample_input, *, model_state=None,
                loss_fn: Callable = cross_entropy, pad_to: int = 1) -> StagedModel:
  """Cuts ``model`` into the stages of ``stage_ids``.

  Args:
    model: a flax module called as ``model.apply(variables, x, train=...)``.
    params: its ``variables["params"]``.
    stage_ids: the structure of ``params`` with an int stage on every leaf, as
      `cdpjax.stages.partition` gives; every top-level unit on one stage, stages
      contiguous in execution order.
    sample_input: an input batch (any rows), to trace the execution order.
    model_state: the other variable collections (``{"batch_stats": ...}``), or None.
    loss_fn: ``loss_fn(outputs, labels)`` of the model's outputs.
    pad_to: ``param_size`` is rounded up to a multiple of this (ZeRO-3 shards it).
  """
  if jax.tree.structure(stage_ids) != jax.tree.structure(params):
    raise ValueError("stage_ids do not match params: give an int stage for every parameter leaf "
                     "(cdpjax.stages.partition builds them).")
  unit_stage = {}
  for unit in params:
    ids = {int(s) for s in jax.tree.leaves(stage_ids[unit])}
    if len(ids) != 1:
      raise ValueError(f"Unit {unit!r} is split over stages {sorted(ids)}: the executed schedules "
                       "cut between top-level units. Use cdpjax.stages.partition.")
    unit_stage[unit] = ids.pop()
  num_stages = 1 + max(unit_stage.values())
  calls = stages_lib.unit_calls(model, sample_input, train=True)
  shared = [u for u, count in calls.items() if count > 1]
  if shared:
    raise ValueError(
        f"Units {shared} are called more than once (shared weights); the executed timetables "
        "run each unit on one stage once. Use parallelism='data' for this model.")
  order = list(calls)
  stage_seq = [unit_stage[u] for u in order]
  if stage_seq != sorted(stage_seq) or set(stage_seq) != set(range(num_stages)):
    raise ValueError(
        f"Stages {stage_seq} (in execution order {order}) are not contiguous and non-empty: "
        "stage j must be the j-th group of consecutive units. Use cdpjax.stages.partition.")
  units = tuple(tuple(u for u in order if unit_stage[u] == j) for j in range(num_stages))
  model_state = dict(model_state or {})
  collections = tuple(sorted(model_state))
  param_layouts = tuple(_Layout({u: params[u] for u in us}) for us in units)
  state_layouts = tuple(_Layout({c: {u: model_state[c][u] for u in us if u in model_state[c]}
                                 for c in collections}) for us in units)
  param_size = max(layout.size for layout in param_layouts)
  param_size = -(-param_size // pad_to) * pad_to
  state_size = max(layout.size for layout in state_layouts)
  return StagedModel(model, units, param_size, state_size, loss_fn, collections,
                     param_layouts, state_layouts)


def padding_report(staged: StagedModel, x_spec) -> dict:
  """Bytes of the padded buffers against the unpadded stages (float32)."""
  sizes = staged.stage_param_sizes()
  acts = [sum(math.prod(s.shape) for s in jax.tree.leaves(spec))
          for spec in staged.boundary_specs(x_spec) if spec is not None]
  return {"param_bytes": 4 * sum(sizes), "padded_param_bytes": 4 * staged.param_size * len(sizes),
          "param_padding_ratio": staged.param_size * len(sizes) / sum(sizes),
          "boundary_bytes": [4 * a for a in acts],
          "padded_boundary_bytes": 4 * staged.act_size(x_spec)}
