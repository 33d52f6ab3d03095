"""Executed CDP pipeline vs GPipe vs DP+MP: devices, memory, bubbles, communication, speed.

Run:
  /work/venv/bin/python experiments/bench_pipeline.py              # J in {2, 4, 8}
  /work/venv/bin/python experiments/bench_pipeline.py --quick      # J = 2, tiny, seconds
  /work/venv/bin/python experiments/bench_pipeline.py --compile_sweep 2,4,8,16  # compile vs J

For each J (N = J micro-batches, one block per stage by default) it compiles
the cyclic schedule (cdp-v2), GPipe (dp) and DP+MP (dp, N*J devices) and
reports per-device memory from ``memory_analysis``, idle slots counted from the
executed schedule, collectives from the compiled HLO, and the step time
relative to GPipe measured in the same run (calls of K steps interleaved
across schedules, median over timed calls, warm-up excluded; as a script on one
CPU, ``--cpus``, for the reason `bench_engine` gives). DP+MP rows whose N*J devices do not exist are analytic and say so.
It also reports the padding cost of flat stage buffers for ResNet-18 cut by
FLOPs (``padding``), and, for the transformer of ``configs/lm.py``'s quick
start (one block per stage, the embedding on the first and the head on the
last; windows of 64 bytes), the cyclic pipeline's and GPipe's compiled memory
and bubble at the same J (``transformer_rows``; compiled, not timed). For both
models it reports the cyclic peak over GPipe's and, less the cyclic pipeline's
stale stage version, over GPipe's (``peak_less_stale_ratio_vs_gpipe``; the goal
is at most 1).
Results go to ``<results_dir>/bench_pipeline.json`` (default
``results/bench_pipeline``).
"""
from __future__ import annotations

import time

import _common
from cdpjax import distributed  # (imports no JAX)

distributed.emulate_cpu_devices(16)  # J = 16 in --compile_sweep.

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from cdpjax import compiled, hlo, models, schedule, stages  # noqa: E402
from cdpjax.executed import pipeline, plan, zero  # noqa: E402
from cdpjax.executed import staged as staged_lib  # noqa: E402
from cdpjax.models.residual_mlp import ResidualMLP  # noqa: E402

RULES = {"cyclic": "cdp-v2", "gpipe": "dp", "dp+mp": "dp"}


def parse(argv=None):
  parser = _common.parser("bench_pipeline", __doc__, timed=True)
  parser.add_argument("--stages", default="2,4,8", help="comma-separated J values")
  parser.add_argument("--blocks_per_stage", type=int, default=1)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--per_micro", type=int, default=32, help="rows b of one micro-batch")
  parser.add_argument("--lm_per_micro", type=int, default=2,
                      help="windows of one transformer micro-batch")
  parser.add_argument("--steps_per_call", type=int, default=4, help="K steps per compiled call")
  parser.add_argument("--timed_calls", type=int, default=20)
  parser.add_argument("--compile_sweep", default="",
                      help="comma-separated J values: only compile time and program size of "
                           "the cyclic pipeline and the cyclic ZeRO step (cdp-v2)")
  args = parser.parse_args(argv)
  if args.quick:
    # The shapes of tests/test_pipeline.py, whose compiles the smoke test then reuses.
    args.stages, args.width, args.hidden, args.per_micro, args.lm_per_micro = "2", 8, 16, 2, 1
    args.blocks_per_stage = 2
    args.steps_per_call, args.timed_calls = 2, 2
  args.stages = [int(s) for s in args.stages.split(",")]
  args.compile_sweep = [int(s) for s in args.compile_sweep.split(",") if s]
  return args


def schedule_counts(schedule, num_stages, num_steps, act_bytes):
  """Slots, idle slots and stashed stage inputs, counted from the executed events."""
  events = plan.executed_events(schedule, RULES[schedule], num_stages, num_steps)
  replicas = num_stages if schedule == "dp+mp" else 1
  slots_per_call = max(e.slot for e in events) + 1
  busy = {}  # Device -> busy slots; a dp+mp device is (replica, stage).
  # Activations j -> j+1 after a forward, cotangents j -> j-1 after a backward.
  sends = sum(1 for e in events if e.stage != (num_stages - 1 if e.kind == "fwd" else 0))
  alive = np.zeros((slots_per_call, replicas * num_stages), np.int64)
  started = {}
  for e in events:
    device = (e.worker if replicas > 1 else 0) * num_stages + e.stage
    busy[device] = busy.get(device, 0) + 1
    # A stage input is stashed from its forward to its backward; stage 0 reads the batch.
    if e.kind == "fwd":
      started[(e.worker, e.step, e.stage)] = e.slot
    elif e.stage > 0:
      alive[started[(e.worker, e.step, e.stage)]:e.slot + 1, device] += 1
  if schedule == "cyclic":
    per_step = 2 * num_stages  # Steady state: step t+1 starts 2J slots after step t.
  else:
    per_step = slots_per_call // num_steps
  busy_per_step = 2 * num_stages // replicas
  return {
      "devices": replicas * num_stages,
      "slots_per_step": per_step,
      "idle_slots_per_step": per_step - busy_per_step,
      "bubble_fraction": (per_step - busy_per_step) / per_step,
      "slots_per_call": slots_per_call,
      "idle_slots_per_call_per_device": slots_per_call - max(busy.values()),
      "useful_permute_bytes_per_step_per_device":
          sends * act_bytes / num_steps / (replicas * num_stages),
      "stashed_inputs_peak_per_device": int(alive.max()),
      "stashed_inputs_peak_total": int(alive.sum(axis=1).max()),
      "stashed_bytes_peak_total": int(alive.sum(axis=1).max()) * act_bytes,
  }


def collective_figures(text, slots_per_step):
  """Collective kinds and bytes per device: static (per op) and per step (executed)."""
  found = hlo.collectives(text)
  kinds = sorted({c.kind for c in found})
  per_step = {}
  for c in found:
    # Permutes run once per slot (a cond picks which of the two), idle slots
    # included; dp+mp's gradient all-reduce runs once per step.
    times = slots_per_step / 2 if c.kind == "collective-permute" else 1
    per_step[c.kind] = per_step.get(c.kind, 0) + c.bytes * times
  return {"collective_kinds": kinds, "collectives": hlo.collective_summary(text),
          "collective_bytes_per_step_per_device": per_step}


def measure(schedule, num_stages, args, staged, params, batch, act_bytes):
  if schedule == "dp+mp":
    mesh = jax.make_mesh((num_stages, num_stages), ("data", "stage"))
  else:
    mesh = jax.make_mesh((num_stages,), ("stage",))
  tx = optax.sgd(0.1, momentum=0.9)  # tests/test_pipeline.py's, so --quick reuses its compiles.
  rule = RULES[schedule]
  ex = pipeline.make_executor(staged, tx, rule=rule, mesh=mesh, timetable=schedule,
                                scan_steps=args.steps_per_call)
  state = ex.init(params)
  exe = ex.lower(state, batch).compile()
  memory = compiled.memory(exe)
  row = {"schedule": schedule, "rule": rule, "num_stages": num_stages, "num_micro": num_stages,
         "analytic": False}
  row.update(schedule_counts(schedule, num_stages, args.steps_per_call, act_bytes))
  row.update({
      "argument_bytes_per_device": memory["argument_bytes"],
      "temp_bytes_per_device": memory["temp_bytes"],
      "output_bytes_per_device": memory["output_bytes"],
      "alias_bytes_per_device": memory["alias_bytes"],
      "peak_bytes_per_device": memory["peak_bytes"],
      "total_bytes": memory["peak_bytes"] * row["devices"],
  })
  row.update(collective_figures(exe.as_text(), row["slots_per_step"]))
  row["timed_steps"] = args.timed_calls * args.steps_per_call
  return row, (ex.step, state, batch)


def peak_ratios(cyclic, gpipe, staged):
  """Adds each row's peak over GPipe's, and the cyclic peak less its stale stage versions
  (``D`` copies of one stage's padded parameters) over GPipe's: issue 11's goal is <= 1."""
  stale_bytes = schedule.max_delay(cyclic["rule"]) * 4 * staged.param_size
  gpipe_peak = gpipe["peak_bytes_per_device"]
  cyclic["stale_bytes_per_device"], gpipe["stale_bytes_per_device"] = stale_bytes, 0
  for row in (cyclic, gpipe):
    row["peak_ratio_vs_gpipe"] = row["peak_bytes_per_device"] / gpipe_peak
    row["peak_less_stale_ratio_vs_gpipe"] = (
        (row["peak_bytes_per_device"] - row["stale_bytes_per_device"]) / gpipe_peak)


def analytic_dp_mp(num_stages, param_bytes_per_stage, act_bytes):
  """DP+MP on N*J devices that do not exist here: schedule figures only."""
  row = {"schedule": "dp+mp", "rule": "dp", "num_stages": num_stages, "num_micro": num_stages,
         "analytic": True, "devices": num_stages * num_stages,
         "slots_per_step": 2 * num_stages, "idle_slots_per_step": 2 * num_stages - 2,
         "bubble_fraction": (num_stages - 1) / num_stages,
         "stashed_inputs_peak_per_device": 1,
         "stashed_inputs_peak_total": num_stages * (num_stages - 1),
         "stashed_bytes_peak_total": num_stages * (num_stages - 1) * act_bytes,
         "useful_permute_bytes_per_step_per_device": 2 * (num_stages - 1) * act_bytes / num_stages,
         "collective_kinds": ["all-reduce", "collective-permute"],
         "collective_bytes_per_step_per_device": {
             "all-reduce": param_bytes_per_stage,
             "collective-permute": num_stages * act_bytes}}
  for key in ("argument_bytes_per_device", "temp_bytes_per_device", "output_bytes_per_device",
              "alias_bytes_per_device", "peak_bytes_per_device", "total_bytes", "collectives",
              "step_time_median_s", "step_time_ratio_vs_gpipe", "slots_per_call",
              "idle_slots_per_call_per_device", "timed_steps"):
    row[key] = None
  return row


def print_table(rows):
  header = (f"{'J':>2} {'schedule':<8} {'dev':>3} {'slots/step':>10} {'idle/step':>9} "
            f"{'bubble':>6} {'peak B/dev':>10} {'temp B/dev':>10} {'total B':>10} "
            f"{'stash tot':>9} {'comm B/step/dev':>16} {'t/gpipe':>7}")
  print(header)
  for r in rows:
    fmt = lambda v, w: f"{'n/a' if v is None else v:>{w}}"
    comm = sum((r["collective_bytes_per_step_per_device"] or {}).values())
    ratio = r.get("step_time_ratio_vs_gpipe")
    print(f"{r['num_stages']:>2} {r['schedule'] + ('*' if r['analytic'] else ''):<8} "
          f"{r['devices']:>3} {r['slots_per_step']:>10} {r['idle_slots_per_step']:>9} "
          f"{r['bubble_fraction']:>6.3f} {fmt(r['peak_bytes_per_device'], 10)} "
          f"{fmt(r['temp_bytes_per_device'], 10)} {fmt(r['total_bytes'], 10)} "
          f"{r['stashed_inputs_peak_total']:>9} {int(comm):>16} "
          f"{'n/a' if ratio is None else f'{ratio:.3f}':>7}")
  print("* analytic: N*J devices do not exist here; schedule figures only.")


def resnet_padding(args) -> list[dict]:
  """The padding cost of flat stage buffers for ResNet-18 (CIFAR stem) cut by FLOPs.

  Stages differ in size, and SPMD pads every stage's parameters (and every
  boundary activation) to the largest. Read from the layout: nothing compiles
  but the per-unit FLOP counts.
  """
  width, image, channels = (4, 8, 1) if args.quick else (64, 32, 3)
  model = models.create_model("resnet18", 10, width=width, stem="cifar")
  sample = jnp.zeros((1, image, image, channels))
  variables = model.init(jax.random.key(0), sample, train=False)
  out = []
  for num_stages in args.stages:
    stage_ids = stages.model_stage_ids(model, variables["params"], num_stages, sample,
                                       by="flops", train=False)
    staged = staged_lib.stage_model(model, variables["params"], stage_ids, sample,
                                    model_state={"batch_stats": variables["batch_stats"]})
    x_spec = jax.ShapeDtypeStruct((args.per_micro, image, image, channels), jnp.float32)
    out.append({"model": f"resnet18 width {width}, {image}x{image}x{channels}", "num_stages": num_stages,
                "per_micro": args.per_micro, **staged_lib.padding_report(staged, x_spec)})
  print("ResNet-18 padding: " + ", ".join(
      f"J={r['num_stages']}: params x{r['param_padding_ratio']:.2f}" for r in out))
  return out


def compile_sweep(args) -> list[dict]:
  """Seconds to lower and compile, and program sizes, of both cyclic executors against J.

  The model is the residual MLP with ``blocks_per_stage`` blocks per stage, one
  step per call (``scan_steps`` = 1 for the pipeline).
  """
  rows = []
  for num_stages in args.compile_sweep:
    if num_stages > jax.device_count():
      print(f"compile sweep: J={num_stages} needs {num_stages} devices; skipped.")
      continue
    staged, params, batch, _ = mlp_workload(num_stages, args, one_step=True, pad_to=num_stages)
    tx = optax.sgd(0.1, momentum=0.9)
    for name, make, axis in (("pipeline", pipeline.make_executor, "stage"),
                             ("zero", zero.make_executor, "data")):
      ex = make(staged, tx, rule="cdp-v2", mesh=jax.make_mesh((num_stages,), (axis,)))
      state = ex.init(params)
      start = time.perf_counter()
      lowered = ex.lower(state, batch)
      lower_s = time.perf_counter() - start
      start = time.perf_counter()
      exe = lowered.compile()
      rows.append({"executor": name, "num_stages": num_stages, "lower_s": round(lower_s, 2),
                   "compile_s": round(time.perf_counter() - start, 2),
                   "stablehlo_chars": len(lowered.as_text()), "hlo_chars": len(exe.as_text())})
      print(rows[-1])
  return rows


def mlp_workload(num_stages, args, one_step=False, pad_to=1):
  """``(staged, params, batch, activation bytes)`` of the residual MLP cut every
  ``blocks_per_stage`` blocks; the batch is ``[K, N*b, ...]`` for ``K =
  args.steps_per_call``, or one step's ``[N*b, ...]`` with ``one_step``."""
  model = ResidualMLP(num_classes=10, width=args.width, hidden=args.hidden,
                      num_blocks=num_stages * args.blocks_per_stage)
  sample = jnp.zeros((1, 8, 8, 1))
  params = model.init(jax.random.key(0), sample)["params"]
  stage_ids = stages.model_stage_ids(
      model, params, num_stages, sample, by="boundaries",
      boundaries=[f"block_{s * args.blocks_per_stage}" for s in range(1, num_stages)])
  staged = staged_lib.stage_model(model, params, stage_ids, sample, pad_to=pad_to)
  rng = np.random.default_rng(0)
  lead = (num_stages * args.per_micro,)
  if not one_step:
    lead = (args.steps_per_call,) + lead
  batch = {"image": rng.normal(size=lead + (8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, size=lead).astype(np.int32)}
  return staged, params, batch, args.per_micro * args.width * 4


def transformer_workload(num_stages, args):
  """The same for configs/lm.py's quick-start transformer with one block per stage."""
  size = (dict(d_model=32, num_heads=2, d_ff=64, seq_len=16) if args.quick else
          dict(d_model=64, num_heads=4, d_ff=256, seq_len=64))
  model = models.create_model("transformer", 256, num_layers=num_stages, **size)
  sample = jnp.zeros((1, size["seq_len"]), jnp.int32)
  params = model.init(jax.random.key(0), sample)["params"]
  stage_ids = stages.model_stage_ids(
      model, params, num_stages, sample, by="boundaries",
      boundaries=[f"block_{s}" for s in range(1, num_stages)])
  staged = staged_lib.stage_model(model, params, stage_ids, sample)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(args.steps_per_call, num_stages * args.lm_per_micro,
                                      size["seq_len"] + 1)).astype(np.int32)
  batch = {"image": tokens[..., :-1], "label": tokens[..., 1:]}
  return staged, params, batch, args.lm_per_micro * size["seq_len"] * size["d_model"] * 4


def main(argv=None, pin=False):
  """The benchmark; ``pin``: apply ``--cpus`` (only before JAX's CPU client starts, as a script)."""
  args = parse(argv)
  _common.pin(args, pin)
  if args.compile_sweep:
    result = {"config": vars(args), "device_count": jax.device_count(),
              "machine": _common.machine(), "compile_sweep": compile_sweep(args)}
    path = _common.results_dir(args) / "bench_pipeline_compile.json"
    _common.write_json(path, result)
    print(f"wrote {path}")
    return result
  rows = []
  for num_stages in args.stages:
    staged, params, batch, act_bytes = mlp_workload(num_stages, args)
    measured, programs = {}, {}
    for schedule in ("cyclic", "gpipe", "dp+mp"):
      if schedule == "dp+mp" and num_stages * num_stages > jax.device_count():
        param_bytes = 4 * staged.param_size  # Every stage is padded to the largest.
        measured[schedule] = analytic_dp_mp(num_stages, param_bytes, act_bytes)
        continue
      measured[schedule], programs[schedule] = measure(
          schedule, num_stages, args, staged, params, batch, act_bytes)
    peak_ratios(measured["cyclic"], measured["gpipe"], staged)
    call_s = _common.interleaved_step_times(programs, steps=args.timed_calls, warmup=2)
    for schedule, row in measured.items():
      if schedule in call_s:
        row["step_time_median_s"] = call_s[schedule] / args.steps_per_call
        row["step_time_ratio_vs_gpipe"] = call_s[schedule] / call_s["gpipe"]
      rows.append(row)
  transformer_rows = []
  for num_stages in args.stages:
    workload = transformer_workload(num_stages, args)
    for schedule in ("cyclic", "gpipe"):
      row, _ = measure(schedule, num_stages, args, *workload)
      transformer_rows.append(row)
    peak_ratios(*transformer_rows[-2:], workload[0])
  result = {"config": vars(args), "device_count": jax.device_count(),
            "machine": _common.machine(), "rows": rows, "transformer_rows": transformer_rows,
            "padding": resnet_padding(args)}
  path = _common.results_dir(args) / "bench_pipeline.json"
  _common.write_json(path, result)
  print("== residual MLP")
  print_table(rows)
  print("== transformer (not timed)")
  print_table(transformer_rows)
  for name, table in (("residual MLP", rows), ("transformer", transformer_rows)):
    cyclic = [r for r in table if r["schedule"] == "cyclic"]
    print(f"cyclic peak / GPipe peak on the {name}: " + ", ".join(
        f"J={r['num_stages']}: {r['peak_ratio_vs_gpipe']:.3f}" for r in cyclic))
    print(f"(cyclic peak - its stale stage) / GPipe peak on the {name}: " + ", ".join(
        f"J={r['num_stages']}: {r['peak_less_stale_ratio_vs_gpipe']:.3f}" for r in cyclic))
  print(f"wrote {path}")
  return result


if __name__ == "__main__":
  main(pin=True)
