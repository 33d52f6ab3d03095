"""What the experiment scripts share: flags, the results folder and JSON output."""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import time
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def parser(name: str, doc: str, timed: bool = False) -> argparse.ArgumentParser:
  """An argument parser with ``--results_dir`` (default ``results/<name>``) and ``--quick``.

  ``timed``: also ``--cpus`` (default 1), the CPUs a benchmark that times steps
  runs on when started as a script (`pin`).
  """
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--results_dir", default=str(REPO / "results" / name),
                 help=f"Folder for the JSON and PNG outputs (default: results/{name}).")
  p.add_argument("--quick", action="store_true", help="A tiny run for smoke tests.")
  if timed:
    p.add_argument("--cpus", type=int, default=1,
                   help="Run on this many CPUs (0: all) when started as a script.")
  return p


def pin(args, as_script: bool) -> None:
  """Applies ``--cpus`` (`pin_cpus`) in a script; a caller in-process (tests) keeps its CPUs."""
  if as_script and args.cpus:
    pin_cpus(args.cpus)


def results_dir(args) -> pathlib.Path:
  path = pathlib.Path(args.results_dir)
  path.mkdir(parents=True, exist_ok=True)
  return path


def write_json(path: pathlib.Path, obj) -> None:
  path.write_text(json.dumps(obj, indent=2, default=float) + "\n")


def interleaved_step_times(programs: dict, *, steps: int, warmup: int) -> dict:
  """Median seconds per step of each ``name: (step_fn, state, batch)``.

  One step of each program in turn, so machine drift hits all of them alike;
  the first ``warmup`` rounds are not timed.
  """
  return interleaved_repeats(programs, steps=steps, warmup=warmup, repeats=1)[0]


def interleaved_repeats(programs: dict, *, steps: int, warmup: int, repeats: int) -> list[dict]:
  """`interleaved_step_times` of ``repeats`` blocks of ``steps`` rounds in a row, one dict a
  block; the states run on from block to block (the steps donate them)."""
  import jax  # pylint: disable=g-import-not-at-top
  states = {name: state for name, (_, state, _) in programs.items()}
  times = {name: [] for name in programs}
  for it in range(warmup + steps * repeats):
    for name, (step, _, batch) in programs.items():
      start = time.perf_counter()
      states[name], metrics = step(states[name], batch)
      jax.block_until_ready((states[name], metrics))
      if it >= warmup:
        times[name].append(time.perf_counter() - start)
  return [{name: float(statistics.median(t[r * steps:(r + 1) * steps]))
           for name, t in times.items()} for r in range(repeats)]


def pin_cpus(count: int) -> list[int]:
  """Runs this process on the first ``count`` CPUs it may use; call it before JAX's CPU client starts.

  XLA's CPU runtime splits a loop fusion into tasks for its thread pool (one
  thread per CPU the process may use); on this shared 2-core machine handing a
  task to the other core cost 0.6-2.4 ms in 5 of 6 processes, a 40-150x
  slowdown of a 0.5 MB concatenate that took 0.016 ms in all 6 pinned ones
  (BENCHMARKS.md). Threads started after the call inherit the CPUs.
  """
  cpus = sorted(os.sched_getaffinity(0))[:count]
  os.sched_setaffinity(0, cpus)
  return cpus


def machine() -> dict:
  """What the figures were measured on: CPU model, cores (and those used), Python, jax, date."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
          "python": platform.python_version(),
          "jax": importlib.metadata.version("jax"),
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
