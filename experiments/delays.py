"""Random and straggler delays against DP, CDP-v1 and CDP-v2 on digits: accuracy over seeds.

Trains ``configs/digits.py`` (8 workers, 4 stages, residual MLP, SGD with
momentum) in-process for every variant and seed, with ``--num_epochs`` epochs
(fewer than the config's 40, so the study fits in minutes on a CPU). A variant
is a rule, or ``random:DISTRIBUTION:D`` / ``straggler:D`` (one slow worker,
the last, reading ``theta_{t-D}``). Writes ``delays.json`` (per-run and
mean +- std test accuracy) and ``delays.png`` (accuracy against ``D``):

  python experiments/delays.py              # 9 variants x 3 seeds, 20 epochs
  python experiments/delays.py --quick      # 1 variant, 1 seed, 4 tiny steps
"""
from __future__ import annotations

import os
import shutil
import sys

import _common
import accuracy_digits
from cdpjax.distributed import emulate_cpu_devices

VARIANTS = ("dp", "cdp-v1", "cdp-v2", "random:uniform:1", "random:uniform:2", "random:uniform:4",
            "random:geometric:4", "straggler:2", "straggler:4")


def config_of(variant: str, seed: int, quick: bool, num_epochs: float):
  """The digits config of ``variant`` (see the module docstring)."""
  rule, *rest = variant.split(":")
  c = accuracy_digits.load_config(f"rule={rule}" + (",smoke" if quick else ""))
  c.seed = seed
  if rule == "random":
    c.delay_distribution, c.max_delay = rest[0], int(rest[1])
  elif rule == "straggler":
    c.max_delay = int(rest[0])
  if not quick:
    c.num_epochs = num_epochs
    c.eval_every_steps = 10**9  # Only the final evaluation.
    c.checkpoint_every_steps = 10**9
  return c


def plot(table: dict, path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4))
  families = {}
  for variant, row in table.items():
    rule, *rest = variant.split(":")
    if rule in ("random", "straggler"):
      label = f"random, {rest[0]}" if rule == "random" else "straggler (1 of 8 workers)"
      families.setdefault(label, []).append((int(rest[-1]), row))
  for label, points in families.items():
    points.sort(key=lambda p: p[0])
    ax.errorbar([d for d, _ in points], [100 * r["mean"] for _, r in points],
                yerr=[100 * r["std"] for _, r in points], marker="o", capsize=3, label=label)
  for rule, style in (("dp", ":"), ("cdp-v1", "--"), ("cdp-v2", "-.")):
    if rule in table:
      ax.axhline(100 * table[rule]["mean"], ls=style, color="gray", label=rule)
  ax.set_xlabel("max delay D (steps)")
  ax.set_ylabel("test accuracy (%), mean ± std over seeds")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title("digits, residual MLP, 8 workers x 4 stages")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  p = _common.parser("delays", __doc__)
  p.add_argument("--seeds", type=int, default=3, help="Seeds 0..seeds-1 per variant.")
  p.add_argument("--variants", default=",".join(VARIANTS), help="Comma-separated variants.")
  p.add_argument("--num_epochs", type=float, default=20.0)
  args = p.parse_args(argv)
  if args.quick:
    args.seeds, args.variants = 1, "random:geometric:2"
  out = _common.results_dir(args)
  # Seeds of a variant compile the same programs: compile them once.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "jax_cache"))
  emulate_cpu_devices(8)
  from cdpjax import train  # pylint: disable=g-import-not-at-top  (JAX starts here)

  runs = []
  for variant in args.variants.split(","):
    for seed in range(args.seeds):
      c = config_of(variant, seed, args.quick, args.num_epochs)
      workdir = out / "runs" / f"{variant.replace(':', '_')}_seed{seed}"
      shutil.rmtree(workdir, ignore_errors=True)  # A fresh run, never a resume.
      summary = train.train_and_evaluate(c, str(workdir))
      runs.append({"rule": variant, "seed": seed, "final_accuracy": summary["final_accuracy"],
                   "final_loss": summary["final_loss"], "steps": summary["final_step"],
                   "wall_time_s": summary["wall_time_s"]})
      print(f"{variant} seed {seed}: test accuracy {summary['final_accuracy']:.4f} "
            f"({summary['wall_time_s']:.0f} s)", flush=True)

  table = accuracy_digits.summarize(runs)
  result = {"config": "configs/digits.py", "num_epochs": args.num_epochs, "table": table,
            "runs": runs}
  _common.write_json(out / "delays.json", result)
  plot(table, out / "delays.png")
  print(markdown(table))
  return result


def markdown(table: dict) -> str:
  lines = ["| variant | test accuracy (mean ± std) | seeds |", "|---|---|---|"]
  for variant, row in table.items():
    lines.append(f"| {variant} | {100 * row['mean']:.2f} ± {100 * row['std']:.2f} % | {row['n']} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main(sys.argv[1:])
