"""The paper's memory and communication claims on the TPU compiler, at pod scale.

Compiles (ahead of time, `cdpjax.aot`: libtpu on this CPU host, nothing runs)
the training step of each strategy for a TPU topology, and puts the compiled
per-chip peak memory and collective bytes per step next to the cost model's
(`cdpjax.analysis`) predictions, with their ratio:

- ResNet-50 at the ImageNet recipe (batch 32 per worker, SGD with momentum,
  ``J = 4`` stages split by FLOPs) on v5e:16x16 (v5e-256);
- a transformer of about 1B parameters (byte-level, ``d_model`` 2048, 20
  layers, sequences of 1024, AdamW, 4 rows per worker) on v5p:8x8x4 (v5p-256).

Strategies: DP, CDP-v1 and CDP-v2 on the engine (one worker per chip: ``N``
= the topology's chips), GPipe and CDP+MP (the executed pipeline), ZeRO-3 and
CDP+ZeRO (``N = J = 4`` chips per ring); GPipe and CDP+MP again with
activations kept from the forward (``-kept``: ``keep_activations``, where
the default recomputes each stage's forward in its backward); CDP+ZeRO
again with the ResNets cut into stages of equal parameters instead of equal
FLOPs (``-params``: ``stages_by=params``; the cyclic timetables pad every
stage buffer and message to the largest stage, ZeRO-3 does not). The executed
timetables fill the pod
with ``R = chips / J`` replicas of one pipeline or ring (the launcher's
``(replica, stage)`` and ``(replica, data)`` meshes, ``num_replicas``), as a
pod run would.

Issue 34's two ``v5e:2x4`` points are small enough that the compiler places
much of a step in on-chip VMEM, differently per strategy; their memory
strategies compile again with every buffer in HBM (``HBM_ONLY``,
``hbm_only_GiB``), where HBM shows all each step holds (ResNet-50's CDP+ZeRO
and ZeRO-3 too).

Each compiled point is cached as JSON in ``--results_dir/points`` and is not
compiled again; ``--quick`` compiles the digits MLP for v5e:2x4 instead. A
last check compiles one ``lax.psum_scatter`` per operand shape for v5e:2x4
(`reduce_scatter_lowering`): the TPU compiler turns that of a flat buffer, or
of fewer than 16 rows of 128 a chip, into an all-reduce; ZeRO-3 pads its
shards to whole tiles (`cdpjax.executed.zero.pad_to`) so that it keeps them.

The largest transformer each strategy fits on v5e and v5p comes from the cost
model (a line in the layer count); one of them, CDP+MP on v5e:16x16
(``LARGEST_CHECK``), is compiled at that size to check it against the HBM.

The cost model's activation terms come from the compiler too (`calibration`:
one micro-batch's backward compiled per chip, with no collective; cached in
``points/``): counted from ``jax.vjp``'s shapes they are 2 to 5 times what a
TPU keeps (each row's ``shapes_peak_ratio``).

  python experiments/tpu_plan.py                  # minutes to hours on 2 cores
  python experiments/tpu_plan.py --quick --results_dir /tmp/tpu_plan
"""
from __future__ import annotations

from collections import defaultdict
import json
import math
import os
import sys

import _common

STRATEGIES = {  # The cost model's name: (rule, parallelism).
    "dp": ("dp", "data"), "cdp-v1": ("cdp-v1", "data"), "cdp-v2": ("cdp-v2", "data"),
    "gpipe": ("dp", "model"), "cdp+mp": ("cdp-v2", "model"),
    "zero-3": ("dp", "zero"), "cdp+zero": ("cdp-v2", "zero"),
    "gpipe-kept": ("dp", "model"), "cdp+mp-kept": ("cdp-v2", "model"),
    "cdp+zero-params": ("cdp-v2", "zero"),
}
KEPT = "-kept"  # A strategy with activations kept (the cost model's own assumption).
BY_PARAMS = "-params"  # Stages of equal parameters (models the plan cuts by FLOPs only).


def base(strategy: str) -> str:
  """The cost model's name of ``strategy``: kept activations are what it counts, and the stage
  cut is the workload's."""
  return strategy.removesuffix(KEPT).removesuffix(BY_PARAMS)
TRANSFORMER_1B = dict(num_layers=20, d_model=2048, num_heads=16, d_ff=8192, seq_len=1024)
PLANS = {
    "full": [
        # (name, config, overrides, model_kwargs, topology)
        ("resnet50", "configs/imagenet_resnet50.py", {}, {}, "v5e:16x16"),
        ("transformer-1b", "configs/lm.py:size=base", {"per_worker_batch_size": 4},
         TRANSFORMER_1B, "v5p:8x8x4"),
        # Issue 34's check points: the quick starts on one v5e host, 2 replicas of J = 4.
        ("lm-quick", "configs/lm.py", {}, {}, "v5e:2x4"),
        ("digits-resnet18", "configs/digits.py:model=resnet18", {}, {}, "v5e:2x4"),
    ],
    "quick": [("digits-mlp", "configs/digits.py", {}, {}, "v5e:2x4")],
}
NUM_STAGES = {"full": 4, "quick": 2}
# The points compiled again with every buffer in HBM (`cdpjax.aot.HBM_ONLY_OPTIONS`; the module
# docstring says why).
_MEMORY = ("gpipe", "cdp+mp", "zero-3", "cdp+zero", "gpipe-kept", "cdp+mp-kept")
HBM_ONLY = {"lm-quick": _MEMORY, "digits-resnet18": _MEMORY, "resnet50": ("zero-3", "cdp+zero")}
OPTIMIZER_FACTOR = {"sgd": 1.0, "adam": 2.0, "adamw": 2.0}  # Optimizer bytes per parameter byte.
FLAT_MASK = {"adamw": 1.0}  # The executed timetables' AdamW decay mask: a float32 row per stage.


def point_config(path, overrides, model_kwargs, strategy, chips, num_stages):
  """The config of one strategy: the engine on every chip, replicas of the executed timetables."""
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  file, _, arg = path.partition(":")
  rule, parallelism = STRATEGIES[strategy]
  workers = chips if parallelism == "data" else num_stages
  c = config_lib.load(os.path.join(_common.REPO, file), arg or None, **overrides)
  with c.unlocked():
    c.rule, c.parallelism, c.num_workers, c.num_stages = rule, parallelism, workers, num_stages
    c.num_replicas = 1 if parallelism == "data" else chips // num_stages
    c.eval_batch_size = chips
    c.grad_clip_norm = 0.0  # The executed timetables do not clip; the same optimizer for all.
    c.keep_activations = strategy.endswith(KEPT)
    if strategy.endswith(BY_PARAMS):
      c.stages_by = "params"
    c.model_kwargs.update(model_kwargs)
  return c


def worker_loss(model, params, state, x, labels):
  """One worker's training loss (the model state's update dropped)."""
  from cdpjax import tasks  # pylint: disable=g-import-not-at-top
  out = model.apply({"params": params, **state}, x, train=True, mutable=list(state) or False)
  return tasks.cross_entropy(out[0] if state else out, labels)


def residual_bytes(model, variables, batch_rows) -> float:
  """Bytes ``jax.vjp`` keeps from one worker's forward for its backward, parameters excluded."""
  import jax  # pylint: disable=g-import-not-at-top
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def backward_of(p, state, batch):
    return jax.vjp(lambda p: worker_loss(model, p, state, batch["image"], batch["label"]), p)[1]
  leaves = jax.tree.leaves(jax.eval_shape(backward_of, params, state, batch_rows))
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  return max(0.0, sum(x.size * x.dtype.itemsize for x in leaves) - param_bytes)


def stage_residual_bytes(staged, x_spec, labels_spec) -> float:
  """Bytes ``jax.vjp`` keeps from the largest stage's forward (a micro-batch), its buffer aside.

  The executed timetables recompute a stage's forward in its backward: these
  residuals are alive while that backward runs. Every device switches over
  the stages (a traced stage index), so it holds the largest stage's.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  flat = lambda size: jax.ShapeDtypeStruct((size,), jnp.float32)
  act, buffer_bytes = staged.act_size(x_spec), 4 * staged.param_size
  state = flat(staged.state_size)

  def backward_of(j):
    def run(p, h, state, x, labels):
      return jax.vjp(lambda p, h: staged.apply(j, p, state, h, x, labels)[:2], p, h)[1]
    leaves = jax.tree.leaves(jax.eval_shape(run, flat(staged.param_size), flat(act), state,
                                            x_spec, labels_spec))
    return sum(x.size * x.dtype.itemsize for x in leaves)
  return max(0.0, max(backward_of(j) for j in range(staged.num_stages)) - buffer_bytes)


def stage_pad(strategy: str, c) -> int:
  """The multiple the launcher pads a strategy's stage buffers to (`cdpjax.executed.zero.pad_to`,
  `cdpjax.executed.device.TPU_TILE`: whole TPU tiles); the engine keeps its stages unpadded."""
  from cdpjax.executed import device, zero  # pylint: disable=g-import-not-at-top
  timetable = {"zero-3": "zero3", "cdp+zero": "cyclic"}.get(base(strategy))
  if timetable:
    return zero.pad_to(c.num_workers, timetable)
  return device.TPU_TILE if STRATEGIES[strategy][1] == "model" else 1


def is_zero3(c) -> bool:
  """Whether ``c`` runs ZeRO-3 (`executor.resolve`: ``parallelism=zero`` with rule ``dp``)."""
  from cdpjax import executor  # pylint: disable=g-import-not-at-top
  return c.parallelism == "zero" and executor.resolve(
      c.rule, "zero", c.num_workers, c.num_stages).timetable == "zero3"


def stage_bytes(c, staged) -> list[float]:
  """The bytes of each stage as an executed timetable of ``c`` holds and moves it: ZeRO-3 its
  shards of each stage (`zero.shard_sizes`), the others a buffer of the largest stage's size."""
  from cdpjax.executed import zero  # pylint: disable=g-import-not-at-top
  if is_zero3(c):
    return [4.0 * c.num_workers * q for q in zero.shard_sizes(staged, c.num_workers)]
  return [4.0 * staged.param_size] * staged.num_stages


def message_bytes(c, staged) -> tuple:
  """CDP+ZeRO's message of each stage: its message class's size (`zero.message_classes`);
  empty for the other strategies."""
  from cdpjax.executed import zero  # pylint: disable=g-import-not-at-top
  if c.parallelism != "zero" or is_zero3(c):
    return ()
  sizes = {j: size for size, stages in zero.message_classes(staged, c.num_workers)
           for j in stages}
  return tuple(4.0 * sizes[j] for j in range(staged.num_stages))


def workload(c, executed: bool, pad_to: int = 1, measured: dict | None = None):
  """The cost model's ``Workload`` of config ``c``, as the compiled program lays it out.

  The executed timetables keep every stage in a flat float32 buffer padded to
  the largest stage (ZeRO-3: each stage at its own size, in whole shards,
  `zero.shard_sizes`), recompute a stage's forward in its backward (so a stage
  keeps its input, padded to the largest boundary, and the recomputation's
  residuals live while its backward runs, `stage_residual_bytes`) and send
  padded boundaries; with ``keep_activations`` a stash row holds what the
  largest stage's backward needs instead (`StagedModel.kept_size`). The
  engine keeps the unpadded stages and ``jax.vjp``'s residuals.

  ``measured``: the activation terms as the TPU compiler keeps them
  (`calibration`), in place of those counted from shapes: the engine's
  activations, the executed timetables' backward of each stage.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from cdpjax import aot, analysis, train  # pylint: disable=g-import-not-at-top
  from cdpjax.executed import staged as staged_lib  # pylint: disable=g-import-not-at-top
  model, sample, batch = aot.model_and_batch(c)
  variables = jax.eval_shape(lambda k: model.init(k, sample, train=False), jax.random.key(0))
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"} or None
  staged = staged_lib.stage_model(model, params, train.model_stage_ids(c, model, params, sample),
                                  sample, model_state=model_state, pad_to=pad_to)
  b = c.per_worker_batch_size
  rows = {k: jax.ShapeDtypeStruct((b, *v.shape[1:]), v.dtype) for k, v in batch.items()}
  x_spec = rows["image"]
  k = OPTIMIZER_FACTOR[c.optimizer]
  J = staged.num_stages
  inputs = float(sum(math.prod(v.shape) * v.dtype.itemsize for v in rows.values()))
  if executed:
    k += FLAT_MASK.get(c.optimizer, 0.0)
    act_size = staged.act_size(x_spec)
    act = 4.0 * act_size
    # A stash row per micro-batch: a stage's input, padded to the largest; a ZeRO worker runs
    # every stage, and its first reads the batch; CDP+ZeRO's inputs at their own sizes
    # (`zero.stash_layout`). Kept: what a backward needs (the largest stage's), the first stage
    # recomputing.
    stash = [0.0 if c.parallelism == "zero" else act] + [act] * (J - 1)
    if c.parallelism == "zero" and not is_zero3(c):
      stash = [0.0] + [4.0 * b for b in staged.boundary_sizes(x_spec)]
    if c.keep_activations:
      flat = lambda size: jax.ShapeDtypeStruct((size,), jnp.float32)
      kept = 4.0 * staged.kept_size(flat(staged.param_size), flat(staged.state_size),
                                    flat(act_size), x_spec, rows["label"])
      stash = [0.0] + [kept] * (J - 1)
    recompute = ([stage_residual_bytes(staged, x_spec, rows["label"])] * J if measured is None
                 else measured["stage_transient_bytes"])
    return analysis.workload(stage_bytes(c, staged), stash, J, optimizer_factor=k,
                             boundary_bytes=act, recompute_bytes=recompute,
                             transient_gradient=measured is not None, input_bytes=inputs,
                             message_bytes=message_bytes(c, staged))
  boundaries = [4.0 * sum(math.prod(s.shape) for s in jax.tree.leaves(spec))
                for spec in staged.boundary_specs(x_spec)[:-1]]
  activations = (residual_bytes(model, variables, rows) if measured is None
                 else measured["engine_bytes"])
  return analysis.workload([4.0 * s for s in staged.stage_param_sizes()], activations, J,
                           optimizer_factor=k, boundary_bytes=boundaries, input_bytes=inputs)


def calibration(out_dir, name, c, topology, executed: bool, pad_to: int,
                cached_only=False, hbm_only=False) -> dict | None:
  """What the TPU compiler keeps per chip for one micro-batch's backward: the cost model's
  activation terms, from programs compiled for ``topology`` (cached in ``points/``; with
  ``hbm_only``, every buffer in HBM).

  ``jax.vjp``'s residuals counted from their shapes (`residual_bytes`,
  `stage_residual_bytes`) include every intermediate; the compiler fuses the
  elementwise work and keeps far less (the 1B transformer's engine: 8.2 of
  38.9 GiB). Each program runs one micro-batch per chip, no collective:

  - ``engine_bytes``: the temp heap of the gradient of one worker's loss;
  - ``stage_transient_bytes``: per stage, the larger temp heap of its
    forward and its backward as the executed timetables run them (the forward
    recomputed in the backward, or with ``keep_activations`` the forward
    keeping what the backward needs, the first stage recomputing), the
    backward's with its gradient, which they hold until it joins the sum.
  """
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  mode = ("executed-kept" if c.keep_activations else "executed") if executed else "engine"
  if executed and is_zero3(c):
    mode = "executed-shards"  # ZeRO-3 gathers each stage at its own size.
  if c.stages_by == "params":
    mode += "-params"
  path = point_path(out_dir, f"{name}_calibration-{mode}-pad{pad_to}", topology, hbm_only)
  if path.exists():
    return json.loads(path.read_text())
  if cached_only:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from cdpjax import train  # pylint: disable=g-import-not-at-top
  from cdpjax.executed import staged as staged_lib  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(aot.topology_devices(topology)), ("chip",))
  model, sample, batch = aot.model_and_batch(c)
  variables = jax.eval_shape(lambda k: model.init(k, sample, train=False), jax.random.key(0))
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}
  b = c.per_worker_batch_size
  rows = {k: jax.ShapeDtypeStruct((b, *v.shape[1:]), v.dtype) for k, v in batch.items()}
  every = NamedSharding(mesh, P())
  same = lambda t: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=every),
                                t)
  per_chip = lambda s: jax.ShapeDtypeStruct((mesh.size, *s.shape), s.dtype,
                                            sharding=NamedSharding(mesh, P("chip")))

  def heap(fn, shared, own, gradient=False):
    """The temp heap of ``fn(*shared, *own)`` on every chip (``own``: one row each), plus its
    first output (``gradient``)."""
    def body(*args):
      out = fn(*args[:len(shared)], *(jax.tree.map(lambda a: a[0], a) for a in args[len(shared):]))
      return jax.tree.map(lambda a: a[None], out)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),) * len(shared)
                                 + (P("chip"),) * len(own), out_specs=P("chip")))
    args = (*same(shared), *(jax.tree.map(per_chip, a) for a in own))
    m = aot.report(step.lower(*args), topology, hbm_only=hbm_only)["memory_per_chip"][
        "hbm_by_kind"]
    out = jax.eval_shape(step, *args)
    extra = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out[0])) / mesh.size
    return m.get("temp", 0) + (extra if gradient else 0)

  if not executed:
    def grad(p, st, x, y):
      return (jax.grad(worker_loss, argnums=1)(model, p, st, x, y),)
    result = {"engine_bytes": heap(grad, (params, state), (rows["image"], rows["label"]))}
  else:
    staged = staged_lib.stage_model(model, params, train.model_stage_ids(c, model, params, sample),
                                    sample, model_state=state or None, pad_to=pad_to)
    flat = lambda size: jax.ShapeDtypeStruct((size,), jnp.float32)
    theta, st = flat(staged.param_size), flat(staged.state_size)
    thetas = [flat(int(b) // 4) for b in stage_bytes(c, staged)]
    h = flat(staged.act_size(rows["image"]))
    kept = staged.kept_size(theta, st, h, rows["image"], rows["label"])
    transient = []
    for j in range(staged.num_stages):
      keeps = c.keep_activations and j > 0
      if keeps:
        forward = lambda p, s, h, x, y, j=j: staged.apply_keeping(j, p, s, h, x, y, kept)
        backward = lambda p, s, x, y, r, cot, j=j: staged.vjp_kept(j, p, s, x, y, r, cot)
        own = (rows["image"], rows["label"], flat(kept), h)
      else:
        forward = lambda p, s, h, x, y, j=j: staged.apply(j, p, s, h, x, y)
        backward = lambda p, s, h, x, y, cot, j=j: staged.vjp(j, p, s, h, x, y, cot)
        own = (h, rows["image"], rows["label"], h)
      inputs = (h, rows["image"], rows["label"])
      transient.append(max(heap(forward, (thetas[j], st), inputs),
                           heap(backward, (thetas[j], st), own, gradient=True)))
    result = {"stage_transient_bytes": transient}
  path.parent.mkdir(parents=True, exist_ok=True)
  _common.write_json(path, result)
  return result


LONG_CALL_STEPS = 64
"""The steps of a long call, whose fill and drain are amortized (the cost model's figure)."""


def executed_permutes(strategy: str, c, num_steps: int = 1, classes=(None,)) -> float:
  """``collective-permute``s one chip executes per step of a ``num_steps``-step call of an
  executed timetable (the compiled points: one step per call).

  Every chip runs the same slot body (one SPMD program), so a permute whose
  pair list is not empty at a slot executes on every chip, idle ones included,
  whether or not the chip is among its targets. Which list a slot uses is
  static (`cdpjax.executed.plan`): GPipe shifts every slot (``2(N+J-1)``),
  the cyclic pipeline swaps neighbours on even and odd slots, CDP-ZeRO sends
  a slot's stage messages in one permute a message class (``classes``: the
  stages of each) and its gradient messages in another
  (`cdpjax.executed.plan.ZeroPlan.num_permutes`; model-state messages left out).
  """
  from cdpjax import schedule  # pylint: disable=g-import-not-at-top
  from cdpjax.executed import plan as plan_lib  # pylint: disable=g-import-not-at-top
  J, N = c.num_stages, c.num_workers
  strategy = base(strategy)
  if strategy == "gpipe":  # A flush every step.
    return 2 * (N + J - 1) if J > 1 else 0
  if strategy == "cdp+mp":
    slots = plan_lib.cyclic_slots(J, num_steps)
    return sum(bool(plan_lib.swap_pairs(J, slot % 2)) for slot in range(slots)) / num_steps
  if strategy == "cdp+zero":
    zero_plan = plan_lib.zero_plan(schedule.resolve(STRATEGIES[strategy][0], N, J), num_steps)
    return zero_plan.num_permutes(model_states=False, classes=classes) / num_steps
  raise ValueError(f"{strategy} is not an executed timetable with permutes.")


REDUCE_SCATTER_SHAPES = ((8192,), (140672,), (64, 128), (128, 128))
"""Per-chip operands of the reduce-scatter lowering check: flat buffers and 2-D tiles."""


def reduce_scatter_lowering(topology: str = "v5e:2x4") -> list[dict]:
  """The collectives the TPU compiler makes of one ``lax.psum_scatter`` over all chips.

  One row per operand shape of `REDUCE_SCATTER_SHAPES` (``tiled=True``,
  scattered over dimension 0): the compiled collectives' kinds and result
  bytes per chip.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(aot.topology_devices(topology), ("data",))
  scatter = lambda a: jax.lax.psum_scatter(a[0], "data", scatter_dimension=0, tiled=True)[None]
  step = jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  rows = []
  for shape in REDUCE_SCATTER_SHAPES:
    x = jax.ShapeDtypeStruct((mesh.size, *shape), jnp.float32,
                             sharding=NamedSharding(mesh, P("data")))
    collectives = aot.report(step.lower(x), topology)["collectives"]
    found = {k: v for k, v in collectives.items() if v["count"]}
    rows.append({"topology": topology, "operand": f"f32{list(shape)}", "chips": mesh.size,
                 "operand_bytes": 4 * math.prod(shape),
                 "compiled": ", ".join(f"{k} x{v['count']} ({v['bytes']} B)"
                                       for k, v in found.items())})
  return rows


PLACEMENT_STAGE = (5120, 128)
"""The stage of `conditional_placement`: 2.5 MiB of float32 in whole TPU tiles (digits ResNet-18's
largest stage is 2.52 MiB)."""
PLACEMENT_READS = ("read unconditionally", "read in a per-chip conditional",
                   "made in a per-chip conditional and sent")


def conditional_placement(topology: str = "v5e:2x4") -> list[dict]:
  """Where the TPU compiler places a stage-sized buffer of a loop over slots, by how it is used.

  Each of 4 slots receives a stage from the previous chip by ``lax.ppermute``
  and reads it whole (a stage's matmuls): ``read unconditionally``, as ZeRO-3
  reads the stage it gathered, or ``read in a per-chip conditional`` (a
  ``lax.switch`` on the chip and slot), as each event of a cyclic timetable
  reads its stage, since chips run different events in a slot. ``made in a
  per-chip conditional and sent``: a stage-sized buffer is the result of such
  a switch and is sent, as a backward's gradient message. Rows: the temp
  heap's arrays in HBM and the on-chip VMEM per chip, and whether the stage is
  in HBM (arrays of at least a stage).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(aot.topology_devices(topology), ("data",))
  ring = [(c, (c + 1) % mesh.size) for c in range(mesh.size)]
  rows, width = math.prod(PLACEMENT_STAGE), PLACEMENT_STAGE[1]
  matmul = lambda a, b: jnp.matmul(a, b, precision="highest")  # At bf16 it sends half.

  def read(stage, h):  # Every element of the stage, as a stage's compute reads its leaves.
    tiles = stage.reshape(PLACEMENT_STAGE)
    whole = jnp.tanh(matmul(tiles, h)).mean(0, keepdims=True)
    return h + jnp.tanh(matmul(tiles[:width], h)) + whole

  def make(h):
    return jnp.tile(jnp.tanh(matmul(h, h)), (rows // (width * width), 1)).reshape(-1)

  def program(how):
    def slot(carry, s):
      stage, h = carry
      event = (jax.lax.axis_index("data") + s) % 2  # Chips run different events in a slot.
      if how == PLACEMENT_READS[2]:
        idle = lambda h: jax.lax.pcast(jnp.zeros((rows,), jnp.float32), "data", to="varying")
        return (stage + jax.lax.ppermute(jax.lax.switch(event, [idle, make], h), "data", ring),
                h), None
      received = jax.lax.ppermute(stage, "data", ring)
      if how == PLACEMENT_READS[0]:
        return (stage, read(received, h)), None
      return (stage, jax.lax.switch(event, [lambda x, h: h, read], received, h)), None
    body = lambda stage, h: jax.lax.scan(slot, (stage, h), jnp.arange(4))[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32,
                                             sharding=NamedSharding(mesh, P("data")))
  found = []
  for how in PLACEMENT_READS:
    memory = aot.report(program(how).lower(spec(mesh.size * rows), spec(mesh.size * width, width)),
                        topology)["memory_per_chip"]
    found.append({"topology": topology, "stage": how, "stage_MiB": 4 * rows / 2**20,
                  "hbm_temp_arrays_MiB": memory["hbm_temp_arrays_bytes"] / 2**20,
                  "vmem_MiB": memory["vmem_bytes"] / 2**20,
                  "stage_in_hbm": memory["hbm_temp_arrays_bytes"] >= 4 * rows})
  return found


def tpu_result_bytes(strategy: str, c, w, comm, num_steps: int = 1) -> float:
  """Result bytes per step of one ``analysis.Communication``, as the compiled TPU program has
  them in a ``num_steps``-step call.

  The executed timetables' permutes run at every slot whose pair list is not
  empty, on every chip (`executed_permutes`), each of one padded boundary
  (pipelines) or one message class's buffer (CDP-ZeRO): the compiled program's
  result bytes exceed the algorithm's messages, which the cost model counts.
  ZeRO-3's all-gathers and reduce-scatters are as the cost model has them: the
  launcher pads its shards to whole TPU tiles (`stage_pad`), which the TPU
  compiler keeps as such (`reduce_scatter_lowering`).
  """
  if comm.kind != "p2p":
    return comm.payload_bytes
  if comm.what == "activations":
    return executed_permutes(strategy, c, num_steps) * max(w.boundary_bytes)
  # CDP-ZeRO: a permute per message class, each at its size (classes differ in size:
  # `zero.message_classes` puts stages of one size in one class).
  classes = defaultdict(list)
  for j, size in enumerate(w.stage_message_bytes):
    classes[size].append(j)
  return sum(executed_permutes(strategy, c, num_steps, [stages]) * size
             for size, stages in classes.items())


MEMORY_TERMS = ("params", "grads", "optimizer", "buffers", "activations", "messages", "inputs")
"""The cost model's per-chip memory, by term (`analysis.Memory`)."""


def predicted(strategy: str, c, w=None) -> dict:
  """The cost model's busiest chip: peak bytes and collective result bytes per step.

  ``w``: the workload of ``c`` (`workload`), when already computed. The
  executed timetables' ``num_replicas`` copies all-reduce their gradients over
  the ``replica`` axis (`analysis.cost`'s ``replicas``).
  """
  from cdpjax import analysis  # pylint: disable=g-import-not-at-top
  executed = STRATEGIES[strategy][1] != "data"
  w = w or workload(c, executed=executed, pad_to=stage_pad(strategy, c))
  cost = analysis.cost(base(strategy), c.num_workers, w,
                       replicas=c.num_replicas if executed else 1)
  m = cost.per_device
  return {"peak_bytes": m.peak, "params_bytes": m.params, "grads_bytes": m.grads,
          "optimizer_bytes": m.optimizer, "buffers_bytes": m.buffers, "messages_bytes": m.messages,
          "inputs_bytes": m.inputs,
          "activations_bytes": m.activations_peak,
          "recompute_bytes": max(w.stage_recompute_bytes, default=0.0),
          "collective_bytes": sum(tpu_result_bytes(strategy, c, w, x) for x in cost.communication),
          "long_call_collective_bytes": sum(tpu_result_bytes(strategy, c, w, x, LONG_CALL_STEPS)
                                            for x in cost.communication),
          "algorithm_collective_bytes": sum(x.payload_bytes for x in cost.communication),
          "workload": {"param_bytes": w.param_bytes, "activation_bytes": w.activation_bytes,
                       "optimizer_factor": w.optimizer_factor},
          "stage_param_bytes": list(w.stage_param_bytes),
          "stash_bytes": sum(w.stage_activation_bytes),
          "boundary_bytes": max(w.boundary_bytes, default=0.0)}


def point_path(out_dir, stem: str, topology: str, hbm_only: bool):
  """Where a compiled point or calibration is cached (``_hbm-only``: every buffer in HBM)."""
  return out_dir / "points" / (f"{stem}_{topology.replace(':', '_')}"
                               + ("_hbm-only" if hbm_only else "") + ".json")


def compile_point(out_dir, name, c, strategy, topology, cached_only=False,
                  hbm_only=False) -> dict | None:
  """The compiled report of one point, from the cache when there (else None if ``cached_only``),
  or ``{"refused": why}`` for a point the launcher refuses (cached as well). ``hbm_only``:
  compiled with every buffer in HBM (cached apart).

  A cached report without the buffer assignment (``hbm_temp_ranges``, compiled
  before cdpjax-compile read it) is compiled again unless ``cached_only``.
  """
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  path = point_path(out_dir, f"{name}_{strategy}", topology, hbm_only)
  cached = json.loads(path.read_text()) if path.exists() else None
  if cached and ("refused" in cached or "hbm_temp_ranges" in cached["memory_per_chip"]
                 or cached_only):
    return cached
  if cached_only:
    return None
  path.parent.mkdir(parents=True, exist_ok=True)
  try:
    result = aot.compile_config(c, topology, hbm_only=hbm_only)
  except ValueError as e:  # E.g. a stash past int32 offsets: the error names the fix.
    result = {"refused": str(e)}
  _common.write_json(path, result)
  return result


def row(name, strategy, topology, compiled, prediction, shapes, calibrated: bool) -> dict:
  """One table row: compiled against predicted (``prediction``: the cost model with the
  compiler's activation terms, `calibration`, if ``calibrated``, else as ``shapes``: with
  those counted from shapes).

  Collective bytes are per step (``cdpjax.hlo.collectives_per_step``; the
  compile runs one step per call): a conditional in the slot scan counts the
  branch its slot table selects; one whose branch depends on data would be
  bounded (``_min``: its cheapest branch, ``_max``: its costliest). A point
  compiled before those figures existed has only the static bytes (each
  instruction once): ``per_step`` is then False and both figures are the
  static one.
  """
  gib, mib = 1 << 30, 1 << 20
  m = compiled["memory_per_chip"]
  peak = peak_bytes(compiled)
  found = compiled["collectives"].values()
  per_step = all("bytes_min" in x for x in found)
  comm = {bound: sum(x[f"bytes_{bound}" if per_step else "bytes"] for x in found)
          for bound in ("min", "max")}
  kinds = ", ".join(f"{k} x{v['count']}" for k, v in compiled["collectives"].items()
                    if v["count"])
  model = prediction["collective_bytes"]
  return {
      "model": name, "topology": topology, "strategy": strategy,
      "chips_used": compiled["devices_used"], "params_M": round(compiled["num_params"] / 1e6, 1),
      "peak_GiB": peak / gib, "model_peak_GiB": prediction["peak_bytes"] / gib,
      "peak_ratio": peak / prediction["peak_bytes"],
      "model_activations": "compiled" if calibrated else "shapes",
      "shapes_peak_GiB": shapes["peak_bytes"] / gib, "shapes_peak_ratio": peak / shapes["peak_bytes"],
      "peak_from": "buffer assignment" if "hbm_bytes" in m else "XLA's estimate",
      "estimate_peak_GiB": m["peak_bytes"] / gib, "vmem_GiB": m.get("vmem_bytes", 0) / gib,
      "hbm_by_kind_MiB": {k: v / mib for k, v in m.get("hbm_by_kind", {}).items()},
      "hbm_temp_large_MiB": [r["bytes"] / mib for r in m.get("hbm_temp_ranges", [])],
      "hbm_temp_arrays_MiB": m["hbm_temp_arrays_bytes"] / mib if "hbm_tuple_tables" in m else None,
      "hbm_tuple_tables": m.get("hbm_tuple_tables"),
      "hbm_live_peak_MiB": (m["hbm_temp_live_peak"]["bytes"] / mib
                            if m.get("hbm_temp_live_peak") else None),
      "hbm_live_peak_values": [f"{v['bytes'] / mib:.2f} MiB {v['value'].split()[0]}"
                               for v in (m.get("hbm_temp_live_peak") or {}).get("values", [])],
      "argument_GiB": m["argument_bytes"] / gib, "temp_GiB": m["temp_bytes"] / gib,
      "fits": compiled["fits"],
      "model_recompute_GiB": prediction["recompute_bytes"] / gib,
      "static_collective_MiB": sum(x["bytes"] for x in found) / mib, "per_step": per_step,
      "collective_MiB_min": comm["min"] / mib, "collective_MiB_max": comm["max"] / mib,
      "model_collective_MiB": model / mib,
      "model_long_call_collective_MiB": prediction["long_call_collective_bytes"] / mib,
      "long_call_steps": LONG_CALL_STEPS,
      "algorithm_collective_MiB": prediction["algorithm_collective_bytes"] / mib,
      "collective_ratio_min": comm["min"] / model if model else float("nan"),
      "collective_ratio_max": comm["max"] / model if model else float("nan"),
      "collectives": kinds or "none",
      "received_MiB": (sum(x["received_mean"] for x in found) / mib  # The mean chip's.
                       if all("received_mean" in x for x in found) else None),
      "model_terms_MiB": {term: prediction[f"{term}_bytes"] / mib for term in MEMORY_TERMS},
      "by_slot_MiB": {kind: [b / mib for b in per_slot]  # All chips; executed timetables only.
                      for kind, per_slot in (compiled.get("collectives_by_slot") or {}).items()},
      "largest_stage_MiB": max(prediction["stage_param_bytes"]) / mib,
      "stash_MiB": prediction["stash_bytes"] / mib,
      "boundary_MiB": prediction["boundary_bytes"] / mib,
      "stage_padding": (len(prediction["stage_param_bytes"]) * max(prediction["stage_param_bytes"])
                        / sum(prediction["stage_param_bytes"])),
  }


def peak_bytes(compiled: dict) -> int:
  """Per chip: the HBM of the buffer assignment, or XLA's estimate for a point compiled before
  cdpjax-compile read it (`cdpjax.compiled.buffer_assignment`)."""
  m = compiled["memory_per_chip"]
  return m.get("hbm_bytes", m["peak_bytes"])


def peak_line(c, strategy: str, num_stages: int, workload_of) -> tuple[float, float]:
  """``(fixed, per_layer)``: the predicted peak of ``c`` is ``fixed + layers * per_layer``.

  Every memory term of the cost model is linear in the workload's bytes, and
  those are affine in the number of layers: two workloads give the line
  (``workload_of(c)``: the workload of ``c``).
  """
  peaks = {}
  for layers in (num_stages, 2 * num_stages):
    with c.unlocked():
      c.model_kwargs.num_layers = layers
    peaks[layers] = predicted(strategy, c, workload_of(c))["peak_bytes"]
  per_layer = (peaks[2 * num_stages] - peaks[num_stages]) / num_stages
  return peaks[num_stages] - num_stages * per_layer, per_layer


def largest_layers(line, hbm: float, num_stages: int) -> int:
  """The most layers (a multiple of ``J``) whose predicted peak fits ``hbm``."""
  fixed, per_layer = line
  return int((hbm - fixed) // per_layer) // num_stages * num_stages


# The largest-model figures come from the cost model; one of them is checked by a compile.
LARGEST_CHECK = ("cdp+mp", "v5e:16x16")
LARGEST_FROM = "transformer-1b"  # The model whose layer count the largest-model figures vary.


def check_largest(out, name, c, largest, cached_only, calibrated_of) -> dict | None:
  """Compiles ``LARGEST_CHECK``'s strategy at its largest layer count, on its pod.

  The line of `peak_line` comes from 4 and 8 layers; the compiler's temporaries
  grow a little faster than linearly (CDP+MP on v5e:16x16: the line says 32 layers
  fit its 15.75 GiB; calibrated at 32 layers, 16.76 GiB). So the check steps down
  from the line's count, ``J`` layers at a time, until the activations
  calibrated at that depth (``calibrated_of(c)``, None where not compiled) fit,
  and compiles that; ``line_layers`` keeps the line's count.
  """
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  strategy, topology = LARGEST_CHECK
  line_layers = layers = next(r["largest_layers"] for r in largest
                              if r["strategy"] == strategy and r["topology"] == topology)
  chip = aot.CHIP_HBM_BYTES[aot.parse_topology(topology)[0]]
  c = c.copy_and_resolve_references()
  with c.unlocked():
    c.num_replicas = aot.parse_topology(topology)[1] // c.num_stages
  while True:
    with c.unlocked():
      c.model_kwargs.num_layers = layers
    calibrated = calibrated_of(c)
    if calibrated is None:
      return None
    peak = predicted(strategy, c, calibrated)["peak_bytes"]
    if peak <= chip or layers <= c.num_stages:
      break
    layers -= c.num_stages
  compiled = compile_point(out, f"{name}-{layers}layers", c, strategy, topology, cached_only)
  if compiled is None:
    return None
  found = {"strategy": strategy, "topology": topology, "layers": layers,
           "line_layers": line_layers, "predicted_peak_GiB": peak / (1 << 30),
           "hbm_GiB": chip / (1 << 30)}
  if "refused" in compiled:  # E.g. the compiler's own "does not fit".
    return {**found, "fits": False, "why": compiled["refused"]}
  return {**found, "params_B": round(compiled["num_params"] / 1e9, 2),
          "compiled_peak_GiB": peak_bytes(compiled) / (1 << 30), "fits": compiled["fits"]}


def print_table(rows):
  columns = ("model", "topology", "strategy", "chips_used", "peak_GiB", "model_peak_GiB",
             "peak_ratio", "collective_MiB_min", "collective_MiB_max", "model_collective_MiB",
             "collective_ratio_min", "collective_ratio_max")
  print(" | ".join(columns))
  for r in rows:
    print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in columns))


def main(argv=None):
  p = _common.parser("tpu_plan", __doc__)
  p.add_argument("--strategies", nargs="+", choices=tuple(STRATEGIES), default=tuple(STRATEGIES))
  p.add_argument("--models", nargs="+", help="Models of the plan to compile (default: all): "
                 + ", ".join(entry[0] for plan in PLANS.values() for entry in plan))
  p.add_argument("--cached_only", action="store_true",
                 help="Tabulate the points compiled before (in --results_dir); compile no "
                 "model (the reduce-scatter check's four small programs still compile).")
  args = p.parse_args(argv)
  out = _common.results_dir(args)
  plan = "quick" if args.quick else "full"
  entries = [e for e in PLANS[plan] if not args.models or e[0] in args.models]
  if not entries:
    raise SystemExit(f"No model of the {plan} plan among --models {args.models}.")
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  aot.quiet_libtpu(entries[0][4])  # Before JAX starts.
  # Each point cuts the model into stages by FLOPs, compiling its units on the CPU: once.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "jax_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  rows, largest, missing, refused, workloads, checked = [], [], [], [], {}, None
  calibrated_workloads = {}

  def measured(name, c, strategy, topology, hbm_only=False):
    """The workload of ``c`` with the compiler's activation terms (None if not calibrated)."""
    executed, pad = STRATEGIES[strategy][1] != "data", stage_pad(strategy, c)
    key = (name, topology, c.parallelism, pad, c.keep_activations, c.stages_by, hbm_only)
    if key not in calibrated_workloads:
      found = calibration(out, name, c, topology, executed, pad, args.cached_only, hbm_only)
      calibrated_workloads[key] = found and workload(c, executed, pad, found)
      if not found:
        missing.append(f"{name} calibration for {strategy} {topology}"
                       + (" with every buffer in HBM" if hbm_only else ""))
    return calibrated_workloads[key]

  def depth_calibrated(strategy, topology):
    """The workload of a ``LARGEST_FROM`` config with its activations compiled at its depth."""
    return lambda c: measured(f"{LARGEST_FROM}-{c.model_kwargs.num_layers}layers", c, strategy,
                              topology)

  def line_workload(strategy, topology):
    calibrated = depth_calibrated(strategy, topology)
    return lambda c: calibrated(c) or workload(c, STRATEGIES[strategy][1] != "data",
                                               stage_pad(strategy, c))

  for name, path, overrides, model_kwargs, pod in entries:
    chips = aot.parse_topology(pod)[1]
    for strategy in args.strategies:
      topology = pod
      c = point_config(path, overrides, model_kwargs, strategy, chips, NUM_STAGES[plan])
      if strategy.endswith(BY_PARAMS) and "flops" != point_config(
          path, overrides, model_kwargs, base(strategy), chips, NUM_STAGES[plan]).stages_by:
        continue  # Cut by FLOPs only: the ResNets. The transformers' layers are equal.
      if name == LARGEST_FROM:  # From the cost model, its activations compiled on each chip.
        for other in ("v5e:16x16", "v5p:8x8x4"):
          line = peak_line(c.copy_and_resolve_references(), strategy, NUM_STAGES[plan],
                           line_workload(strategy, other))
          hbm = aot.CHIP_HBM_BYTES[aot.parse_topology(other)[0]]
          layers = largest_layers(line, hbm, NUM_STAGES[plan])
          per_layer_params = 12 * c.model_kwargs.d_model ** 2  # Attention 4 d^2, MLP 8 d^2.
          largest.append({"strategy": strategy, "topology": other, "largest_layers": layers,
                          "d_model": c.model_kwargs.d_model,
                          "params_B": round(layers * per_layer_params / 1e9, 2),
                          "predicted_GiB_per_layer": line[1] / (1 << 30)})
      if name == LARGEST_FROM and strategy == LARGEST_CHECK[0]:
        checked = check_largest(out, name, c, largest, args.cached_only,
                                depth_calibrated(strategy, LARGEST_CHECK[1]))
        if checked is None:
          missing.append(f"{name} {strategy} {LARGEST_CHECK[1]} at its largest size")
      compiled = compile_point(out, name, c, strategy, topology, args.cached_only)
      if compiled is None:
        missing.append(f"{name} {strategy} {topology}")
        continue
      if "refused" in compiled:
        refused.append({"point": f"{name} {strategy} {topology}", "why": compiled["refused"]})
        continue
      pad = stage_pad(strategy, c)
      key = (name, c.parallelism, pad, c.keep_activations, c.stages_by)
      if key not in workloads:
        workloads[key] = workload(c, STRATEGIES[strategy][1] != "data", pad)
      shapes = predicted(strategy, c, workloads[key])
      calibrated = measured(name, c, strategy, topology)
      rows.append(row(name, strategy, topology, compiled,
                      predicted(strategy, c, calibrated) if calibrated else shapes, shapes,
                      bool(calibrated)))
      if strategy in HBM_ONLY.get(name, ()):
        in_hbm = compile_point(out, name, c, strategy, topology, args.cached_only, hbm_only=True)
        if in_hbm is None:
          missing.append(f"{name} {strategy} {topology} with every buffer in HBM")
        else:
          rows[-1]["hbm_only_GiB"] = peak_bytes(in_hbm) / (1 << 30)
          in_hbm_model = measured(name, c, strategy, topology, hbm_only=True)
          if in_hbm_model:  # The cost model, its activations compiled with every buffer in HBM.
            rows[-1]["hbm_only_model_GiB"] = (predicted(strategy, c, in_hbm_model)["peak_bytes"]
                                              / (1 << 30))
      print(f"{name} {strategy} {topology}: compiled", flush=True)
  lowering, placement = reduce_scatter_lowering(), conditional_placement()
  result = {"rows": rows, "largest_transformer": largest, "largest_checked": checked,
            "not_compiled": missing, "refused": refused, "reduce_scatter_lowering": lowering,
            "conditional_placement": placement, "hbm_source": aot.HBM_SOURCE}
  _common.write_json(out / "tpu_plan.json", result)
  print_table(rows)
  for r in lowering:
    print(f"psum_scatter of {r['operand']} per chip over {r['chips']} chips ({r['topology']}): "
          f"{r['compiled']}")
  for r in placement:
    print(f"a stage {r['stage']} ({r['topology']}): "
          f"{'HBM' if r['stage_in_hbm'] else 'on chip'} (HBM arrays {r['hbm_temp_arrays_MiB']:.2f} "
          f"MiB, VMEM {r['vmem_MiB']:.2f} MiB)")
  if missing:
    print("not compiled (a run without --cached_only compiles what is missing):",
          "; ".join(missing))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
