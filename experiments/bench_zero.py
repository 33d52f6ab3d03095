"""CDP-ZeRO vs ZeRO-3 vs the replicated engine: memory, communication, balance, speed.

For N = J in {2, 4, 8} workers on emulated CPU devices, the digits ResidualMLP
(J blocks, one per stage) is trained with:

- ``cyclic``: ``executed.zero.make_executor(timetable="cyclic")``, rule cdp-v2;
- ``zero3``: ``executed.zero.make_executor(timetable="zero3")``, rule dp;
- ``engine``: the replicated engine (``executors.build("data", ...)``), rule cdp-v2.

``cyclic`` and ``zero3`` run ``--scan_steps`` K steps per compiled call (the
timetable fills and drains once per call), the engine one. Memory and collectives
are read from the compiled programs (per device); the cyclic step's bytes come
from its slot plan (`plan.zero_plan`), since its messages sit in a loop body.
Speed is a ratio measured in this run, calls interleaved, warm-up excluded,
per training step; as a script on one CPU (``--cpus``, for the reason
`bench_engine` gives). ``--repeats`` blocks of ``--steps`` calls each give a
median per program; a step time is the median of these, and
``step_time_vs_zero3_range`` the range of the blocks' ratios to ZeRO-3
(2026-12-03, N = 4: 1.38-1.54 within one run; two runs of the same code
hours apart gave medians 0.06 / 0.09 / 0.18 apart at N = 4 / 2 / 8, so
compare figures of one run).

Timing ablations run beside them (``--floors``; their numbers are wrong,
only their time counts): ``cyclic`` with its messages replaced by one 64-byte
collective-permute per slot (``slot_rendezvous``: exchanging data every slot
with no bytes and a single collective), and by nothing (``no_collectives``:
the slots' compute and bookkeeping alone, each worker running free). Then each
stage's forward and backward replaced by a stand-in of the same shapes that
reads the parameters and writes the gradient buffer (`compute_replaced`):
``no_compute`` (``cyclic``'s messages and bookkeeping), ``bookkeeping``
(neither compute nor messages) and ``zero3_no_compute`` (ZeRO-3's collectives
and bookkeeping). Their differences split each step into stage compute,
collectives and bookkeeping (``split`` in the goals, in units of ZeRO-3's
step time; each part is a difference of two timed programs, as noisy as both).

The compile sweep lowers and compiles both ZeRO steps for J = N in
``--compile_sweep`` (the residual MLP, width 32, one step per call; a child
process when this one has fewer devices than the largest J). Run:

  python experiments/bench_zero.py            # writes results/bench_zero.json
  python experiments/bench_zero.py --quick    # a tiny configuration, seconds
"""
import argparse
import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  pylint: disable=g-import-not-at-top
from cdpjax import distributed  # noqa: E402  (imports no JAX)

distributed.emulate_cpu_devices(8)

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from cdpjax import compiled, executors, hlo, stages  # noqa: E402
from cdpjax.executed import plan, zero  # noqa: E402
from cdpjax.executed import staged as staged_lib  # noqa: E402
from cdpjax.models.residual_mlp import ResidualMLP  # noqa: E402


def bytes_sent_per_device(hlo_text: str, num_workers: int) -> np.ndarray:
  """Bytes each device sends in one run of the compiled program, by the usual ring costs.

  collective-permute: its buffer per pair the device sources; all-gather:
  ``(G-1)/G`` of the result; reduce-scatter: ``G-1`` results; all-reduce:
  ``2 (G-1)/G`` of the buffer (G: group size). A loop body counts once.
  """
  sent = np.zeros(num_workers)
  for c in hlo.collectives(hlo_text):
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


def plan_bytes_sent_per_step(delays, num_steps: int, message_bytes) -> np.ndarray:
  """Bytes each device sends per step of a ``K``-step cyclic call, from its slot plan
  (``message_bytes``: each stage's message, its class's size)."""
  sent = np.zeros(delays.shape[0])
  for t in plan.cyclic_transfers(delays, num_steps):  # The MLP has no model state to send.
    sent[t.src] += message_bytes[t.stage]
  return sent / num_steps


def state_bytes(tree) -> int:
  """Bytes of one device's shards of ``tree``."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def residual_mlp(num_workers, width, hidden, rows):
  """The model cut into N blocks (one a stage), a batch of ``rows`` and its stage layout."""
  model = ResidualMLP(num_classes=10, width=width, hidden=hidden, num_blocks=num_workers)
  rng = np.random.default_rng(0)
  batch = {"image": rng.normal(size=(rows, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, rows).astype(np.int32)}
  params = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0),
                                                        batch["image"][:1])["params"])
  sample = batch["image"][:1]
  stage_ids = stages.model_stage_ids(
      model, params, num_workers, sample, by="boundaries",
      boundaries=[f"block_{s}" for s in range(1, num_workers)])
  staged = staged_lib.stage_model(model, params, stage_ids, sample, pad_to=num_workers)
  return model, params, stage_ids, staged, batch


def build(num_workers, args):
  """The three programs for N = J = ``num_workers``: ``{name: (call, state, batch, row)}``."""
  model, params, stage_ids, staged, batch = residual_mlp(
      num_workers, args.width, 4 * args.width, num_workers * args.per_worker)
  mesh = jax.make_mesh((num_workers,), ("data",))
  tx = optax.adam(1e-3)
  steps_batch = jax.tree.map(lambda x: np.stack([x] * args.scan_steps), batch)
  programs, hlo_of = {}, {}
  for name, rule in (("cyclic", "cdp-v2"), ("zero3", "dp"), ("engine", "cdp-v2")):
    if name == "engine":
      ex = executors.build("data", model, tx, params=params, model_state=None,
                          stage_ids=stage_ids, sample_input=batch["image"][:1], rule=rule,
                          mesh=mesh, loss_fn=staged_lib.cross_entropy)
      num_steps, call_batch = 1, batch
    else:
      ex = zero.make_executor(staged, tx, rule=rule, mesh=mesh, timetable=name,
                                scan_steps=args.scan_steps)
      num_steps, call_batch = args.scan_steps, steps_batch
    state = ex.init(params)
    start = time.perf_counter()
    executable = ex.lower(state, call_batch).compile()
    row = {"num_workers": num_workers, "num_stages": num_workers, "schedule": name,
           "rule": rule, "steps_per_call": num_steps,
           "compile_s": round(time.perf_counter() - start, 2)}
    row.update(program_figures(executable, state, staged, ex.plan.delays, num_steps, name))
    programs[name] = (ex.step, state, call_batch, row)
    hlo_of[name] = executable.as_text()
  if args.floors:
    programs.update({name: (*p, None) for name, p in floor_programs(
        staged, params, tx, mesh, steps_batch, args.scan_steps, hlo_of).items()})
  return programs


# name: (timetable, its messages (`messages_replaced`), its stage compute replaced).
FLOORS = {"slot_rendezvous": ("cyclic", "slot_rendezvous", False),
          "no_collectives": ("cyclic", "no_collectives", False),
          "no_compute": ("cyclic", None, True),
          "bookkeeping": ("cyclic", "no_collectives", True),
          "zero3_no_compute": ("zero3", None, True)}


@contextlib.contextmanager
def compute_replaced():
  """While tracing: every stage's forward and backward a stand-in of the same shapes (a timing
  ablation; numbers wrong). Each reads the stage's parameters once, as the real stage does, and
  the backward writes the gradient buffer (the stage interface's output)."""
  cls = staged_lib.StagedModel
  apply, vjp = cls.apply, cls.vjp

  def forward(self, stage, params, state, h, x, labels):
    del self, stage, x, labels
    out = h * 0.5 + jnp.mean(params)
    return out, jnp.mean(out), state  # The loss reads the output, or a last stage's is dead.

  cls.apply = forward
  cls.vjp = lambda self, stage, params, state, h, x, labels, cot: (
      params * 1e-3 + cot[0], cot * 0.5 + h[0])
  try:
    yield
  finally:
    cls.apply, cls.vjp = apply, vjp


@contextlib.contextmanager
def messages_replaced(floor: str):
  """While tracing: the cyclic ring without its messages (a timing ablation; numbers wrong).

  Every collective-permute becomes the worker's own buffer; ``slot_rendezvous``
  then adds one 64-byte collective-permute around the ring per slot, which the
  slot waits for: the least that exchanging data every slot costs these
  slots. ``no_collectives`` leaves each worker running free.
  """
  route, permute = zero.Ring.route, zero.Ring.permute

  def one_rendezvous(ring, name, *args, stages=None):
    out = route(ring, name, *args, stages=stages)
    if name != ("param", "owner") or stages != ring.classes[0][1]:  # Once a slot.
      return out
    pairs = [(i, (i + 1) % ring.num_workers) for i in range(ring.num_workers)]
    token = permute(ring, out[:16], pairs)
    return out.at[0].add(0 * jnp.sum(token))  # In place.

  zero.Ring.permute = lambda ring, buffer, pairs: buffer
  if floor == "slot_rendezvous":
    zero.Ring.route = one_rendezvous
  try:
    yield
  finally:
    zero.Ring.route, zero.Ring.permute = route, permute


def _collectives_run(text, scan_steps):
  runs = hlo.collectives_per_step(text, scan_steps)
  return {k: (v["count_min"], v["count_max"]) for k, v in runs.items() if v["count_max"]}


def floor_programs(staged, params, tx, mesh, steps_batch, scan_steps, hlo_of) -> dict:
  """``{name: (step, state, batch)}``: each of `FLOORS` traced under its replacements.

  Each compiled program is checked to hold what its name says: no collective,
  one collective-permute per slot, or the collectives its timetable's program
  (``hlo_of[timetable]``) runs.
  """
  programs = {}
  for name, (timetable, messages, no_compute) in FLOORS.items():
    ex = zero.make_executor(staged, tx, rule="cdp-v2" if timetable == "cyclic" else "dp",
                              mesh=mesh, timetable=timetable, scan_steps=scan_steps)
    with contextlib.ExitStack() as replaced:  # The first call traces and compiles.
      if messages:
        replaced.enter_context(messages_replaced(messages))
      if no_compute:
        replaced.enter_context(compute_replaced())
      state, _ = ex.step(ex.init(params), steps_batch)
      text = ex.lower(state, steps_batch).compile().as_text()
    slots = plan.zero_slots(staged.num_stages, scan_steps) / scan_steps
    want = {None: _collectives_run(hlo_of[timetable], scan_steps), "no_collectives": {},
            "slot_rendezvous": {"collective-permute": (slots, slots)}}[messages]
    if _collectives_run(text, scan_steps) != want:
      raise RuntimeError(f"The {name} ablation runs {_collectives_run(text, scan_steps)} "
                         f"collectives per step, not {want}.")
    programs[name] = (ex.step, state, steps_batch)
  return programs


def time_split(step_time: dict) -> dict:
  """Each timetable's step time in parts, from the ablations' times (seconds a step)."""
  cyclic = {"compute": step_time["no_collectives"] - step_time["bookkeeping"],
            "collectives": step_time["cyclic"] - step_time["no_collectives"],
            "bookkeeping": step_time["bookkeeping"]}
  zero3 = {"compute": step_time["zero3"] - step_time["zero3_no_compute"],
           "collectives_and_bookkeeping": step_time["zero3_no_compute"]}
  return {name: {k: v / step_time["zero3"] for k, v in parts.items()}
          for name, parts in (("cyclic", cyclic), ("zero3", zero3))}


def program_figures(executable, state, staged, delays, num_steps, name) -> dict:
  """Memory, collectives, bytes per device per step and the busiest slot of one program."""
  text = executable.as_text()
  memory = compiled.memory(executable)
  num_workers = staged.num_stages
  stale = getattr(state, "stale_params", ())
  row = {
      "memory": {
          "parameters": state_bytes((state.params, stale)),
          "optimizer": state_bytes(state.opt_state),
          "temporaries": memory["temp_bytes"],
          "argument_bytes": memory["argument_bytes"],
          "peak_bytes": memory["peak_bytes"],
      },
      "collectives": {k: v for k, v in hlo.collective_summary(text).items() if v["count"]},
  }
  row["memory"]["model_states"] = row["memory"]["parameters"] + row["memory"]["optimizer"]
  classes = zero.message_classes(staged, num_workers)
  stage_bytes = [4 * size for j in range(num_workers)  # The bytes each stage moves.
                 for size, members in classes if j in members] if name == "cyclic" else [
                     4 * num_workers * q for q in zero.shard_sizes(staged, num_workers)]
  if name == "cyclic":
    sent = plan_bytes_sent_per_step(delays, num_steps, stage_bytes)
    # Collectives run per step: a ppermute per slot, route and message class (the MLP has no
    # model state).
    runs = plan.zero_plan(delays, num_steps).num_permutes(
        model_states=False, classes=[members for _, members in classes]) / num_steps
  else:  # One step in the program (zero3's scan body, or the engine's step).
    sent = bytes_sent_per_device(text, num_workers)
    runs = sum(v["count"] for v in row["collectives"].values())
  row["collectives_per_step"] = float(runs)
  row["bytes_per_device_per_step"] = int(sent.max())  # The busiest device.
  row["bytes_per_device_per_step_mean"] = float(sent.mean())
  if name == "engine":  # All J all-reduces run together after the backward.
    row["max_slot_bytes_per_device"] = row["bytes_per_device_per_step"]
    row["max_slot_bytes"] = row["bytes_per_device_per_step"] * num_workers
  else:  # One step, flushed (cyclic: its messages in steady state are the same).
    traffic = plan.slot_traffic(name, num_workers, stage_bytes,
                                rule="dp" if name == "zero3" else "cdp-v2")
    row["max_slot_bytes_per_device"] = traffic["max_slot_bytes_per_device"]
    row["max_slot_bytes"] = traffic["max_slot_bytes"]
  return row


def compile_sweep(num_stages_list, args) -> list[dict]:
  """Lower and compile seconds and program sizes of both ZeRO steps against J (one step a call)."""
  if max(num_stages_list, default=0) > jax.device_count():
    return _compile_sweep_in_child(num_stages_list, args)
  rows = []
  tx = optax.sgd(0.1, momentum=0.9)
  for num_stages in num_stages_list:
    _, params, _, staged, batch = residual_mlp(num_stages, 32, 64, num_stages * 8)
    mesh = jax.make_mesh((num_stages,), ("data",))
    for name, rule in (("cyclic", "cdp-v2"), ("zero3", "dp")):
      ex = zero.make_executor(staged, tx, rule=rule, mesh=mesh, timetable=name)
      state = ex.init(params)
      start = time.perf_counter()
      lowered = ex.lower(state, batch)
      lower_s = time.perf_counter() - start
      start = time.perf_counter()
      text = lowered.compile().as_text()
      rows.append({"schedule": name, "num_stages": num_stages, "lower_s": round(lower_s, 2),
                   "compile_s": round(time.perf_counter() - start, 2),
                   "stablehlo_mb": round(len(lowered.as_text()) / 1e6, 3),
                   "hlo_mb": round(len(text) / 1e6, 3)})
  return rows


def _compile_sweep_in_child(num_stages_list, args) -> list[dict]:
  """The sweep in a child process with ``max(J)`` emulated devices."""
  count = max(num_stages_list)
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                            env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={count}"
  out = pathlib.Path(args.results_dir) / "compile_child"
  cmd = [sys.executable, os.path.abspath(__file__), "--compile_only", "--results_dir", str(out),
         "--compile_sweep", ",".join(map(str, num_stages_list))]
  subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
  rows = json.loads((out / "bench_zero_compile.json").read_text())["compile_sweep"]
  shutil.rmtree(out)
  return rows


def main(argv=None, pin=False):
  """The benchmark; ``pin``: apply ``--cpus`` (only before JAX's CPU client starts, as a script)."""
  parser = _common.parser("bench_zero", __doc__, timed=True)
  parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--per-worker", type=int, default=32)
  parser.add_argument("--scan_steps", type=int, default=16,
                      help="K steps per call (ZeRO), the trainer's default")
  parser.add_argument("--steps", type=int, default=10,
                      help="timed calls (of K steps each) a repeat")
  parser.add_argument("--repeats", type=int, default=3, help="blocks of --steps timed calls")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--compile_sweep", default="2,4,8,16", help="comma-separated J")
  parser.add_argument("--compile_only", action="store_true", help="only the compile sweep")
  parser.add_argument("--floors", action=argparse.BooleanOptionalAction, default=True,
                      help="time the ablations (FLOORS) beside them")
  args = parser.parse_args(argv)
  _common.pin(args, pin)
  if args.quick:
    args.workers, args.width, args.per_worker, args.steps, args.warmup = [2], 16, 4, 3, 1
    args.repeats = 2
    args.scan_steps, args.compile_sweep = 2, ""  # The sweep runs in the full benchmark only.
  sweep_stages = [int(j) for j in args.compile_sweep.split(",") if j]
  if args.compile_only:
    path = _common.results_dir(args) / "bench_zero_compile.json"
    _common.write_json(path, {"compile_sweep": compile_sweep(sweep_stages, args)})
    return
  rows, goals = [], {}
  for num_workers in args.workers:
    if num_workers > jax.device_count():
      sys.exit(f"N={num_workers} needs {num_workers} devices, found {jax.device_count()}.")
    programs = build(num_workers, args)
    blocks = _common.interleaved_repeats({name: p[:3] for name, p in programs.items()},
                                         steps=args.steps, warmup=args.warmup,
                                         repeats=args.repeats)
    medians = {name: float(np.median([b[name] for b in blocks])) for name in programs}
    by_name = {name: p[3] for name, p in programs.items() if p[3] is not None}
    for name, row in by_name.items():
      row["step_time_s"] = medians[name] / row["steps_per_call"]
    for name, row in by_name.items():
      row["step_time_ratio"] = row["step_time_s"] / by_name["engine"]["step_time_s"]
      rows.append(row)
    goals[str(num_workers)] = _goals(by_name, num_workers)
    ratios = [b["cyclic"] / b["zero3"] for b in blocks]
    goals[str(num_workers)]["step_time_vs_zero3_range"] = [min(ratios), max(ratios)]
    if args.floors:  # Per step, as the cyclic row (K steps a call).
      step_time = {name: medians[name] / args.scan_steps for name in FLOORS}
      step_time.update((name, by_name[name]["step_time_s"]) for name in ("cyclic", "zero3"))
      for name in FLOORS:
        goals[str(num_workers)][f"{name}_vs_zero3"] = step_time[name] / step_time["zero3"]
      goals[str(num_workers)]["split"] = time_split(step_time)
  sweep = compile_sweep(sweep_stages, args)
  result = {"config": {k: v for k, v in vars(args).items() if k != "results_dir"}, "runs": rows,
            "compile_sweep": sweep, "goals": goals, "devices": jax.device_count(),
            "backend": jax.default_backend(), "machine": _common.machine()}
  path = _common.results_dir(args) / "bench_zero.json"
  _common.write_json(path, result)
  _print_tables(rows, sweep, goals)
  print("wrote", path)


def _goals(by_name, num_workers) -> dict:
  cyc, z3, eng = by_name["cyclic"], by_name["zero3"], by_name["engine"]
  return {
      "only_point_to_point": set(cyc["collectives"]) <= {"collective-permute"},
      "step_time_vs_zero3": cyc["step_time_s"] / z3["step_time_s"],
      "bytes_vs_zero3": cyc["bytes_per_device_per_step"] / z3["bytes_per_device_per_step"],
      "mean_bytes_vs_zero3": (cyc["bytes_per_device_per_step_mean"]
                              / z3["bytes_per_device_per_step_mean"]),
      "model_states_vs_engine_times_n": (cyc["memory"]["model_states"] * num_workers
                                         / eng["memory"]["model_states"]),
      "max_slot_bytes_vs_zero3": cyc["max_slot_bytes"] / z3["max_slot_bytes"],
      "collectives_per_step_vs_zero3": cyc["collectives_per_step"] / z3["collectives_per_step"],
  }


def _print_tables(rows, sweep, goals) -> None:
  print(f"{'N':>2} {'schedule':>8} {'K':>2} {'params':>9} {'optim':>9} {'temp':>9} "
        f"{'collectives':<34} {'runs':>5} {'sent/dev':>9} {'max slot':>9} {'step ms':>8} "
        f"{'ratio':>5}")
  for r in rows:
    kinds = ", ".join(f"{v['count']} {k}" for k, v in r["collectives"].items())
    m = r["memory"]
    print(f"{r['num_workers']:>2} {r['schedule']:>8} {r['steps_per_call']:>2} "
          f"{m['parameters']:>9} {m['optimizer']:>9} {m['temporaries']:>9} {kinds:<34} "
          f"{r['collectives_per_step']:>5.1f} {r['bytes_per_device_per_step']:>9} "
          f"{r['max_slot_bytes']:>9} "
          f"{1e3 * r['step_time_s']:>8.2f} {r['step_time_ratio']:>5.2f}")
  print("ratio: per-step time over the engine's; K: steps per compiled call; runs: collectives "
        "run per step (cyclic: a ppermute per slot and route, from the plan).")
  print(f"{'J':>2} {'schedule':>8} {'lower s':>8} {'compile s':>9} {'StableHLO MB':>12} "
        f"{'HLO MB':>7}")
  for r in sweep:
    print(f"{r['num_stages']:>2} {r['schedule']:>8} {r['lower_s']:>8.2f} {r['compile_s']:>9.2f} "
          f"{r['stablehlo_mb']:>12.3f} {r['hlo_mb']:>7.3f}")
  for n, g in goals.items():
    low, high = g["step_time_vs_zero3_range"]
    print(f"N={n} cyclic/zero3 step time {g['step_time_vs_zero3']:.2f} ({low:.2f}-{high:.2f} "
          "over the repeats)")
    if "split" in g:
      parts = lambda name: ", ".join(f"{k} {v:.2f}" for k, v in g["split"][name].items())
      print(f"N={n} step time in parts of ZeRO-3's: cyclic {parts('cyclic')}; "
            f"zero3 {parts('zero3')}")
  print("goals:", json.dumps(goals))


if __name__ == "__main__":
  main(pin=True)
