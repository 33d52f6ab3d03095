"""Is DP's lead over CDP on the LM real, or one learning rate's artefact? A tuned comparison.

For each rule (dp, cdp-v1, cdp-v2 and, on the lm, cdp-v2 with weight
prediction, ``cdp-v2+predict``) and optimizer, a grid of peak learning
rates x warm-up lengths at seed 0, then seeds 0, 1, 2 at each (rule,
optimizer)'s best grid point (issue 35). Tasks, in this order (the most
informative first):

- ``lm``: ``configs/lm.py`` (the quick-start transformer, 600 steps, 4 workers x
  4 stages), AdamW (weight decay 0.1, the config's) at lr 5e-4..6.4e-2 (dp was best at
  8e-3, then 1.6e-2, each the grid's edge at the time), then SGD
  with momentum 0.9 (no weight decay: the coupled 0.1 would be far too strong)
  at lr 0.006..2 (placed by the probes below); warm-up 10% or 2% of the steps;
  cosine decay, gradients clipped to norm 1 (the config's). Metric: final eval
  bits per byte (lower is better).
- ``digits``: ``configs/digits.py:model=resnet18`` (8 workers x 4 stages,
  BatchNorm), SGD with momentum (weight decay 5e-4, the config's) at lr
  0.005..0.5 (the config's 0.02 inside), warm-up 5%; metric: final test
  accuracy (higher is better).

Each run writes ``runs/<name>.json`` under ``--results_dir`` as soon as it ends
(final metric, eval curve, wall time, config point; ``"diverged": true`` with
the error when the launcher stopped on a non-finite loss); a rerun skips the
runs whose JSON exists and starts the others afresh. After every run the
summary ``lm_sweep.json`` (the grid, and per (task, optimizer, rule) the best
point's mean +- std over seeds) is rewritten, and, unless ``--quick``, the figure
``--figure`` (final metric against lr per rule, best-point curves):

  python experiments/lm_sweep.py                     # lm then digits: 128 + 21 runs
  python experiments/lm_sweep.py --task lm           # the language model only
  python experiments/lm_sweep.py --task digits       # the ResNet-18 only
  python experiments/lm_sweep.py --quick             # smoke configs, 2 lrs x 2 rules per task

Time on the 2 shared cores here: an lm run takes ~2.3 min at an idle machine
(README: 2 min 16 s), so the 128 lm runs take ~5 h, more when the cores are
shared (8.5 min a run at a load of 12); the digits runs' time is in their
``wall_time_s``. ``--quick`` takes a minute or two (8 smoke runs).

The SGD grid was placed by 200-step probes (10% warm-up, eval bits per byte;
the AdamW grid brackets the config's 2e-3 and BENCHMARKS.md's 3e-3): see
``SGD_PROBES``. cdp-v1 blew up at lr 2 (loss 11, above a uniform guess's 5.5)
and was best at 0.02 (0.005 and 0.1 worse); dp was still training at lr 2. So 6
rates, a factor ~3 apart, from below cdp-v1's optimum to its blow-up.
"""
from __future__ import annotations

import json
import math
import shutil
import sys

import _common
import accuracy_digits
import accuracy_lm

RULES = accuracy_lm.RULES
# The delay compensations (issue 35) -> their config keys.
COMPENSATIONS = {"none": {}, "predict": {"weight_prediction": True}, "dc": {"dc_lambda": 1.0},
                 "lr_scale": {"lr_delay_scale": 1.0},
                 "predict+dc": {"weight_prediction": True, "dc_lambda": 1.0}}
# Rules with a compensation, "<rule>+<compensation>": the lm grids tune cdp-v2
# with weight prediction, the best compensation at lr 2e-3 (experiments/compensation.py).
COMPENSATED = ("cdp-v2+predict",)
TASK_RULES = {"lm": RULES + COMPENSATED, "digits": RULES}
SEEDS = (0, 1, 2)
# 200-step probes of SGD + momentum 0.9 on the lm (10% warm-up, cosine, clip 1):
# (rule, lr) -> final eval bits per byte (the bigram baseline: 3.55).
SGD_PROBES = {("cdp-v1", 0.005): 4.647, ("cdp-v1", 0.02): 4.449, ("cdp-v1", 0.1): 4.696,
              ("cdp-v1", 0.5): 4.805, ("cdp-v1", 2.0): 16.22, ("dp", 2.0): 4.646}
# task -> optimizer -> (learning rates, warm-up fractions of the steps, optimizer keys).
GRIDS = {
    "lm": {
        "adamw": ((5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2), (0.10, 0.02), {}),
        "sgd": ((0.006, 0.02, 0.06, 0.2, 0.6, 2.0), (0.10, 0.02),
                {"momentum": 0.9, "weight_decay": 0.0}),
    },
    "digits": {
        "sgd": ((0.005, 0.015, 0.05, 0.15, 0.5), (0.05,), {"momentum": 0.9}),
    },
}
QUICK_GRIDS = {"lm": {"adamw": ((1e-3, 1e-2), (0.25,), {})},
               "digits": {"sgd": ((0.01, 0.05), (0.25,), {"momentum": 0.9})}}
QUICK_RULES = ("dp", "cdp-v2+predict")
METRICS = {"lm": ("eval/bits_per_byte", "final_bits_per_byte", min),
           "digits": ("eval/accuracy", "final_accuracy", max)}


def load_config(task: str, rule: str, quick: bool):
  """The task's config for ``rule``, a compensated rule's keys set."""
  rule, _, variant = rule.partition("+")  # A compensation may hold "+" too.
  c = _task_config(task, rule, quick)
  for k, v in COMPENSATIONS[variant or "none"].items():
    c[k] = v
  return c


def _task_config(task: str, rule: str, quick: bool):
  if task == "lm":
    return accuracy_lm.load_config(f"rule={rule}" + (",smoke" if quick else ""))
  return accuracy_digits.load_config(f"rule={rule},model=resnet18" + (",smoke" if quick else ""))


def mean_std(best: dict, digits: int = 3) -> str:
  if best["mean"] is None:
    return "diverged"
  return f"{best['mean']:.{digits}f} ± {best['std']:.{digits}f}"


def run_name(task, optimizer, rule, lr, warmup, seed, variant: str = "") -> str:
  """The run's file name; ``variant`` (e.g. a delay compensation) follows the rule."""
  return f"{task}_{optimizer}_{rule}{variant and '_' + variant}_lr{lr:g}_wu{warmup:g}_seed{seed}"


def score(run: dict) -> float:
  """The run's final metric, worst possible when it diverged: lower is better for both tasks."""
  _, final, best = METRICS[run["task"]]
  value = run.get(final)
  ok = not run["diverged"] and value is not None and math.isfinite(value)
  sign = 1.0 if best is min else -1.0
  return sign * value if ok else math.inf


def train_one(task, optimizer, rule, lr, warmup, seed, extra, quick, out,
              variant: str = "") -> dict:
  """Trains one grid point afresh (``extra``: config keys), writes and returns its
  ``runs/<name>.json``."""
  from cdpjax import train  # pylint: disable=g-import-not-at-top
  name = run_name(task, optimizer, rule, lr, warmup, seed, variant)
  c = load_config(task, rule, quick)
  key, final, _ = METRICS[task]
  c.seed, c.optimizer, c.learning_rate = seed, optimizer, lr
  for k, v in extra.items():
    c[k] = v
  if task == "digits":  # Steps from epochs: the launcher derives them the same way.
    steps = c.num_train_steps if c.num_train_steps > 0 else None
  else:
    steps = c.num_train_steps
  if steps:
    c.warmup_epochs, c.warmup_steps = 0.0, max(1, round(warmup * steps))
  else:
    c.warmup_steps, c.warmup_epochs = 0, warmup * c.num_epochs
  if not quick:
    c.eval_every_steps = 25 if task == "lm" else accuracy_digits.EVAL_EVERY
    c.checkpoint_every_steps = 10**9  # Only the final checkpoint: a run is redone, not resumed.
  workdir = out / "work" / name
  shutil.rmtree(workdir, ignore_errors=True)  # A fresh run.
  row = {"name": name, "task": task, "optimizer": optimizer, "rule": rule, "learning_rate": lr,
         "warmup_fraction": warmup, "warmup_steps": c.warmup_steps,
         "warmup_epochs": c.warmup_epochs, "seed": seed, **extra,
         **{k: c[k] for k in ("weight_prediction", "dc_lambda", "lr_delay_scale")}}
  try:
    summary = train.train_and_evaluate(c, str(workdir))
  except train.NonFiniteError as e:
    row.update(diverged=True, error=train.first_line(e), **{final: None})
  else:
    if summary["preempted"]:
      sys.exit(f"Stopped during {name}: rerun the same command to go on.")
    row.update(diverged=not math.isfinite(summary[final]), **{final: summary[final]},
               final_loss=summary["final_loss"], steps=summary["final_step"],
               wall_time_s=summary["wall_time_s"])
    if task == "lm":
      row["bigram_bits_per_byte"] = summary["bigram_bits_per_byte"]
  metrics = accuracy_digits.read_metrics(workdir) if (workdir / "metrics.jsonl").exists() else []
  row["curve"] = dict(zip(("steps", "values"), accuracy_digits.curve(metrics, key)))
  _common.write_json(out / "runs" / f"{name}.json", row)
  shutil.rmtree(workdir, ignore_errors=True)  # The JSON holds what the study needs.
  return row


def lm_run(rule, lr, warmup, seed, extra, quick, out, variant: str = "") -> dict:
  """An AdamW run of the LM quick start: its ``runs/<name>.json`` under ``out`` if a study has
  run it already, else trained now (`train_one`) and its final bits per byte printed."""
  name = run_name("lm", "adamw", rule, lr, warmup, seed, variant)
  path = out / "runs" / f"{name}.json"
  if path.exists():
    return json.loads(path.read_text())
  row = train_one("lm", "adamw", rule, lr, warmup, seed, extra, quick, out, variant)
  final = METRICS["lm"][1]
  print(f"{name}: {'diverged' if row['diverged'] else f'{row[final]:.4f}'}", flush=True)
  return row


def seed_stats(runs: list[dict], final: str) -> dict:
  """Mean and std (over seeds, ddof 0) of the runs' ``final`` metric, and how many runs: those
  that did not diverge."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  values = np.array([r[final] for r in runs if math.isfinite(score(r))])
  return {"mean": float(values.mean()) if values.size else None,
          "std": float(values.std()) if values.size else None, "n": int(values.size)}


def summarize(rows: dict, grids: dict, rules, planned: int) -> dict:
  """The grid (seed 0) and, per task/optimizer/rule, the best point's seeds' mean +- std."""
  tasks = {}
  for task, optimizers in grids.items():
    final = METRICS[task][1]
    table = tasks.setdefault(task, {"metric": final, "optimizers": {}})
    for optimizer in optimizers:
      for rule in rules:
        grid = [r for r in rows.values() if (r["task"], r["optimizer"], r["rule"], r["seed"])
                == (task, optimizer, rule, 0)]
        if not grid:
          continue
        best = min(grid, key=score)
        seeds = [r for r in rows.values() if (r["task"], r["optimizer"], r["rule"],
                                              r["learning_rate"], r["warmup_fraction"])
                 == (task, optimizer, rule, best["learning_rate"], best["warmup_fraction"])]
        table["optimizers"].setdefault(optimizer, {})[rule] = {
            "learning_rate": best["learning_rate"], "warmup_fraction": best["warmup_fraction"],
            **seed_stats(seeds, final),
            "diverged_seeds": sorted(r["seed"] for r in seeds if not math.isfinite(score(r))),
            "seeds": sorted(r["seed"] for r in seeds),
            "grid": [{k: r[k] for k in ("learning_rate", "warmup_fraction", "diverged", final)}
                     for r in sorted(grid, key=lambda r: (r["warmup_fraction"],
                                                          r["learning_rate"]))]}
  return {"planned_runs": planned, "finished_runs": len(rows), "tasks": tasks,
          "machine": _common.machine(),
          "runs": [{k: v for k, v in r.items() if k != "curve"} for r in rows.values()]}


def plot(summary: dict, rows: dict, path) -> None:
  """Per (task, optimizer): the final metric against lr per rule and warm-up; best-point curves."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  panels = [(t, o, rules) for t, d in summary["tasks"].items() for o, rules in
            d["optimizers"].items()]
  if not panels:
    return
  fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.6 * len(panels)), squeeze=False)
  for (task, optimizer, rules), (left, right) in zip(panels, axes):
    final = METRICS[task][1]
    label = "eval bits/byte" if task == "lm" else "test accuracy"
    for i, (rule, best) in enumerate(rules.items()):
      color = f"C{i}"
      for warmup, style in zip(sorted({g["warmup_fraction"] for g in best["grid"]}), ("-", "--")):
        pts = [g for g in best["grid"] if g["warmup_fraction"] == warmup]
        ok = [g for g in pts if not g["diverged"]]
        left.plot([g["learning_rate"] for g in ok], [g[final] for g in ok], style, color=color,
                  marker="o", label=f"{rule}, warm-up {warmup:.0%}")
        for g in pts:
          if g["diverged"]:
            left.axvline(g["learning_rate"], color=color, linestyle=":", alpha=0.5)
      curves = [rows[run_name(task, optimizer, rule, best["learning_rate"],
                              best["warmup_fraction"], s)]["curve"] for s in best["seeds"]]
      curves = [c for c in curves if c["values"]]
      if curves:
        n = min(len(c["values"]) for c in curves)
        values = np.array([c["values"][:n] for c in curves])
        mean, std = values.mean(0), values.std(0)
        right.plot(curves[0]["steps"][:n], mean, color=color,
                   label=f"{rule}: lr {best['learning_rate']:g}, warm-up "
                         f"{best['warmup_fraction']:.0%}, {mean_std(best)} "
                         f"({best['n']} seeds)")
        right.fill_between(curves[0]["steps"][:n], mean - std, mean + std, color=color,
                           alpha=0.25)
    left.set_xscale("log")
    left.set_xlabel("peak learning rate (dotted: diverged)")
    left.set_ylabel(f"final {label}, seed 0")
    right.set_xlabel("step")
    right.set_ylabel(label)
    for ax in (left, right):
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
      ax.set_title(f"{task}, {optimizer}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict:
  p = _common.parser("lm_sweep", __doc__)
  p.add_argument("--task", default="lm,digits", help="Comma-separated tasks: lm, digits.")
  p.add_argument("--figure", default=str(_common.REPO / "docs" / "figures" / "lm_sweep.png"),
                 help="Where the figure goes (not written with --quick).")
  args = p.parse_args(argv)
  out = _common.results_dir(args)
  (out / "runs").mkdir(exist_ok=True)
  tasks = args.task.split(",")
  grids = {t: (QUICK_GRIDS if args.quick else GRIDS)[t] for t in tasks}
  task_rules = {t: QUICK_RULES if args.quick else TASK_RULES[t] for t in tasks}
  rules = tuple(dict.fromkeys(r for t in tasks for r in task_rules[t]))
  seeds = SEEDS[:1] if args.quick else SEEDS
  from cdpjax.distributed import emulate_cpu_devices  # pylint: disable=g-import-not-at-top
  emulate_cpu_devices(max(load_config(t, "dp", args.quick).num_workers for t in tasks))

  rows = {}
  for path in sorted((out / "runs").glob("*.json")):
    row = json.loads(path.read_text())
    rows[row["name"]] = row
  planned = sum(len(task_rules[t]) * (len(lrs) * len(wus) + len(seeds) - 1)
                for t in tasks for lrs, wus, _ in grids[t].values())

  def run(task, optimizer, rule, lr, warmup, seed, extra):
    name = run_name(task, optimizer, rule, lr, warmup, seed)
    if name not in rows:
      rows[name] = train_one(task, optimizer, rule, lr, warmup, seed, extra, args.quick, out)
      r = rows[name]
      value = "diverged" if r["diverged"] else f"{r[METRICS[task][1]]:.4f}"
      print(f"[{len(rows)}/{planned}] {name}: {value}", flush=True)
      summary = summarize(rows, grids, rules, planned)
      _common.write_json(out / "lm_sweep.json", summary)
      if not args.quick:
        plot(summary, rows, args.figure)

  for task in tasks:
    for optimizer, (lrs, warmups, extra) in grids[task].items():
      # The grid at seed 0, all rules side by side; the middle learning rates first.
      for warmup in warmups:
        for lr in sorted(lrs, key=lambda lr: abs(lrs.index(lr) - (len(lrs) - 1) / 2)):
          for rule in task_rules[task]:
            run(task, optimizer, rule, lr, warmup, 0, extra)
      for seed in seeds[1:]:  # More seeds at each rule's best point.
        for rule in task_rules[task]:
          table = summarize(rows, grids, rules, planned)["tasks"][task]["optimizers"]
          best = table[optimizer][rule]
          run(task, optimizer, rule, best["learning_rate"], best["warmup_fraction"], seed, extra)
  summary = summarize(rows, grids, rules, planned)
  _common.write_json(out / "lm_sweep.json", summary)
  for task, table in summary["tasks"].items():
    print(f"{task}: {table['metric']}\n| optimizer | rule | lr | warm-up | mean ± std | seeds |\n"
          "|---|---|---|---|---|---|")
    for optimizer, by_rule in table["optimizers"].items():
      for rule, b in by_rule.items():
        print(f"| {optimizer} | {rule} | {b['learning_rate']:g} | {b['warmup_fraction']:.0%} | "
              f"{mean_std(b, 4)} | {b['n']} |")
  return summary


if __name__ == "__main__":
  main(sys.argv[1:])
