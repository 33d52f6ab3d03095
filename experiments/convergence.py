"""Delayed vs synchronous gradient descent on least squares, where the optimum is known.

The problem: ``f(theta) = 1/(2m) ||X theta - Y||_F^2`` on the digits pixels
(standardised, plus a bias column) with one-hot targets; ``theta*`` from
``numpy.linalg.lstsq``. ``theta``'s feature rows are cut into ``J`` stages
and trained by the real ``cdpjax.engine`` (plain SGD, 8 emulated devices, each
worker a fixed ``m/N`` rows, so every step is a full-batch step) with ``dp``,
``cdp-v1`` and ``cdp-v2``, for learning rates given as fractions of ``2/L``
(``L`` the Hessian's largest eigenvalue). It records ``f(theta_t) - f*``.

Theory for a quadratic: synchronous GD is stable for ``lr < 2/L``; with every
stage one step late (``cdp-v1``, PipeDream-2BW's delay) the iteration
``theta_{t+1} = theta_t - lr grad f(theta_{t-1})`` is stable only for
``lr < 1/L``. Writes ``convergence.json`` and ``convergence.png``.

It then measures each rule's divergence threshold on ``lr * L`` with the
engine, by bisection (a run diverges when its loss grows over the second half
of ``--num_steps`` steps), against ``cdpjax.stability``'s prediction from the
same per-worker Hessians: the companion matrix for fixed delays (``dp``,
``cdp-v1``, ``cdp-v2``, ``straggler``), a simulation of the same draws for the
``random`` rules. Writes ``thresholds.json``:

  python experiments/convergence.py              # 7 learning rates x 400 steps, thresholds
  python experiments/convergence.py --quick
  python experiments/convergence.py --compensated --results_dir results/compensated_thresholds

``--compensated`` measures only cdp-v1's and cdp-v2's thresholds with each
delay compensation of ``COMPENSATIONS`` (weight prediction; a delay-scaled
learning rate; DC-ASGD, linearized at the optimum, where each worker's gradient
``g_i*`` is not 0: its ``dc_lambda g_i*^2`` moves the limit) against
``cdpjax.stability``'s prediction with the same option.
"""
from __future__ import annotations

import math
import sys

import numpy as np

import _common
from cdpjax.distributed import emulate_cpu_devices

RULES = ("dp", "cdp-v1", "cdp-v2")
LR_FRACTIONS = (0.1, 0.25, 0.45, 0.55, 0.75, 0.9, 0.99)  # Of 2/L.
DIVERGED = 1e6  # A gap this many times the initial one counts as diverged.


def least_squares_problem(num_rows: int):
  """``(X [m, F], Y [m, 10])`` from the digits pixels; constant pixels dropped."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  pixels, labels = datasets.load_digits(return_X_y=True)
  pixels, labels = pixels[:num_rows], labels[:num_rows]
  pixels = pixels[:, pixels.std(0) > 0]
  x = (pixels - pixels.mean(0)) / pixels.std(0)
  x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
  return x.astype(np.float32), np.eye(10, dtype=np.float32)[labels]


def objective(x, y, theta) -> float:
  r = x.astype(np.float64) @ theta - y
  return 0.5 * float(np.sum(r * r)) / len(x)


def split_rows(num_features: int, num_stages: int) -> list[slice]:
  edges = np.linspace(0, num_features, num_stages + 1).round().astype(int)
  return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def main(argv=None) -> dict:
  p = _common.parser("convergence", __doc__)
  p.add_argument("--num_workers", type=int, default=8)
  p.add_argument("--num_stages", type=int, default=4)
  p.add_argument("--num_steps", type=int, default=400)
  p.add_argument("--lr_fractions", default=",".join(map(str, LR_FRACTIONS)),
                 help="Learning rates as fractions of 2/L, comma-separated.")
  p.add_argument("--async_steps", type=int, default=40,
                 help="Steps of the event-by-event asynchronous and CDP-v2 simulations.")
  p.add_argument("--async_workers", type=int, default=4)
  p.add_argument("--async_stages", type=int, default=2)
  p.add_argument("--resolution", type=float, default=0.02,
                 help="Relative width at which the threshold bisection stops.")
  p.add_argument("--compensated", action="store_true",
                 help="Only the thresholds of cdp-v1 and cdp-v2 with each delay compensation "
                      "(COMPENSATIONS), into compensated_thresholds.json.")
  args = p.parse_args(argv)
  if args.quick:
    args.num_steps, args.lr_fractions, args.resolution = 5, "0.45,0.75", 0.5
  n, j = args.num_workers, args.num_stages
  out = _common.results_dir(args)
  emulate_cpu_devices(n)
  import jax  # pylint: disable=g-import-not-at-top  (JAX starts here)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from cdpjax import engine, schedule, stability, stages  # pylint: disable=g-import-not-at-top

  x, y = least_squares_problem(1797 // n * n)
  theta_star = np.linalg.lstsq(x.astype(np.float64), y, rcond=None)[0]
  f_star = objective(x, y, theta_star)
  lipschitz = float(np.linalg.eigvalsh(x.T.astype(np.float64) @ x / len(x)).max())
  rows = split_rows(x.shape[1], j)
  names = [f"stage{s}" for s in range(j)]
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  if args.compensated:
    rows_ = thresholds(x, y, rows, names, mesh, args)
    result = {"problem": "least squares, digits pixels -> one-hot", "num_workers": n,
              "num_stages": j, "L": lipschitz, "thresholds": rows_,
              "plain_limits": {rule: stability.stability_limit(
                  np.stack([xi.T @ xi / len(xi) for xi in np.split(x.astype(np.float64), n)]),
                  np.concatenate([[s] * (r.stop - r.start) for s, r in enumerate(rows)]),
                  schedule.delay_matrix(rule, n, j)) for rule in RULES},
              "machine": _common.machine()}
    _common.write_json(out / "compensated_thresholds.json", result)
    print(threshold_table(rows_))
    return result
  batch = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))

  def loss_fn(params, b):
    pred = sum(b["x"][:, r] @ params[name] for r, name in zip(rows, names))
    return 0.5 * jnp.mean(jnp.sum(jnp.square(pred - b["y"]), axis=1))

  # The rate lives in the optimizer state, so one compiled step per rule serves every rate.
  sgd = optax.inject_hyperparams(optax.sgd)
  init = {name: np.zeros((r.stop - r.start, y.shape[1]), np.float32)
          for r, name in zip(rows, names)}
  fractions = [float(v) for v in args.lr_fractions.split(",")]
  runs = []
  for rule in RULES:
    step = engine.make_train_step(loss_fn, sgd(learning_rate=0.0), rule=rule, mesh=mesh,
                                  stage_ids=stages.grouped(init))
    for fraction in fractions:
      lr = 2 * fraction / lipschitz
      state = engine.init_state(init, sgd(learning_rate=lr), rule=rule)
      gaps = [objective(x, y, np.concatenate([init[k] for k in names])) - f_star]
      for _ in range(args.num_steps):
        state, _ = step(state, batch)
        theta = np.concatenate([np.asarray(state.params[k], np.float64) for k in names])
        gaps.append(objective(x, y, theta) - f_star)
        if not math.isfinite(gaps[-1]) or gaps[-1] > DIVERGED * gaps[0]:
          break
      diverged = not math.isfinite(gaps[-1]) or gaps[-1] > gaps[0]
      runs.append({"rule": rule, "lr_fraction_of_2_over_L": fraction, "lr": lr,
                   "lr_times_L": lr * lipschitz, "gaps": gaps, "diverged": diverged,
                   "final_gap": gaps[-1]})
      print(f"{rule:7s} lr*L={lr * lipschitz:5.2f}: "
            + ("diverged" if diverged else f"gap {gaps[-1]:.3e}"), flush=True)

  result = {"problem": "least squares, digits pixels -> one-hot", "rows": len(x),
            "features": x.shape[1], "num_workers": n, "num_stages": j, "f_star": f_star,
            "L": lipschitz, "num_steps": args.num_steps, "runs": runs,
            "stability_limit_lr_times_L": stability_limits(runs)}
  _common.write_json(out / "convergence.json", result)
  plot(runs, fractions, out / "convergence.png", n, j)
  print(table(runs, fractions))
  result["thresholds"] = thresholds(x, y, rows, names, mesh, args)
  _common.write_json(out / "thresholds.json", result["thresholds"])
  print(threshold_table(result["thresholds"]))
  result["async"] = async_runs(x, y, f_star, lipschitz, args)
  _common.write_json(out / "async.json", result["async"])
  return result


def async_runs(x, y, f_star, lipschitz, args) -> dict:
  """Asynchronous SGD (``simulate.simulate_async``) against CDP-v2 (``simulate``) on the problem.

  Stage ``j`` adds ``x[:, rows_j] @ theta_j`` to the prediction, so the
  event-by-event simulators run the same least squares as the engine. Each
  worker's micro-batch is its fixed ``m / N`` rows (full-batch steps). The
  simulators dispatch every stage op eagerly, so this runs at a smaller
  ``N x J`` (``--async_workers``, ``--async_stages``) than the engine.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from cdpjax import analysis, simulate  # pylint: disable=g-import-not-at-top
  n, j = args.async_workers, args.async_stages
  rows = split_rows(x.shape[1], j)
  num_steps = 2 if args.quick else args.async_steps
  fractions = [0.45] if args.quick else [0.25, 0.45, 0.75, 1.0, 1.2]  # Of 2/L.

  def stage_fn(r):
    return lambda theta, h: (h[0], h[1] + h[0][:, r] @ theta)

  def micro_loss(out, target):
    return 0.5 * jnp.mean(jnp.sum(jnp.square(out[1] - target), axis=1))

  stage_fns = [stage_fn(r) for r in rows]
  init = [np.zeros((r.stop - r.start, y.shape[1]), np.float32) for r in rows]
  parts = list(zip(np.split(x, n), np.split(y, n)))
  batches = [[((xi, np.zeros_like(yi)), yi) for xi, yi in parts]] * num_steps

  def gap(stage_params):
    return objective(x, y, np.concatenate([np.asarray(p, np.float64) for p in stage_params])) - f_star

  runs = []
  for fraction in fractions:
    lr = 2 * fraction / lipschitz
    a = simulate.simulate_async(stage_fns, micro_loss, init, optax.sgd(lr), batches)
    c = simulate.simulate(stage_fns, micro_loss, init, optax.sgd(lr), batches, "cdp-v2")
    runs.append({"lr_times_L": lr * lipschitz, "async_final_gap": gap(a.params),
                 "cdp_v2_final_gap": gap(c.params), "initial_gap": gap(init)})
    print(f"async vs cdp-v2, lr*L={lr * lipschitz:.2f}: gap {runs[-1]['async_final_gap']:.3e} vs "
          f"{runs[-1]['cdp_v2_final_gap']:.3e} after {num_steps} steps", flush=True)
  profile = analysis.async_profile(n, j, max(num_steps, 3), [r.stop - r.start for r in rows])
  values, counts = np.unique(profile.async_staleness[1:], return_counts=True)
  return {"num_workers": n, "num_stages": j, "num_steps": num_steps, "runs": runs,
          "async_staleness_steps": dict(zip(map(float, values), map(int, counts))),
          "cdp_v2_staleness_steps": {int(k): int(v) for k, v in zip(
              *np.unique(profile.cdp_staleness[1:], return_counts=True))}}


COMPENSATIONS = {"prediction": {"predict": True}, "delay-scaled lr 1": {"lr_delay_scale": 1.0},
                 "DC-ASGD 1": {"dc_lambda": 1.0}}


def threshold_rules(n: int, j: int, quick: bool, compensated: bool = False) -> dict:
  """The rules whose thresholds are measured: name -> (rule, delay compensation)."""
  from cdpjax import schedule  # pylint: disable=g-import-not-at-top
  if compensated:  # Each fixed delayed rule with each compensation of COMPENSATIONS.
    return {f"{rule} + {name}": (rule, comp) for rule in RULES[1:2 if quick else 3]
            for name, comp in list(COMPENSATIONS.items())[:1 if quick else None]}
  rules = {name: (name, {}) for name in RULES}
  if quick:
    return {"cdp-v1": ("cdp-v1", {}), "random uniform D=2": (schedule.random_rule(n, j, 2), {})}
  rules.update({label: (rule, {}) for label, rule in {
      "random uniform D=2": schedule.random_rule(n, j, 2),
      "random geometric D=2": schedule.random_rule(n, j, 2, distribution="geometric"),
      "random uniform D=4": schedule.random_rule(n, j, 4),
      "straggler D=2": schedule.straggler_rule(n, j, 2),
      "straggler D=4": schedule.straggler_rule(n, j, 4),
  }.items()})
  return rules


def diverges(losses) -> bool:
  """Non-finite, or the loss's peaks in the last quarter exceed those of the second."""
  losses = np.asarray(losses, np.float64)
  quarter = len(losses) // 4
  if not np.all(np.isfinite(losses)):
    return True
  return bool(losses[3 * quarter:].max() > losses[quarter:2 * quarter].max())


def thresholds(x, y, rows, names, mesh, args) -> list:
  """Per rule: predicted and measured largest stable ``lr * L``."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from cdpjax import engine, executor, schedule, stability, stages  # pylint: disable=g-import-not-at-top
  n, j = args.num_workers, args.num_stages
  x64 = x.astype(np.float64)
  hessians = np.stack([xi.T @ xi / len(xi) for xi in np.split(x64, n)])
  # DC-ASGD's g_i*^2: each worker's gradient at the optimum, per coordinate and output column.
  optimum = np.linalg.lstsq(x64, y, rcond=None)[0]
  squares = np.stack([xi.T @ (xi @ optimum - yi) / len(xi) for xi, yi in
                      zip(np.split(x64, n), np.split(y.astype(np.float64), n))]) ** 2
  stage_of_coord = np.concatenate([[s] * (r.stop - r.start) for s, r in enumerate(rows)])
  big_l = stability.lipschitz(hessians)
  chunk = min(25, args.num_steps)
  num_steps = args.num_steps // chunk * chunk
  stacked = {"x": np.stack([x] * chunk), "y": np.stack([y] * chunk)}
  sgd = optax.inject_hyperparams(optax.sgd)
  init = {name: np.zeros((r.stop - r.start, y.shape[1]), np.float32) for r, name in zip(rows, names)}

  def loss_fn(params, b):
    pred = sum(b["x"][:, r] @ params[name] for r, name in zip(rows, names))
    return 0.5 * jnp.mean(jnp.sum(jnp.square(pred - b["y"]), axis=1))

  out = []
  for label, (rule, comp) in threshold_rules(n, j, args.quick, args.compensated).items():
    if isinstance(rule, schedule.DelayRule) and label.startswith("random"):
      predicted = stability.random_rule_limit(hessians, stage_of_coord, rule, num_steps=num_steps)
      how = "simulated recursion, same draws"
    elif "dc_lambda" in comp:  # Linearized at the optimum, one output column at a time.
      matrix = schedule.delay_matrix(rule, n, j)
      others = {k: v for k, v in comp.items() if k != "dc_lambda"}
      predicted = min(stability.stability_limit(
          hessians, stage_of_coord, matrix, dc=comp["dc_lambda"] * squares[:, :, c], **others)
          for c in range(squares.shape[2]))
      how = "companion matrix, linearized at the optimum"
    else:
      matrix = rule(0) if isinstance(rule, schedule.DelayRule) else schedule.delay_matrix(rule, n, j)
      predicted = stability.stability_limit(hessians, stage_of_coord, matrix, **comp)
      how = "companion matrix"
    rule = executor.resolve(rule, "data", n, j, **comp) if comp else rule
    step = engine.make_train_step(loss_fn, sgd(learning_rate=0.0), rule=rule, mesh=mesh,
                                  stage_ids=stages.grouped(init),
                                  scan_steps=chunk)

    def unstable(lr_times_l):
      state = engine.init_state(init, sgd(learning_rate=lr_times_l / big_l), rule=rule)
      losses = []
      for _ in range(num_steps // chunk):
        state, metrics = step(state, stacked)
        losses.extend(np.asarray(jax.device_get(metrics["loss"]), np.float64))
        if not np.isfinite(losses[-1]) or losses[-1] > 1e8 * losses[0]:
          return True
      return diverges(losses)

    lo, hi = 0.8 * predicted, 1.25 * predicted
    while unstable(lo):
      lo, hi = 0.8 * lo, lo
    while not unstable(hi):
      lo, hi = hi, 1.25 * hi
    probes = 2
    while (hi - lo) / hi > args.resolution:
      mid = 0.5 * (lo + hi)
      lo, hi = (lo, mid) if unstable(mid) else (mid, hi)
      probes += 1
    mean_limit = None
    if isinstance(rule, schedule.DelayRule) and label.startswith("random"):
      probs = schedule.delay_probabilities(label.split()[1], rule.max_delay)
      mean_limit = stability.mean_delay_limit(probs)
    row = {"rule": label, "predicted": predicted, "prediction": how, "stable_up_to": lo,
           "diverges_from": hi, "agrees": bool(lo * (1 - args.resolution) <= predicted
                                               <= hi * (1 + args.resolution)),
           "expected_iterate_limit": mean_limit, "probes": probes, "num_steps": num_steps}
    print(f"{label:22s} predicted {predicted:.3f}  measured ({lo:.3f}, {hi:.3f})", flush=True)
    out.append(row)
  return out


def threshold_table(rows) -> str:
  lines = ["| rule | predicted lr·L limit | how | measured: stable at | diverges at | agrees |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['rule']} | {r['predicted']:.3f} | {r['prediction']} | "
                 f"{r['stable_up_to']:.3f} | {r['diverges_from']:.3f} | "
                 f"{'yes' if r['agrees'] else 'no'} |")
  return "\n".join(lines)


def stability_limits(runs) -> dict:
  """Per rule, the largest ``lr * L`` tried that did not diverge."""
  return {rule: max((r["lr_times_L"] for r in runs if r["rule"] == rule and not r["diverged"]),
                    default=None) for rule in RULES}


def table(runs, fractions) -> str:
  lines = ["| lr * L | " + " | ".join(f"{r} gap" for r in RULES) + " |",
           "|---|" + "---|" * len(RULES)]
  for fraction in fractions:
    cells = []
    for rule in RULES:
      (r,) = [r for r in runs if r["rule"] == rule and r["lr_fraction_of_2_over_L"] == fraction]
      cells.append("diverged" if r["diverged"] else f"{r['final_gap']:.2e}")
    lines.append(f"| {2 * fraction:.2f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(runs, fractions, path, n: int, j: int) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(RULES), figsize=(5 * len(RULES), 3.8), sharey=True)
  colors = plt.get_cmap("viridis")(np.linspace(0, 0.95, len(fractions)))
  for ax, rule in zip(axes, RULES):
    for color, fraction in zip(colors, fractions):
      (r,) = [r for r in runs if r["rule"] == rule and r["lr_fraction_of_2_over_L"] == fraction]
      gaps = np.maximum(np.asarray(r["gaps"], float), 1e-12)
      ax.semilogy(gaps, color=color, ls="--" if r["diverged"] else "-",
                  label=f"lr·L = {2 * fraction:.2f}" + (" (diverges)" if r["diverged"] else ""))
    ax.set_title(rule)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.set_ylim(top=max(np.max(np.asarray(r["gaps"][:1])) for r in runs) * 100)
  axes[0].set_ylabel("f(theta_t) - f*")
  axes[-1].legend(fontsize=7, loc="lower left")
  fig.suptitle(f"Least squares on digits, full-batch GD via cdpjax.engine, N = {n}, J = {j}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main(sys.argv[1:])
