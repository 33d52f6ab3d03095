"""The paper's schedule figure, drawn from ``cdpjax.schedule``: DP, CDP-v1 and CDP-v2.

Top row: every stage forward (light) and backward (dark) on each worker's
timeline, coloured by worker, labelled ``F<j>``/``B<j>``; hatched events use
one-step-stale parameters. Middle: stage activations alive, summed over
workers, in units of ``Psi_A`` (one micro-batch through the whole model).
Bottom: gradient contributions completed per ``1/N`` slot, with the slots where
each stage's reduction can start. Writes ``timeline.png`` and ``timeline.json``:

  python experiments/timeline.py --num_workers 4 --num_stages 4 --num_steps 3
"""
from __future__ import annotations

import sys

import matplotlib
import numpy as np

import _common
from cdpjax import schedule

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

RULES = ("dp", "cdp-v1", "cdp-v2")


def profiles(rule: str, n: int, j: int, steps: int) -> dict:
  """The events and profiles of one rule, as plain lists for JSON."""
  events = schedule.timeline(rule, n, j, steps)
  acts = schedule.activation_profile(events, n, j)
  comms = schedule.communication_profile(events, n, j)
  steady = slice(2 * j * n, 4 * j * n) if steps >= 3 else slice(None)  # The middle step.
  return {
      "delay_matrix": schedule.delay_matrix(rule, n, j).tolist(),
      "events": [{"slot": float(e.slot), "worker": e.worker, "step": e.step, "stage": e.stage,
                  "kind": e.kind, "stale": e.version < e.step} for e in events],
      "activation_times": acts.times.tolist(),
      "activations_psi_a": (acts.alive / j).tolist(),
      "steady_activation_peak_psi_a": float(acts.alive[steady].max() / j),
      "steady_activation_mean_psi_a": float(acts.alive[steady].mean() / j),
      "contribution_times": comms.times.tolist(),
      "contributions": comms.contributions.tolist(),
      "max_contributions_per_tick": int(comms.contributions.max()),
      "reduction_slots": comms.reduction_slots.tolist(),
  }


def draw(results: dict, n: int, j: int, path) -> None:
  colors = plt.get_cmap("tab10" if n <= 10 else "viridis")(np.linspace(0, 1, 10)[:n] if n <= 10
                                                           else np.linspace(0, 1, n))
  fig, axes = plt.subplots(3, len(results), figsize=(5.2 * len(results), 7.5), sharex=True,
                           gridspec_kw={"height_ratios": [2.2, 1, 1]}, squeeze=False)
  end = max(e["slot"] + 1 for r in results.values() for e in r["events"])
  for col, (rule, r) in enumerate(results.items()):
    gantt, act, comm = axes[:, col]
    for e in r["events"]:
      dark = e["kind"] == "bwd"
      gantt.barh(e["worker"], 1, left=e["slot"], height=0.8, color=colors[e["worker"]],
                 alpha=1.0 if dark else 0.45, edgecolor="black", linewidth=0.4,
                 hatch="///" if e["stale"] else None)
      if n * j <= 64:
        gantt.text(e["slot"] + 0.5, e["worker"], f"{'B' if dark else 'F'}{e['stage']}",
                   ha="center", va="center", fontsize=6)
    gantt.set_title(f"{rule}  (hatched: stale parameters)")
    gantt.set_ylabel("worker")
    gantt.set_yticks(range(n))
    gantt.invert_yaxis()
    act.step(r["activation_times"], r["activations_psi_a"], where="post", color="C3")
    act.axhline(r["steady_activation_peak_psi_a"], color="C3", ls=":", lw=1,
                label=f"steady peak {r['steady_activation_peak_psi_a']:.2f}")
    act.set_ylabel("activations (Psi_A)")
    act.set_ylim(0, n * 1.1)
    act.legend(loc="upper right", fontsize=7)
    comm.bar(r["contribution_times"], r["contributions"], width=1 / n, align="edge", color="C0")
    for slot in np.ravel(r["reduction_slots"]):
      comm.axvline(slot, color="C1", lw=0.8, ls="--")
    comm.set_ylabel("grad contributions")
    comm.set_xlabel("slot (one stage forward or backward)")
    comm.set_xlim(0, end)
  fig.suptitle(f"N = {n} workers, J = {j} stages (dashed: a stage's reduction can start)")
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def main(argv=None) -> dict:
  p = _common.parser("timeline", __doc__)
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--num_stages", type=int, default=4)
  p.add_argument("--num_steps", type=int, default=3)
  args = p.parse_args(argv)
  n, j, steps = args.num_workers, args.num_stages, 2 if args.quick else args.num_steps
  out = _common.results_dir(args)
  results = {rule: profiles(rule, n, j, steps) for rule in RULES}
  _common.write_json(out / "timeline.json", {"num_workers": n, "num_stages": j,
                                             "num_steps": steps, "rules": results})
  draw(results, n, j, out / "timeline.png")
  print("| rule | activation peak (Psi_A) | activation mean (Psi_A) | max contributions / tick |")
  print("|---|---|---|---|")
  for rule, r in results.items():
    print(f"| {rule} | {r['steady_activation_peak_psi_a']:.3g} | "
          f"{r['steady_activation_mean_psi_a']:.3g} | {r['max_contributions_per_tick']} |")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
