"""Figures read from compiled XLA programs (memory, FLOPs, their HLO text) and the XLA options
cdpjax's train steps are compiled with (`compiler_options`). The collectives of that text are
read by `cdpjax.hlo`.
"""
from __future__ import annotations

import numpy as np


def hlo_text(compiled) -> str:
  """The HLO text of a compiled program with every constant printed in full.

  ``compiled.as_text()`` elides large constants (``{...}``), among them the
  executed timetables' slot tables, which `hlo.collectives_per_step` reads to
  know the branch each slot takes; jax has no public option to print them, so
  this uses jaxlib's ``HloPrintOptions``.
  """
  from jaxlib import _hlo  # pylint: disable=g-import-not-at-top
  options = _hlo.HloPrintOptions()
  options.print_large_constants = True
  return "\n".join(m.to_string(options) for m in compiled.runtime_executable().hlo_modules())


def compiler_options(mesh) -> dict[str, object]:
  """XLA options for a train step on ``mesh``'s platform: ``jax.jit(compiler_options=...)``.

  On the CPU, copy insertion's region analysis
  (``xla_cpu_copy_insertion_use_region_analysis``, off by default). Without
  it XLA copies a loop-carried version that changes place (``theta_t`` into
  the stale slot of a ``lax.scan`` of steps) three times per step where one
  suffices (docs/design_notes.md, "What was tried in the code"). The GPU
  has the same option (``xla_gpu_...``), not set: not measured here. The TPU's copy
  insertion is left as it is (one copy per version in our AOT checks).

  On the CPU, also no YNN fusion (``xla_cpu_experimental_ynn_fusion_type``
  empty): jaxlib 0.10.2's fuses a chain of pads and adds into a kernel that
  writes zeros for one gradient leaf (docs/xla_cpu_miscompile.md).
  """
  platform = np.asarray(mesh.devices).flat[0].platform
  if platform != "cpu":
    return {}
  return {"xla_cpu_copy_insertion_use_region_analysis": True,
          "xla_cpu_experimental_ynn_fusion_type": ""}


def buffer_assignment(dump_dir: str) -> dict:
  """Bytes per memory space of the buffer assignment XLA dumped into ``dump_dir``, and the
  default space's by kind of allocation.

  Compile with ``compiler_options={"xla_dump_to": dump_dir}``; XLA writes a
  memory-usage report per program, whose ``Total bytes`` of a memory space is
  every allocation there. On the TPU, ``default`` is the chip's HBM and
  ``vmem`` its on-chip memory. ``memory_analysis()`` is not this: on the TPU
  its temp counted on-chip buffers and missed HBM ones (ZeRO-3 of the quick
  LM: temp 0 against a 1.8 MB HBM heap; BENCHMARKS.md, "Pod plan"). One
  program in ``dump_dir``.

  Returns ``{"spaces": {name: bytes}, "default_by_kind": {kind: bytes},
  "temp_ranges": [...], "temp_arrays": bytes, "temp_tuple_tables": count,
  "temp_tuple_tables_by_kind": {kind: count}, "temp_live_peak": {...}}``:
  kinds ``parameter`` (arguments), ``temp`` (the heap of temporaries at its
  peak), ``output``, ``thread-local``, ``constant``; ``temp_ranges``, the
  disjoint byte ranges of that heap holding values of at least 2% of it
  (``{"offset", "bytes", "values"}``, a few value names and shapes each): the
  large temporaries the program needs at some point together, as the compiler
  placed them. ``temp_arrays``: the bytes of the heap that arrays cover; the
  rest is tuple tables (``temp_tuple_tables`` of them: the TPU compiler gives
  each a 16 KiB slot, which dominates small programs' heaps) and alignment;
  ``temp_tuple_tables_by_kind`` counts them by the instruction that makes the
  tuple (``fusion`` for every multi-output fusion, ``collective-permute-start``
  for each permute instruction, ``tuple`` for a conditional branch's or a
  loop's results...), most first.
  ``temp_live_peak`` (`_live_peak`): the most bytes of that heap live at once
  and the largest values then, from the dumped live ranges (None without them).
  """
  import collections  # pylint: disable=g-import-not-at-top
  import glob  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  found = {}
  for kind in ("memory-usage-report", "buffer-assignment"):
    found[kind] = glob.glob(f"{dump_dir}/*after_optimizations-{kind}.txt")
    if len(found[kind]) != 1:
      raise ValueError(
          f"Expected one XLA {kind} in {dump_dir}, found {len(found[kind])}: compile one program "
          "with compiler_options={'xla_dump_to': dump_dir}.")
  with open(found["memory-usage-report"][0]) as f:
    spaces = {name: int(total) for name, total in re.findall(
        r"^Memory Space: (\S+) \(color=\d+\)\nTotal bytes: (\d+)", f.read(), re.M)}
  by_kind, heap, tuples = {}, [], {}
  with open(found["buffer-assignment"][0]) as f:
    text = f.read()
  for size, rest, values in re.findall(
      r"^allocation \d+: size (\d+), (.*):\n((?: value: .*\n)*)", text, re.M):
    if rest.startswith("color"):
      continue  # Another memory space.
    kind = next((k for k, word in (("parameter", "parameter"), ("temp", "preallocated-temp"),
                                   ("output", "output"), ("output", "maybe-live-out"),
                                   ("thread-local", "thread-local"), ("constant", "constant"))
                 if rest.startswith(word)), "other")
    by_kind[kind] = by_kind.get(kind, 0) + int(size)
    if kind == "temp":
      for name, n, o, shape in re.findall(
          r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", values):
        if shape.startswith("("):  # A table's kind: the first value at its offset.
          tuples.setdefault(int(o), "fusion" if "fusion" in name
                            else re.sub(r"(\.\d+)?(\{.*\})?$", "", name))
        else:
          heap.append((int(o), int(n), f"{name} {shape}"))
  arrays, end = 0, 0  # The bytes of the heap that arrays cover (the union of their ranges).
  for offset, size, _ in sorted(heap):
    arrays += max(0, offset + size - max(offset, end))
    end = max(end, offset + size)
  ranges = []
  for offset, size, value in sorted(v for v in heap if v[1] >= 0.02 * by_kind.get("temp", 0)):
    if ranges and offset < ranges[-1]["offset"] + ranges[-1]["bytes"]:  # Overlaps: merge.
      last = ranges[-1]
      last["bytes"] = max(last["bytes"], offset + size - last["offset"])
      if value not in last["values"] and len(last["values"]) < 3:
        last["values"].append(value)
    else:
      ranges.append({"offset": offset, "bytes": size, "values": [value]})
  live = glob.glob(f"{dump_dir}/*after_optimizations-live-range.txt")
  peak = _live_peak(text, open(live[0]).read()) if len(live) == 1 else None
  return {"spaces": spaces, "default_by_kind": by_kind, "temp_ranges": ranges,
          "temp_arrays": arrays, "temp_tuple_tables": len(tuples),
          "temp_tuple_tables_by_kind": dict(collections.Counter(tuples.values()).most_common()),
          "temp_live_peak": peak}


def _live_peak(assignment: str, live_range: str, largest: int = 6) -> dict | None:
  """The most bytes of the temp heap live at once, from the dumped live ranges.

  A heap slot (offset and size) counts once while any value placed there is
  live; a loop's carried values (``phi``) hold their slot from the slot's first
  use to its last. ``bytes`` at most the heap's size: the rest of the heap is
  space the placement leaves between values live together. Returns
  ``{"bytes", "at": the instruction, "values": the largest live values}``, or
  None without a heap.
  """
  import re  # pylint: disable=g-import-not-at-top
  heap = re.search(r"^allocation \d+: size \d+, preallocated-temp:\n((?: value: .*\n)*)",
                   assignment, re.M)
  ranges = dict(re.findall(r"^    (\S+):(\d+-\d+)$", live_range, re.M))
  order = dict(re.findall(r"^    (\d+):(\S+)$", live_range, re.M))
  if not heap or not order:
    return None
  slots = {}  # (offset, size) -> [(start, end, name, shape, phi)]
  for name, phi, size, offset, shape in re.findall(
      r"value: <\d+ (\S+?)( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", heap.group(1)):
    key = name if name.endswith("}") else name + "{}"
    if key in ranges and int(size):
      start, end = map(int, ranges[key].split("-"))
      slots.setdefault((int(offset), int(size)), []).append((start, end, name, shape, bool(phi)))
  steps = max(map(int, order)) + 2
  occupied = np.zeros(steps, np.int64)
  for (_, size), values in slots.items():
    first, last = min(v[0] for v in values), max(v[1] for v in values)
    spans = sorted((first, last) if v[4] else (v[0], v[1]) for v in values)
    merged = []
    for a, b in spans:
      if merged and a <= merged[-1][1] + 1:
        merged[-1][1] = max(merged[-1][1], b)
      else:
        merged.append([a, b])
    for a, b in merged:
      occupied[a] += size
      occupied[b + 1] -= size
  occupied = np.cumsum(occupied)
  t = int(np.argmax(occupied))
  top = []  # One value per live slot (values sharing a slot are one buffer), largest first.
  for (_, size), values in slots.items():
    first, last = min(v[0] for v in values), max(v[1] for v in values)
    now = [v for v in values if v[0] <= t <= v[1] or (v[4] and first <= t <= last)]
    if now and not now[0][3].startswith("("):  # Arrays: a tuple's slot is its table.
      top.append({"bytes": size, "value": f"{now[0][2]} {now[0][3]}"})
  top = sorted(top, key=lambda v: -v["bytes"])[:largest]
  return {"bytes": int(occupied[t]), "at": order.get(str(t), ""), "values": top}


def memory(compiled) -> dict[str, int]:
  """Per-device byte counts from ``compiled.memory_analysis()``.

  ``peak_bytes`` is the usual estimate argument + output + temp - alias
  (aliased outputs reuse argument buffers). Not ``peak_memory_in_bytes``: on
  the CPU it left out arguments in our checks, and on the TPU it is neither
  this nor the HBM of the buffer assignment. The TPU's temp can exceed that
  HBM, so a peak just over a chip's HBM may still fit (docs/multihost.md,
  BENCHMARKS.md).
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
