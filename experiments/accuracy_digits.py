"""DP vs CDP-v1 vs CDP-v2 on the embedded digits set: test accuracy over seeds.

Trains ``configs/digits.py`` (8 workers, 4 stages, residual MLP) in-process with
``train.train_and_evaluate`` for every rule and seed, then writes
``accuracy.json`` (per-run and mean +- std test accuracy) and
``learning_curves.png`` (train loss and test accuracy against steps, mean over
seeds with a +-1 std band) under ``--results_dir``:

  python experiments/accuracy_digits.py              # 3 rules x 3 seeds
  python experiments/accuracy_digits.py --quick      # 1 seed, 4 tiny steps
"""
from __future__ import annotations

import json
import shutil
import sys

import _common
from cdpjax import config as config_lib
from cdpjax.distributed import emulate_cpu_devices

RULES = ("dp", "cdp-v1", "cdp-v2")
EVAL_EVERY = 20  # Denser than the config's 100, for the curves; eval does not touch training.


def load_config(arg: str):
  """``get_config(arg)`` of configs/digits.py, as ``--config configs/digits.py:arg`` does."""
  return config_lib.load(str(_common.REPO / "configs" / "digits.py"), arg)


def read_metrics(workdir) -> list[dict]:
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def curve(records: list[dict], key: str):
  points = [(r["step"], r[key]) for r in records if key in r]
  return [s for s, _ in points], [v for _, v in points]


def summarize(runs: list[dict]) -> dict:
  """``{rule: {mean, std, n}}`` of the final test accuracy (std over seeds, ddof=0)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  table = {}
  for rule in dict.fromkeys(r["rule"] for r in runs):
    acc = np.array([r["final_accuracy"] for r in runs if r["rule"] == rule])
    table[rule] = {"mean": float(acc.mean()), "std": float(acc.std()), "n": int(acc.size)}
  return table


def plot(runs: list[dict], path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, key, label in ((axes[0], "train/loss", "train loss"),
                         (axes[1], "eval/accuracy", "test accuracy")):
    for rule in dict.fromkeys(r["rule"] for r in runs):
      curves = [curve(r["metrics"], key) for r in runs if r["rule"] == rule]
      steps = curves[0][0]
      values = np.array([v for _, v in curves])
      mean, std = values.mean(0), values.std(0)
      ax.plot(steps, mean, label=f"{rule} ({len(curves)} seed{'s' * (len(curves) > 1)})")
      ax.fill_between(steps, mean - std, mean + std, alpha=0.25)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].set_yscale("log")
  axes[1].legend()
  fig.suptitle("digits, residual MLP, 8 workers x 4 stages (configs/digits.py)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  p = _common.parser("accuracy_digits", __doc__)
  p.add_argument("--seeds", type=int, default=3, help="Seeds 0..seeds-1 per rule.")
  p.add_argument("--rules", default=",".join(RULES), help="Comma-separated rules.")
  args = p.parse_args(argv)
  if args.quick:
    args.seeds = 1
  out = _common.results_dir(args)
  emulate_cpu_devices(8)
  from cdpjax import train  # pylint: disable=g-import-not-at-top  (JAX starts here)

  runs = []
  for rule in args.rules.split(","):
    for seed in range(args.seeds):
      c = load_config(f"rule={rule}" + (",smoke" if args.quick else ""))
      c.seed = seed
      if not args.quick:
        c.eval_every_steps = EVAL_EVERY
        c.checkpoint_every_steps = 10**9  # Only the final checkpoint.
      workdir = out / "runs" / f"{rule}_seed{seed}"
      shutil.rmtree(workdir, ignore_errors=True)  # A fresh run, never a resume.
      summary = train.train_and_evaluate(c, str(workdir))
      runs.append({"rule": rule, "seed": seed, "final_accuracy": summary["final_accuracy"],
                   "final_loss": summary["final_loss"], "steps": summary["final_step"],
                   "wall_time_s": summary["wall_time_s"], "metrics": read_metrics(workdir)})
      print(f"{rule} seed {seed}: test accuracy {summary['final_accuracy']:.4f}", flush=True)

  table = summarize(runs)
  c = load_config("smoke" if args.quick else None)
  result = {"config": "configs/digits.py", "num_workers": c.num_workers,
            "num_stages": c.num_stages, "table": table,
            "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs]}
  _common.write_json(out / "accuracy.json", result)
  plot(runs, out / "learning_curves.png")
  print("| rule | test accuracy (mean ± std) | seeds |\n|---|---|---|")
  for rule, row in table.items():
    print(f"| {rule} | {100 * row['mean']:.2f} ± {100 * row['std']:.2f} % | {row['n']} |")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
