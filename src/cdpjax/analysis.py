"""A cost model of DP, pipelines, ZeRO and CDP: devices, memory, communication, bubble, staleness.

Everything is derived, not measured: memory from the state each strategy keeps
and from the activation lifetimes on its timeline, communication from the
collectives it issues, priced with the alpha-beta model of Ben-Nun & Hoefler
(2019): a message of ``M`` bytes costs ``alpha + beta * M``; over ``n``
devices a ring all-reduce costs ``2(n-1) alpha + 2(n-1)/n beta M``, a ring
all-gather or reduce-scatter ``(n-1) alpha + (n-1)/n beta M``.

Time is the slot model of ``cdpjax.schedule``: a stage forward or backward of
one micro-batch takes one slot. DP, ZeRO and DP+MP read their activation
lifetimes off ``schedule.timeline`` (in lockstep, or on the cyclic timeline for
a delayed rule). The schedules that cdpjax executes, GPipe, CDP+MP and CDP+ZeRO,
are read off the executors' own slot plan (``cdpjax.executed.plan``): their
events, and for CDP+ZeRO the point-to-point transfers. 1F1B, which cdpjax does
not execute, is a list schedule of its per-device op orders.

Notation: ``N`` workers (= micro-batches per step), ``J`` stages, ``P_j``
parameter bytes of stage ``j`` (``Psi_P = sum P_j``), ``A_j`` activation bytes
stage ``j`` stores for its backward per micro-batch (``Psi_A = sum A_j``), ``k``
optimizer bytes per parameter byte (1 for momentum, 2 for Adam).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, NamedTuple, Sequence

import numpy as np

from cdpjax import schedule
from cdpjax.executed import plan as plan_lib


class Workload(NamedTuple):
  """What one model costs, per stage.

  Attributes:
    stage_param_bytes: ``P_j``, parameter bytes of each stage.
    stage_activation_bytes: ``A_j``, bytes stage ``j`` keeps from its forward
      to its backward, for one micro-batch.
    boundary_bytes: bytes of the tensor stage ``j`` sends to stage ``j+1``
      (and of the cotangent sent back), per micro-batch; ``J - 1`` entries.
    optimizer_factor: ``k``, optimizer-state bytes per parameter byte.
    stage_recompute_bytes: bytes alive only while stage ``j``'s backward runs,
      for one micro-batch: the residuals of its forward, recomputed there (the
      executed timetables), beyond ``A_j``; zeros when nothing is recomputed.
      They add to the per-device activation peak (a pipeline device: its
      stage's; a worker that runs every stage: the largest), not to the
      activations kept between a forward and its backward (means, totals).
    transient_gradient: ``stage_recompute_bytes`` include the gradient the
      stage's backward returns (a compiled calibration measures it so); the
      ZeRO strategies then count no buffer of their own for it.
    input_bytes: a micro-batch's input rows and labels, which a device holds
      for the step (a pipeline device, its pipeline's ``N`` micro-batches).
    message_bytes: bytes of each stage's point-to-point message where
      CDP+ZeRO sends it in a class of like-sized stages
      (`cdpjax.executed.zero.message_classes`); empty: ``P_j``.
  """
  stage_param_bytes: tuple
  stage_activation_bytes: tuple
  boundary_bytes: tuple
  optimizer_factor: float
  stage_recompute_bytes: tuple = ()
  transient_gradient: bool = False
  input_bytes: float = 0.0
  message_bytes: tuple = ()

  @property
  def stage_message_bytes(self) -> tuple:
    return self.message_bytes or self.stage_param_bytes

  @property
  def num_stages(self) -> int:
    return len(self.stage_param_bytes)

  @property
  def param_bytes(self) -> float:
    return float(sum(self.stage_param_bytes))

  @property
  def activation_bytes(self) -> float:
    return float(sum(self.stage_activation_bytes))


def _per_stage(value, num_stages: int, name: str) -> tuple:
  if np.ndim(value) == 0:
    return (float(value) / num_stages,) * num_stages
  if len(value) != num_stages:
    raise ValueError(f"{name} has {len(value)} entries; give one per stage ({num_stages}) "
                     "or a total to split evenly.")
  return tuple(float(v) for v in value)


def workload(param_bytes, activation_bytes, num_stages: int, *, optimizer_factor: float = 1.0,
             boundary_bytes=None, recompute_bytes=0.0, transient_gradient=False,
             input_bytes=0.0, message_bytes=()) -> Workload:
  """A ``Workload`` from totals (split evenly over stages) or per-stage sequences.

  Args:
    param_bytes: ``Psi_P`` or ``[P_0, ..., P_{J-1}]``.
    activation_bytes: ``Psi_A`` (per micro-batch) or ``[A_0, ..., A_{J-1}]``.
    num_stages: ``J``.
    optimizer_factor: ``k`` (0 for plain SGD, 1 for momentum, 2 for Adam).
    boundary_bytes: one number for every stage boundary or ``J - 1`` numbers;
      defaults to ``A_{j+1}`` (a stage stores just its input, as with
      recomputation).
    recompute_bytes: the transient residuals of a stage's forward recomputed
      in its backward, per micro-batch: a total split evenly, or ``J``
      numbers; 0 without recomputation.
    transient_gradient: ``recompute_bytes`` include the backward's gradient
      (`Workload.transient_gradient`).
    input_bytes: a micro-batch's input rows and labels (`Workload.input_bytes`).
    message_bytes: ``J`` numbers, or empty (`Workload.message_bytes`).
  """
  if int(num_stages) != num_stages or num_stages < 1:
    raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}.")
  params = _per_stage(param_bytes, num_stages, "param_bytes")
  acts = _per_stage(activation_bytes, num_stages, "activation_bytes")
  if boundary_bytes is None:
    boundary = acts[1:]
  elif np.ndim(boundary_bytes) == 0:
    boundary = (float(boundary_bytes),) * (num_stages - 1)
  else:
    boundary = tuple(float(b) for b in boundary_bytes)
    if len(boundary) != num_stages - 1:
      raise ValueError(
          f"boundary_bytes has {len(boundary)} entries; need J - 1 = {num_stages - 1}.")
  recompute = _per_stage(recompute_bytes, num_stages, "recompute_bytes")
  messages = _per_stage(message_bytes, num_stages, "message_bytes") if len(message_bytes) else ()
  return Workload(params, acts, boundary, float(optimizer_factor), recompute,
                  bool(transient_gradient), float(input_bytes), messages)


class Network(NamedTuple):
  """Alpha-beta link model: ``alpha`` seconds per message, ``beta`` seconds per byte.

  The defaults (5 us, 100 Gb/s) are illustrative, not measured.
  """
  alpha: float = 5e-6
  beta: float = 8 / 100e9


def p2p_time(nbytes: float, net: Network) -> float:
  return net.alpha + net.beta * nbytes


def all_reduce_time(n: int, nbytes: float, net: Network) -> float:
  """Ring all-reduce of ``nbytes`` over ``n`` devices."""
  return 0.0 if n == 1 else 2 * (n - 1) * net.alpha + 2 * (n - 1) / n * net.beta * nbytes


def all_gather_time(n: int, nbytes: float, net: Network) -> float:
  """Ring all-gather (or reduce-scatter) of a ``nbytes`` buffer over ``n`` devices."""
  return 0.0 if n == 1 else (n - 1) * net.alpha + (n - 1) / n * net.beta * nbytes


class Communication(NamedTuple):
  """One kind of traffic of a strategy, per training step.

  Attributes:
    kind: ``all-reduce``, ``all-gather``, ``reduce-scatter`` or ``p2p``.
    what: ``gradients``, ``parameters`` or ``activations`` (with cotangents).
    group: devices taking part in one operation.
    ops: operations per step on the busiest device.
    payload_bytes: bytes of those operations' results on that device, as the
      compiled HLO counts them (an all-gather's gathered buffer, a
      reduce-scatter's shard, a p2p message).
    sent_bytes: bytes that device sends per step (ring algorithms).
    total_bytes: bytes sent per step over all devices.
    time_s: alpha-beta time of that device's operations, none overlapped.
  """
  kind: str
  what: str
  group: int
  ops: int
  payload_bytes: float
  sent_bytes: float
  total_bytes: float
  time_s: float


class Memory(NamedTuple):
  """Bytes held, per device or summed over devices.

  Attributes:
    params: parameters, stale versions included.
    grads: gradient buffers kept over the step.
    optimizer: optimizer state.
    buffers: transient stage buffers (gathered or received parameters and
      gradient partial sums of ZeRO-2/3 and CDP+ZeRO).
    activations_peak: the most activation bytes alive at once.
    activations_mean: activation bytes alive, averaged over a steady-state step.
    messages: what a pipeline device holds in flight: the permute's result (a
      boundary), and two stash rows, the one a backward reads (copied out for
      the event's switch) and the one a forward writes (the switch's result);
      a ZeRO-3 worker, the cotangent a stage's backward receives; a CDP+ZeRO
      worker, that boundary carry and the stash row a backward reads.
    inputs: the batch rows (inputs and labels) the device holds for the step.
  """
  params: float
  grads: float
  optimizer: float
  buffers: float
  activations_peak: float
  activations_mean: float
  messages: float = 0.0
  inputs: float = 0.0

  @property
  def model_states(self) -> float:
    return self.params + self.grads + self.optimizer + self.buffers

  @property
  def peak(self) -> float:
    return self.model_states + self.activations_peak + self.messages + self.inputs


class Cost(NamedTuple):
  """The derived costs of one strategy.

  Attributes:
    strategy: the name in ``STRATEGIES``.
    devices: devices the strategy needs.
    per_device: memory of the device with the largest peak.
    total: memory summed over devices; ``activations_peak`` is the peak of
      the sum over time (not the sum of per-device peaks).
    communication: the step's traffic, one entry per kind.
    grad_ready_peak: the largest fraction of the step's gradient
      contributions (bytes, all workers) that become ready within one slot;
      None where gradients are not communicated.
    step_slots: slots between the starts of consecutive steps (steady state).
    bubble: idle fraction of the busiest device's slots.
    max_staleness: the largest delay ``d[i, j]`` (steps).
    stale_fraction: the fraction of (worker, stage) pairs computed on stale
      parameters.
  """
  strategy: str
  devices: int
  per_device: Memory
  total: Memory
  communication: tuple
  grad_ready_peak: float | None
  step_slots: int
  bubble: float
  max_staleness: int
  stale_fraction: float

  @property
  def comm_time_s(self) -> float:
    return sum(c.time_s for c in self.communication)

  @property
  def comm_sent_bytes(self) -> float:
    return sum(c.sent_bytes for c in self.communication)


# -- Timelines and activation lifetimes ------------------------------------------


def list_schedule(orders: Sequence[Sequence[tuple[str, int]]]) -> list[schedule.Event]:
  """Times the per-device op orders of one pipelined step; device ``j`` is stage ``j``.

  Each op ``("fwd" | "bwd", micro_batch)`` takes one slot and starts as soon
  as its device is free and its input exists: the forward of stage ``j-1`` or
  the backward of stage ``j+1`` (stage ``J-1``: its own forward).

  Returns:
    ``schedule.Event``s with ``worker`` = micro-batch, ``step`` = version = 0.
  """
  num_stages = len(orders)
  done: dict[tuple[str, int, int], int] = {}
  free, pos, events = [0] * num_stages, [0] * num_stages, []
  while any(pos[j] < len(orders[j]) for j in range(num_stages)):
    progressed = False
    for j in range(num_stages):
      if pos[j] == len(orders[j]):
        continue
      kind, m = orders[j][pos[j]]
      if kind == "fwd":
        dep = ("fwd", m, j - 1) if j > 0 else None
      else:
        dep = ("bwd", m, j + 1) if j < num_stages - 1 else ("fwd", m, j)
      if dep is not None and dep not in done:
        continue
      start = max(free[j], done[dep] if dep else 0)
      done[(kind, m, j)] = free[j] = start + 1
      events.append(schedule.Event(Fraction(start), m, 0, j, kind, 0))
      pos[j] += 1
      progressed = True
    if not progressed:
      raise ValueError("The op orders deadlock: a device waits for an op that never runs.")
  return sorted(events)


def one_f_one_b_orders(num_micro: int, num_stages: int) -> list[list[tuple[str, int]]]:
  """1F1B (PipeDream-Flush): ``J-1-j`` warm-up forwards, then alternate, then drain."""
  orders = []
  for j in range(num_stages):
    warm = min(num_stages - 1 - j, num_micro)
    order = [("fwd", m) for m in range(warm)]
    for m in range(num_micro - warm):
      order += [("fwd", warm + m), ("bwd", m)]
    orders.append(order + [("bwd", m) for m in range(num_micro - warm, num_micro)])
  return orders


class DeviceProfile(NamedTuple):
  """Activation bytes alive over a window: per device ``[num_devices]`` and summed over devices."""
  peak: np.ndarray
  mean: np.ndarray
  total_peak: float
  total_mean: float


def activation_bytes_profile(events, stage_bytes, device_of: Callable[[schedule.Event], int],
                             num_devices: int, window: tuple, ticks_per_slot: int) -> DeviceProfile:
  """Activation bytes alive per device over ``[window[0], window[1])`` slots.

  An activation of stage ``j`` (``stage_bytes[j]``) lives from the start of its
  forward to the end of its backward, on the device ``device_of(forward)``.
  """
  lo, hi = (int(Fraction(w) * ticks_per_slot) for w in window)
  change = np.zeros((num_devices, hi - lo + 1))
  forwards = {(e.worker, e.step, e.stage): e for e in events if e.kind == "fwd"}
  for e in events:
    if e.kind != "bwd":
      continue
    f = forwards[(e.worker, e.step, e.stage)]
    a = int(f.slot * ticks_per_slot)
    b = int((e.slot + 1) * ticks_per_slot)
    a, b = max(a, lo), min(b, hi)
    if a < b:
      change[device_of(f), a - lo] += stage_bytes[e.stage]
      change[device_of(f), b - lo] -= stage_bytes[e.stage]
  alive = np.cumsum(change, axis=1)[:, :-1]
  total = alive.sum(0)
  return DeviceProfile(alive.max(1), alive.mean(1), float(total.max()), float(total.mean()))


def _steady_timeline(rule, num_workers: int, num_stages: int, *, executed: bool = False):
  """A 3-step timeline and its steady-state window (the middle step's period).

  ``executed``: the events of the executed cyclic timetable (`plan`, ``N = J``).
  """
  if executed:
    events = plan_lib.executed_events("cyclic", rule, num_stages, 3)
  else:
    events = schedule.timeline(rule, num_workers, num_stages, 3)
  period = 2 * num_stages
  return events, (period, 2 * period)


def grad_ready_peak(events, stage_param_bytes, num_workers: int, window: tuple) -> float:
  """The largest fraction of a step's gradient bytes (``N * Psi_P``) ready within one slot.

  A backward of stage ``j`` makes ``P_j`` bytes of gradient ready when it
  ends; windows of one slot slide over the ``1/N`` slot grid of ``window``.
  """
  lo, hi = (int(Fraction(w) * num_workers) for w in window)
  ready = np.zeros(hi - lo + num_workers)
  for e in events:
    end = int((e.slot + 1) * num_workers)
    if e.kind == "bwd" and lo <= end < hi + num_workers:
      ready[end - lo] += stage_param_bytes[e.stage]
  per_slot = np.convolve(ready, np.ones(num_workers))[num_workers - 1:num_workers - 1 + hi - lo]
  return float(per_slot.max() / (num_workers * sum(stage_param_bytes)))


# -- Strategies --------------------------------------------------------------------


def _memory_sum(memories: Sequence[Memory], total_peak: float, total_mean: float) -> Memory:
  return Memory(*(sum(m[k] for m in memories) for k in range(4)), total_peak, total_mean,
                sum(m.messages for m in memories), sum(m.inputs for m in memories))


def _busiest(memories: Sequence[Memory]) -> Memory:
  return max(memories, key=lambda m: m.peak)


def _staleness(rule, num_workers: int, num_stages: int) -> tuple[int, float]:
  d = schedule.resolve(rule, num_workers, num_stages)
  return int(d.max()), float(np.mean(d > 0))


def _data_parallel(name: str, rule, n: int, w: Workload, net: Network, *,
                   shard: int) -> Cost:
  """DP, CDP-v1/v2 and ZeRO-``shard`` (0: none): ``N`` workers, each runs the whole model."""
  J, P, k = w.num_stages, w.param_bytes, w.optimizer_factor
  events, window = _steady_timeline(rule, n, J)
  prof = activation_bytes_profile(events, w.stage_activation_bytes, lambda e: e.worker, n,
                                  window, n)
  # The engine keeps a stale copy of stage j only as deep as some worker reads it,
  # max_i d[i, j]: cdp-v2 at N = J keeps (J-1)/J of a copy, cdp-v1 a whole one.
  depths = schedule.resolve(rule, n, J).max(axis=0)
  params = sum((1 + int(d)) * p for d, p in zip(depths, w.stage_param_bytes))
  params = params / n if shard >= 3 else params
  pmax = max(w.stage_param_bytes)
  grads = P / n if shard >= 2 else P
  gradient = 0.0 if w.transient_gradient else pmax  # A stage's gradient before its scatter.
  buffers = gradient if shard == 2 else 0.0  # ZeRO-3's: below, stage by stage.
  activations = float(prof.peak.max()) + _recompute(w)
  if shard >= 3:  # Stage by stage: the backward of stage j holds the activations kept up to
    # stage j, its recomputed residuals, and its stage gathered (with its gradient unless the
    # calibrated backward holds it), each stage at its own size.
    held = 1.0 if w.transient_gradient else 2.0
    at = [(sum(w.stage_activation_bytes[:j + 1]) + _recompute(w, j), held * p)
          for j, p in enumerate(w.stage_param_bytes)]
    activations, buffers = max(at, key=sum)
  boundary = max(w.boundary_bytes, default=0.0) if shard >= 3 else 0.0  # Stage by stage.
  memory = Memory(params, grads, k * P / n if shard >= 1 else k * P, buffers, activations,
                  float(prof.mean.max()), boundary, w.input_bytes)
  if shard == 0:
    comms = (Communication(
        "all-reduce", "gradients", n, J, P, 2 * (n - 1) / n * P, 2 * (n - 1) * P,
        sum(all_reduce_time(n, p, net) for p in w.stage_param_bytes)),)
  else:
    gathers = 2 if shard >= 3 else 1  # ZeRO-3 gathers a stage for its forward and its backward.
    comms = (
        Communication("reduce-scatter", "gradients", n, J, P / n, (n - 1) / n * P, (n - 1) * P,
                      sum(all_gather_time(n, p, net) for p in w.stage_param_bytes)),
        Communication("all-gather", "parameters", n, gathers * J, gathers * P,
                      gathers * (n - 1) / n * P, gathers * (n - 1) * P,
                      gathers * sum(all_gather_time(n, p, net) for p in w.stage_param_bytes)))
  staleness = _staleness(rule, n, J)
  return Cost(name, n, memory, _memory_sum([memory] * n, prof.total_peak, prof.total_mean), comms,
              grad_ready_peak(events, w.stage_param_bytes, n, window), 2 * J, 0.0, *staleness)


def dp(n: int, w: Workload, net: Network = Network()) -> Cost:
  """Data parallelism: ``N`` replicas in lockstep, one all-reduce per stage bucket."""
  return _data_parallel("dp", "dp", n, w, net, shard=0)


def cdp_v1(n: int, w: Workload, net: Network = Network()) -> Cost:
  """CDP-v1: the cyclic timeline, every stage one step stale (PipeDream-2BW's delay)."""
  return _data_parallel("cdp-v1", "cdp-v1", n, w, net, shard=0)


def cdp_v2(n: int, w: Workload, net: Network = Network()) -> Cost:
  """CDP-v2: the cyclic timeline, stale exactly where the timeline forces it."""
  return _data_parallel("cdp-v2", "cdp-v2", n, w, net, shard=0)


def zero_1(n: int, w: Workload, net: Network = Network()) -> Cost:
  """ZeRO-1: data parallelism with the optimizer state sharded over the ``N`` workers."""
  return _data_parallel("zero-1", "dp", n, w, net, shard=1)


def zero_2(n: int, w: Workload, net: Network = Network()) -> Cost:
  """ZeRO-2: optimizer state and gradients sharded."""
  return _data_parallel("zero-2", "dp", n, w, net, shard=2)


def zero_3(n: int, w: Workload, net: Network = Network(), *, replicas: int = 1) -> Cost:
  """ZeRO-3 (FSDP): parameters sharded too, each stage all-gathered at use.

  ``replicas``: ``R`` groups of ``n``; each worker all-reduces its shard of
  every stage's gradient over the ``R`` groups, ``J`` all-reduces of ``P_j/n``.
  """
  c = _data_parallel("zero-3", "dp", n, w, net, shard=3)
  return _replicated(c, replicas, [p / n for p in w.stage_param_bytes], w.param_bytes, net)


def _p2p(n_micro: int, w: Workload, net: Network, pipelines: int) -> Communication:
  """Activations forward and cotangents backward over every stage boundary.

  A middle stage sends one of each per micro-batch; with two stages, one each.
  """
  b = max(w.boundary_bytes, default=0.0)
  ops = n_micro * min(w.num_stages - 1, 2)
  total = 2 * n_micro * sum(w.boundary_bytes) * pipelines
  return Communication("p2p", "activations", 2, ops, ops * b, ops * b, total,
                       ops * p2p_time(b, net))


def _recompute(w: Workload, j: int | None = None) -> float:
  """The transient residuals of a recomputed forward: stage ``j``'s, or the largest stage's."""
  if j is None or not w.stage_recompute_bytes:
    return max(w.stage_recompute_bytes, default=0.0)
  return w.stage_recompute_bytes[j]


def _stage_memory(w: Workload, j: int, versions: int, act_peak: float, act_mean: float,
                  micro_batches: int) -> Memory:
  """Device ``j`` of a pipeline; its backward adds the stage's recomputed residuals to the peak,
  and it holds a boundary and two of the largest stash rows in flight (`Memory.messages`), and
  its pipeline's ``micro_batches`` of input rows."""
  p = w.stage_param_bytes[j]
  messages = max(w.boundary_bytes, default=0.0) + 2 * max(w.stage_activation_bytes)
  return Memory(versions * p, p, w.optimizer_factor * p, 0.0, act_peak + _recompute(w, j),
                act_mean, messages, micro_batches * w.input_bytes)


def dp_mp(n: int, w: Workload, net: Network = Network()) -> Cost:
  """DP + model parallelism: ``N`` replicas of a ``J``-device pipeline, one micro-batch each."""
  J = w.num_stages
  events, window = _steady_timeline("dp", n, J)
  prof = activation_bytes_profile(events, w.stage_activation_bytes,
                                  lambda e: e.worker * J + e.stage, n * J, window, n)
  memories = [_stage_memory(w, j, 1, prof.peak[i * J + j], prof.mean[i * J + j], 1)
              for i in range(n) for j in range(J)]
  pmax = max(w.stage_param_bytes)
  comms = (Communication("all-reduce", "gradients", n, 1, pmax, 2 * (n - 1) / n * pmax,
                         2 * (n - 1) * w.param_bytes, all_reduce_time(n, pmax, net)),
           _p2p(1, w, net, n))
  return Cost("dp+mp", n * J, _busiest(memories),
              _memory_sum(memories, prof.total_peak, prof.total_mean), comms,
              grad_ready_peak(events, w.stage_param_bytes, n, window), 2 * J, 1 - 1 / J, 0, 0.0)


def _replicated(c: Cost, replicas: int, op_bytes: Sequence[float], replica_bytes: float,
                net: Network) -> Cost:
  """``replicas`` copies of ``c``'s devices whose gradients are all-reduced over the copies.

  ``op_bytes``: the all-reduces of ``c``'s device (its ``Communication``'s
  device), one entry per operation; ``replica_bytes``: their bytes summed over
  the devices of one copy. ``replicas = 1`` returns ``c``.
  """
  if int(replicas) != replicas or replicas < 1:
    raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}.")
  if replicas == 1:
    return c
  r, payload = int(replicas), float(sum(op_bytes))
  reduce = Communication("all-reduce", "gradients", r, len(op_bytes), payload,
                         2 * (r - 1) / r * payload, 2 * (r - 1) * replica_bytes,
                         sum(all_reduce_time(r, b, net) for b in op_bytes))
  total = c.total._replace(**{k: r * v for k, v in c.total._asdict().items()})
  return c._replace(devices=r * c.devices, total=total, communication=c.communication + (reduce,))


def _flushed_pipeline(name: str, events, n: int, w: Workload, net: Network) -> Cost:
  J = w.num_stages
  length = int(max(e.slot for e in events)) + 1
  prof = activation_bytes_profile(events, w.stage_activation_bytes, lambda e: e.stage, J,
                                  (0, length), 1)
  memories = [_stage_memory(w, j, 1, prof.peak[j], prof.mean[j], n) for j in range(J)]
  return Cost(name, J, _busiest(memories), _memory_sum(memories, prof.total_peak, prof.total_mean),
              (_p2p(n, w, net, 1),), None, length, 1 - 2 * n / length, 0, 0.0)


def gpipe(n: int, w: Workload, net: Network = Network(), *, replicas: int = 1) -> Cost:
  """GPipe on ``J`` devices: ``N`` micro-batches, all forwards, all backwards, flush.

  ``replicas``: ``R`` pipelines; device ``j`` all-reduces stage ``j``'s
  gradient over them once per step (its busiest device: the largest stage).
  """
  events = plan_lib.executed_events("gpipe", "dp", w.num_stages, 1, num_micro_batches=n)
  return _replicated(_flushed_pipeline("gpipe", events, n, w, net), replicas,
                     [max(w.stage_param_bytes)], w.param_bytes, net)


def one_f_one_b(n: int, w: Workload, net: Network = Network()) -> Cost:
  """1F1B (PipeDream-Flush) on ``J`` devices: stage ``j`` stashes at most ``J-j`` micro-batches."""
  return _flushed_pipeline("1f1b", list_schedule(one_f_one_b_orders(n, w.num_stages)), n, w, net)


def _check_cyclic_square(name: str, n: int, w: Workload) -> None:
  if n != w.num_stages:
    raise ValueError(f"{name} runs N = J micro-batches on the cyclic timeline; got N={n}, "
                     f"J={w.num_stages}. Use as many workers as stages.")


def cdp_mp(n: int, w: Workload, net: Network = Network(), *, rule="cdp-v2",
           replicas: int = 1) -> Cost:
  """CDP + model parallelism: ``J`` devices, device ``j`` runs stage ``j`` of every micro-batch.

  ``replicas``: as for `gpipe`, one all-reduce of stage ``j`` per step.
  """
  _check_cyclic_square("cdp+mp", n, w)
  J = w.num_stages
  events, window = _steady_timeline(rule, n, J, executed=True)
  prof = activation_bytes_profile(events, w.stage_activation_bytes, lambda e: e.stage, J,
                                  window, n)
  # Device j's ring buffer holds D + 1 whole versions of its stage, stale or not.
  versions = 1 + schedule.max_delay(rule)
  memories = [_stage_memory(w, j, versions, prof.peak[j], prof.mean[j], n) for j in range(J)]
  c = Cost("cdp+mp", J, _busiest(memories),
           _memory_sum(memories, prof.total_peak, prof.total_mean),
           (_p2p(n, w, net, 1),), None, 2 * J, 0.0, *_staleness(rule, n, J))
  return _replicated(c, replicas, [max(w.stage_param_bytes)], w.param_bytes, net)


def cdp_zero(n: int, w: Workload, net: Network = Network(), *, rule="cdp-v2",
             replicas: int = 1) -> Cost:
  """CDP + ZeRO: worker ``r`` owns stage ``J-1-r``, sends it to each use and sums its gradients.

  The messages are the executor's (`plan.cyclic_transfers`): per step and
  stage, each of the ``N-1`` non-owners receives the stage from the owner once
  for its forward and once for its backward, and sends the owner its
  gradient, ``3(N-1)`` point-to-point messages of ``P_j`` bytes (of its
  message class, `Workload.message_bytes`). The owner
  keeps the gradients' sum (``grads``); a device holds the stage it uses, the
  gradient it receives as owner and the one it sends (``buffers``; the sent one
  in the transient where `Workload.transient_gradient`), and with several
  message classes each smaller class's stage buffer, which its gradient
  message passes through (a switch per class, `zero._cyclic_body`; the TPU
  compiler runs a slot's stage messages before its events). Its
  ``Communication`` is the average device's. With ``replicas`` rings, each
  owner all-reduces its stage's gradient over them once per step (the average
  device: ``Psi_P / N``).
  """
  _check_cyclic_square("cdp+zero", n, w)
  J, k = w.num_stages, w.optimizer_factor
  events, window = _steady_timeline(rule, n, J, executed=True)
  prof = activation_bytes_profile(events, w.stage_activation_bytes, lambda e: e.worker, n,
                                  window, n)
  versions = 1 + schedule.max_delay(rule)  # The owner keeps D + 1 whole versions of its stage.
  pmax = max(w.stage_param_bytes)
  classes = set(w.message_bytes or [pmax])
  buffers = (2 if w.transient_gradient else 3) * pmax + sum(classes) - max(classes)
  messages = max(w.boundary_bytes, default=0.0) + max(w.stage_activation_bytes)
  memories = [Memory(versions * p, p, k * p, buffers, prof.peak[J - 1 - j] + _recompute(w),
                     prof.mean[J - 1 - j], messages, w.input_bytes)
              for j, p in enumerate(w.stage_param_bytes)]
  transfers = plan_lib.cyclic_transfers(schedule.resolve(rule, n, J))
  hops = len(transfers) // n  # Messages per step received by the average device.
  total = float(sum(w.stage_message_bytes[t.stage] for t in transfers))
  comms = (Communication("p2p", "parameters+gradients", 2, hops, total / n, total / n,
                         total, hops * net.alpha + total / n * net.beta),)
  c = Cost("cdp+zero", n, _busiest(memories),
           _memory_sum(memories, prof.total_peak, prof.total_mean), comms,
           grad_ready_peak(events, w.stage_param_bytes, n, window), 2 * J, 0.0,
           *_staleness(rule, n, J))
  return _replicated(c, replicas, [w.param_bytes / n], w.param_bytes, net)


STRATEGIES: dict[str, Callable[..., Cost]] = {
    "dp": dp, "dp+mp": dp_mp, "gpipe": gpipe, "1f1b": one_f_one_b,
    "zero-1": zero_1, "zero-2": zero_2, "zero-3": zero_3,
    "cdp-v1": cdp_v1, "cdp-v2": cdp_v2, "cdp+mp": cdp_mp, "cdp+zero": cdp_zero,
}
"""Every strategy: ``STRATEGIES[name](num_workers, workload, network) -> Cost``."""

REPLICATED = ("gpipe", "cdp+mp", "zero-3", "cdp+zero")
"""The strategies that take ``replicas``: the executed timetables on a ``(replica, ...)`` mesh."""


def cost(strategy: str, num_workers: int, w: Workload, net: Network = Network(), *,
         replicas: int = 1) -> Cost:
  """``STRATEGIES[strategy](num_workers, w, net)``, with a helpful error for a bad name.

  ``replicas``: ``R`` copies of the strategy's devices, each device's gradients
  all-reduced over them (`REPLICATED` strategies only).
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}.")
  if replicas == 1:
    return STRATEGIES[strategy](num_workers, w, net)
  if strategy not in REPLICATED:
    raise ValueError(f"{strategy} takes no replicas (got {replicas}): use one of "
                     f"{', '.join(REPLICATED)}, or more workers.")
  return STRATEGIES[strategy](num_workers, w, net, replicas=replicas)


def compare(num_workers: int, w: Workload, net: Network = Network(),
            strategies: Sequence[str] = tuple(STRATEGIES)) -> list[Cost]:
  """The costs of ``strategies``; those that need ``N = J`` are left out otherwise."""
  square_only = ("cdp+mp", "cdp+zero")
  return [cost(s, num_workers, w, net) for s in strategies
          if num_workers == w.num_stages or s not in square_only]


def markdown_table(costs: Sequence[Cost], w: Workload, num_workers: int,
                   net: Network = Network()) -> str:
  """A Table-1-style comparison, in units of ``Psi_P`` (model states) and ``Psi_A`` (activations).

  Labelled as derived: every figure comes from this cost model, none is measured.
  """
  P, A = w.param_bytes, w.activation_bytes
  lines = [
      f"*Derived by `cdpjax.analysis` (not measured): N = {num_workers} workers, "
      f"J = {w.num_stages} stages, optimizer state = {w.optimizer_factor:g} x params, "
      f"alpha = {net.alpha:g} s, beta = {net.beta:g} s/B. Model states in Psi_P, activations "
      "in Psi_A (one micro-batch through the whole model); per device = the busiest device; "
      "comm = bytes the busiest device sends per step.*",
      "",
      "| strategy | devices | params+stale /dev | grads /dev | optim /dev | buffers /dev "
      "| act peak /dev | act peak total | act mean total | comm (kind: ops, sent) "
      "| comm time | grad ready peak /slot | bubble | max staleness (stale pairs) |",
      "|" + "---|" * 14]

  def comm_text(c: Communication) -> str:
    unit = A if c.what == "activations" else P
    sym = "Psi_A" if c.what == "activations" else "Psi_P"
    return f"{c.kind} {c.what}: {c.ops}, {c.sent_bytes / unit:.3g} {sym}"

  for c in costs:
    m, t = c.per_device, c.total
    ready = "-" if c.grad_ready_peak is None else f"{c.grad_ready_peak:.3g}"
    lines.append(
        f"| {c.strategy} | {c.devices} | {m.params / P:.3g} | {m.grads / P:.3g} "
        f"| {m.optimizer / P:.3g} | {m.buffers / P:.3g} | {m.activations_peak / A:.3g} "
        f"| {t.activations_peak / A:.3g} | {t.activations_mean / A:.3g} "
        f"| {'; '.join(map(comm_text, c.communication))} | {1e3 * c.comm_time_s:.3g} ms "
        f"| {ready} | {c.bubble:.3g} | {c.max_staleness} ({c.stale_fraction:.0%}) |")
  return "\n".join(lines) + "\n"


# -- Asynchronous updates against CDP's per-stage barrier -------------------------


class AsyncProfile(NamedTuple):
  """Staleness and traffic of asynchronous SGD against CDP on the same timeline.

  Staleness is in steps: a gradient applied ``s`` updates of its stage after
  its forward read the stage is ``s / N`` steps stale for asynchronous SGD (a
  stage takes ``N`` updates of ``lr / N`` per step), and ``d`` steps for CDP
  (its delay: one update of ``lr`` per step).

  Attributes:
    async_staleness: ``(T, N, J)`` floats, in steps (``simulate_async``'s count / N).
    cdp_staleness: ``(T, N, J)`` ints, in steps (``schedule.delays_per_step``).
    times: ``(K,)`` floats, slots on the ``1/N`` grid.
    async_bytes: ``(K,)`` bytes sent at each time by asynchronous SGD through a
      per-stage parameter holder: a worker pushes its stage gradient when its
      backward ends and pulls the stage when its forward starts (``2 P_j`` per
      (worker, stage, step)).
    cdp_bytes: ``(K,)`` bytes of CDP's ring all-reduce of stage ``j``,
      ``2 (N-1) P_j`` over all links, issued when its ``N``-th gradient arrives.
  """
  async_staleness: np.ndarray
  cdp_staleness: np.ndarray
  times: np.ndarray
  async_bytes: np.ndarray
  cdp_bytes: np.ndarray


def async_staleness(events, num_workers: int, num_stages: int) -> np.ndarray:
  """Per gradient, updates of its stage applied between its read and its own update.

  ``events`` gives the times (``schedule.timeline``); updates apply at their
  backward's end in time order, a forward sees the updates ended by its start.
  Returns ``(T, N, J)`` ints, as ``simulate.simulate_async`` counts them.
  """
  num_steps = max(e.step for e in events) + 1
  out = np.zeros((num_steps, num_workers, num_stages), dtype=np.int64)
  for j in range(num_stages):
    mine = [(k, e) for k, e in enumerate(events) if e.stage == j]
    ends = sorted((e.end, k) for k, e in mine if e.kind == "bwd")  # Ties: event order.
    rank = {k: r for r, (_, k) in enumerate(ends)}
    end_times = [end for end, _ in ends]
    reads = {(e.worker, e.step): int(np.searchsorted(end_times, e.slot, side="right"))
             for _, e in mine if e.kind == "fwd"}
    for k, e in mine:
      if e.kind == "bwd":
        out[e.step, e.worker, j] = rank[k] - reads[(e.worker, e.step)]
  return out


def async_profile(num_workers: int, num_stages: int, num_steps: int, stage_param_bytes,
                  *, speeds=None, jitter=None, max_delay: int = 1) -> AsyncProfile:
  """``AsyncProfile`` of ``num_steps`` steps; CDP keeps staleness ``<= max_delay``.

  Both run on ``schedule.timeline``: asynchronous SGD never waits, CDP's
  forwards wait for ``theta_{t-D}``, so with unequal ``speeds`` their times
  differ. Traffic is binned on the ``1/N`` slot grid (times rounded down).
  """
  speeds = [1] * num_workers if speeds is None else speeds
  stage_param_bytes = _per_stage(stage_param_bytes, num_stages, "stage_param_bytes")
  async_events = schedule.timeline("cdp-v2", num_workers, num_stages, num_steps, speeds=speeds,
                                   jitter=jitter, max_delay=num_steps)
  cdp_events = schedule.timeline("cdp-v2", num_workers, num_stages, num_steps, speeds=speeds,
                                 jitter=jitter, max_delay=max_delay)
  horizon = max(e.end for e in async_events + cdp_events)
  ticks = int(horizon * num_workers) + 1
  async_bytes, cdp_bytes = np.zeros(ticks), np.zeros(ticks)
  for e in async_events:  # A pull before each forward, a push after each backward.
    when = e.slot if e.kind == "fwd" else e.end
    async_bytes[int(when * num_workers)] += stage_param_bytes[e.stage]
  last = {}
  for e in cdp_events:
    if e.kind == "bwd":
      last[(e.step, e.stage)] = max(last.get((e.step, e.stage), e.end), e.end)
  for (_, j), when in last.items():
    cdp_bytes[int(when * num_workers)] += 2 * (num_workers - 1) * stage_param_bytes[j]
  return AsyncProfile(
      async_staleness(async_events, num_workers, num_stages) / num_workers,
      schedule.delays_per_step(cdp_events, num_workers, num_stages),
      np.arange(ticks) / num_workers, async_bytes, cdp_bytes)
