"""CDP-ZeRO vs ZeRO-3 vs the replicated engine: memory, communication, balance, speed.

For N = J in {2, 4, 8} workers on emulated CPU devices, the digits ResidualMLP
(J blocks, one per stage) is trained with:

- ``cyclic``: ``executed.zero.make_train_step(timetable="cyclic")``, rule cdp-v2;
- ``zero3``: ``executed.zero.make_train_step(timetable="zero3")``, rule dp;
- ``engine``: the replicated engine (``executor.build("data", ...)``), rule cdp-v2.

Memory and communication are read from the compiled programs (per device);
speed is a ratio to the engine measured in this run, steps interleaved, warm-up
excluded, median of ``--steps`` steps. Run:

  python experiments/bench_zero.py            # writes results/bench_zero.json
  python experiments/bench_zero.py --quick    # a tiny configuration, seconds
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  pylint: disable=g-import-not-at-top
from cdpjax import distributed  # noqa: E402  (imports no JAX)

distributed.emulate_cpu_devices(8)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402

from cdpjax import compiled, executor, stages  # noqa: E402
from cdpjax.executed import plan, zero  # noqa: E402
from cdpjax.executed import staged as staged_lib  # noqa: E402
from cdpjax.models.residual_mlp import ResidualMLP  # noqa: E402


def bytes_sent_per_device(hlo_text: str, num_workers: int) -> np.ndarray:
  """Bytes each device sends in one step, by the usual ring costs.

  collective-permute: its buffer per pair the device sources; all-gather:
  ``(G-1)/G`` of the result; reduce-scatter: ``G-1`` results; all-reduce:
  ``2 (G-1)/G`` of the buffer (G: group size).
  """
  sent = np.zeros(num_workers)
  for c in compiled.collectives(hlo_text):
    if c.kind == "collective-permute":
      for src, _ in c.source_target_pairs:
        sent[src] += c.bytes
      continue
    groups = c.replica_groups or ((tuple(range(num_workers))),)
    size = len(groups[0]) if groups[0] else num_workers
    factor = {"all-gather": (size - 1) / size, "reduce-scatter": size - 1,
              "all-reduce": 2 * (size - 1) / size, "all-to-all": (size - 1) / size}[c.kind]
    sent += c.bytes * factor
  return sent


def state_bytes(tree) -> int:
  """Bytes of one device's shards of ``tree``."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def build(num_workers, args):
  """The three programs for N = J = ``num_workers``: ``{name: (call, state, batch, row)}``."""
  num_blocks = num_workers
  model = ResidualMLP(num_classes=10, width=args.width, hidden=4 * args.width,
                      num_blocks=num_blocks)
  rng = np.random.default_rng(0)
  n = num_workers * args.per_worker
  batch = {"image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, n).astype(np.int32)}
  variables = jax.jit(model.init)(jax.random.key(0), batch["image"][:1])
  params = jax.tree.map(np.asarray, variables["params"])
  mesh = jax.make_mesh((num_workers,), ("data",))
  tx = optax.adam(1e-3)
  sample = batch["image"][:1]
  stage_ids = stages.model_stage_ids(
      model, params, num_workers, sample, strategy="boundaries",
      boundaries=[f"block_{s}" for s in range(1, num_workers)])
  staged = staged_lib.stage_model(model, params, stage_ids, sample, pad_to=num_workers)
  programs = {}
  for name, rule in (("cyclic", "cdp-v2"), ("zero3", "dp"), ("engine", "cdp-v2")):
    if name == "engine":
      ex = executor.build("data", model, tx, params=params, model_state=None,
                          stage_ids=stage_ids, sample_input=sample, rule=rule, mesh=mesh,
                          loss_fn=staged_lib.cross_entropy)
    else:
      ex = zero.make_train_step(staged, tx, rule=rule, mesh=mesh, timetable=name)
    state = ex.init(params)
    start = time.perf_counter()
    executable = ex.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    hlo = executable.as_text()
    memory = compiled.memory(executable)
    summary = {k: v for k, v in compiled.collective_summary(hlo).items() if v["count"]}
    stale = getattr(state, "stale_params", ())
    row = {
        "num_workers": num_workers, "num_stages": num_workers, "schedule": name, "rule": rule,
        "compile_s": round(compile_s, 2),
        "memory": {
            "parameters": state_bytes((state.params, stale)),
            "optimizer": state_bytes(state.opt_state),
            "temporaries": memory["temp_bytes"],
            "argument_bytes": memory["argument_bytes"],
            "peak_bytes": memory["peak_bytes"],
        },
        "collectives": summary,
    }
    sent = bytes_sent_per_device(hlo, num_workers)
    row["bytes_per_device_per_step"] = int(sent.max())  # The busiest device.
    row["bytes_per_device_per_step_mean"] = float(sent.mean())
    row["memory"]["model_states"] = row["memory"]["parameters"] + row["memory"]["optimizer"]
    if name == "engine":  # All J all-reduces run together after the backward.
      row["max_slot_bytes_per_device"] = row["bytes_per_device_per_step"]
      row["max_slot_bytes"] = row["bytes_per_device_per_step"] * num_workers
    else:
      stage_bytes = 4 * staged.param_size
      traffic = plan.slot_traffic(name, num_workers, stage_bytes, rule=rule)
      row["max_slot_bytes_per_device"] = traffic["max_slot_bytes_per_device"]
      row["max_slot_bytes"] = traffic["max_slot_bytes"]
      row["num_slots"] = traffic["num_slots"]
    programs[name] = (ex.step, state, batch, row)
  return programs


def main(argv=None):
  parser = _common.parser("bench_zero", __doc__)
  parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--per-worker", type=int, default=32)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args(argv)
  if args.quick:
    args.workers, args.width, args.per_worker, args.steps, args.warmup = [2], 16, 4, 3, 1
  rows, goals = [], {}
  for num_workers in args.workers:
    if num_workers > jax.device_count():
      sys.exit(f"N={num_workers} needs {num_workers} devices, found {jax.device_count()}.")
    programs = build(num_workers, args)
    medians = _common.interleaved_step_times(
        {name: p[:3] for name, p in programs.items()}, steps=args.steps, warmup=args.warmup)
    by_name = {name: p[3] for name, p in programs.items()}
    for name, row in by_name.items():
      row["step_time_s"] = medians[name]
      row["step_time_ratio"] = medians[name] / medians["engine"]
      rows.append(row)
    cyc, z3, eng = by_name["cyclic"], by_name["zero3"], by_name["engine"]
    goals[str(num_workers)] = {
        "only_point_to_point": set(cyc["collectives"]) <= {"collective-permute"},
        "bytes_vs_zero3": cyc["bytes_per_device_per_step"] / z3["bytes_per_device_per_step"],
        "mean_bytes_vs_zero3": (cyc["bytes_per_device_per_step_mean"]
                                / z3["bytes_per_device_per_step_mean"]),
        "model_states_vs_engine_times_n": (cyc["memory"]["model_states"] * num_workers
                                           / eng["memory"]["model_states"]),
        "max_slot_bytes_vs_zero3": cyc["max_slot_bytes"] / z3["max_slot_bytes"],
    }
  result = {"config": {k: v for k, v in vars(args).items() if k != "results_dir"}, "runs": rows,
            "goals": goals, "devices": jax.device_count(), "backend": jax.default_backend(),
            "machine": _common.machine()}
  path = _common.results_dir(args) / "bench_zero.json"
  _common.write_json(path, result)
  header = (f"{'N':>2} {'schedule':>8} {'params':>9} {'optim':>9} {'temp':>9} "
            f"{'collectives':<34} {'sent/dev':>9} {'max slot':>9} {'step ms':>8} {'ratio':>5}")
  print(header)
  for r in rows:
    kinds = ", ".join(f"{v['count']} {k}" for k, v in r["collectives"].items())
    m = r["memory"]
    print(f"{r['num_workers']:>2} {r['schedule']:>8} {m['parameters']:>9} {m['optimizer']:>9} "
          f"{m['temporaries']:>9} {kinds:<34} {r['bytes_per_device_per_step']:>9} "
          f"{r['max_slot_bytes']:>9} {1e3 * r['step_time_s']:>8.2f} {r['step_time_ratio']:>5.2f}")
  print("goals:", json.dumps(goals))
  print("wrote", path)


if __name__ == "__main__":
  main()
