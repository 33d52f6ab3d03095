"""Runs every benchmark and writes BENCHMARKS.md: their tables and the machine they ran on.

Each script of ``BENCHES`` (``experiments/bench_*.py``, ``tpu_plan.py``,
``executed_equivalence.py``) runs as a subprocess with its results folder
flag (``--out_dir``, ``--results_dir`` or ``--out``, whichever it defines)
pointing under ``--results_dir``, and ``--quick`` when given. The
report holds, per benchmark, the table it printed and the rows of the JSON it
wrote; a benchmark that does not exist yet or fails gets a section saying so.

  python experiments/report.py                 # full benchmarks -> BENCHMARKS.md
  python experiments/report.py --quick --output /tmp/BENCHMARKS.md
  python experiments/report.py --benches bench_overlap   # rerun one, keep the other sections
  python experiments/report.py --benches tpu_plan --bench_args=--cached_only  # compiled points only
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import _common

BENCHES = ("bench_engine", "bench_pipeline", "bench_zero", "bench_overlap", "tpu_plan",
           "executed_equivalence")
DEVICE_COUNT = 8


def bench_env() -> dict:
  """The environment benchmarks run in: 8 emulated CPU devices unless XLA_FLAGS sets a count."""
  env = dict(os.environ)
  if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={DEVICE_COUNT}").strip()
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  return env


def run_bench(script: pathlib.Path, out: pathlib.Path, quick: bool, timeout: float,
              extra_args: str = "") -> dict:
  """Runs one benchmark; returns its status, printed output and JSON files."""
  out.mkdir(parents=True, exist_ok=True)
  cmd = ([sys.executable, str(script), "--results_dir", str(out)] + (["--quick"] if quick else [])
         + shlex.split(extra_args))
  start = time.time()
  try:
    proc = subprocess.run(cmd, cwd=_common.REPO, env=bench_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {"command": cmd, "ok": False, "error": f"timed out after {timeout:.0f} s", "stdout": "",
            "json": {}, "seconds": time.time() - start}
  found = {str(p.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.rglob("*.json"))}
  return {"command": cmd, "ok": proc.returncode == 0, "stdout": proc.stdout,
          "error": proc.stderr[-3000:] if proc.returncode else "", "json": found,
          "seconds": time.time() - start}


def _flatten(row: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in row.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    elif isinstance(value, (int, float, str, bool)) or value is None:
      flat[prefix + key] = value
  return flat


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def json_tables(data) -> list[str]:
  """Markdown tables of every list of dicts in ``data`` (nested keys joined with dots)."""
  tables = []
  for key, value in (data.items() if isinstance(data, dict) else []):
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
      rows = [_flatten(v) for v in value]
      columns = list(dict.fromkeys(c for r in rows for c in r))
      lines = [f"`{key}`:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
      lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
      tables.append("\n".join(lines))
    elif isinstance(value, dict) and key != "config":
      tables += json_tables(value)
  return tables


def section(name: str, script: pathlib.Path, result: dict | None) -> str:
  lines = [f"## {name}", ""]
  if result is None:
    return "\n".join(lines + [f"Not run: `{script.name}` does not exist yet.", ""])
  command = " ".join("python" if c == sys.executable
                     else os.path.relpath(c, _common.REPO) if os.path.isabs(c) else c
                     for c in result["command"])
  lines += [f"Command: `{command}` ({result['seconds']:.0f} s)", ""]
  if not result["ok"]:
    lines += ["**Failed.**", "", "```", result["error"].strip() or "(no output)", "```", ""]
  if result["stdout"].strip():
    lines += ["Printed table:", "", "```", result["stdout"].strip(), "```", ""]
  for path, data in result["json"].items():
    lines += [f"From `{path}`:", ""] + [t + "\n" for t in json_tables(data)]
  return "\n".join(lines)


def previous_sections(path: pathlib.Path) -> dict[str, str]:
  """``{first word of the title: its "## title" section}`` of an existing report, or ``{}``."""
  if not path.exists():
    return {}
  chunks = re.split(r"^(?=## )", path.read_text(), flags=re.M)[1:]
  return {chunk.split()[1]: chunk.rstrip() + "\n" for chunk in chunks}


def main(argv=None) -> str:
  p = _common.parser("report", __doc__)
  p.add_argument("--output", default=str(_common.REPO / "BENCHMARKS.md"))
  p.add_argument("--bench_dir", default=str(_common.REPO / "experiments"),
                 help="Where the bench_*.py scripts are.")
  p.add_argument("--timeout", type=float, default=3600, help="Seconds per benchmark.")
  p.add_argument("--benches", nargs="+", choices=BENCHES, default=BENCHES,
                 help="Benchmarks to run; the sections of the others are kept from --output.")
  p.add_argument("--bench_args", default="",
                 help="More arguments for the benchmarks run, e.g. --cached_only for tpu_plan.")
  args = p.parse_args(argv)
  kept = previous_sections(pathlib.Path(args.output))
  out = _common.results_dir(args)
  host = _common.machine()
  parts = [
      "# Benchmarks", "",
      f"Generated by `python experiments/report.py{' --quick' if args.quick else ''}`"
      + (" (quick mode: tiny configurations, not representative)." if args.quick else "."), "",
      "| machine | |", "|---|---|",
      *[f"| {k} | {v} |" for k, v in host.items()],
      f"| devices | {DEVICE_COUNT} emulated CPU devices unless XLA_FLAGS sets a count |", ""]
  for name in BENCHES:
    if name not in args.benches and name in kept:
      parts.append(kept[name])
      continue
    script = pathlib.Path(args.bench_dir) / f"{name}.py"
    result = (run_bench(script, out / name, args.quick, args.timeout, args.bench_args)
              if script.exists() else None)
    print(f"{name}: " + ("missing" if result is None else "ok" if result["ok"] else "FAILED"),
          flush=True)
    parts.append(section(name, script, result))
  # Hand-written sections (studies that are not bench_*.py runs) stay, after the benchmarks.
  parts += [body for name, body in kept.items() if name not in BENCHES]
  text = "\n".join(parts).rstrip() + "\n"
  pathlib.Path(args.output).write_text(text)
  print("wrote", args.output)
  return text


if __name__ == "__main__":
  main(sys.argv[1:])
