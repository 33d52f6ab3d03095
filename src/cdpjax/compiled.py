"""Figures read from compiled XLA programs: collectives, memory and FLOPs.

`collectives` and the ``count`` and ``bytes`` of `collective_summary` are
static: a collective inside a loop body (``lax.scan``) or a conditional branch
counts once. `collectives_per_step` weights each one by the trip counts of the
loops around it, and bounds what conditionals run (cheapest and costliest
branch). All figures are per device. Collectives are parsed from the HLO text by
hand because jax exposes no public per-instruction API.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import NamedTuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
"""Collective kinds, as XLA's HLO spells them."""

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_GROUPS = re.compile(  # {{0,1},{2,3}} or the iota form [2,4]<=[4,2]T(1,0).
    r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
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
    match = any(kind in line for kind in KINDS) and _INSTRUCTION.match(line)
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
  """
  name: str
  kind: str
  bytes: int
  position: int
  compute_after: int


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
  the entry computation.

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
  scheduled = []
  for position, line in enumerate(instructions):
    name = _INSTRUCTION.match(line).group("name")
    if name in found:
      c = found[name]
      scheduled.append(ScheduledCollective(
          name=name, kind=c.kind, bytes=c.bytes, position=position,
          compute_after=sum(is_compute[position + 1:])))
  return scheduled, sum(is_compute)


def collective_summary(hlo_text: str, steps_per_call: int = 1) -> dict[str, dict]:
  """Per kind of `KINDS` (zeros included), the collectives of compiled HLO, static and per step.

  ``count`` and ``bytes`` are static: each instruction once. ``count_min``,
  ``count_max``, ``bytes_min`` and ``bytes_max`` are per step
  (`collectives_per_step`): weighted by loop trip counts and divided by
  ``steps_per_call``, with every conditional taking its cheapest (``_min``) or
  its costliest (``_max``) branch.
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
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


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


def _scalar_constant(name: str, defs) -> int | None:
  """The integer a scalar resolves to, through copies and conversions; None if not a constant."""
  while name in defs:
    _, opcode, after = defs[name]
    if opcode == "constant":
      match = re.match(r"\s*(-?\d+)\)", after)
      return int(match.group(1)) if match else None
    if opcode not in _PASS_THROUGH:
      return None
    name = _operands(after)[0]
  return None


def _trip_count(line: str, caller, condition) -> int | None:
  """A while loop's trip count: XLA's ``known_trip_count``, else read off its condition.

  The TPU compiler's HLO carries no ``known_trip_count``; a ``lax.scan`` or
  ``fori_loop`` loop's condition is ``counter < C`` with the counter's initial
  value a constant ``c0`` in the loop's operand tuple and a step of 1 (how JAX
  lowers them): ``C - c0`` trips. None where the loop has another form.
  """
  known = _TRIP.search(line)
  if known:
    return int(known.group(1))
  roots = [_INSTRUCTION.match(l).group("name") for l in condition.get("__lines__", ())
           if l.strip().startswith("ROOT")]
  if not roots or condition[roots[0]][1] != "compare":
    return None
  _, _, after = condition[roots[0]]
  lhs, rhs = _operands(after)[:2]
  direction = re.search(r"direction=(\w+)", after)
  if direction and direction.group(1) == "GT":
    lhs, rhs = rhs, lhs
  elif not direction or direction.group(1) != "LT":
    return None
  bound, counter = _scalar_constant(rhs, condition), condition.get(lhs)
  if bound is None or counter is None or counter[1] != "get-tuple-element":
    return None
  index = int(re.search(r"index=(\d+)", counter[2]).group(1))
  operand = caller.get(_operands(line.split(" while(", 1)[1])[0])
  if operand is None or operand[1] != "tuple":
    return None
  start = _scalar_constant(_operands(operand[2])[index], caller)
  return None if start is None else max(bound - start, 0)


def collectives_per_step(hlo_text: str, steps_per_call: int = 1) -> dict[str, dict[str, float]]:
  """``{kind: {"count_min", "count_max", "bytes_min", "bytes_max"}}`` per step, per device.

  Each collective counts as often as the loops around it run (their trip
  counts, `_trip_count`), divided by ``steps_per_call`` (the steps one call
  runs, e.g. ``scan_steps``). Which branch of a conditional runs is decided at
  run time, so the ``_min`` figures take each conditional's cheapest branch
  (per kind) and the ``_max`` figures its costliest: a collective inside a
  branch is bounded, not counted. A loop whose trip count cannot be read counts
  once, with a warning. Without loops and conditionals, min = max = the static
  `collective_summary`.
  """
  if int(steps_per_call) != steps_per_call or steps_per_call < 1:
    raise ValueError(f"steps_per_call must be a positive int, got {steps_per_call!r}.")
  bodies, entry = _computations(hlo_text)
  column = {kind: i for i, kind in enumerate(KINDS)}
  memo: dict[str, np.ndarray] = {}

  def ranges(name: str) -> np.ndarray:
    """``[min|max, count|bytes, kind]`` of one run of computation ``name``."""
    if name in memo:
      return memo[name]
    memo[name] = out = np.zeros((2, 2, len(KINDS)))  # Cuts cycles; computations form a DAG.
    lines = bodies.get(name, [])
    for c in collectives("\n".join(lines)):
      out[:, :, column[c.kind]] += (1, c.bytes)
    defs = _definitions(lines)
    for line in lines:
      loop, branches = _WHILE.search(line), _BRANCHES.search(line)
      if loop and " while(" in line:
        condition = _definitions(bodies.get(loop.group(1), []))
        condition["__lines__"] = bodies.get(loop.group(1), [])
        trips = _trip_count(line, defs, condition)
        if trips is None:
          warnings.warn(f"Loop {loop.group(2)} has no readable trip count; counted once.")
          trips = 1
        out += trips * ranges(loop.group(2))
      elif branches:
        names = (branches.group(1) or f"{branches.group(2)},{branches.group(3)}").split(",")
        each = np.stack([ranges(b.strip().lstrip("%")) for b in names])
        out[0] += each[:, 0].min(axis=0)
        out[1] += each[:, 1].max(axis=0)
      else:
        for callee in _CALLEES.findall(line):
          out += ranges(callee)
    return out

  total = ranges(entry) / steps_per_call
  return {kind: {"count_min": float(total[0, 0, i]), "count_max": float(total[1, 0, i]),
                 "bytes_min": float(total[0, 1, i]), "bytes_max": float(total[1, 1, i])}
          for kind, i in column.items()}


def stablehlo_collectives(lowered_text: str) -> dict[str, int]:
  """``{kind: count}`` over `KINDS` of lowered StableHLO, ``jit(f).lower(*a).as_text()``.

  This is the program as JAX emitted it, before XLA combines collectives. Kinds
  use the HLO spelling (``all-reduce`` for ``stablehlo.all_reduce``).
  """
  counts = dict.fromkeys(KINDS, 0)
  for op in _STABLEHLO.findall(lowered_text):
    counts[op.replace("_", "-")] += 1
  return counts


def memory(compiled) -> dict[str, int]:
  """Per-device byte counts from ``compiled.memory_analysis()``.

  ``peak_bytes`` is the usual estimate argument + output + temp - alias
  (aliased outputs reuse argument buffers); XLA reports no true peak.
  """
  stats = compiled.memory_analysis()
  out = {
      "argument_bytes": stats.argument_size_in_bytes,
      "output_bytes": stats.output_size_in_bytes,
      "temp_bytes": stats.temp_size_in_bytes,
      "alias_bytes": stats.alias_size_in_bytes,
      "generated_code_bytes": stats.generated_code_size_in_bytes,
  }
  out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                       - out["alias_bytes"])
  return out


def flops(compiled) -> float:
  """FLOPs of a compiled program (0 when XLA counts none, e.g. pure data movement)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
    analysis = analysis[0]
  return float((analysis or {}).get("flops", 0.0))
