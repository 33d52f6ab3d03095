"""Plan a TPU run on any machine: compile the configured step for a TPU topology, ahead of time.

With ``jax[tpu]`` installed (``pip install -e ".[tpu]"``, which brings
libtpu), ``jax.experimental.topologies`` describes the chips of a TPU slice or
pod, such as the 256 chips of ``v5e:16x16``, without a TPU. The configured
train step (model, rule, parallelism) is built on a mesh of those chips from
abstract inputs (shapes and shardings only: no parameter is allocated,
``jax.eval_shape`` gives the state) and compiled by the real TPU compiler,
which reports the program's per-chip memory and its collectives (not its FLOPs:
``REPORT_KEYS``).
Nothing is executed.

  cdpjax-compile --config configs/imagenet_resnet50.py:rule=cdp-v2 \\
    --config.num_workers=256 --topology v5e:16x16 --workdir runs/plan

The mesh is the one ``cdpjax-train`` builds (`cdpjax.train.make_mesh`), on
the first chips of the topology: ``num_workers`` devices (``num_stages`` for
``parallelism=model``), times ``num_replicas`` (``model``, ``zero``) or
``devices_per_worker`` (``data``). For a full pod (``v5e:16x16``) the TPU
compiler compiles for all its chips, so the mesh must use every chip (a
``ValueError`` says so): ``num_replicas = 256 / J`` copies of an executed
schedule fill it. Smaller slices such as ``v5e:2x4`` take fewer.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile

GIB = 1 << 30
# HBM per chip, from the Cloud TPU documentation's system architecture pages
# (tpu/docs/v4, v5e, v5p, v6e), read 2026-12: v4 "32 GiB", v5p "95 GiB", v5e
# "16 GB" and v6e "32 GB" (HBM stacks come in binary sizes: read as GiB). The
# runtime keeps a little of it for itself, so a step within a few percent of
# the figure may still not fit.
CHIP_HBM_BYTES = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}
HBM_SOURCE = ("Cloud TPU documentation, system architecture pages: HBM per chip v4 32 GiB, "
              "v5e 16 GB, v5p 95 GiB, v6e 32 GB (read as GiB)")
# libtpu's name for a slice of ``CHIP`` chips, for TPU_ACCELERATOR_TYPE (``v5litepod-8``).
_ACCELERATOR_NAME = {"v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}
_TOPOLOGY = re.compile(r"^(?P<chip>v\d+[a-z]*):(?P<shape>\d+(?:x\d+)*)$")
# Model inputs of the datasets (``cdpjax.data``), so that planning needs no prepared data:
# (num_classes, one example's shape). Text sets take ``[seq_len]`` int32 bytes, 256 classes.
IMAGE_DATASETS = {"digits": (10, (8, 8, 1)), "cifar10": (10, (32, 32, 3)),
                  "imagenet2012": (1000, (224, 224, 3))}
REPORT_KEYS = ("topology", "chips", "devices_used", "mesh", "runs", "config", "num_params",
               "stage_params", "hbm_only", "memory_per_chip", "hbm_per_chip_bytes",
               "hbm_source", "fits", "collectives", "collectives_by_slot", "collective_schedule")
# XLA's memory-space assignment off: it places buffers in the chip's on-chip memory (VMEM), so
# a step small enough to fit there shows little HBM; off, every buffer is in HBM, and the HBM
# figure is what the step holds whatever the placement (the fusions' scratch stays in VMEM).
HBM_ONLY_OPTIONS = {"xla_msa_enable": False}
# FLOPs and the compiler's optimal_seconds are left out: XLA's cost analysis counts a loop's body
# once, so a K-step scan or a slot loop reads as one iteration (ZeRO-3 showed 2.0e9 FLOPs and
# CDP+ZeRO 4.9e8 for the same model and steps), and the HLO gives no per-op FLOPs to weight.


def parse_topology(topology: str) -> tuple[str, int]:
  """``("v5e", 256)`` for ``"v5e:16x16"``; ValueError naming the valid forms."""
  match = _TOPOLOGY.match(topology)
  if not match or match.group("chip") not in CHIP_HBM_BYTES:
    raise ValueError(
        f"Unknown TPU topology {topology!r}: use CHIP:SHAPE with CHIP in "
        f"{sorted(CHIP_HBM_BYTES)} and SHAPE the chips per dimension, e.g. v5e:2x4, "
        "v5e:16x16, v5p:4x4x4 (v4 and v5p count chips in three dimensions).")
  return match.group("chip"), math.prod(int(s) for s in match.group("shape").split("x"))


def quiet_libtpu(topology: str) -> None:
  """Spares the user libtpu's warnings about the TPU VM it is not running on.

  Without a TPU, libtpu looks up the VM's accelerator type and worker list (a
  metadata server) and logs an error for each one it cannot find; compiling
  needs neither. Set for this process only, before libtpu starts; values the
  user set win. ``JAX_PLATFORMS=cpu`` keeps JAX's default backend on the CPU;
  ``ALLOW_MULTIPLE_LIBTPU_LOAD`` lets this process load libtpu while another
  holds its lock file (compiling touches no chip).
  """
  chip, num_chips = parse_topology(topology)
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"),
                     ("TPU_ACCELERATOR_TYPE", f"{_ACCELERATOR_NAME[chip]}-{num_chips}"),
                     ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                     ("JAX_PLATFORMS", "cpu"), ("TF_CPP_MIN_LOG_LEVEL", "3"),
                     ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(key, value)


def topology_devices(topology: str) -> list:
  """The chips of a TPU topology (compile-only devices), e.g. 256 for ``v5e:16x16``."""
  parse_topology(topology)
  quiet_libtpu(topology)
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    description = topologies.get_topology_desc(topology, "tpu")
  except Exception as e:  # pylint: disable=broad-except  (libtpu missing: several error types)
    raise RuntimeError(
        f"Cannot describe TPU topology {topology!r} ({type(e).__name__}: {e}). Compiling for "
        "TPU needs libtpu: pip install -e '.[tpu]'.") from e
  return list(description.devices)


def model_and_batch(c):
  """The model, a one-row sample input and the abstract global batch of config ``c``."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from cdpjax import config as config_lib, data, models, train  # pylint: disable=g-import-not-at-top
  rows = config_lib.global_batch_size(c)
  if c.dataset in data.TEXT_DATASETS:
    if c.model != "transformer":
      raise ValueError(f"dataset={c.dataset!r} is text: set --config.model=transformer.")
    num_classes, seq_len = 256, c.model_kwargs.seq_len
    sample = jnp.zeros((1, seq_len), jnp.int32)
    batch = {"image": jax.ShapeDtypeStruct((rows, seq_len), jnp.int32),
             "label": jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)}
  elif c.dataset in IMAGE_DATASETS:
    num_classes, shape = IMAGE_DATASETS[c.dataset]
    sample = jnp.zeros((1, *shape), jnp.float32)
    batch = {"image": jax.ShapeDtypeStruct((rows, *shape), jnp.float32),
             "label": jax.ShapeDtypeStruct((rows,), jnp.int32)}
  else:
    raise ValueError(f"Unknown dataset {c.dataset!r}: use one of {', '.join(data.DATASETS)}.")
  model = models.create_model(c.model, num_classes, **train.model_kwargs(c))
  return model, sample, batch


def build(c, devices):
  """The lowered step of config ``c`` on the first chips of ``devices``, and what it is.

  Returns ``(lowered, info)``; ``info`` has the mesh, the plan's description
  and the parameter count.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from cdpjax import config as config_lib, executor as executor_lib, executors, stages, tasks, train  # pylint: disable=g-import-not-at-top
  config_lib.validate(c)
  if c.backend != "shard_map":
    raise ValueError(f"backend={c.backend!r} cannot be compiled ahead of time here: use "
                     "--config.backend=shard_map.")
  needed = config_lib.num_devices(c)
  if needed > len(devices):
    raise ValueError(f"The mesh {dict(zip(*config_lib.mesh_axes(c)[::-1]))} needs {needed} "
                     f"devices (parallelism={c.parallelism!r}); the topology has {len(devices)} "
                     "chips. Use a larger topology, or fewer workers or replicas.")
  mesh = train.make_mesh(c, devices)
  model, sample, batch = model_and_batch(c)
  variables = jax.eval_shape(lambda k: model.init(k, sample, train=False), jax.random.key(0))
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"} or None
  # The learning-rate schedule changes constants of the program, not its buffers or collectives.
  tx = train.make_optimizer(c, optax.constant_schedule(c.learning_rate))
  stage_ids = train.model_stage_ids(c, model, params, sample)
  executor = executors.build(
      c.parallelism, model, tx, params=params, model_state=model_state,
      stage_ids=stage_ids, sample_input=sample,
      rule=config_lib.delay_rule(c), mesh=mesh, loss_fn=tasks.cross_entropy, backend=c.backend,
      tied_backward=c.tied_backward, keep_activations=c.keep_activations,
      gradient_reduction=c.gradient_reduction)
  state = jax.eval_shape(executor.init, params, model_state)
  # The engine lowers abstract inputs as they are: they carry its placement (replicated state,
  # rows split over the workers). The executed timetables place them themselves.
  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, train.rows_spec(mesh, batch["label"].shape[0]))
  state = executor_lib.place(state, replicated)
  batch = executor_lib.place(batch, rows)
  lowered = executor.lower(state, batch)
  info = {"mesh": dict(mesh.shape), "runs": executor.plan.describe(),
          "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
          "stage_params": stages.stage_sizes(params, stage_ids)}
  return lowered, info


def compile_uncached(lowered, compiler_options=None):
  """``lowered.compile(compiler_options)`` with JAX's persistent compilation cache off.

  A TPU executable in that cache cannot be read back on a host without a TPU
  (each later run would warn), so TPU programs compiled here stay out of it.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # The flag is read when the cache starts.
  try:
    return lowered.compile(compiler_options=compiler_options)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
    compilation_cache.reset_cache()


def report(lowered, topology: str, slots: bool = False, hbm_only: bool = False) -> dict:
  """What the TPU compiler makes of ``lowered``: per-chip memory, collectives, fit.

  ``hbm_bytes`` is the HBM of the TPU's buffer assignment (`cdpjax.compiled.buffer_assignment`;
  ``hbm_by_kind``: the arguments, the temp heap at its peak, constants...),
  ``vmem_bytes`` its on-chip memory; ``fits`` compares ``hbm_bytes`` with the
  chip's HBM (`CHIP_HBM_BYTES`). ``peak_bytes`` is XLA's argument + output +
  temp - alias estimate (`cdpjax.compiled.memory`), kept for reference: its
  temp is not the HBM heap. Collectives are the collective instructions of the
  compiled program with the bytes of their results on one chip
  (`cdpjax.hlo.collective_summary`): ``count`` and ``bytes`` count each
  instruction once; ``count_min``/``_max`` and ``bytes_min``/``_max`` are per
  step, weighted by the loops' trip counts and the branches the slot tables
  take (bounds where a branch cannot be read statically). With ``slots`` (an
  executed timetable's step), ``collectives_by_slot`` gives the bytes of each
  kind in each slot of the step, summed over the chips
  (`cdpjax.hlo.collectives_per_trip`): when, in the step, the chips
  communicate; None for a program without a slot loop (ZeRO-3's lockstep step).
  A program without one has ``collective_schedule`` instead: its collectives in
  schedule order against its compute instructions (`cdpjax.hlo.collective_schedule`:
  ``[kind, bytes, compute after it, compute beside it]``, the last for an
  asynchronous collective, between its start and its done). With ``hbm_only``
  the compiler places no buffer in on-chip VMEM (`HBM_ONLY_OPTIONS`).
  """
  from cdpjax import compiled, hlo  # pylint: disable=g-import-not-at-top
  dump = tempfile.mkdtemp(prefix="cdpjax-aot-")
  try:
    program = compile_uncached(lowered, {"xla_dump_to": dump,
                                         **(HBM_ONLY_OPTIONS if hbm_only else {})})
    assignment = compiled.buffer_assignment(dump)
  except Exception as e:  # pylint: disable=broad-except  (XLA raises JaxRuntimeError)
    if "RESOURCE_EXHAUSTED" in str(e):
      raise ValueError(f"The step does not fit one chip of {topology}: "
                       f"{str(e).split('RESOURCE_EXHAUSTED: ')[-1].splitlines()[0]} Use fewer "
                       "layers or rows per worker, or a strategy that holds less per chip "
                       "(parallelism=model or zero).") from e
    if "should include all slice devices" not in str(e):
      raise
    raise ValueError(
        f"The TPU compiler compiles for every chip of {topology}, and this step uses fewer "
        f"than its {parse_topology(topology)[1]} chips. Use a topology "
        "with as many chips as the mesh (e.g. v5e:2x2 for 4 stages), or fill the chips: "
        "num_workers = chips (parallelism=data), or num_replicas = chips / J "
        "(parallelism=model or zero: R copies of the executed schedule).") from e
  finally:
    shutil.rmtree(dump, ignore_errors=True)
  memory = compiled.memory(program)
  memory.update(hbm_bytes=assignment["spaces"]["default"],
                vmem_bytes=assignment["spaces"].get("vmem", 0),
                hbm_by_kind=assignment["default_by_kind"],
                hbm_temp_ranges=assignment["temp_ranges"],
                hbm_temp_arrays_bytes=assignment["temp_arrays"],
                hbm_temp_live_peak=assignment["temp_live_peak"],
                hbm_tuple_tables=assignment["temp_tuple_tables"],
                hbm_tuple_tables_by_kind=assignment["temp_tuple_tables_by_kind"])
  chip, num_chips = parse_topology(topology)
  hbm = CHIP_HBM_BYTES[chip]
  text = compiled.hlo_text(program)
  return {
      "topology": topology,
      "chips": num_chips,
      "hbm_only": hbm_only,
      "memory_per_chip": memory,
      "hbm_per_chip_bytes": hbm,
      "hbm_source": HBM_SOURCE,
      "fits": memory["hbm_bytes"] <= hbm,
      "collectives": hlo.collective_summary(text),
      **_by_slot_or_schedule(text, slots),
  }


def _by_slot_or_schedule(hlo_text: str, slots: bool) -> dict:
  """``collectives_by_slot``: ``{kind: [bytes in slot s, summed over the chips]}`` of a
  program's slot loop; else ``collective_schedule`` of its entry computation."""
  from cdpjax import hlo  # pylint: disable=g-import-not-at-top
  if slots:
    try:
      per_trip = hlo.collectives_per_trip(hlo_text).sum(axis=1)
      return {"collectives_by_slot": {kind: per_trip[:, k].tolist()
                                      for k, kind in enumerate(hlo.KINDS) if per_trip[:, k].any()},
              "collective_schedule": None}
    except ValueError:  # No slot loop.
      pass
  scheduled, num_compute = hlo.collective_schedule(hlo_text)
  return {"collectives_by_slot": None, "collective_schedule": {
      "compute_instructions": num_compute,
      "collectives": [[c.kind, c.bytes, c.compute_after, c.compute_during] for c in scheduled]}}


def _schedule_lines(schedule) -> list[str]:
  """Per kind: how many collectives the schedule places after the last compute instruction, and
  how many run beside compute (asynchronous, compute between start and done)."""
  if not schedule or not schedule["collectives"]:
    return []
  lines = [f"against compute, in schedule order ({schedule['compute_instructions']} compute "
           "instructions: convolutions, dots and what holds them):"]
  for kind in dict.fromkeys(k for k, *_ in schedule["collectives"]):
    ops = [(b, after, during) for k, b, after, during in schedule["collectives"] if k == kind]
    beside = sum(b for b, _, during in ops if during) / max(sum(b for b, _, _ in ops), 1)
    lines.append(f"  {kind:<20} {len(ops)}: {sum(not after for _, after, _ in ops)} after the "
                 f"last compute, {sum(bool(during) for *_, during in ops)} beside compute "
                 f"({beside:.2f} of their bytes); compute after each: "
                 + " ".join(str(after) for _, after, _ in ops[:16])
                 + (" ..." if len(ops) > 16 else ""))
  return lines


def compile_config(c, topology: str, hbm_only: bool = False) -> dict:
  """Builds, lowers and compiles config ``c`` for ``topology``; the report (`REPORT_KEYS`).
  ``hbm_only``: no buffer in on-chip VMEM (`HBM_ONLY_OPTIONS`)."""
  devices = topology_devices(topology)
  lowered, info = build(c, devices)
  result = report(lowered, topology, slots=c.parallelism != "data", hbm_only=hbm_only)
  result.update(info, devices_used=int(math.prod(info["mesh"].values())),
                config={k: c[k] for k in ("model", "dataset", "rule", "parallelism",
                                          "num_workers", "num_stages", "per_worker_batch_size",
                                          "optimizer")})
  return {k: result[k] for k in REPORT_KEYS}


# Each parallelism's synchronous baseline (rule dp), as a careful user would run it: ZeRO-3
# keeps every stage at its own size, gathered and reduced by all-gathers and reduce-scatters.
BASELINES = {"data": "DP", "model": "GPipe", "zero": "ZeRO-3"}


def baseline_config(c):
  """Config ``c`` under rule dp: the same model, batch, parallelism and mesh, no delay."""
  if c.rule == "dp":
    raise ValueError("--baseline compares a delayed rule with dp, and the config's rule is dp: "
                     "set --config.rule (e.g. cdp-v2), or leave out --baseline.")
  b = c.copy_and_resolve_references()
  with b.unlocked():  # No delay, so nothing to compensate.
    b.rule, b.weight_prediction, b.dc_lambda, b.lr_delay_scale = "dp", False, 0.0, 0.0
  return b


def comparison(result: dict, baseline: dict) -> str:
  """The report of a delayed rule beside its baseline's (`baseline_config`), for the terminal."""
  def received(r):  # The mean chip's bytes received over links a step, every kind.
    return sum(c["received_mean"] for c in r["collectives"].values())

  def kinds(r):
    return ", ".join(f"{k} x{_range(c['count_min'], c['count_max'], '.0f')}"
                     for k, c in r["collectives"].items() if c["count"]) or "none"

  name = BASELINES[result["config"]["parallelism"]]
  hbm = [r["memory_per_chip"]["hbm_bytes"] for r in (result, baseline)]
  moved = [received(r) for r in (result, baseline)]
  stage = 4 * max(result["stage_params"])  # The largest stage in float32: the goals' unit.
  lines = [f"against {name} (rule dp, the same parallelism, mesh and batch), this step / "
           f"{name}'s, per chip:",
           f"  HBM             {_gib(hbm[0])} / {_gib(hbm[1])} = {hbm[0] / hbm[1]:.2f}x "
           f"({(hbm[0] - hbm[1]) / (1 << 20):+.2f} MiB: {(hbm[0] - hbm[1]) / stage:+.2f} times "
           f"the largest of its {len(result['stage_params'])} stages, {_gib(stage)} in float32)",
           f"  received over links a step (mean chip)  {moved[0] / (1 << 20):.2f} / "
           f"{moved[1] / (1 << 20):.2f} MiB"
           + (f" = {moved[0] / moved[1]:.2f}x" if moved[1] else ""),
           f"  collectives a step  {kinds(result)} / {kinds(baseline)}"]
  for label, r in (("this step", result), (name, baseline)):
    reduce = (r.get("collectives_by_slot") or {}).get("all-reduce")
    if reduce:
      lines.append(f"  {label}'s all-reduces in slots "
                   + ", ".join(str(s) for s, b in enumerate(reduce) if b)
                   + f" of {len(reduce)}")
  return "\n".join(lines)


def write(result: dict, workdir: str) -> str:
  """Writes ``compile.json`` in ``workdir``; returns its path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "compile.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  return path


def _gib(nbytes: float) -> str:
  """GiB, or MiB below one GiB (the quick starts' programs)."""
  return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.2f} MiB"


def _range(low: float, high: float, spec: str) -> str:
  return f"{low:{spec}}" if low == high else f"{low:{spec}}-{high:{spec}}"


def _live_peak_line(peak) -> list[str]:
  if not peak:
    return []
  return [f"  the temp heap's most live at once: {_gib(peak['bytes'])} (at {peak['at']}), the "
          "largest: " + ", ".join(f"{_gib(v['bytes'])} {v['value'].split()[0]}"
                                  for v in peak["values"][:4])]


def summary(result: dict) -> str:
  """A short table of a report, for the terminal."""
  m = result["memory_per_chip"]
  lines = [
      f"{result['runs']}",
      f"topology {result['topology']}: {result['chips']} chips, the program uses "
      f"{result['devices_used']} (mesh {result['mesh']}); {result['num_params']:,} parameters "
      f"(by stage: {', '.join(f'{n:,}' for n in result['stage_params'])})",
      "per chip, the buffer assignment" + (" (memory-space assignment off: every buffer in "
                                           "HBM)" if result.get("hbm_only") else "") + ":",
      f"  HBM used        {_gib(m['hbm_bytes'])} of {_gib(result['hbm_per_chip_bytes'])}: "
      + ("fits" if result["fits"] else "DOES NOT FIT"),
      "  of it: " + ", ".join(f"{kind} {_gib(n)}" for kind, n in m["hbm_by_kind"].items()),
      "  the temp heap's large ranges: " + (", ".join(
          f"{_gib(r['bytes'])} ({r['values'][0].split()[0]})" for r in m["hbm_temp_ranges"])
          or "none"),
      f"  the temp heap's arrays: {_gib(m['hbm_temp_arrays_bytes'])}; the rest is "
      f"{m['hbm_tuple_tables']} tuple tables (16 KiB each: "
      + ", ".join(f"{kind} {n}" for kind, n in m["hbm_tuple_tables_by_kind"].items())
      + ") and alignment",
      *_live_peak_line(m.get("hbm_temp_live_peak")),
      f"  on-chip (VMEM)  {_gib(m['vmem_bytes'])}",
      "XLA's memory analysis (its temp is not the HBM heap: docs/multihost.md):",
      *[f"  {key:<15} {_gib(m[key + '_bytes'])}" for key in
        ("argument", "output", "temp", "alias", "peak")],
      "collectives per chip and step (loops' trips and the branches taken counted; "
      "a range from the least to the busiest chip, or where a branch depends on data):",
      *[f"  {kind:<20} {_range(c['count_min'], c['count_max'], '.0f'):>9} ops "
        f"{_range(c['bytes_min'] / (1 << 20), c['bytes_max'] / (1 << 20), '.2f'):>21} MiB "
        f"({c['count']} instructions; received over links "
        f"{_range(c['received_min'] / (1 << 20), c['received_max'] / (1 << 20), '.2f')} MiB"
        + (f", mean {c['received_mean'] / (1 << 20):.2f}"
           if c["received_min"] != c["received_max"] else "") + ")"
        for kind, c in result["collectives"].items() if c["count"]],
  ]
  if not any(c["count"] for c in result["collectives"].values()):
    lines.append("  (none)")
  if result["collectives_by_slot"]:
    lines.append("by slot of the step, all chips (one call: the timetable's fill and drain "
                 "included):")
    for kind, per_slot in result["collectives_by_slot"].items():
      used = [s for s, b in enumerate(per_slot) if b]
      lines.append(f"  {kind:<20} in {len(used)} of {len(per_slot)} slots ("
                   + ", ".join(map(str, used[:16])) + (", ..." if len(used) > 16 else "")
                   + f"), the busiest {max(per_slot) / (1 << 20):.2f} MiB")
  lines += _schedule_lines(result.get("collective_schedule"))
  lines.append("FLOPs: not reported (XLA's cost analysis counts a loop body once, not per step)")
  return "\n".join(lines)
