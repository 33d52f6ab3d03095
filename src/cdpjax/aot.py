"""Plan a TPU run on any machine: compile the configured step for a TPU topology, ahead of time.

With ``jax[tpu]`` installed (``pip install -e ".[tpu]"``, which brings
libtpu), ``jax.experimental.topologies`` describes the chips of a TPU slice or
pod, such as the 256 chips of ``v5e:16x16``, without a TPU. The configured
train step is lowered on a mesh of those chips from abstract inputs (shapes
and shardings only: no parameter is allocated) and compiled by the real TPU
compiler, which reports the program's per-chip memory, its collectives and
its FLOPs. Nothing is executed.

  cdpjax-compile --config configs/digits.py --topology v5e:2x4 --workdir runs/plan
"""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import compiled

GIB = 1 << 30
# HBM per chip, from the Cloud TPU documentation's system architecture pages
# ("TPU v4", "TPU v5e", "TPU v5p", "TPU v6e"), read 2026-12.
CHIP_HBM_BYTES = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5litepod": 16 * GIB, "v5p": 95 * GIB,
                  "v6e": 32 * GIB}
_TOPOLOGY = re.compile(r"^(?P<chip>v\d+[a-z]*|v5litepod):(?P<shape>\d+(?:x\d+)*)$")


def chip_of(topology: str) -> str:
  """The chip name of ``"v5e:16x16"`` (``"v5e"``); ValueError naming the valid forms."""
  match = _TOPOLOGY.match(topology)
  if not match or match.group("chip") not in CHIP_HBM_BYTES:
    raise ValueError(
        f"Unknown TPU topology {topology!r}: use CHIP:SHAPE with CHIP in "
        f"{sorted(CHIP_HBM_BYTES)} and SHAPE the chips per dimension, e.g. v5e:2x4, "
        "v5e:16x16, v5p:4x4x4 (v4 and v5p count chips in three dimensions).")
  return match.group("chip")


def _quiet_libtpu(chip: str, num_chips: int) -> None:
  """Spares the user libtpu's warnings about the TPU VM it is not running on.

  Without a TPU, libtpu looks for the VM's accelerator type and worker list
  and prints an error for each one it cannot find; compiling needs neither.
  """
  accelerator = f"{'v5litepod' if chip == 'v5e' else chip}-{num_chips}"
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", accelerator),
                     ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0")):
    os.environ.setdefault(key, value)


def topology_devices(topology: str) -> list:
  """The chips of a TPU topology (compile-only devices), e.g. 256 for ``v5e:16x16``."""
  chip = chip_of(topology)
  num_chips = 1
  for size in topology.split(":")[1].split("x"):
    num_chips *= int(size)
  _quiet_libtpu(chip, num_chips)
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    description = topologies.get_topology_desc(topology, "tpu")
  except Exception as e:  # pylint: disable=broad-except  (libtpu missing: several error types)
    raise RuntimeError(
        f"Cannot describe TPU topology {topology!r} ({type(e).__name__}: {e}). Compiling for "
        "TPU needs libtpu: pip install -e '.[tpu]'.") from e
  return list(description.devices)


def abstract(tree, sharding):
  """``tree``'s arrays as ``jax.ShapeDtypeStruct`` on ``sharding``: inputs for ``lower``."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a),
                                                     sharding=sharding), tree)


def report(lowered, topology: str) -> dict:
  """What the TPU compiler makes of ``lowered``: per-chip memory, collectives, FLOPs, fit.

  ``peak_bytes`` is XLA's argument + output + temp - alias estimate; ``fits``
  compares it with the chip's HBM (`CHIP_HBM_BYTES`).
  """
  program = lowered.compile()
  memory = compiled.memory(program)
  analysis = program.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0]
  hbm = CHIP_HBM_BYTES[chip_of(topology)]
  return {
      "topology": topology,
      "chips": len(lowered.compile_args.get("device_assignment", ()) or ()) or None,
      "memory_per_chip": memory,
      "hbm_per_chip_bytes": hbm,
      "fits": memory["peak_bytes"] <= hbm,
      "collectives": compiled.collective_summary(program.as_text()),
      "flops": float((analysis or {}).get("flops", 0.0)),
      "optimal_seconds": float((analysis or {}).get("optimal_seconds", float("nan"))),
  }


def write(result: dict, workdir: str) -> str:
  """Writes ``compile.json`` in ``workdir``; returns its path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "compile.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  return path


def replicated_and_rows(mesh, axis: str):
  """The two shardings every step needs: the replicated state and rows split over ``axis``."""
  return NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))
