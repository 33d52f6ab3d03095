"""DP vs CDP-v1 vs CDP-v2 on the byte-level language model: eval bits per byte over seeds.

Trains ``configs/lm.py`` (the quick-start transformer on the Python standard
library, 4 workers, 4 stages) in-process for every rule and seed, then writes
``accuracy_lm.json`` (per-run and mean +- std final eval bits per byte, and the
bigram baseline) and ``bits_per_byte.png`` (eval bits per byte against steps,
mean over seeds with a +-1 std band) under ``--results_dir``, after every run:

  python experiments/accuracy_lm.py                  # 3 rules x 3 seeds, 600 steps (BENCHMARKS.md)
  python experiments/accuracy_lm.py --resume         # go on with an interrupted study
  python experiments/accuracy_lm.py --quick          # 1 seed, the smoke config
"""
from __future__ import annotations

import shutil
import sys

import _common
import accuracy_digits
from cdpjax import config as config_lib
from cdpjax.distributed import emulate_cpu_devices

RULES = ("dp", "cdp-v1", "cdp-v2")
KEY = "eval/bits_per_byte"


def load_config(arg: str):
  """``get_config(arg)`` of configs/lm.py, as ``--config configs/lm.py:arg`` does."""
  return config_lib.load(str(_common.REPO / "configs" / "lm.py"), arg)


def summarize(runs: list[dict]) -> dict:
  """``{rule: {mean, std, n}}`` of the final eval bits per byte (std over seeds, ddof=0)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  table = {}
  for rule in dict.fromkeys(r["rule"] for r in runs):
    bpb = np.array([r["final_bits_per_byte"] for r in runs if r["rule"] == rule])
    table[rule] = {"mean": float(bpb.mean()), "std": float(bpb.std()), "n": int(bpb.size)}
  return table


def plot(runs: list[dict], baseline: float, title: str, path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for rule in dict.fromkeys(r["rule"] for r in runs):
    curves = [accuracy_digits.curve(r["metrics"], KEY) for r in runs if r["rule"] == rule]
    steps = curves[0][0]
    values = np.array([v for _, v in curves])
    mean, std = values.mean(0), values.std(0)
    ax.plot(steps, mean, label=f"{rule} ({len(curves)} seed{'s' * (len(curves) > 1)})")
    ax.fill_between(steps, mean - std, mean + std, alpha=0.25)
  ax.axhline(baseline, color="gray", linestyle="--", label="bigram baseline")
  ax.set_xlabel("step")
  ax.set_ylabel("eval bits per byte")
  ax.set_ylim(top=max(baseline + 1.0, ax.get_ylim()[0] + 0.5), bottom=None)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_results(runs: list[dict], c, quick: bool, out) -> dict:
  """Writes ``accuracy_lm.json`` and ``bits_per_byte.png`` for the runs so far; returns the JSON."""
  table = summarize(runs)
  baseline = runs[0]["bigram_bits_per_byte"]
  k = c.model_kwargs
  title = (f"byte-level LM on the Python stdlib (configs/lm.py{':smoke' * quick}): "
           f"{k.num_layers} layers, d_model {k.d_model},\n{c.num_workers} workers x "
           f"{c.num_stages} stages, {c.num_train_steps} steps, lr {c.learning_rate:g}")
  result = {"config": "configs/lm.py" + (":smoke" if quick else ""),
            "num_workers": c.num_workers, "num_stages": c.num_stages,
            "num_train_steps": c.num_train_steps, "learning_rate": c.learning_rate,
            "warmup_steps": c.warmup_steps, "model_kwargs": k.to_dict(),
            "bigram_bits_per_byte": baseline, "table": table, "machine": _common.machine(),
            "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs]}
  _common.write_json(out / "accuracy_lm.json", result)
  plot(runs, baseline, title, out / "bits_per_byte.png")
  return result


def main(argv=None) -> dict:
  p = _common.parser("accuracy_lm", __doc__)
  p.add_argument("--seeds", type=int, default=3, help="Seeds 0..seeds-1 per rule.")
  p.add_argument("--rules", default=",".join(RULES), help="Comma-separated rules.")
  p.add_argument("--steps", type=int, default=0,
                 help="Train steps per run (0: the config's); warm-up stays 5%% of them.")
  p.add_argument("--learning_rate", type=float, default=0.0,
                 help="Peak learning rate (0: the config's).")
  p.add_argument("--eval_every", type=int, default=25, help="Steps between evaluations.")
  p.add_argument("--resume", action="store_true",
                 help="Keep the run folders: finished runs are read back, interrupted ones go "
                      "on from their last checkpoint (the launcher refuses a changed config).")
  args = p.parse_args(argv)
  if args.quick:
    args.seeds = 1
  out = _common.results_dir(args)
  base = "smoke" if args.quick else ""
  c = load_config(base)
  emulate_cpu_devices(c.num_workers)
  from cdpjax import train  # pylint: disable=g-import-not-at-top  (JAX starts here)

  runs = []
  for seed in range(args.seeds):  # Seed-major: an interrupted study has every rule's first seeds.
    for rule in args.rules.split(","):
      c = load_config(f"rule={rule}" + (",smoke" if args.quick else ""))
      c.seed = seed
      if args.steps:
        c.num_train_steps = args.steps
        c.warmup_steps = max(1, args.steps // 20)
      if args.learning_rate:
        c.learning_rate = args.learning_rate
      if not args.quick:
        c.eval_every_steps = args.eval_every
        c.checkpoint_every_steps = 100
      workdir = out / "runs" / f"{rule}_seed{seed}"
      if not args.resume:
        shutil.rmtree(workdir, ignore_errors=True)  # A fresh run.
      summary = train.train_and_evaluate(c, str(workdir))
      if summary["preempted"]:  # SIGTERM or Ctrl-C: the run saved a checkpoint.
        sys.exit(f"Stopped during {rule} seed {seed}: rerun with --resume to go on.")
      runs.append({"rule": rule, "seed": seed,
                   "final_bits_per_byte": summary["final_bits_per_byte"],
                   "final_loss": summary["final_loss"], "steps": summary["final_step"],
                   "bigram_bits_per_byte": summary["bigram_bits_per_byte"],
                   "wall_time_s": summary["wall_time_s"],
                   "tokens_per_second": summary.get("tokens_per_second"),
                   "metrics": accuracy_digits.read_metrics(workdir)})
      print(f"{rule} seed {seed}: eval bits/byte {summary['final_bits_per_byte']:.4f} "
            f"(bigram {summary['bigram_bits_per_byte']:.4f})", flush=True)
      result = write_results(runs, c, args.quick, out)  # After every run: partial studies count.
  print(f"bigram baseline: {result['bigram_bits_per_byte']:.3f} bits/byte")
  print("| rule | eval bits/byte (mean ± std) | seeds |\n|---|---|---|")
  for rule, row in result["table"].items():
    print(f"| {rule} | {row['mean']:.3f} ± {row['std']:.3f} | {row['n']} |")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
