"""CDP with ZeRO: the cyclic schedule executed on the ``data`` axis, model states sharded by stage.

The stacked-block ``ResidualMLP`` is cut into ``J = N`` stages: stage ``j`` is
blocks ``j*k .. (j+1)*k - 1`` (``k = num_blocks / N``), plus ``embed`` for stage
0 and ``head`` for stage ``J-1``. Every stage is stored as one flat float32
buffer of ``P`` elements with one layout (``k`` blocks, an embed region, a head
region; regions a stage lacks are zeros), so stages travel and update alike and
one stage function serves all. Worker ``r`` owns stage ``J-1-r``: it
alone holds that stage's ``theta_t``, its stale versions and its optimizer
state (rows of ``[N, P]`` state arrays are in owner order).

**cyclic.** Worker ``i`` runs its micro-batch through all stages starting
``2J/N = 2`` slots after worker ``i-1``: the forward of stage ``j`` at slot
``2i + j``, its backward at ``2i + 2J-1-j`` (DESIGN.md section 1). Every
message is one ``lax.ppermute`` of a ``P``-element buffer:

- The buffer a worker uses for stage ``j`` goes on to worker ``i+1``, which needs
  the same stage, in the same direction, 2 slots later (the ring). The owner
  uses its own copy, and sends the version the rule prescribes to worker 0 and
  to any worker whose version differs from its predecessor's. With owner
  ``J-1-j``, ``cdp-v2``'s switch from stale to fresh happens exactly at the
  owner, so the owner only ever injects into worker 0. Forward and backward
  each circulate the stage once: no worker keeps a stage from its forward to
  its backward (ZeRO-3 gathers twice for the same reason).
- A stage's gradient is accumulated along two ring chains as backwards run:
  workers ``0..o`` end at the owner ``o``; workers ``o+1..N-1`` end at worker
  ``N-1``, which sends the sum to the owner.
- Each owner then applies the optimizer to its stage. The step is flushed: it
  starts from ``theta_t`` and ends with ``theta_{t+1}``, so one call is one
  training step of the engine, with the same numbers.

The compiled cyclic step holds collective-permutes only. The loss comes out
per worker (``loss_per_worker``, sharded); ``loss`` is its mean, computed
outside the step. Each backward recomputes its stage forward from the stage
input it stashed.

**zero3.** The baseline with the same state: ZeRO-3 (FSDP) data parallelism in
lockstep. Each stage's buffers are sharded ``P/N`` per worker; a stage is
all-gathered at use in the forward and again in the backward, and its gradient
is reduce-scattered. Rule ``dp`` always runs this way (the cyclic timeline has
no causal ``dp``).

The optimizer sees each stage as one flat vector, so it must act elementwise
(sgd, momentum, adam, adamw without masks): a transform that needs a global
view, such as ``clip_by_global_norm``, would need an all-reduce.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import schedule
from cdpjax.models.residual_mlp import block_apply, embed_apply, head_apply

AXIS = "data"
SCHEDULES = ("cyclic", "zero3")


class StageLayout(NamedTuple):
  """Where each parameter leaf lives in a flat stage buffer (static, hashable).

  Every stage buffer has the same layout: its ``k`` blocks, then an ``embed``
  region (filled in stage 0 only) and a ``head`` region (stage ``J-1`` only),
  zero elsewhere. One stage function thus serves every stage.

  Attributes:
    num_stages: ``J`` (equal to the number of workers ``N``).
    num_blocks: blocks of the model, ``J * k``.
    width: the residual stream width.
    stage_size: ``P``, the buffer length, padded to a multiple of ``N`` so
      ZeRO-3 can split it evenly.
    segments: ``(unit, path, shape, offset)`` per leaf; ``unit`` is ``"embed"``,
      ``"head"`` or the block's index ``m`` within the stage (block ``j*k + m``).
  """
  num_stages: int
  num_blocks: int
  width: int
  stage_size: int
  segments: tuple

  def owner(self, stage: int) -> int:
    """The worker that owns ``stage``: worker ``J-1-j`` (row ``J-1-j`` of the state)."""
    return self.num_stages - 1 - stage

  def unit_name(self, stage: int, unit) -> str | None:
    """The flax name of ``unit`` in ``stage``, or None where its region is padding."""
    if unit == "embed":
      return "embed" if stage == 0 else None
    if unit == "head":
      return "head" if stage == self.num_stages - 1 else None
    return f"block_{stage * self.num_blocks // self.num_stages + unit}"


@flax.struct.dataclass
class ZeroState:
  """The sharded training state (a pytree of arrays; ``layout`` is static).

  Attributes:
    step: int32 scalar, updates applied so far.
    params: ``[N, P]`` float32, ``theta_t``; row ``r`` is the stage worker ``r``
      owns (stage ``N-1-r``).
    stale_params: ``(theta_{t-1}, ..., theta_{t-D})``, each ``[N, P]``.
    opt_state: ``vmap(tx.init)`` of ``params``: every leaf has a leading ``N``.
    layout: the ``StageLayout`` (not a pytree leaf).
  """
  step: jax.Array
  params: jax.Array
  stale_params: tuple
  opt_state: Any
  layout: StageLayout = flax.struct.field(pytree_node=False)


def stage_layout(params, num_workers: int, num_blocks: int) -> StageLayout:
  """The flat layout of a ``ResidualMLP`` params dict cut into ``J = N`` stages."""
  _check_num_blocks(num_workers, num_blocks)
  expected = {"embed", "head"} | {f"block_{b}" for b in range(num_blocks)}
  if set(params) != expected:
    raise ValueError(
        f"params has units {sorted(params)}, expected embed, block_0..block_{num_blocks - 1}, "
        "head: pass ResidualMLP(num_blocks=num_blocks).init(...)['params'].")
  k = num_blocks // num_workers
  units = [(m, f"block_{m}") for m in range(k)] + [("embed", "embed"), ("head", "head")]
  segments, offset = [], 0
  for unit, name in units:
    for path, leaf in jax.tree_util.tree_flatten_with_path(params[name])[0]:
      segments.append((unit, tuple(p.key for p in path), tuple(np.shape(leaf)), offset))
      offset += int(np.size(leaf))
  size = -(-offset // num_workers) * num_workers
  width = int(np.shape(params["embed"]["bias"])[0])
  return StageLayout(num_workers, num_blocks, width, size, tuple(segments))


def _pack(params, layout: StageLayout) -> np.ndarray:
  """``[N, P]`` float32 rows in owner order (row ``r`` = stage ``N-1-r``)."""
  rows = np.zeros((layout.num_stages, layout.stage_size), np.float32)
  for j in range(layout.num_stages):
    for unit, keys, shape, offset in layout.segments:
      name = layout.unit_name(j, unit)
      if name is not None:
        leaf = params[name]
        for key in keys:
          leaf = leaf[key]
        rows[layout.owner(j), offset:offset + int(np.prod(shape))] = np.ravel(leaf)
  return rows


def _unpack(flat, layout: StageLayout) -> dict:
  """``{unit: params}`` of one stage buffer (padding regions included)."""
  units: dict = {}
  for unit, keys, shape, offset in layout.segments:
    node = units.setdefault(unit, {})
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = flat[offset:offset + int(np.prod(shape))].reshape(shape)
  return units


def current_params(state: ZeroState) -> dict:
  """``theta_t`` as the flax ``params`` dict (for evaluation and checkpoints)."""
  layout = state.layout
  rows = np.asarray(jax.device_get(_replicated(state.params)))
  out = {}
  for j in range(layout.num_stages):
    for unit, unit_params in _unpack(rows[layout.owner(j)], layout).items():
      name = layout.unit_name(j, unit)
      if name is not None:
        out[name] = unit_params
  return out


def _replicated(x):
  """``x`` copied to every device of its mesh (readable on every process), if on a mesh."""
  if isinstance(getattr(x, "sharding", None), NamedSharding):
    return jax.device_put(x, NamedSharding(x.sharding.mesh, P()))
  return x


def _place(x, dtype, sharding: NamedSharding) -> jax.Array:
  """A host array or a global ``jax.Array`` as ``dtype`` on ``sharding``."""
  x = x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)
  return jax.device_put(x, sharding)


def _delays(rule, num_workers: int) -> np.ndarray:
  """The ``(N, N)`` delay matrix of ``rule``; CDP-ZeRO has one stage per worker."""
  if not isinstance(rule, str) and np.shape(rule) != (num_workers, num_workers):
    raise ValueError(
        f"Delay matrix has shape {np.shape(rule)}; CDP-ZeRO needs (N, J) = ({num_workers}, "
        f"{num_workers}): one stage per worker. Use J = N stages, or the replicated engine "
        "(cdpjax.engine) for N != J.")
  return schedule.resolve(rule, num_workers, num_workers)


def _check_num_blocks(num_workers: int, num_blocks: int) -> None:
  if int(num_blocks) != num_blocks or num_blocks < 1 or num_blocks % num_workers:
    raise ValueError(
        f"num_blocks={num_blocks} is not a positive multiple of the {num_workers} workers: "
        f"CDP-ZeRO cuts the model into J = N = {num_workers} stages of num_blocks/N blocks "
        "(worker r owns stage N-1-r). Use a model with k * num_workers blocks.")


def init_state(params, tx: optax.GradientTransformation, *, rule, mesh: Mesh,
               num_blocks: int) -> ZeroState:
  """Builds the sharded state at ``t = 0``; every stale version is ``theta_0``.

  Args:
    params: the ``ResidualMLP`` flax ``params`` dict (``embed``, ``block_i``, ``head``).
    tx: an elementwise optax optimizer.
    rule: a name of ``schedule.RULES`` or an ``(N, N)`` delay matrix.
    mesh: a mesh with axis ``data`` of size ``N``.
    num_blocks: the model's number of blocks, a multiple of ``N``.
  """
  num_workers = _num_workers(mesh)
  layout = stage_layout(params, num_workers, num_blocks)
  num_stale = int(_delays(rule, num_workers).max(initial=0))
  rows = jnp.asarray(_pack(params, layout))
  state = ZeroState(
      step=jnp.zeros((), jnp.int32), params=rows,
      stale_params=tuple(jnp.array(rows) for _ in range(num_stale)),
      opt_state=jax.vmap(tx.init)(rows), layout=layout)
  return jax.device_put(state, _shardings(state, mesh, "cyclic"))


def _num_workers(mesh: Mesh) -> int:
  if AXIS not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {tuple(mesh.axis_names)} but no axis {AXIS!r}: build it with "
        f"jax.make_mesh((num_workers,), ({AXIS!r},)).")
  return int(mesh.shape[AXIS])


def _specs(state: ZeroState, schedule_name: str):
  """PartitionSpecs of the state: rows per worker (cyclic) or columns (zero3)."""
  row_shape = np.shape(state.params)

  def spec(leaf):
    if np.ndim(leaf) == 0:
      return P()
    if schedule_name == "cyclic":
      return P(AXIS)
    return P(None, AXIS) if np.shape(leaf) == row_shape else P()
  return jax.tree.map(spec, state)


def _shardings(state, mesh, schedule_name):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), _specs(state, schedule_name),
                      is_leaf=lambda x: isinstance(x, P))


# ---------------------------------------------------------------------------
# Stage functions.

def _where(flag, on_true: Callable, on_false):
  """``on_true()`` where ``flag``; a Python bool flag skips the unused side."""
  if isinstance(flag, bool):
    return on_true() if flag else on_false
  return jnp.where(flag, on_true(), on_false)


def _stage_apply(layout: StageLayout, flat, h, x, y, first, last):
  """One stage: ``(h_out, loss)``; embed where ``first``, head and loss where ``last``.

  ``first`` and ``last`` are Python bools (static stage) or traced booleans
  (the cyclic step, where each worker runs a different stage); then embed and
  head run on every stage and are selected, a small cost next to the blocks.
  """
  units = _unpack(flat, layout)
  h = _where(first, lambda: embed_apply(units["embed"], x), h)
  for m in range(layout.num_blocks // layout.num_stages):
    h = block_apply(units[m], h)
  loss = _where(last, lambda: optax.softmax_cross_entropy_with_integer_labels(
      head_apply(units["head"], h), y).mean(), jnp.zeros((), jnp.float32))
  return h, loss


def _stage_vjp(layout, flat, h_in, x, y, cot_h, first, last):
  """``(grad_flat, cot_h_in)``: the backward of one stage, recomputing its forward."""
  _, vjp = jax.vjp(lambda p, h: _stage_apply(layout, p, h, x, y, first, last), flat, h_in)
  return vjp((cot_h, jnp.ones((), jnp.float32)))


# ---------------------------------------------------------------------------
# The cyclic plan.

class Transfer(NamedTuple):
  """One point-to-point message of the cyclic step: a whole stage buffer.

  Attributes:
    slot: the message is delivered before this slot's compute.
    kind: ``"param"`` or ``"grad"``.
    src: sending worker.
    dst: receiving worker.
    stage: ``j``.
    route: ``"ring"`` (from ``dst - 1``, which used or summed the buffer 2 slots
      earlier), ``"owner"`` (a parameter version from the owner) or ``"final"``
      (worker ``N-1`` hands the tail chain's sum to the owner).
    delay: for ``"owner"`` messages, which version ``theta_{t - delay}`` is sent.
  """
  slot: int
  kind: str
  src: int
  dst: int
  stage: int
  route: str
  delay: int


def work_slot(worker: int, phase: int) -> int:
  """Slot of a worker's ``phase``-th stage op (``o_i = i * 2J/N = 2i`` for ``N = J``)."""
  return 2 * worker + phase


def cyclic_transfers(delays) -> list[Transfer]:
  """Every message of one cyclic step for an ``(N, N)`` delay matrix, by slot."""
  delays = np.asarray(delays)
  num_workers, num_stages = delays.shape
  owner = [num_stages - 1 - j for j in range(num_stages)]
  out = []
  for i in range(num_workers):
    for phase in range(2 * num_stages):
      s = work_slot(i, phase)
      j = phase if phase < num_stages else 2 * num_stages - 1 - phase
      d, o = int(delays[i, j]), owner[j]
      if i != o and i > 0 and delays[i - 1, j] == d:
        out.append(Transfer(s, "param", i - 1, i, j, "ring", d))
      elif i != o:
        out.append(Transfer(s, "param", o, i, j, "owner", d))
      if phase >= num_stages:
        if 1 <= i <= o or i >= o + 2:
          out.append(Transfer(s, "grad", i - 1, i, j, "ring", 0))
        if i == num_workers - 1 and o != i:
          out.append(Transfer(s + 1, "grad", i, o, j, "final", 0))
  return sorted(out)


def _permutations(transfers) -> list[list[Transfer]]:
  """Splits same-operand transfers into groups with distinct sources and targets."""
  groups: list[list[Transfer]] = []
  for t in transfers:
    for g in groups:
      if all(t.src != u.src and t.dst != u.dst for u in g):
        g.append(t)
        break
    else:
      groups.append([t])
  return groups


def slot_traffic(schedule_name: str, num_workers: int, stage_bytes: int,
                 rule="cdp-v2") -> dict[str, int]:
  """Bytes received per slot of one step, from the plan (balance figures).

  A cyclic transfer moves one stage buffer (``stage_bytes``); a ZeRO-3
  all-gather or reduce-scatter of a stage moves ``(N-1)/N`` of it per device,
  the gathers at the stage's forward and backward slots, the reduce-scatter at
  its backward slot.

  Returns:
    ``total_bytes`` (all devices), ``max_slot_bytes`` (all devices, busiest
    slot), ``max_slot_bytes_per_device`` (busiest device and slot) and
    ``num_slots``.
  """
  delays = _delays(rule, num_workers)
  inbound = defaultdict(int)  # (slot, device) -> bytes.
  if schedule_name == "cyclic":
    for t in cyclic_transfers(delays):
      inbound[t.slot, t.dst] += stage_bytes
  else:
    share = stage_bytes * (num_workers - 1) // num_workers
    for j in range(num_workers):
      gathers = len(set(delays[:, j].tolist())) * share
      for device in range(num_workers):
        inbound[j, device] += gathers
        inbound[2 * num_workers - 1 - j, device] += gathers + share
  per_slot = defaultdict(int)
  for (slot, _), size in inbound.items():
    per_slot[slot] += size
  return {"total_bytes": sum(per_slot.values()),
          "max_slot_bytes": max(per_slot.values(), default=0),
          "max_slot_bytes_per_device": max(inbound.values(), default=0),
          "num_slots": 1 + max(per_slot, default=-1)}


def _table(values, me):
  """This worker's entry of a static per-worker table."""
  return jnp.asarray(np.asarray(values, np.int32))[me]


def _cyclic_body(tx, delays, layout: StageLayout):
  """The per-worker cyclic step, for ``shard_map`` over ``data``."""
  num_workers = num_stages = layout.num_stages
  by_slot = defaultdict(list)
  for t in cyclic_transfers(delays):
    by_slot[t.slot].append(t)
  last_work = work_slot(num_workers - 1, 2 * num_stages - 1)
  num_slots = 1 + max(max(by_slot, default=0), last_work)
  work = [[None] * num_workers for _ in range(num_slots)]  # (stage, is_backward) or None.
  for i in range(num_workers):
    for phase in range(2 * num_stages):
      j = phase if phase < num_stages else 2 * num_stages - 1 - phase
      work[work_slot(i, phase)][i] = (j, phase >= num_stages)

  def body(state: ZeroState, batch):
    me = jax.lax.axis_index(AXIS)
    x, y = batch["image"], batch["label"]
    versions = jnp.stack([state.params[0]] + [v[0] for v in state.stale_params])  # [V, P]
    zeros_p = jnp.zeros((layout.stage_size,), jnp.float32)
    h = cot = jnp.zeros((x.shape[0], layout.width), jnp.float32)
    stash = jnp.zeros((num_stages,) + h.shape, jnp.float32)  # Each stage's input.
    loss, acc = jnp.zeros((), jnp.float32), zeros_p  # acc: the owned stage's gradient sum.
    used, partial = {}, {}  # Per slot: the stage buffer used, the gradient sum sent on.
    # Owner sends depend on ``clock`` (0 * a value that changes every slot; XLA
    # cannot fold it, 0 * nan is not 0): else CSE merges a backward's send into
    # the forward's, and the receiver holds the stage in between.
    clock = jnp.zeros((), jnp.float32)

    def idle(flat, h, cot, stash, loss, j):
      return h, cot, stash, loss, zeros_p

    def forward(flat, h, cot, stash, loss, j):
      stash = jax.lax.dynamic_update_index_in_dim(stash, h, j, 0)
      h, stage_loss = _stage_apply(layout, flat, h, x, y, j == 0, j == num_stages - 1)
      return h, cot, stash, jnp.where(j == num_stages - 1, stage_loss, loss), zeros_p

    def backward(flat, h, cot, stash, loss, j):
      h_in = jax.lax.dynamic_index_in_dim(stash, j, 0, keepdims=False)
      grad, cot = _stage_vjp(layout, flat, h_in, x, y, cot, j == 0, j == num_stages - 1)
      return h, cot, stash, loss, grad

    for s in range(num_slots):
      cur, chain_in = zeros_p, zeros_p
      groups = defaultdict(list)  # Transfers with the same operand.
      for t in by_slot[s]:
        groups[(t.kind, t.route, t.delay if t.route == "owner" else 0)].append(t)
      for (kind, route, delay), group in sorted(groups.items()):
        operand = {("param", "ring"): lambda: used[s - 2],
                   ("param", "owner"): lambda: versions[delay] + 0 * clock,
                   ("grad", "ring"): lambda: partial[s - 2],
                   ("grad", "final"): lambda: partial[s - 1]}[(kind, route)]()
        for perm in _permutations(group):
          received = jax.lax.ppermute(operand, AXIS, [(t.src, t.dst) for t in perm])
          if kind == "param":
            is_dst = _table([any(t.dst == i for t in perm) for i in range(num_workers)], me)
            cur = jnp.where(is_dst == 1, received, cur)
          elif route == "ring":
            chain_in = chain_in + received  # Zeros on workers that are not targets.
          else:
            acc = acc + received
      row = work[s]
      if not any(row):
        continue
      local = [w is not None and layout.owner(w[0]) == i for i, w in enumerate(row)]
      local_delay = [int(delays[i, w[0]]) if w else 0 for i, w in enumerate(row)]
      cur = jnp.where(_table(local, me) == 1, versions[_table(local_delay, me)], cur)
      used[s] = cur
      codes = [0 if w is None else 1 + int(w[1]) for w in row]
      present = sorted(set(codes))
      branches = [(idle, forward, backward)[c] for c in present]
      stage = _table([w[0] if w else 0 for w in row], me)
      h, cot, stash, loss, grad = jax.lax.switch(
          _table([present.index(c) for c in codes], me), branches, cur, h, cot, stash, loss,
          stage)
      partial[s] = chain_in + grad
      clock = h[0, 0] + cot[0, 0]
      owns = [w is not None and w[1] and layout.owner(w[0]) == i for i, w in enumerate(row)]
      acc = jnp.where(_table(owns, me) == 1, acc + partial[s], acc)

    updates, opt_state = jax.vmap(tx.update)((acc / num_workers)[None], state.opt_state,
                                             state.params)
    return _advance(state, updates, opt_state), loss[None]

  return body


def _advance(state: ZeroState, updates, opt_state) -> ZeroState:
  """``theta_{t+1} = theta_t + updates``; ``theta_t`` becomes the newest stale version."""
  stale = ((state.params,) + tuple(state.stale_params))[:len(state.stale_params)]
  return state.replace(step=state.step + 1, params=state.params + updates,
                       stale_params=stale, opt_state=opt_state)


def _zero3_body(tx, delays, layout: StageLayout):
  """The per-worker ZeRO-3 step (lockstep DP, stages gathered at use), for ``shard_map``."""
  num_workers = num_stages = layout.num_stages

  def body(state: ZeroState, batch):
    me = jax.lax.axis_index(AXIS)
    x, y = batch["image"], batch["label"]

    def gather(versions, j, after=None):
      """This worker's view of stage ``j``: every version it may read, gathered.

      ``after`` adds ``0 * after`` to the shards: a data dependence XLA cannot
      fold (``0 * nan`` is not 0), so a backward gathers again at use instead of
      sharing the forward's gather (CSE; an optimization barrier is expanded
      before CSE on CPU).
      """
      column = sorted(set(delays[:, j].tolist()))
      shard = lambda v: versions[v][layout.owner(j)]
      if after is not None:
        shard = lambda v, shard=shard: shard(v) + 0 * after
      full = {v: jax.lax.all_gather(shard(v), AXIS, tiled=True) for v in column}
      view = full[column[0]]
      for v in column[1:]:
        view = jnp.where(_table(delays[:, j], me) == v, full[v], view)
      return view

    versions = (state.params,) + tuple(state.stale_params)  # Each [N, P/N].
    h = jnp.zeros((x.shape[0], layout.width), jnp.float32)
    stash = []
    for j in range(num_stages):
      stash.append(h)
      h, loss = _stage_apply(layout, gather(versions, j), h, x, y, j == 0, j == num_stages - 1)
    cot = jnp.zeros_like(h)
    grads = [None] * num_workers
    for j in reversed(range(num_stages)):
      after = loss if j == num_stages - 1 else cot[0, 0]
      grad, cot = _stage_vjp(layout, gather(versions, j, after), stash[j], x, y, cot, j == 0,
                             j == num_stages - 1)
      grads[layout.owner(j)] = jax.lax.psum_scatter(grad, AXIS, tiled=True) / num_workers
    updates, opt_state = jax.vmap(tx.update)(jnp.stack(grads), state.opt_state, state.params)
    return _advance(state, updates, opt_state), loss[None]

  return body


@dataclasses.dataclass(frozen=True)
class ZeroTrainStep:
  """``state, metrics = step(state, batch)``; ``lower(state, batch)`` for HLO and memory.

  ``metrics``: ``loss_per_worker`` ``[N]`` (an output of the compiled step) and
  ``loss``, its mean, computed outside the step so the step needs no all-reduce.
  Both are replicated on every device, so every process can read them.
  """
  run: Callable
  prepare: Callable
  schedule: str

  def __call__(self, state, batch):
    state, loss_per_worker = self.run(*self.prepare(state, batch))
    loss_per_worker = _replicated(loss_per_worker)
    return state, {"loss": jnp.mean(loss_per_worker), "loss_per_worker": loss_per_worker}

  def lower(self, state, batch):
    return self.run.lower(*self.prepare(state, batch))


def make_train_step(tx: optax.GradientTransformation, *, rule, mesh: Mesh, num_blocks: int,
                    schedule: str = "cyclic", donate: bool = True) -> ZeroTrainStep:
  """Builds the CDP-ZeRO (``cyclic``) or ZeRO-3 (``zero3``) step of the digits ``ResidualMLP``.

  Args:
    tx: an elementwise optax optimizer (it sees each stage as one flat vector).
    rule: a name of ``schedule.RULES`` or an ``(N, N)`` delay matrix; ``dp``
      always runs the ``zero3`` schedule.
    mesh: a mesh with axis ``data`` of size ``N``; the model is cut into
      ``J = N`` stages, worker ``r`` owning stage ``N-1-r``.
    num_blocks: the model's blocks, a multiple of ``N``.
    schedule: ``"cyclic"`` (point-to-point only) or ``"zero3"``.
    donate: donate the input state's buffers.

  Returns:
    A ``ZeroTrainStep``. ``batch`` is ``{"image": [N*b, 8, 8, 1] float32,
    "label": [N*b] int32}``, host arrays or global ``jax.Array``s; worker ``i``
    gets rows ``i*b:(i+1)*b`` (with several processes, pass a global array
    sharded over ``data``, each process holding its workers' rows).
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"Unknown schedule {schedule!r}: use one of {SCHEDULES}.")
  num_workers = _num_workers(mesh)
  _check_num_blocks(num_workers, num_blocks)
  delays = _delays(rule, num_workers)
  name = "zero3" if isinstance(rule, str) and rule == "dp" else schedule
  make_body = _cyclic_body if name == "cyclic" else _zero3_body
  batch_specs = {"image": P(AXIS), "label": P(AXIS)}

  def run(state: ZeroState, batch):  # The layout is static, so specs are built while tracing.
    specs = _specs(state, name)
    return jax.shard_map(
        make_body(tx, delays, state.layout), mesh=mesh, in_specs=(specs, batch_specs),
        out_specs=(specs, P(AXIS)), check_vma=False)(state, batch)

  def prepare(state: ZeroState, batch):
    layout = state.layout
    if layout.num_stages != num_workers or layout.num_blocks != num_blocks:
      raise ValueError(
          f"The state was built for N = {layout.num_stages} workers and {layout.num_blocks} "
          f"blocks, the step for {num_workers} and {num_blocks}: build both with the same "
          "mesh and num_blocks.")
    if len(state.stale_params) != delays.max(initial=0):
      raise ValueError(
          f"The state keeps {len(state.stale_params)} stale versions, rule {rule!r} needs "
          f"{delays.max(initial=0)}: build the state with init_state(..., rule={rule!r}).")
    if not isinstance(batch, dict) or set(batch) != {"image", "label"}:
      raise ValueError("batch must be a dict with keys 'image' and 'label'.")
    size = np.shape(batch["label"])[0]
    if size == 0 or size % num_workers or np.shape(batch["image"])[0] != size:
      raise ValueError(
          f"Batch of {np.shape(batch['image'])[0]} images and {size} labels: use "
          f"num_workers * b rows for both ({num_workers} workers; worker i gets rows "
          "i*b:(i+1)*b).")
    sharding = NamedSharding(mesh, P(AXIS))
    batch = {"image": _place(batch["image"], np.float32, sharding),
             "label": _place(batch["label"], np.int32, sharding)}
    return jax.device_put(state, _shardings(state, mesh, name)), batch

  return ZeroTrainStep(run=jax.jit(run, donate_argnums=(0,) if donate else ()),
                       prepare=prepare, schedule=name)
