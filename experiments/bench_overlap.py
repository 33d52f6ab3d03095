"""Can the J per-stage gradient all-reduces overlap the backward? Read from the compiled schedule.

The engine issues one all-reduce per stage (the lowered StableHLO holds
exactly J). Whether they stay apart, and where the compiler schedules them,
is read from the compiled HLO of the same step, for:

- the CPU compiler (8 emulated devices);
- the TPU compiler, ahead of time for a v5e topology, when libtpu is installed
  (``pip install -e ".[tpu]"``; no TPU is needed);

each with XLA's all-reduce combiner on (the default) and off
(``compiler_options={"xla_disable_hlo_passes": "all-reduce-combiner"}``). For
each compiled all-reduce the table gives how many compute instructions
(convolutions and dots, or fusions holding one) the schedule places after it:
an all-reduce with none after it cannot overlap the backward.

Beside the engine's step (``backward=engine``: ``jax.value_and_grad`` of the
whole loss, then one ``psum`` per stage), the same step with the engine's tied
backward (``backward=tied``, ``--config.tied_backward``,
``engine.make_train_step(staged=)``): each stage's vjp, then its ``psum``; the
cotangent handed to stage ``j - 1`` leaves an ``optimization_barrier``
together with stage ``j``'s reduced gradients, so no backward of an earlier
stage can be scheduled before stage ``j``'s all-reduce. The tied program
shows where the compilers then put the ``J`` all-reduces: between the stages'
backwards. And the engine's step with ``gradient_reduction="permutes"``
(``--config.gradient_reduction=permutes``): each stage's gradient summed by
``N - 1`` collective-permutes around the ring of workers and an all-gather,
which the TPU compiler runs asynchronously: how many compute instructions each
permute runs beside (between its start and its done), and the share of the
permutes' bytes that runs beside some; on the TPU compiler also for ResNet-50
(``configs/imagenet_resnet50.py``, 8 workers, as ``cdpjax-compile`` builds
it), both reductions.

The executed timetables (``parallelism=model`` and ``zero``) run their step
as a loop over slots: on the TPU compiler, for digits ResNet-18 with 2
replicas of ``N = J = 4`` (tpu_plan's v5e:2x4 point), each slot's collectives
on each chip (`hlo.collectives_per_trip`, the branch each slot takes): when,
in the step, each stage's gradient is all-reduced over the replicas (GPipe:
every stage after the flush; CDP: each at its stage's last backward), and
CDP+ZeRO's stage and gradient messages slot by slot. ZeRO-3, lockstep with no
slot loop: the compute instructions after each of its collectives.

  python experiments/bench_overlap.py          # results/bench_overlap/bench_overlap.json
  python experiments/bench_overlap.py --quick  # seconds
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  pylint: disable=g-import-not-at-top
from cdpjax import aot, distributed  # noqa: E402  (import no JAX)

TPU_TOPOLOGY = "v5e:2x4"  # 8 chips: one worker each.
distributed.emulate_cpu_devices(8)
aot.quiet_libtpu(TPU_TOPOLOGY)  # Before libtpu starts: no look-ups of a TPU VM.

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from cdpjax import compiled, engine, hlo, stages, tasks  # noqa: E402
from cdpjax.executed import staged as staged_lib  # noqa: E402
from cdpjax.models.residual_mlp import ResidualMLP  # noqa: E402
import tpu_plan  # noqa: E402  (its v5e:2x4 points' configs)

NUM_WORKERS = 8
NUM_STAGES = 4
NO_COMBINER = {"xla_disable_hlo_passes": "all-reduce-combiner"}


def tpu_mesh():
  """A mesh of the TPU topology's chips, or None when libtpu is not installed."""
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    topology = topologies.get_topology_desc(TPU_TOPOLOGY, "tpu")
  except Exception as e:  # pylint: disable=broad-except  (no libtpu: a RuntimeError or ImportError)
    print(f"TPU compiler skipped ({type(e).__name__}): pip install -e '.[tpu]' to include it.")
    return None
  return topologies.make_mesh(topology, (NUM_WORKERS,), ("data",))


def _problem(width: int):
  model = ResidualMLP(num_classes=10, width=width, hidden=2 * width, num_blocks=2 * NUM_STAGES)
  sample = jnp.zeros((1, 8, 8, 1))
  params = jax.eval_shape(lambda k: model.init(k, sample), jax.random.key(0))["params"]
  stage_ids = stages.model_stage_ids(model, params, NUM_STAGES, sample, by="params")
  return model, sample, params, stage_ids, optax.sgd(0.1, momentum=0.9)


def _abstract_batch(mesh, per_worker_batch: int):
  rows = NamedSharding(mesh, P("data"))
  size = NUM_WORKERS * per_worker_batch
  return {"image": jax.ShapeDtypeStruct((size, 8, 8, 1), jnp.float32, sharding=rows),
          "label": jax.ShapeDtypeStruct((size,), jnp.int32, sharding=rows)}


def _abstract(tree, mesh):
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), tree)


def lowered_step(mesh, rule: str, width: int, per_worker_batch: int, tied: bool = False,
                 reduction: str = "all-reduce"):
  """The engine's lowered step for a residual MLP on ``mesh``, from abstract inputs only;
  ``tied``: with the tied backward; ``reduction``: its ``gradient_reduction``."""
  model, sample, params, stage_ids, tx = _problem(width)

  def loss_fn(p, batch):
    return tasks.cross_entropy(model.apply({"params": p}, batch["image"]), batch["label"])

  staged = (staged_lib.stage_model(model, params, stage_ids, sample, loss_fn=tasks.cross_entropy)
            if tied else None)
  step = engine.make_train_step(loss_fn, tx, stage_ids=stage_ids, rule=rule, mesh=mesh,
                                staged=staged, gradient_reduction=reduction)
  state = _abstract(jax.eval_shape(step.init, params), mesh)
  return step.lower(state, _abstract_batch(mesh, per_worker_batch))


def measure(lowered, compiler_options) -> dict:
  program = aot.compile_uncached(lowered, compiler_options)  # TPU executables stay out of the cache.
  scheduled, num_compute = hlo.collective_schedule(program.as_text())
  all_reduces = [c for c in scheduled if c.kind == "all-reduce"]
  permutes = [c for c in scheduled if c.kind == "collective-permute"]
  return {
      "stablehlo_all_reduces": hlo.stablehlo_collectives(lowered.as_text())["all-reduce"],
      "compiled_all_reduces": len(all_reduces),
      "bytes": [c.bytes for c in all_reduces],
      "compute_after": [c.compute_after for c in all_reduces],
      "compute_instructions": num_compute,
      "permutes_compute_during": [c.compute_during for c in permutes],
      "permutes_bytes": [c.bytes for c in permutes],
      "all_gathers_compute_after": [c.compute_after for c in scheduled
                                    if c.kind == "all-gather"],
  }


RESNET50 = "configs/imagenet_resnet50.py"


def measure_resnet50(reduction: str, devices) -> dict:
  """The engine's ResNet-50 step on the topology's 8 chips, its gradients summed by
  ``reduction``: where its collectives sit against its compute (`measure`)."""
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.load(os.path.join(_common.REPO, RESNET50), None, num_workers=NUM_WORKERS,
                      gradient_reduction=reduction)
  lowered, _ = aot.build(c, devices)
  return {"compiler": f"tpu {TPU_TOPOLOGY}", "backward": "engine", "rule": c.rule,
          "combiner": "on", "reduction": reduction, "model": "ResNet-50",
          **measure(lowered, None)}


EXECUTED = ("gpipe", "cdp+mp", "zero-3", "cdp+zero")  # tpu_plan's executed strategies.
EXECUTED_POINT = "configs/digits.py:model=resnet18"


def measure_executed(strategy: str, devices) -> dict:
  """The bytes of each slot's collectives on each chip of tpu_plan's v5e:2x4 point; for a step
  without slots (ZeRO-3), the compute instructions after each collective."""
  c = tpu_plan.point_config(EXECUTED_POINT, {}, {}, strategy, len(devices), NUM_STAGES)
  lowered, _ = aot.build(c, devices)
  text = compiled.hlo_text(aot.compile_uncached(lowered))
  found = {"strategy": strategy, "point": EXECUTED_POINT, "num_replicas": c.num_replicas}
  try:
    per_trip = hlo.collectives_per_trip(text)
  except ValueError:  # Lockstep: one step, no slot loop.
    scheduled, num_compute = hlo.collective_schedule(text)
    return {**found, "compute_instructions": num_compute,
            "schedule": [[x.kind, x.bytes, x.compute_after] for x in scheduled]}
  return {**found, "slots": len(per_trip), "kinds": list(hlo.KINDS),
          "bytes_per_slot": per_trip.tolist()}


def main(argv=None):
  args = _common.parser("bench_overlap", __doc__).parse_args(argv)
  out = _common.results_dir(args)
  width = 64 if args.quick else 512
  meshes = {"cpu": jax.make_mesh((NUM_WORKERS,), ("data",))}
  if not args.quick:
    mesh = tpu_mesh()
    if mesh is not None:
      meshes[f"tpu {TPU_TOPOLOGY}"] = mesh
  rows = []
  for compiler, mesh in meshes.items():
    programs = [(backward, rule, lowered_step(mesh, rule, width, 32, tied=backward == "tied"))
                for backward in ("engine", "tied")
                for rule in (("dp",) if args.quick else ("dp", "cdp-v2"))]
    for backward, rule, lowered in programs:
      for combiner, options in (("on", None), ("off", NO_COMBINER)):
        rows.append({"compiler": compiler, "backward": backward, "rule": rule,
                     "combiner": combiner, "reduction": "all-reduce",
                     **measure(lowered, options)})
    for rule in ("dp",) if args.quick else ("dp", "cdp-v2"):  # No combiner pass for permutes.
      lowered = lowered_step(mesh, rule, width, 32, reduction="permutes")
      rows.append({"compiler": compiler, "backward": "engine", "rule": rule, "combiner": "on",
                   "reduction": "permutes", **measure(lowered, None)})
  executed = []
  if f"tpu {TPU_TOPOLOGY}" in meshes:
    devices = aot.topology_devices(TPU_TOPOLOGY)
    executed = [measure_executed(strategy, devices) for strategy in EXECUTED]
    rows += [measure_resnet50(reduction, devices) for reduction in ("all-reduce", "permutes")]
  result = {"machine": _common.machine(), "num_workers": NUM_WORKERS, "num_stages": NUM_STAGES,
            "width": width, "rows": rows, "executed": executed}
  _common.write_json(out / "bench_overlap.json", result)
  print(f"{'compiler':<14} {'backward':<9} {'rule':<7} {'combiner':<8} {'stablehlo':>9} "
        f"{'compiled':>8}  compute instructions after each all-reduce (of all)")
  for r in rows:
    if r["reduction"] == "permutes":
      print(f"{r['compiler']:<14} {r['backward']:<9} {r['rule']:<7} permutes: compute "
            f"instructions beside each of {len(r['permutes_compute_during'])} permutes "
            f"{r['permutes_compute_during']}, after each all-gather "
            f"{r['all_gathers_compute_after']} (of {r['compute_instructions']})")
      continue
    print(f"{r['compiler']:<14} {r['backward']:<9} {r['rule']:<7} {r['combiner']:<8} "
          f"{r['stablehlo_all_reduces']:>9} "
          f"{r['compiled_all_reduces']:>8}  {r['compute_after']} (of {r['compute_instructions']})")
  for r in executed:
    if "schedule" in r:
      print(f"{r['strategy']}: compute instructions after each collective (of "
            f"{r['compute_instructions']}): " + ", ".join(f"{k} {a}" for k, _, a in r["schedule"]))
      continue
    per_slot = np.asarray(r["bytes_per_slot"]).sum(axis=1) / 2**20  # [slots, kinds], all chips.
    print(f"{r['strategy']}: MiB per slot, all chips: " + "; ".join(
        f"{kind} " + " ".join(f"{b:.2f}" for b in per_slot[:, k])
        for k, kind in enumerate(r["kinds"]) if per_slot[:, k].any()))
  return result


if __name__ == "__main__":
  main()
