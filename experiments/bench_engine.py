"""The engine's overhead: CDP rules against DP, and the engine against plain DP.

On 8 emulated CPU devices in one process, one model, mesh and batch:

- step-time ratios cdp-v1/dp and cdp-v2/dp of ``engine.make_train_step``;
- the ratio of the engine's dp step to a hand-written ``shard_map`` DP step
  (grad at a varying copy of the parameters, ``pmean``, optax update);
- compiled memory of each from ``memory_analysis()``, and the extra bytes of
  CDP over DP against one copy of the parameters.

Steps are interleaved so machine drift hits all variants alike; warm-up is
excluded and the median of ``--steps`` steps is taken. Goals: every ratio
<= 1.05; CDP's extra memory <= one parameter copy.

  python experiments/bench_engine.py          # results/bench_engine/bench_engine.json
  python experiments/bench_engine.py --quick  # seconds
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  pylint: disable=g-import-not-at-top
from cdpjax import distributed  # noqa: E402  (imports no JAX)

distributed.emulate_cpu_devices(8)

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from cdpjax import compiled, engine, stages  # noqa: E402
from cdpjax.models.residual_mlp import ResidualMLP  # noqa: E402

NUM_WORKERS = 8
NUM_STAGES = 4


def cross_entropy(model, params, batch):
  logits = model.apply({"params": params}, batch["image"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def plain_dp_step(loss_fn, tx, mesh):
  """Textbook data parallelism with shard_map, as a user would write it."""

  def step(state, batch):
    params, opt_state = state
    local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    grads, loss = jax.lax.pmean((grads, loss), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=(P(), P())), donate_argnums=0)


def main(argv=None):
  parser = _common.parser("bench_engine", __doc__)
  parser.add_argument("--steps", type=int, default=30, help="Timed steps per variant.")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--per_worker_batch", type=int, default=32)
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.warmup, args.width, args.per_worker_batch = 3, 1, 32, 4

  mesh = jax.make_mesh((NUM_WORKERS,), ("data",))
  model = ResidualMLP(num_classes=10, width=args.width, hidden=2 * args.width,
                      num_blocks=NUM_STAGES)
  rng = np.random.default_rng(0)
  n = NUM_WORKERS * args.per_worker_batch
  batch = {"image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, size=n).astype(np.int32)}
  params = model.init(jax.random.key(0), batch["image"][:1])["params"]
  stage_ids = stages.model_stage_ids(
      model, params, NUM_STAGES, batch["image"][:1], strategy="boundaries",
      boundaries=[f"block_{j}" for j in range(1, NUM_STAGES)])
  tx = optax.sgd(0.01, momentum=0.9)

  def loss_fn(p, b):
    return cross_entropy(model, p, b)

  replicated = NamedSharding(mesh, P())
  device_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  programs = {}
  for rule in ("dp", "cdp-v1", "cdp-v2"):
    step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule, mesh=mesh)
    state = jax.device_put(engine.init_state(params, tx, rule=rule), replicated)
    programs[f"engine {rule}"] = (step, state, step.lower(state, device_batch).compile())
  plain = plain_dp_step(loss_fn, tx, mesh)
  plain_state = jax.device_put((jax.tree.map(jnp.array, params), tx.init(params)), replicated)
  programs["plain dp"] = (plain, plain_state, plain.lower(plain_state, device_batch).compile())

  step_s = _common.interleaved_step_times(
      {name: (fn, state, device_batch) for name, (fn, state, _) in programs.items()},
      steps=args.steps, warmup=args.warmup)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  rows = {name: {"median_step_s": step_s[name], **compiled.memory(exe)}
          for name, (_, _, exe) in programs.items()}
  ratios = {
      "cdp-v1/dp": step_s["engine cdp-v1"] / step_s["engine dp"],
      "cdp-v2/dp": step_s["engine cdp-v2"] / step_s["engine dp"],
      "engine dp/plain dp": step_s["engine dp"] / step_s["plain dp"],
  }
  extra = {rule: rows[f"engine {rule}"]["peak_bytes"] - rows["engine dp"]["peak_bytes"]
           for rule in ("cdp-v1", "cdp-v2")}
  result = {
      "devices": NUM_WORKERS, "num_stages": NUM_STAGES, "width": args.width,
      "per_worker_batch": args.per_worker_batch, "steps": args.steps, "param_bytes": param_bytes,
      "variants": rows, "ratios": ratios,
      "extra_peak_bytes_over_dp": extra,
      "extra_over_dp_in_param_copies": {k: v / param_bytes for k, v in extra.items()},
      "goals_met": {"ratios<=1.05": all(r <= 1.05 for r in ratios.values()),
                    "extra<=1 param copy": all(v <= param_bytes for v in extra.values())},
      "machine": _common.machine(),
  }
  out = _common.results_dir(args) / "bench_engine.json"
  _common.write_json(out, result)

  print(f"{'variant':<16}{'step ms':>10}{'args KiB':>10}{'temp KiB':>10}{'peak KiB':>10}")
  for name, r in rows.items():
    print(f"{name:<16}{1e3 * r['median_step_s']:>10.3f}{r['argument_bytes'] / 1024:>10.1f}"
          f"{r['temp_bytes'] / 1024:>10.1f}{r['peak_bytes'] / 1024:>10.1f}")
  for name, r in ratios.items():
    print(f"{name:<20}{r:.3f}")
  for rule, v in result["extra_over_dp_in_param_copies"].items():
    print(f"extra peak of {rule} over dp: {v:.3f} parameter copies")
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
