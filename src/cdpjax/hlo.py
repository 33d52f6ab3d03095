"""Collectives read from the text of compiled XLA programs (HLO) and of lowered StableHLO.

`collectives` and the ``count`` and ``bytes`` of `collective_summary` are
static: a collective inside a loop body (``lax.scan``) or a conditional branch
counts once. `collectives_per_step` weights each one by the trip counts of the
loops around it and, where a conditional's branch index is a static function
of the loop counter and the device (the executed timetables' slot tables),
counts the branch each trip takes, with a small integer interpreter of the
index computations (`_Evaluator`); other conditionals are bounded (cheapest
and costliest branch). All figures are per device. The HLO text is parsed by
hand because jax exposes no public per-instruction API.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Callable, NamedTuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
"""Collective kinds, as XLA's HLO spells them."""

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_GROUPS = re.compile(  # {{0,1},{2,3}} or the iota form [2,4]<=[4,2]T(1,0).
    r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
# The TPU compiler splits an overlapped collective into a start fusion and continuation
# fusions, each holding a copy of the collective: the start's (flag_start -1) is the one.
_CONTINUATION = re.compile(r'"async_collective_fusion_config":\{"flag_start":"(?!-1")')
_STABLEHLO = re.compile(
    r"\bstablehlo\.(all_reduce|all_gather|reduce_scatter|collective_permute|all_to_all)\b")


class Collective(NamedTuple):
  """One collective instruction of a compiled HLO module.

  Attributes:
    name: the HLO instruction name.
    kind: one of `KINDS`; async ``-start`` ops map to their base kind.
    shape: the result shape text (of the ``-done`` op for async pairs).
    bytes: bytes of that result, summed over tuple elements.
    replica_groups: device groups, or None when the op has none.
    source_target_pairs: ``(source, target)`` pairs of a collective-permute,
      else None.
    is_async: whether it is a ``-start``/``-done`` pair.
  """
  name: str
  kind: str
  shape: str
  bytes: int
  replica_groups: tuple[tuple[int, ...], ...] | None
  source_target_pairs: tuple[tuple[int, int], ...] | None
  is_async: bool

  def received_bytes(self, num_devices: int) -> float:
    """Bytes a device receives over links, on average over the program's ``num_devices``.

    A bandwidth-optimal (ring) algorithm in groups of ``g``: an all-reduce
    receives ``2 (g-1)/g`` of its result, an all-gather and an all-to-all
    ``(g-1)/g``, a reduce-scatter ``g-1`` results (the shards it sums); a
    collective-permute's result counts once per pair whose target is another
    device. The result bytes (`bytes`) count a permute's buffer on every
    device, one that receives nothing included.
    """
    if self.kind == "collective-permute":
      pairs = [p for p in self.source_target_pairs or () if p[0] != p[1]]
      return self.bytes * len(pairs) / num_devices
    groups = self.replica_groups
    g = len(groups[0]) if groups and groups[0] else num_devices
    share = {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g,
             "all-to-all": (g - 1) / g, "reduce-scatter": g - 1}[self.kind]
    return self.bytes * share


def _split_shape(rest: str) -> tuple[str, str]:
  """Splits ``SHAPE opcode(...)...`` into the shape and the remainder."""
  if not rest.startswith("("):
    shape, _, tail = rest.partition(" ")
    return shape, tail
  depth = 0  # Tuple shapes nest, and tiled layouts hold parentheses: match brackets.
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i + 1], rest[i + 1:].lstrip()
  raise ValueError(f"Unbalanced HLO shape in {rest[:200]!r}.")


def _element_bits(dtype: str) -> int:
  if dtype == "pred":
    return 8
  if dtype == "token":
    return 0
  match = re.match(r"(?:bf|[fsuc])(\d+)", dtype)  # f32, bf16, s4, u8, c64, f8e4m3fn...
  if not match:
    raise ValueError(f"Unknown HLO element type {dtype!r}.")
  return int(match.group(1))


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape such as ``f32[4,16]{1,0}`` or a tuple of them."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    count = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
    total += math.ceil(count * _element_bits(dtype) / 8)
  return total


def _replica_groups(attrs: str):
  match = _GROUPS.search(attrs)
  if not match:
    return None
  text = match.group(1)
  if text.startswith("{"):
    groups = re.findall(r"\{([\d,]*)\}", text)
    return tuple(tuple(int(d) for d in g.split(",") if d) for g in groups)
  # Iota form [G,S]<=[dims]T(perm): reshape, transpose, reshape.
  out_dims, iota_dims, *perm = re.findall(r"[\[(]([\d,]+)[\])]", text)
  to_ints = lambda s: [int(d) for d in s.split(",")]
  ids = np.arange(math.prod(to_ints(iota_dims))).reshape(to_ints(iota_dims))
  if perm:
    ids = ids.transpose(to_ints(perm[0]))
  return tuple(tuple(int(d) for d in g) for g in ids.reshape(to_ints(out_dims)))


def collectives(hlo_text: str) -> list[Collective]:
  """The collectives of compiled HLO text, ``jit(f).lower(*a).compile().as_text()``."""
  instructions = []
  for line in hlo_text.splitlines():
    match = (any(kind in line for kind in KINDS) and not _CONTINUATION.search(line)
             and _INSTRUCTION.match(line))
    if match:
      shape, tail = _split_shape(match.group("rest"))
      opcode, _, after = tail.partition("(")
      instructions.append((match.group("name"), shape, opcode, after))
  # An async pair's payload is the result of its -done, whose operand is the -start.
  done_shapes = {
      _OPERAND.search(after).group(1): shape
      for _, shape, opcode, after in instructions if opcode.endswith("-done")}
  found = []
  for name, shape, opcode, after in instructions:
    kind = opcode.removesuffix("-start")
    if kind not in KINDS:
      continue
    is_async = opcode.endswith("-start")
    if is_async:
      shape = done_shapes.get(name, shape)
    pairs = _PAIRS.search(after)
    found.append(Collective(
        name=name, kind=kind, shape=shape, bytes=shape_bytes(shape),
        replica_groups=_replica_groups(after),
        source_target_pairs=pairs and tuple(
            (int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))),
        is_async=is_async))
  return found


class ScheduledCollective(NamedTuple):
  """A collective's place in the entry computation's instruction schedule.

  Attributes:
    name: the HLO instruction name (of the ``-start`` op for async pairs).
    kind: one of `KINDS`.
    bytes: bytes of its result.
    position: its index among the entry computation's instructions.
    compute_after: how many compute instructions (convolutions and dots, or
      fusions and calls that contain one) the schedule places after it.
    compute_during: how many it places between an async pair's ``-start`` and
      its ``-done``: the compute the collective runs beside (0 when synchronous).
  """
  name: str
  kind: str
  bytes: int
  position: int
  compute_after: int
  compute_during: int = 0


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)")
_COMPUTE = re.compile(r"\b(convolution|dot)\(|custom_call_target=\"[^\"]*(?:[Mm]atmul|[Cc]onv|[Gg]emm)")


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """``({computation name: its instruction lines}, entry name)`` of compiled HLO text."""
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("{")[0].split("(")[0]:
      current = header.group("name")
      bodies[current] = []
      if header.group(1):
        entry = current
    elif line.strip() == "}":
      current = None
    elif current is not None:
      bodies[current].append(line)
  if entry is None:
    raise ValueError("No ENTRY computation in the HLO text: pass compiled.as_text().")
  return bodies, entry


def collective_schedule(hlo_text: str) -> tuple[list[ScheduledCollective], int]:
  """Where the collectives sit in the schedule of a compiled module's entry computation.

  Compiled HLO lists each computation's instructions in the order its schedule
  runs them, so a collective with compute instructions after it can overlap
  them (when the backend runs it asynchronously), and one placed after every
  compute instruction cannot. Loop bodies count as one compute instruction of
  the entry computation; a collective the compiler fused into a fusion (the TPU
  compiler's all-gather fusions) sits at the fusion's place.

  Returns:
    The entry computation's collectives in schedule order, and its number of
    compute instructions.
  """
  bodies, entry = _computations(hlo_text)
  computes: dict[str, bool] = {}

  def has_compute(name: str, seen=()) -> bool:
    if name not in computes:
      computes[name] = False  # Cuts cycles; computations form a DAG anyway.
      computes[name] = any(_is_compute(line, seen + (name,)) for line in bodies.get(name, ()))
    return computes[name]

  def _is_compute(line: str, seen) -> bool:
    if _COMPUTE.search(line):
      return True
    return any(has_compute(callee.strip().lstrip("%"), seen)
               for group in _CALLS.findall(line) for callee in group.split(","))

  instructions = [line for line in bodies[entry] if _INSTRUCTION.match(line)]
  is_compute = [_is_compute(line, (entry,)) for line in instructions]
  found = {c.name: c for c in collectives("\n".join(instructions))}
  done_at = {}  # An async pair's -start name -> the position of its -done.
  for position, line in enumerate(instructions):
    if re.search(r"\s(?:%s)-done\(" % "|".join(KINDS), line):
      done_at[_OPERAND.search(line.partition("-done(")[2]).group(1)] = position

  def fused(line: str) -> list[Collective]:  # The TPU compiler fuses some collectives.
    return [c for callee in _CALLEES.findall(line) if " fusion(" in line
            for c in collectives("\n".join(bodies.get(callee, [])))]
  scheduled = []
  for position, line in enumerate(instructions):
    name = _INSTRUCTION.match(line).group("name")
    for c in [found[name]] if name in found else fused(line):
      scheduled.append(ScheduledCollective(
          name=c.name, kind=c.kind, bytes=c.bytes, position=position,
          compute_after=sum(is_compute[position + 1:]),
          compute_during=sum(is_compute[position + 1:done_at.get(c.name, position)])))
  return scheduled, sum(is_compute)


def collective_summary(hlo_text: str, steps_per_call: int = 1) -> dict[str, dict]:
  """Per kind of `KINDS` (zeros included), the collectives of compiled HLO, static and per step.

  ``count`` and ``bytes`` are static: each instruction once. The figures of
  `collectives_per_step` (``count_min``, ..., ``received_mean``) are per step:
  weighted by loop trip counts and divided by ``steps_per_call``, with the
  branches the slot tables take on each device (the least busy device's, the
  busiest's, their mean) and every other conditional bounded.
  """
  summary = {kind: {"count": 0, "bytes": 0} for kind in KINDS}
  for c in collectives(hlo_text):
    summary[c.kind]["count"] += 1
    summary[c.kind]["bytes"] += c.bytes
  for kind, figures in collectives_per_step(hlo_text, steps_per_call).items():
    summary[kind].update(figures)
  return summary


_WHILE = re.compile(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}')
_INIT = re.compile(r'"known_init_step":\{"init":"(-?\d+)","step":"1"\}')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


def _definitions(lines) -> dict[str, tuple[str, str, str]]:
  """``{name: (shape, opcode, text after the opcode's parenthesis)}`` of a computation."""
  out = {}
  for line in lines:
    match = _INSTRUCTION.match(line)
    if match:
      shape, tail = _split_shape(match.group("rest"))
      opcode, _, after = tail.partition("(")
      out[match.group("name")] = (shape, opcode.strip(), re.sub(r"/\*.*?\*/", "", after))
  return out


def _operands(after: str) -> list[str]:
  return _OPERAND.findall(after.partition(")")[0])


class _Unknown(Exception):
  """A value that cannot be computed from the HLO text alone."""


class _NeedsDevice(_Unknown):
  """A value that depends on ``partition-id``, evaluated without a device."""


class _Scope(NamedTuple):
  """Where an instruction is evaluated: its computation and what its parameters hold.

  ``param(k)``: the value of parameter ``k`` (fused computations);
  ``element(k)``: element ``k`` of a tuple parameter (loop bodies);
  ``device``: the value of ``partition-id``, None when not fixed.
  """
  computation: str
  param: Callable
  element: Callable
  device: int | None
  cache: dict


def _unknown(*_):
  raise _Unknown()


_BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
    "minimum": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "remainder": np.fmod,  # C's remainder, as XLA's: the sign of the dividend.
    "divide": lambda a, b: np.trunc(np.true_divide(a, b)).astype(np.int64),
    "shift-left": np.left_shift, "shift-right-arithmetic": np.right_shift,
    "shift-right-logical": lambda a, b: np.right_shift(np.bitwise_and(a, 0xFFFFFFFF), b),
}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}


class _Evaluator:
  """Evaluates the integer index computations of compiled HLO: constants, iotas, the loop
  counter, ``partition-id`` and elementwise, slicing and reshaping ops on them.

  Anything else (data, parameters of the entry computation, gathers) raises
  `_Unknown`: the caller then bounds instead of counting.
  """

  def __init__(self, bodies, defs=None):
    self.bodies = bodies
    self.defs = dict(defs or {})

  def definitions(self, computation: str):
    if computation not in self.defs:
      self.defs[computation] = _definitions(self.bodies.get(computation, ()))
    return self.defs[computation]

  def root(self, computation: str) -> str:
    for line in self.bodies.get(computation, ()):
      if line.strip().startswith("ROOT"):
        return _INSTRUCTION.match(line).group("name")
    raise _Unknown()

  def value(self, name: str, scope: _Scope) -> np.ndarray:
    if name not in scope.cache:
      try:
        scope.cache[name] = self._value(name, scope)
      except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
        raise _Unknown() from e  # An op or attribute spelled otherwise than expected.
    return scope.cache[name]

  def _value(self, name: str, scope: _Scope) -> np.ndarray:
    defs = self.definitions(scope.computation)
    if name not in defs:
      raise _Unknown()
    shape, opcode, after = defs[name]
    arrays = _ARRAY.findall(shape)
    if len(arrays) != 1:
      raise _Unknown()  # Tuples are only read through get-tuple-element of a parameter.
    dtype, dims = arrays[0]
    dims = tuple(int(d) for d in dims.split(",") if d)
    ops = _operands(after)
    attrs = after.partition(")")[2]
    if opcode == "parameter":
      return scope.param(int(after.partition(")")[0]))
    if opcode == "get-tuple-element":
      if defs.get(ops[0], ("", ""))[1] != "parameter":
        raise _Unknown()
      return scope.element(int(re.search(r"index=(\d+)", attrs).group(1)))
    if opcode == "constant":
      text = after.partition(")")[0].replace("{", " ").replace("}", " ").replace(",", " ")
      try:
        values = [{"true": 1, "false": 0}.get(t, None) if t in ("true", "false") else float(t)
                  for t in text.split()]
      except ValueError as e:
        raise _Unknown() from e
      return self._typed(np.array(values).reshape(dims), dtype)
    if opcode == "iota":
      axis = int(re.search(r"iota_dimension=(\d+)", attrs).group(1))
      shape_ = [1] * len(dims)
      shape_[axis] = dims[axis]
      return np.broadcast_to(np.arange(dims[axis]).reshape(shape_), dims)
    if opcode == "partition-id":
      if scope.device is None:
        raise _NeedsDevice()
      return np.array(scope.device)
    if opcode == "copy-done":  # Of an asynchronous copy-start, whose operand is the value.
      start = defs.get(ops[0])
      if not start or start[1] != "copy-start":
        raise _Unknown()
      return self.value(_operands(start[2])[0], scope)
    if opcode == "fusion":
      callee = _CALLEES.search(attrs).group(1)
      args = [self.value(o, scope) for o in ops]
      inner = _Scope(callee, lambda k: args[k], _unknown, scope.device, {})
      return self.value(self.root(callee), inner)
    args = [self.value(o, scope) for o in ops]
    if opcode in _BINARY:
      out = _BINARY[opcode](args[0], args[1])
    elif opcode == "compare":
      out = _COMPARE[re.search(r"direction=(\w+)", attrs).group(1)](args[0], args[1])
    elif opcode == "select":
      out = np.where(args[0], args[1], args[2])
    elif opcode == "clamp":
      out = np.clip(args[1], args[0], args[2])
    elif opcode in ("not", "negate", "abs", "sign"):
      out = {"not": np.invert, "negate": np.negative, "abs": np.abs, "sign": np.sign}[opcode](
          args[0])
    elif opcode in ("copy", "bitcast", "reshape", "convert"):
      out = args[0]
    elif opcode == "broadcast":
      kept = [int(d) for d in re.search(r"dimensions=\{([\d,]*)\}", attrs).group(1).split(",")
              if d]
      shape_ = [1] * len(dims)
      for axis, d in zip(kept, np.shape(args[0])):
        shape_[axis] = d
      out = np.broadcast_to(np.reshape(args[0], shape_), dims)
    elif opcode == "slice":
      spans = re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", attrs)
      out = args[0][tuple(slice(int(a), int(b), int(c or 1)) for a, b, c in spans)]
    elif opcode == "dynamic-slice":
      sizes = [int(d) for d in re.search(r"dynamic_slice_sizes=\{([\d,]*)\}", attrs).group(1)
               .split(",") if d]
      operand = args[0]
      starts = [int(np.clip(int(i), 0, n - k)) for i, n, k in zip(args[1:], operand.shape, sizes)]
      out = operand[tuple(slice(a, a + k) for a, k in zip(starts, sizes))]
    elif opcode == "concatenate":
      axis = int(re.search(r"dimensions=\{(\d+)\}", attrs).group(1))
      out = np.concatenate(args, axis=axis)
    else:
      raise _Unknown()
    return self._typed(np.reshape(out, dims), dtype)

  @staticmethod
  def _typed(value: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "pred":
      return value != 0
    if re.fullmatch(r"[su]\d+", dtype):
      return np.trunc(value).astype(np.int64)
    return value.astype(np.float64)


def _loop(line: str, caller, condition_lines) -> tuple[int, int, int] | None:
  """``(trips, counter's tuple index, its start)`` of a while loop, or None.

  The CPU compiler annotates a loop (``known_trip_count``, its induction
  variable and start); the TPU compiler does not, so they are read off the
  condition: a ``lax.scan`` or ``fori_loop`` loop's condition is ``counter <
  C``, the counter's initial value a constant in the loop's operand tuple and
  its step 1 (how JAX lowers them): ``C - start`` trips.
  """
  known, index, init = _TRIP.search(line), _INDUCTION.search(line), _INIT.search(line)
  if known and index and init:
    return int(known.group(1)), int(index.group(1)), int(init.group(1))
  condition = _definitions(condition_lines)
  roots = [_INSTRUCTION.match(l).group("name") for l in condition_lines
           if l.strip().startswith("ROOT")]
  if not roots or condition[roots[0]][1] != "compare":
    return None
  after = condition[roots[0]][2]
  lhs, rhs = _operands(after)[:2]
  direction = re.search(r"direction=(\w+)", after)
  if direction and direction.group(1) == "GT":
    lhs, rhs = rhs, lhs
  elif not direction or direction.group(1) != "LT":
    return None
  counter = condition.get(lhs)
  if counter is None or counter[1] != "get-tuple-element":
    return None
  index = int(re.search(r"index=(\d+)", counter[2]).group(1))
  operand = caller.get(_operands(line.split(" while(", 1)[1])[0])
  if operand is None or operand[1] != "tuple":
    return None
  evaluator = _Evaluator({}, {"condition": condition, "caller": caller})
  try:
    bound = int(evaluator.value(rhs, _Scope("condition", _unknown, _unknown, None, {})))
    start = int(evaluator.value(_operands(operand[2])[index],
                                _Scope("caller", _unknown, _unknown, None, {})))
  except _Unknown:
    return None
  return max(bound - start, 0), index, start


def _branch_names(match) -> list[str]:
  names = match.group(1) or f"{match.group(2)},{match.group(3)}"
  return [b.strip().lstrip("%") for b in names.split(",")]


def collectives_per_step(hlo_text: str, steps_per_call: int = 1) -> dict[str, dict[str, float]]:
  """``{kind: {"count_min", "count_max", "count_mean", "bytes_min", ..., "received_mean"}}``
  per step, per device (``received``: `Collective.received_bytes`, averaged over the
  devices).

  Each collective counts as often as the loops around it run (their trip
  counts, `_loop`), divided by ``steps_per_call`` (the steps one call runs,
  e.g. ``scan_steps``). A conditional directly in a loop body whose branch
  index is a static function of the loop counter and the device (the
  executed timetables' slot tables: constants indexed by the slot, the
  stage's ``axis_index``) counts the branch it takes at each trip, on each
  device (`_Evaluator`); ``_min``, ``_max`` and ``_mean`` are then the least
  busy device's, the busiest's and the devices' mean. Any other conditional is
  bounded: ``_min`` takes its cheapest branch (per kind), ``_max`` and
  ``_mean`` its costliest. A loop whose trip count cannot be read counts once,
  with a warning. Without loops and conditionals, min = max = mean = the
  static `collective_summary`.
  """
  if int(steps_per_call) != steps_per_call or steps_per_call < 1:
    raise ValueError(f"steps_per_call must be a positive int, got {steps_per_call!r}.")
  counter = _Counter(hlo_text)
  total = counter.ranges(counter.entry) / steps_per_call
  return {kind: {f"{figure}_{bound}": float(total[b, f, i])
                 for f, figure in enumerate(("count", "bytes", "received"))
                 for b, bound in enumerate(("min", "max", "mean"))}
          for i, kind in enumerate(KINDS)}


def collectives_per_trip(hlo_text: str) -> np.ndarray:
  """``[trips, devices, kinds]``: the bytes of the collectives (their results, `KINDS`) each
  trip of the module's slot loop runs on each device.

  The slot loop is the outermost while loop (the first met from the entry
  computation, callers before callees) whose body holds conditionals: the scan
  over the executed timetables' slots (`collectives_per_step`), so this shows
  when, in the step, each chip communicates. A conditional whose branch cannot
  be read counts its costliest branch.
  """
  counter = _Counter(hlo_text)
  queue, seen = [counter.entry], {counter.entry}
  while queue:
    caller = queue.pop(0)
    lines = counter.bodies.get(caller, [])
    defs = _definitions(lines)
    for line in lines:
      loop = _WHILE.search(line)
      if loop and " while(" in line:
        info = _loop(line, defs, counter.bodies.get(loop.group(1), []))
        body = info and _LoopBody(counter, caller, defs, line, loop.group(2), *info[1:])
        if body and body.conditionals:
          rest = body.unconditional()
          return np.array([[(rest + body.trip(i, device))[1, 1] for device in counter.devices]
                           for i in range(info[0])])
      for group in _CALLS.findall(line):
        for callee in (c.strip().lstrip("%") for c in group.split(",")):
          if callee not in seen:
            seen.add(callee)
            queue.append(callee)
  raise ValueError("The program has no loop with conditionals: per-trip figures are for the "
                   "executed timetables' slot loops (parallelism='model' or 'zero').")


def _zeros() -> np.ndarray:
  """``[min|max|mean, count|bytes|received, kind]``: the figures of one run of some HLO."""
  return np.zeros((3, 3, len(KINDS)))


class _Counter:
  """The collectives of each computation of a module, counted per run (`collectives_per_step`)."""

  def __init__(self, hlo_text: str):
    self.bodies, self.entry = _computations(hlo_text)
    header = re.search(r"num_partitions=(\d+)", hlo_text.partition("\n")[0])
    self.devices = range(int(header.group(1)) if header else 1)
    self.evaluator = _Evaluator(self.bodies)
    self.memo: dict[str, np.ndarray] = {}

  def own(self, name: str) -> np.ndarray:
    """The collectives computation ``name`` itself holds."""
    out = _zeros()
    for c in collectives("\n".join(self.bodies.get(name, []))):
      out[:, :, KINDS.index(c.kind)] += (1, c.bytes, c.received_bytes(len(self.devices)))
    return out

  def ranges(self, name: str) -> np.ndarray:
    """One run of computation ``name`` and what it calls, conditionals bounded."""
    if name not in self.memo:
      self.memo[name] = _zeros()  # Cuts cycles; computations form a DAG.
      defs = _definitions(self.bodies.get(name, []))
      self.memo[name] = self.own(name) + sum(
          (self.line_ranges(name, defs, line) for line in self.bodies.get(name, [])), _zeros())
    return self.memo[name]

  def bounded(self, branches) -> np.ndarray:
    """A conditional: its cheapest branch per kind (min) and its costliest (max, and the
    mean device's: which branch it takes is not known)."""
    each = np.stack([self.ranges(b) for b in branches])
    return np.stack([each[:, 0].min(axis=0), each[:, 1].max(axis=0), each[:, 2].max(axis=0)])

  def line_ranges(self, name: str, defs, line: str) -> np.ndarray:
    """What one instruction of computation ``name`` runs: a loop, a conditional or called
    computations."""
    loop, branches = _WHILE.search(line), _BRANCHES.search(line)
    if loop and " while(" in line:
      return self.loop_ranges(name, defs, line, loop.group(1), loop.group(2))
    if branches:
      return self.bounded(_branch_names(branches))
    return sum((self.ranges(callee) for callee in _CALLEES.findall(line)), _zeros())

  def loop_ranges(self, caller: str, defs, line: str, condition: str, body: str) -> np.ndarray:
    """A while loop: its trips, with the branch each trip's conditionals take where it can be
    read (`_LoopBody`)."""
    info = _loop(line, defs, self.bodies.get(condition, []))
    if info is None:
      warnings.warn(f"Loop {body} has no readable trip count; counted once.")
      return self.ranges(body)
    trips = info[0]
    loop = _LoopBody(self, caller, defs, line, body, *info[1:])
    if not loop.conditionals:
      return trips * self.ranges(body)
    rest = loop.unconditional()
    try:  # One pass when the branches do not depend on the device, else one per device.
      per_device = [sum((loop.trip(i, None) for i in range(trips)), _zeros())]
    except _NeedsDevice:
      per_device = [sum((loop.trip(i, d) for i in range(trips)), _zeros())
                    for d in self.devices]
    per_device = np.broadcast_to(per_device, (len(per_device),) + _zeros().shape)
    return trips * rest + np.stack([per_device[:, 0].min(axis=0), per_device[:, 1].max(axis=0),
                                    per_device[:, 2].mean(axis=0)])


class _LoopBody:
  """One while loop's body: the branch its conditionals take at each trip, on each device."""

  def __init__(self, counter: _Counter, caller: str, caller_defs, line: str, body: str,
               index: int, start: int):
    self.counter, self.body, self.index, self.start = counter, body, index, start
    self.defs = _definitions(counter.bodies.get(body, []))
    self.conditionals = [(_INSTRUCTION.match(l).group("name"), _BRANCHES.search(l))
                         for l in counter.bodies.get(body, []) if _BRANCHES.search(l)]
    if not self.conditionals:
      return
    root = self.defs[counter.evaluator.root(body)]
    self.returned = _operands(root[2]) if root[1] == "tuple" else []
    self.init = _operands(caller_defs[_operands(line.split(" while(", 1)[1])[0]][2])
    self.caller = caller
    self.caller_scopes = {}

  def unconditional(self) -> np.ndarray:
    """What every trip runs: the body's collectives outside its conditionals."""
    counter = self.counter
    return counter.own(self.body) + sum(
        (counter.line_ranges(self.body, self.defs, l)
         for l in counter.bodies.get(self.body, []) if not _BRANCHES.search(l)), _zeros())

  def source(self, name: str):
    """What ``name`` copies: the TPU compiler moves a loop-invariant table between memory
    spaces (``copy-start``/``copy-done``, ``copy``) before the body returns it."""
    while name in self.defs and self.defs[name][1] in ("copy-done", "copy-start", "copy",
                                                       "bitcast"):
      name = _operands(self.defs[name][2])[0]
    return self.defs.get(name)

  def passed_from(self, k: int) -> int | None:
    """The element of the loop's state that the body returns as element ``k``, if any."""
    passed = self.source(self.returned[k]) if k < len(self.returned) else None
    if not passed or passed[1] != "get-tuple-element":
      return None
    return int(re.search(r"index=(\d+)", passed[2]).group(1))

  def invariant(self, k: int, device) -> np.ndarray:
    """Element ``k`` of the loop's state, when the body passes it through unchanged, or
    returns a copy of an element that is (the TPU compiler may keep a table twice, one
    copy per memory space) and starts equal to it."""
    evaluator = self.counter.evaluator
    if device not in self.caller_scopes:
      self.caller_scopes[device] = _Scope(self.caller, _unknown, _unknown, device, {})
    scope = self.caller_scopes[device]
    value = evaluator.value(self.init[k], scope)
    other = self.passed_from(k)
    if other is None or self.passed_from(other) != other or not np.array_equal(
        value, evaluator.value(self.init[other], scope)):
      raise _Unknown()
    return value

  def trip(self, i: int, device) -> np.ndarray:
    """The branches the conditionals take at trip ``i`` on ``device`` (None: any device)."""
    element = lambda k: np.array(self.start + i) if k == self.index else self.invariant(k, device)
    scope = _Scope(self.body, _unknown, element, device, {})
    out = _zeros()
    for name, match in self.conditionals:
      branches = _branch_names(match)
      try:
        index = int(self.counter.evaluator.value(_operands(self.defs[name][2])[0], scope))
      except _NeedsDevice:
        raise
      except _Unknown:
        out += self.counter.bounded(branches)
        continue
      if match.group(2):  # A predicate: true runs the first (true_computation).
        index = 1 - bool(index)
      out += self.counter.ranges(branches[index if 0 <= index < len(branches) else -1])
    return out


def stablehlo_collectives(lowered_text: str) -> dict[str, int]:
  """``{kind: count}`` over `KINDS` of lowered StableHLO, ``jit(f).lower(*a).as_text()``.

  This is the program as JAX emitted it, before XLA combines collectives. Kinds
  use the HLO spelling (``all-reduce`` for ``stablehlo.all_reduce``).
  """
  counts = dict.fromkeys(KINDS, 0)
  for op in _STABLEHLO.findall(lowered_text):
    counts[op.replace("_", "-")] += 1
  return counts
