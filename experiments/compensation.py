"""Which delay compensation brings CDP to DP on the LM? (issue 35)

Trains ``configs/lm.py`` (the quick-start transformer, 600 steps, 4 workers x 4
stages, AdamW) for dp and, for cdp-v2 and cdp-v1, each compensation of
``--config`` (docs/delays.md), at one learning rate and warm-up (the config's
2e-3 and 10% by default; the tuned sweep, ``experiments/lm_sweep.py``, finds
each plain rule's best), seeds ``0..seeds-1``:

- ``none``: the plain rule;
- ``predict``: weight prediction (``weight_prediction=True``);
- ``dc``: DC-ASGD's correction (``dc_lambda=1``);
- ``lr_scale``: a delay-aware learning rate (``lr_delay_scale=1``);
- ``predict+dc``: both of the first two.

Each run writes ``runs/<name>.json`` under ``--results_dir`` as it ends (a rerun
skips those); after every run ``compensation.json`` holds, per rule and
variant, the final eval bits per byte (mean +- std over seeds) and its gap to
dp's at the same seeds:

  python experiments/compensation.py                 # 9 runs a seed, ~2.3 min each here
  python experiments/compensation.py --seeds 3       # then seeds 1 and 2
  python experiments/compensation.py --quick         # the smoke config, seconds
"""
from __future__ import annotations

import sys

import _common
import lm_sweep

VARIANTS = lm_sweep.COMPENSATIONS
RULES = ("cdp-v2", "cdp-v1")
QUICK_VARIANTS = ("none", "predict")
FINAL = "final_bits_per_byte"


def summarize(rows: list[dict], seeds: int) -> dict:
  """Per rule and variant: mean +- std of the final bits per byte, and the gap to dp's mean."""
  table = {}
  for r in rows:
    table.setdefault(r["rule"], {}).setdefault(r["variant"], []).append(r)
  out = {}
  for rule, variants in table.items():
    for variant, runs in variants.items():
      out.setdefault(rule, {})[variant] = {
          **lm_sweep.seed_stats(runs, FINAL), "seeds": sorted(r["seed"] for r in runs),
          "diverged": sum(r["diverged"] for r in runs),
          **{k: runs[0][k] for k in VARIANTS[variant]}}
  dp = (out.get("dp") or {}).get("none")
  for rule, variants in out.items():
    for row in variants.values():
      ok = dp and dp["mean"] is not None and row["mean"] is not None
      row["gap_to_dp"] = (row["mean"] - dp["mean"]) / dp["mean"] if ok else None
  return {"config": "configs/lm.py", "seeds_planned": seeds, "table": out,
          "machine": _common.machine()}


def main(argv=None) -> dict:
  p = _common.parser("compensation", __doc__)
  p.add_argument("--seeds", type=int, default=1, help="Seeds 0..seeds-1 per rule and variant.")
  p.add_argument("--learning_rate", type=float, default=2e-3, help="AdamW's peak learning rate.")
  p.add_argument("--warmup", type=float, default=0.1, help="Warm-up, a fraction of the steps.")
  args = p.parse_args(argv)
  out = _common.results_dir(args)
  (out / "runs").mkdir(exist_ok=True)
  variants = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
  points = [("dp", "none")] + [(rule, v) for rule in RULES for v in variants]
  from cdpjax.distributed import emulate_cpu_devices  # pylint: disable=g-import-not-at-top
  emulate_cpu_devices(lm_sweep.load_config("lm", "dp", args.quick).num_workers)
  rows = []
  for seed in range(args.seeds):  # Seed-major: an interrupted study has every point's first seeds.
    for rule, variant in points:
      tag = "" if variant == "none" else variant.replace("+", "-")
      row = lm_sweep.lm_run(rule, args.learning_rate, args.warmup, seed, VARIANTS[variant],
                            args.quick, out, tag)
      rows.append({**row, "variant": variant})
      _common.write_json(out / "compensation.json", summarize(rows, args.seeds))
  result = summarize(rows, args.seeds)
  print("| rule | variant | eval bits/byte | against dp |\n|---|---|---|---|")
  for rule, variants_ in result["table"].items():
    for variant, row in variants_.items():
      gap = "" if row["gap_to_dp"] is None else f"{100 * row['gap_to_dp']:+.1f}%"
      print(f"| {rule} | {variant} | {lm_sweep.mean_std(row)} ({row['n']}) | {gap} |")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
