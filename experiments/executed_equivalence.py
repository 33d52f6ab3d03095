"""The executed schedules against the engine, through the launcher, on a real config.

Run:
  python experiments/executed_equivalence.py            # configs/digits.py:model=resnet18, 3 steps
  python experiments/executed_equivalence.py --quick    # the residual MLP, 2 steps

For each rule (dp, cdp-v1, cdp-v2) it trains the config under
``parallelism=data`` (the update-rule engine), ``model`` (executed CDP+MP or
GPipe) and ``zero`` (executed CDP+ZeRO or ZeRO-3), N = J = 4, with the
config's own optimizer (SGD with momentum 0.9 and weight decay 5e-4 for the
ResNet-18), and reports, against ``data``: the largest relative difference
of the logged losses, and the largest difference of a leaf of ``theta_T``
(``final_params.msgpack``) and of the BatchNorm statistics
(``final_model_state.msgpack``), in units of that leaf's largest magnitude.
The goals (issue "The executed stage backward drops a gradient"): losses
within 1e-5, leaves within 1e-4. Results go to
``<results_dir>/executed_equivalence.json``.

What limits dp here is the model, not a schedule: the loss has a kink within
float32 rounding of ``theta_1`` (``python experiments/gradient_kink.py``,
2026-12-04). The dp step-2 gradient norm is 21.09127 at both runs' ``theta_1``
(which agree within 8.5e-7 of each leaf's scale), and 21.08693 at ``theta_1``
plus noise of 1e-7 of each leaf's scale, in all three draws and in float64 as
in float32 (a jump of 2.1e-4). Two correct programs whose ``theta_1`` differ
by rounding can so take step-2 gradients 2e-4 apart: the executed runs'
step-3 losses are 2.574641 against the engine's 2.575947 (float64 2.575928).
The cdp rules, whose step-2 gradients read ``theta_0`` on their delayed
stages, agree within 4e-7.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import _common
from cdpjax import distributed  # (imports no JAX)

distributed.emulate_cpu_devices(8)

import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top
from flax import traverse_util  # noqa: E402

from cdpjax import config as config_lib  # noqa: E402
from cdpjax import train  # noqa: E402

RULES = ("dp", "cdp-v1", "cdp-v2")
PARALLELISMS = ("data", "model", "zero")
GOALS = {"loss_rel": 1e-5, "leaf_of_scale": 1e-4}


def run_one(arg: str, steps: int, parallelism: str, rule: str, workdir: str) -> dict:
  """Logged losses and the final variables of one launch."""
  c = config_lib.load(str(_common.REPO / "configs" / "digits.py"),
                      f"{arg}parallelism={parallelism},rule={rule}", num_workers=4,
                      num_stages=4, num_train_steps=steps, log_every_steps=1,
                      eval_every_steps=steps, checkpoint_every_steps=steps)
  with contextlib.redirect_stdout(sys.stderr):  # The launcher's log; stdout is the table.
    train.train_and_evaluate(c, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    losses = [r["train/loss"] for r in map(json.loads, f) if "train/loss" in r]
  return {"losses": losses, "final": train.exported(workdir)}


def _leaves(tree) -> dict:
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def compare(got: dict, want: dict) -> dict:
  loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
  worst = {}
  for name in want["final"]:
    g = _leaves(got["final"][name])
    errors = {k: float(np.abs(g[k] - w).max() / max(np.abs(w).max(), 1e-30))
              for k, w in _leaves(want["final"][name]).items()}
    key = max(errors, key=errors.get)
    worst[name] = {"leaf": key, "of_scale": errors[key]}
  return {"loss_rel": float(loss_rel), "worst_leaf": worst,
          "met": bool(loss_rel <= GOALS["loss_rel"] and
                      all(w["of_scale"] <= GOALS["leaf_of_scale"] for w in worst.values()))}


def main(argv=None) -> dict:
  args = _common.parser("executed_equivalence", __doc__).parse_args(argv)
  arg, steps = ("smoke,", 2) if args.quick else ("model=resnet18,", 3)
  out = {"config": f"configs/digits.py:{arg}N=J=4", "steps": steps, "goals": GOALS,
         "machine": _common.machine(), "rules": {}}
  with tempfile.TemporaryDirectory() as root:
    for rule in RULES:
      runs = {p: run_one(arg, steps, p, rule, os.path.join(root, f"{rule}-{p}"))
              for p in PARALLELISMS}
      out["rules"][rule] = {p: {**compare(runs[p], runs["data"]), "losses": runs[p]["losses"]}
                            for p in PARALLELISMS[1:]}
      out["rules"][rule]["data"] = {"losses": runs["data"]["losses"]}
  _common.write_json(_common.results_dir(args) / "executed_equivalence.json", out)
  print(f"{out['config']}, {steps} steps, against parallelism=data:")
  for rule, rows in out["rules"].items():
    for p in PARALLELISMS[1:]:
      r = rows[p]
      leaves = ", ".join(f"{n} {w['of_scale']:.1e} ({w['leaf']})" for n, w in r["worst_leaf"].items())
      print(f"  {rule:7s} {p:5s} loss {r['loss_rel']:.1e}  worst leaf of scale: {leaves}  "
            f"{'met' if r['met'] else 'NOT MET'}")
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
