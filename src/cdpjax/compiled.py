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
  "temp_ranges": [...], "temp_arrays": bytes, "temp_tuple_tables": count}``:
  kinds ``parameter`` (arguments), ``temp`` (the heap of temporaries at its
  peak), ``output``, ``thread-local``, ``constant``; ``temp_ranges``, the
  disjoint byte ranges of that heap holding values of at least 2% of it
  (``{"offset", "bytes", "values"}``, a few value names and shapes each): the
  large temporaries the program needs at some point together, as the compiler
  placed them. ``temp_arrays``: the bytes of the heap that arrays cover; the
  rest is tuple tables (``temp_tuple_tables`` of them: the TPU compiler gives
  each a 16 KiB slot, which dominates small programs' heaps) and alignment.
  """
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
  by_kind, heap, tuples = {}, [], set()
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
        if shape.startswith("("):
          tuples.add(int(o))
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
  return {"spaces": spaces, "default_by_kind": by_kind, "temp_ranges": ranges,
          "temp_arrays": arrays, "temp_tuple_tables": len(tuples)}


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
