"""Does Adam's momentum decide how much a one-step delay costs on the LM?

Asynchronous SGD with staleness behaves like SGD with extra momentum
(Mitliagkas et al., 2016, "Asynchrony begets momentum"), so a delayed rule
with the usual momentum may be over-damped where DP is not. This study
trains ``configs/lm.py`` (the quick-start transformer, 600 steps, 4 workers x
4 stages, AdamW, 10% warm-up) for dp, cdp-v2 and cdp-v2 with weight
prediction at each of Adam's first-moment
decays ``b1`` (``adam_b1``: 0.9, the config's, 0.5 and 0) and second-moment
decays ``b2`` (``adam_b2``: 0.999, the config's, and 0.95, common for language
models), at cdp-v2's tuned learning rate (2e-3, ``experiments/lm_sweep.py``),
4e-3 and 8e-3 (near dp's best, where cdp-v2 loses 40% at b1 0.9).

Each run writes ``runs/<name>.json`` under ``--results_dir`` as it ends (a rerun
skips those); after every run ``adam_betas.json`` holds, per learning rate and
(b1, b2), the final eval bits per byte of each rule (mean +- std over seeds)
and each delayed rule's gap to dp's:

  python experiments/adam_betas.py                  # 54 runs a seed, ~1.2 min each here
  python experiments/adam_betas.py --seeds 2        # then seed 1
  python experiments/adam_betas.py --quick          # the smoke config, seconds
"""
from __future__ import annotations

import itertools
import sys

import _common
import lm_sweep

RULES = ("dp", "cdp-v2", "cdp-v2+predict")  # cdp-v2 with weight prediction, the best
# compensation at the config's decays (experiments/compensation.py), came after the others.
B1 = (0.9, 0.5, 0.0)
B2 = (0.999, 0.95)
LEARNING_RATES = (8e-3, 2e-3, 4e-3)  # 8e-3 first (the delay costs most there); 4e-3 came last.
FINAL = "final_bits_per_byte"


def point_name(lr: float, b1: float, b2: float) -> str:
  return f"lr {lr:g}, b1 {b1:g}, b2 {b2:g}"


def summarize(rows: list[dict], seeds: int) -> dict:
  """Per point (learning rate, b1, b2) and rule: mean +- std of the final bits per byte over
  seeds, and each delayed rule's gap to dp's mean."""
  runs = {}
  for r in rows:
    point = point_name(r["learning_rate"], r["adam_b1"], r["adam_b2"])
    runs.setdefault(point, {}).setdefault(r["rule"], []).append(r)
  table = {}
  for point, by_rule in runs.items():
    for rule, found in by_rule.items():
      table.setdefault(point, {})[rule] = {**lm_sweep.seed_stats(found, FINAL),
                                           "diverged": sum(r["diverged"] for r in found)}
    dp = table[point].get("dp")
    for rule, row in table[point].items():
      if rule != "dp" and dp and dp["mean"] is not None and row["mean"] is not None:
        row["gap_to_dp"] = (row["mean"] - dp["mean"]) / dp["mean"]
  host = _common.machine()
  return {"config": "configs/lm.py", "seeds_planned": seeds, "table": table, "machine": host,
          "source": f"produced by `python experiments/adam_betas.py --seeds {seeds}` in the "
                    f"background ({len(rows)} runs so far: a rerun skips them), the last ending "
                    f"{host['date']} ({host['cpu']}, jax {host['jax']})"}


def main(argv=None) -> dict:
  p = _common.parser("adam_betas", __doc__)
  p.add_argument("--seeds", type=int, default=1, help="Seeds 0..seeds-1 per point and rule.")
  p.add_argument("--warmup", type=float, default=0.1, help="Warm-up, a fraction of the steps.")
  args = p.parse_args(argv)
  out = _common.results_dir(args)
  (out / "runs").mkdir(exist_ok=True)
  points = list(itertools.product(LEARNING_RATES, B2, B1))
  if args.quick:
    points = [(1e-2, 0.999, b1) for b1 in (0.9, 0.0)]
  from cdpjax.distributed import emulate_cpu_devices  # pylint: disable=g-import-not-at-top
  emulate_cpu_devices(lm_sweep.load_config("lm", "dp", args.quick).num_workers)
  rows = []
  for seed in range(args.seeds):  # Seed-major: an interrupted study has every point's first seeds.
    for (lr, b2, b1), rule in itertools.product(points, RULES):
      rows.append(lm_sweep.lm_run(rule, lr, args.warmup, seed, {"adam_b1": b1, "adam_b2": b2},
                                  args.quick, out, f"b1-{b1:g}_b2-{b2:g}"))
      _common.write_json(out / "adam_betas.json", summarize(rows, args.seeds))
  result = summarize(rows, args.seeds)
  print("| point | rule | eval bits/byte | against dp |\n|---|---|---|---|")
  for point, by_rule in result["table"].items():
    for rule, row in by_rule.items():
      gap = f"{100 * row['gap_to_dp']:+.1f}%" if "gap_to_dp" in row else ""
      print(f"| {point} | {rule} | {lm_sweep.mean_std(row)} | {gap} |")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
