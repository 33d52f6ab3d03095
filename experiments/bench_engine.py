"""The engine's overhead: CDP rules against DP, and the engine against plain DP.

On 8 emulated CPU devices in one process (``--workers``), for three workloads — the digits
residual MLP (memory-bound: a few FLOPs per parameter), a ResNet-18 on
CIFAR-sized images at a quarter of its width (compute-bound) and the
quick-start transformer of ``configs/lm.py`` (4 blocks, ``d_model`` 64,
windows of 64 bytes, AdamW; stages of whole blocks) — with the same model,
mesh and batch within a workload:

- step-time ratios cdp-v1/dp and cdp-v2/dp of ``engine.make_train_step`` on
  steps that do not log (``norms=False``), and the cost of the health norms
  (engine dp with norms over without);
- the ratio of the engine's dp step to a hand-written ``shard_map`` DP step
  (grad at a varying copy of the parameters, ``pmean``, optax update): what
  is left is the per-stage bucket packing that gives exactly J all-reduces;
- compiled memory of each from ``memory_analysis()``: CDP's extra peak over
  DP against the bytes of the stale stages it keeps, and the parameter-sized
  ``copy`` instructions of each compiled step;
- the bytes each compiled step reads and writes (``cost_analysis()``), beyond
  engine dp's, in parameter sizes: the fixed per-parameter cost of a rule
  (cdp-v2's per-worker choice of version is a select that reads two versions
  and writes one; see ``engine._worker_view`` for why not a switch), apart
  from overhead. XLA counts both branches of the
  engine's norms conditional (4 parameter sizes) though a step without norms
  runs neither pass; the rest of engine dp's excess over the hand-written
  step is the per-stage bucket packing (JAX lowers a variadic ``psum`` to one
  all-reduce per operand, so packing is what keeps exactly ``J``).

Each workload is measured with one step per compiled call and with 16 (the
trainer's default, ``--steps_per_call``; the hand-written step then scans
too). With one step per call the versions rotate through their buffers; in a
``lax.scan`` the carry keeps each version in its place, so ``theta_t`` is
copied once per step into each stale leaf's slot, which the copy counts show,
except in the leaves some workers read fresh and others stale (cdp-v2's):
there the stale slot carries each worker's view (``engine._carried_view_body``)
and nothing is copied. Times are per step. So are bytes accessed: XLA's cost
analysis counts a loop body once, so a scanned call's figure is one step's
plus what the call does outside the loop (cdp-v2: the first step's views, a
select of three parameter sizes).

Whether a rule's compiled step runs exactly dp's operations (``same_ops_as_dp``:
the same instructions and shapes, only other buffers read and written) is
read from the HLO. With one step per call cdp-v1 does (every worker reads
every stage stale), so its time ratio to dp is what this machine and XLA's
CPU runtime make of the same work: the noise floor of the other ratios.

Run as a script, the benchmark pins itself to one CPU (``--cpus``) before JAX
starts: XLA's CPU runtime hands parts of a fusion to its thread pool, and on a
shared 2-core machine that handoff cost up to 2.4 ms at random per process
(``_common.pin_cpus``). On one CPU the emulated devices take turns, so a ratio
is one of total work, which is what a rule changes on every device alike.
``--workers`` uses fewer of the 8 devices (``--per_worker_batch`` keeps the
global batch).

Calls are interleaved so machine drift hits all variants alike; warm-up
(``--warmup`` steps, at least one call) is excluded and the median of
``--steps`` steps (``--steps // K`` calls, at least 3) is taken; that is repeated ``--repeats`` times from fresh states,
and each ratio is the median of its repeats with their range printed beside
it (the noise). Goals: every ratio <= 1.05; CDP's extra peak at most its
stale stages' bytes (+5%: XLA may place the stale version where dp leaves
memory idle, so less is possible); no copies beyond the scan's shift.

  python experiments/bench_engine.py          # results/bench_engine/bench_engine.json
  python experiments/bench_engine.py --quick  # seconds
"""
import os
import re
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

from cdpjax import compiled, engine, models, stages  # noqa: E402

NUM_STAGES = 4
RULES = ("dp", "cdp-v1", "cdp-v2")


def plain_dp_step(loss_fn, tx, mesh, scan_steps: int | None):
  """Textbook data parallelism with shard_map, as a user would write it (``K`` steps: a scan)."""

  def step(state, batch):
    params, opt_state = state
    local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    grads, loss = jax.lax.pmean((grads, loss), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

  body = step if scan_steps is None else lambda state, batches: jax.lax.scan(step, state, batches)
  replicated = NamedSharding(mesh, P())
  batch_spec = P("data") if scan_steps is None else P(None, "data")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec),
                               out_specs=(P(), P())),
                 out_shardings=(replicated, replicated), donate_argnums=0,
                 compiler_options=compiled.compiler_options(mesh))


def workload(name: str, quick: bool, per_worker_batch: int, num_workers: int = 8):
  """``(model, batch, stage cut, optimizer)`` of a workload; BatchNorm runs in eval mode.

  The transformer's batch is next-byte pairs, as ``cdpjax.tasks`` feeds it:
  ``image`` the input bytes, ``label`` the bytes one position later.
  """
  rng = np.random.default_rng(0)
  n = num_workers * per_worker_batch
  if name == "transformer":
    size = dict(num_layers=4, d_model=32, num_heads=2, d_ff=64, seq_len=16) if quick else dict(
        num_layers=4, d_model=64, num_heads=4, d_ff=256, seq_len=64)  # configs/lm.py's quick.
    model = models.create_model("transformer", 256, **size)
    tokens = rng.integers(0, 256, size=(n, size["seq_len"] + 1)).astype(np.int32)
    per = size["num_layers"] // NUM_STAGES  # Whole blocks per stage, as configs/lm.py cuts.
    blocks = dict(by="boundaries",
                  boundaries=[f"block_{s * per}" for s in range(1, NUM_STAGES)])
    return (model, {"image": tokens[:, :-1], "label": tokens[:, 1:]}, blocks,
            optax.adamw(1e-3, weight_decay=0.1))
  if name == "mlp":
    width = 32 if quick else 256
    model = models.create_model("residual_mlp", 10, width=width, hidden=2 * width,
                                num_blocks=NUM_STAGES)
    shape = (8, 8, 1)
  else:
    model = models.create_model("resnet18", 10, stem="cifar", width=4 if quick else 16)
    shape = (8, 8, 3) if quick else (32, 32, 3)
  batch = {"image": rng.normal(size=(n,) + shape).astype(np.float32),
           "label": rng.integers(0, 10, size=n).astype(np.int32)}
  return model, batch, dict(by="params"), optax.sgd(0.01, momentum=0.9)


def parameter_copies(hlo_text: str, params) -> int:
  """``copy`` instructions that copy a program input (or loop-carried value) of a parameter's shape.

  Copies of computed values (a transposed convolution kernel's gradient, say)
  are layout changes, not copies of a parameter version.
  """
  shapes = {f"{jnp.dtype(x.dtype).name.replace('float', 'f')}[{','.join(map(str, x.shape))}]"
            for x in jax.tree.leaves(params)}
  return sum(1 for line in hlo_text.splitlines()
             if re.search(r" copy\(%(param|get-tuple-element)", line)
             and line.split("=")[1].split("{")[0].strip() in shapes)


def operations(hlo_text: str) -> list[str]:
  """The program's instructions as ``shape opcode(...)`` without names: what it computes, not where.

  Parameters, tuples and their elements are left out (a rule with a stale
  version takes and returns more buffers); so are operand names and metadata.
  """
  ops = []
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*)", line)
    if not m or re.search(r" (parameter|tuple|get-tuple-element)\(", m.group(1)):
      continue
    ops.append(re.sub(r"%[\w.\-]+", "%", m.group(1).split(", metadata=")[0]))
  return ops


def bytes_accessed(program) -> float:
  """XLA's count of the bytes a compiled step reads and writes (``cost_analysis``)."""
  analysis = program.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
    analysis = analysis[0]
  return float(analysis.get("bytes accessed", 0.0))


def measure(name: str, args, steps_per_call: int) -> dict:
  """One workload's figures with ``steps_per_call`` steps per compiled call (times per step)."""
  mesh = jax.make_mesh((args.workers,), ("data",))  # The first --workers devices.
  per_worker_batch = {"mlp": args.per_worker_batch, "resnet18": args.resnet_batch,
                      "transformer": args.lm_batch}[name]
  model, batch, cut, tx = workload(name, args.quick, per_worker_batch, args.workers)
  sample = batch["image"][:1]
  scan_steps = steps_per_call if steps_per_call > 1 else None
  if scan_steps:  # The same rows every step: [K, N * b, ...].
    batch = jax.tree.map(lambda x: np.stack([x] * scan_steps), batch)
  variables = model.init(jax.random.key(0), sample, train=False)
  params = variables["params"]
  frozen = {k: v for k, v in variables.items() if k != "params"}  # BatchNorm statistics.
  stage_ids = stages.model_stage_ids(model, params, NUM_STAGES, sample, train=False, **cut)

  def loss_fn(p, b):
    logits = model.apply({"params": p, **frozen}, b["image"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).mean()

  device_batch = jax.device_put(
      batch, NamedSharding(mesh, P("data") if scan_steps is None else P(None, "data")))
  programs, rows, ops = {}, {}, {}
  for rule in RULES:
    step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule, mesh=mesh,
                                  scan_steps=scan_steps)
    state = step.init(params)
    program = step.lower(state, device_batch, norms=False).compile()
    stale = jax.tree.leaves(state.stale_params)
    ops[rule] = operations(program.as_text())
    rows[f"engine {rule}"] = {**compiled.memory(program),
                              "stale_bytes": sum(x.nbytes for x in stale),
                              "stale_leaves": len(stale),
                              "parameter_copies": parameter_copies(program.as_text(), params),
                              "bytes_accessed": bytes_accessed(program),
                              "same_ops_as_dp": ops[rule] == ops["dp"]}
    programs[f"engine {rule}"] = (lambda s, b, step=step: step(s, b, norms=False),
                                  lambda step=step: step.init(params))
    if rule == "dp":
      programs["engine dp, norms"] = (step, lambda step=step: step.init(params))
  plain = plain_dp_step(loss_fn, tx, mesh, scan_steps)
  plain_init = lambda: jax.device_put((jax.tree.map(jnp.array, params), tx.init(params)),  # noqa: E731
                                      NamedSharding(mesh, P()))
  program = plain.lower(plain_init(), device_batch).compile()
  rows["plain dp"] = {**compiled.memory(program), "bytes_accessed": bytes_accessed(program)}
  programs["plain dp"] = (plain, plain_init)

  # Each repeat starts from fresh states (the steps donate theirs); a ratio is
  # the median of its repeats' ratios, with their range as the noise.
  calls = max(3, args.steps // steps_per_call)
  repeats = [{key: t / steps_per_call for key, t in _common.interleaved_step_times(
      {name: (fn, init(), device_batch) for name, (fn, init) in programs.items()},
      steps=calls, warmup=max(1, args.warmup // steps_per_call)).items()}
             for _ in range(args.repeats)]
  for key in programs:
    rows.setdefault(key, {})["median_step_s"] = float(np.median([r[key] for r in repeats]))
  pairs = {"cdp-v1/dp": ("engine cdp-v1", "engine dp"), "cdp-v2/dp": ("engine cdp-v2", "engine dp"),
           "engine dp/plain dp": ("engine dp", "plain dp"),
           "norms on/off": ("engine dp, norms", "engine dp")}
  per_repeat = {k: [r[a] / r[b] for r in repeats] for k, (a, b) in pairs.items()}
  ratios = {k: float(np.median(v)) for k, v in per_repeat.items()}
  ratio_range = {k: [float(min(v)), float(max(v))] for k, v in per_repeat.items()}
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  extra = {rule: rows[f"engine {rule}"]["peak_bytes"] - rows["engine dp"]["peak_bytes"]
           for rule in RULES[1:]}
  return {
      "workload": name, "steps_per_call": steps_per_call, "param_bytes": param_bytes,
      "per_worker_batch": per_worker_batch,
      "variants": rows, "ratios": ratios, "ratio_range_over_repeats": ratio_range,
      # Fixed per-parameter traffic: what each step reads and writes beyond dp's, in
      # parameter sizes (cdp-v2's per-worker select of the version reads two, writes one).
      "extra_bytes_accessed_over_dp_in_params": {
          key: (rows[key]["bytes_accessed"] - rows["engine dp"]["bytes_accessed"]) / param_bytes
          for key in ("engine cdp-v1", "engine cdp-v2", "plain dp")},
      "extra_peak_over_stale_bytes": {
          rule: extra[rule] / max(1, rows[f"engine {rule}"]["stale_bytes"]) for rule in extra},
      "goals_met": {
          "ratios<=1.05": all(ratios[k] <= 1.05 for k in ("cdp-v1/dp", "cdp-v2/dp",
                                                           "engine dp/plain dp")),
          "extra peak <= stale bytes (+5%)": all(
              extra[rule] <= 1.05 * rows[f"engine {rule}"]["stale_bytes"] for rule in extra),
          # One step per call rotates the versions in place; a scan's carry keeps each
          # version in its place, so theta_t is copied once into each stale leaf's slot
          # (none where the slot carries the workers' views).
          "no parameter copies beyond the scan's shift": all(
              rows[f"engine {rule}"]["parameter_copies"]
              <= (rows[f"engine {rule}"]["stale_leaves"] if scan_steps else 0)
              for rule in RULES)},
  }


def main(argv=None, pin=False):
  """The benchmark; ``pin``: apply ``--cpus`` (only before JAX's CPU client starts, as a script)."""
  parser = _common.parser("bench_engine", __doc__, timed=True)
  parser.add_argument("--steps", type=int, default=30, help="Timed steps per variant.")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=3,
                      help="Interleaved timings from fresh states; ratios are their median.")
  parser.add_argument("--workers", type=int, default=8,
                      help="Data-parallel workers: emulated devices used (at most 8).")
  parser.add_argument("--per_worker_batch", type=int, default=32, help="MLP rows per worker.")
  parser.add_argument("--resnet_batch", type=int, default=8, help="ResNet images per worker.")
  parser.add_argument("--lm_batch", type=int, default=4,
                      help="Transformer windows per worker (configs/lm.py trains 16).")
  parser.add_argument("--workloads", nargs="+", default=["mlp", "resnet18", "transformer"],
                      choices=["mlp", "resnet18", "transformer"])
  parser.add_argument("--steps_per_call", type=int, nargs="+", default=[1, 16],
                      help="Steps per compiled call to measure (the trainer's default is 16).")
  args = parser.parse_args(argv)
  _common.pin(args, pin)
  if not 1 <= args.workers <= len(jax.devices()):
    parser.error(f"--workers {args.workers}: this process has {len(jax.devices())} devices "
                 "(set XLA_FLAGS=--xla_force_host_platform_device_count=N for more).")
  if args.quick:
    args.steps, args.warmup, args.per_worker_batch, args.resnet_batch, args.lm_batch = (
        3, 1, 4, 2, 1)
    args.repeats = 2
    args.steps_per_call = [k if k == 1 else 2 for k in args.steps_per_call]
  results = [measure(name, args, k) for name in args.workloads for k in args.steps_per_call]
  result = {"devices": args.workers, "num_stages": NUM_STAGES, "steps": args.steps,
            "repeats": args.repeats,
            "workloads": results, "machine": _common.machine()}
  out = _common.results_dir(args) / "bench_engine.json"
  _common.write_json(out, result)

  for r in results:
    print(f"== {r['workload']}, {r['steps_per_call']} step(s) per call "
          f"(parameters {r['param_bytes'] / 1024:.0f} KiB)")
    print(f"{'variant':<18}{'ms/step':>9}{'peak KiB':>10}{'stale KiB':>10}{'copies':>7}"
          f"{'dp ops':>7}")
    for name, v in r["variants"].items():
      peak = f"{v['peak_bytes'] / 1024:.1f}" if "peak_bytes" in v else "-"
      same = {True: "same", False: "more"}.get(v.get("same_ops_as_dp"), "")
      print(f"{name:<18}{1e3 * v['median_step_s']:>9.2f}{peak:>10}"
            f"{v.get('stale_bytes', 0) / 1024:>10.1f}{v.get('parameter_copies', ''):>7}{same:>7}")
    for name, v in r["ratios"].items():
      low, high = r["ratio_range_over_repeats"][name]
      print(f"  {name:<20}{v:.3f}  ({low:.3f}-{high:.3f} over {args.repeats} repeats)")
    for rule, v in r["extra_peak_over_stale_bytes"].items():
      print(f"  extra peak of {rule} over dp / its stale bytes: {v:.3f}")
    for key, v in r["extra_bytes_accessed_over_dp_in_params"].items():
      print(f"  bytes accessed by {key} beyond engine dp: {v:+.2f} parameter sizes")
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main(pin=True)
