"""Static slot plans of the executed schedules: what each device does and sends, slot by slot.

numpy first (no JAX import): the event functions take ``xp`` (numpy to list and
count, ``jax.numpy`` inside a compiled step), so the executors, the benchmarks
and the tests read one plan.

- Pipeline (mesh axis ``stage``): ``cyclic_event`` and ``gpipe_event`` give a
  device's ``SlotEvent`` at a slot; ``executed_events`` lists a whole call as
  ``schedule.Event``s, comparable with ``schedule.timeline``; ``idle_fraction``
  counts a call's idle device-slots.
- ZeRO (mesh axis ``data``): ``zero_plan`` gives each worker's event, the
  source of its stage buffer and every point-to-point message of a ``K``-step
  cyclic call; ``slot_traffic`` counts their bytes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from cdpjax import schedule as schedule_lib

IDLE, FWD, BWD = 0, 1, 2


class SlotEvent(NamedTuple):
  """What one device does in one slot.

  Attributes:
    kind: ``IDLE``, ``FWD`` or ``BWD``.
    step: local step ``t`` of the call (0 when idle).
    micro: micro-batch ``i`` within its step (0 when idle).
    num_updates: updates applied to this stage in this call before the slot.
    version: which of the ``D+1`` newest versions the event uses (0 = newest).
    delay: ``d[i, j]`` of the event's worker: how stale its read is, for weight
      prediction (``version`` counts from the device's newest version instead).
    stash: the stash entry of this micro-batch's stage input.
    then_update: whether the stage is updated right after this event.
  """
  kind: Any
  step: Any
  micro: Any
  num_updates: Any
  version: Any
  delay: Any
  stash: Any
  then_update: Any


def cyclic_slots(num_stages: int, num_steps: int) -> int:
  """Slots of a ``K``-step cyclic call: ``2J(K+1) - 2`` (the last backward ends it)."""
  return 2 * num_stages * (num_steps + 1) - 2


def cyclic_event(slot, stage, delays, num_steps: int, xp=np) -> SlotEvent:
  """The cyclic CDP schedule (``N = J``) at ``slot`` on device ``stage``.

  Micro-batch ``m = J t + i`` runs the forward of stage ``j`` at ``2m + j`` and
  its backward at ``2m + 2J-1-j``; stage ``j`` of step ``t`` is updated after
  its last backward, at slot ``2Jt + 4J-3-j``.
  """
  num_stages = delays.shape[1]
  period = 2 * num_stages
  forward = (slot - stage) % 2 == 0
  m = xp.where(forward, (slot - stage) // 2, (slot + stage + 1 - period) // 2)
  valid = (m >= 0) & (m < num_stages * num_steps)
  m = xp.where(valid, m, 0)
  step, micro = m // num_stages, m % num_stages
  updates = xp.clip((slot - (2 * period - 3 - stage) + period - 1) // period, 0, num_steps)
  version = updates - step + xp.asarray(delays)[micro, stage]
  return SlotEvent(
      kind=xp.where(valid, xp.where(forward, FWD, BWD), IDLE), step=step, micro=micro,
      num_updates=updates, version=version, delay=xp.asarray(delays)[micro, stage],
      stash=m % max(num_stages - 1, 1),
      then_update=valid & ~forward & (micro == num_stages - 1))


def gpipe_event(slot, stage, delays, *, num_micro: int, num_steps: int, worker0=0,
                xp=np) -> SlotEvent:
  """GPipe at ``slot`` on device ``stage``: ``2(M+J-1)`` slots per step.

  Micro-batch ``i`` of step ``t`` runs the forward of stage ``j`` at slot
  ``r = i + j`` of the step and its backward at ``r = (M+J-1) + i + (J-1-j)``;
  every stage is updated at the end of the step's last slot, then the pipeline
  is empty (the flush). ``worker0`` is the delay-matrix row of micro-batch 0
  (the replica, for ``dp+mp``).
  """
  num_stages = delays.shape[1]
  phase = num_micro + num_stages - 1
  step, r = slot // (2 * phase), slot % (2 * phase)
  forward = r < phase
  micro = xp.where(forward, r - stage, r - phase - (num_stages - 1 - stage))
  valid = (micro >= 0) & (micro < num_micro) & (step < num_steps)
  micro = xp.where(valid, micro, 0)
  step = xp.clip(step, 0, num_steps - 1)
  return SlotEvent(
      kind=xp.where(valid, xp.where(forward, FWD, BWD), IDLE), step=step, micro=micro,
      num_updates=step, version=xp.asarray(delays)[worker0 + micro, stage],
      delay=xp.asarray(delays)[worker0 + micro, stage], stash=micro,
      then_update=r == 2 * phase - 1)


def executed_events(timetable: str, rule, num_stages: int, num_steps: int,
                    num_micro_batches: int | None = None) -> list[schedule_lib.Event]:
  """The events a ``K``-step call executes, as ``schedule.Event``s sorted by time.

  Versions are global step indices (``theta_{-1} := theta_0`` shows as 0), so
  the cyclic events can be compared with ``schedule.timeline``. For ``dp+mp``,
  ``worker`` is the replica.
  """
  num_micro = num_stages if num_micro_batches is None else num_micro_batches
  delays = schedule_lib.resolve(rule, num_micro, num_stages)
  stages = np.arange(num_stages)[None, :]
  rows = []  # (slot, worker, step, stage, kind, version) arrays.
  if timetable == "cyclic":
    slots = np.arange(cyclic_slots(num_stages, num_steps))[:, None]
    ev = cyclic_event(slots, stages, delays, num_steps)
    rows.append((slots, ev.micro, ev.step, ev.kind, ev.num_updates - ev.version))
  else:
    per_replica = 1 if timetable == "dp+mp" else num_micro
    slots = np.arange(num_steps * 2 * (per_replica + num_stages - 1))[:, None]
    for r in range(num_micro // per_replica):
      ev = gpipe_event(slots, stages, delays, num_micro=per_replica, num_steps=num_steps,
                       worker0=r * per_replica)
      rows.append((slots, ev.micro + r * per_replica, ev.step, ev.kind, ev.step - ev.version))
  events = []
  for slots, worker, step, kind, version in rows:
    slots, worker, step, kind, version = np.broadcast_arrays(slots, worker, step, kind, version)
    for s, j in zip(*np.nonzero(kind != IDLE)):
      events.append(schedule_lib.Event(
          int(slots[s, j]), int(worker[s, j]), int(step[s, j]), int(j),
          "fwd" if kind[s, j] == FWD else "bwd", max(int(version[s, j]), 0)))
  return sorted(events)


def idle_fraction(timetable: str, num_stages: int, num_steps: int,
                  num_micro_batches: int | None = None) -> float:
  """Idle device-slots / all device-slots of a ``K``-step pipeline call, counted on the plan.

  ``cyclic`` fills once and drains once per call; ``gpipe`` and ``dp+mp``
  (one micro-batch per replica) flush every step.
  """
  num_micro = num_stages if num_micro_batches is None else num_micro_batches
  delays = np.zeros((num_micro, num_stages), np.int32)  # Versions do not change the slots.
  stages = np.arange(num_stages)[None, :]
  if timetable == "cyclic":
    kind = cyclic_event(np.arange(cyclic_slots(num_stages, num_steps))[:, None], stages, delays,
                        num_steps).kind
  elif timetable in ("gpipe", "dp+mp"):
    per_replica = 1 if timetable == "dp+mp" else num_micro
    slots = np.arange(num_steps * 2 * (per_replica + num_stages - 1))[:, None]
    kind = gpipe_event(slots, stages, delays[:per_replica], num_micro=per_replica,
                       num_steps=num_steps).kind
  else:
    raise ValueError(f"Unknown pipeline timetable {timetable!r}: use cyclic, gpipe or dp+mp.")
  return float(np.mean(kind == IDLE))


def swap_pairs(num_stages: int, parity: int) -> list[tuple[int, int]]:
  """The cyclic schedule's ``ppermute`` at slots of ``parity``.

  Devices ``j = parity (mod 2)`` ran a forward and send to ``j+1``; the others ran
  a backward and send to ``j-1``: disjoint swaps of neighbours.
  """
  pairs = []
  for j in range(parity, num_stages - 1, 2):
    pairs += [(j, j + 1), (j + 1, j)]
  return pairs


LOCAL, OWNER = 0, 1  # Where a ZeRO worker's stage buffer comes from.


class Transfer(NamedTuple):
  """One point-to-point message of the cyclic ZeRO call.

  Attributes:
    slot: a ``"param"`` or ``"state"`` message is delivered before this slot's
      compute; a ``"grad"`` message leaves right after it.
    kind: ``"param"`` (a stage version and its model state, from the owner to
      the worker that uses it), ``"grad"`` (a backward's gradient, to the
      stage's owner) or ``"state"`` (a stage's model state and the running sum
      of its new ones, from the previous forward of the stage).
    src: sending worker.
    dst: receiving worker.
    stage: ``j``.
    route: ``"owner"`` (to or from the stage's owner) or ``"ring"`` (from
      ``dst - 1``, which ran the stage's forward 2 slots earlier; ``N-1 -> 0``
      into the next step).
    delay: for ``"param"`` messages, which version row (0 = newest) is sent.
  """
  slot: int
  kind: str
  src: int
  dst: int
  stage: int
  route: str
  delay: int


ROUTES = (("param", "owner"), ("grad", "owner"), ("state", "ring"))


class ZeroPlan(NamedTuple):
  """The static timetable of a ``K``-step cyclic CDP-ZeRO call (``N = J``).

  Tables are int ``[S, N]`` (slot, worker). A worker runs its micro-batch of
  step ``t`` from slot ``2Jt + 2i``: the forward of stage ``j`` at phase ``j``,
  its backward at ``2J-1-j``; no flush between steps. At any slot a stage is
  used by at most one worker, so each slot's stage messages (owner to user)
  and gradient messages (user to owner) are each one permutation. Worker
  ``J-1-j`` owns stage ``j`` and updates it at the start of the slot after
  worker ``N-1``'s backward of it (``2Jt + 4J-2-j``), which is its own next
  forward of it.

  Attributes:
    kind, stage, step: the event (``IDLE``, ``FWD``, ``BWD``) of each worker.
    version: the owner's version row the event reads (0 = newest, after the
      slot's update).
    delay: ``d[i, j]`` of the event: how stale the read is, for weight
      prediction and DC-ASGD.
    source: ``LOCAL`` (the owner's own use) or ``OWNER`` (a message).
    serve_version, serve_delay: per owner, the ``version`` and ``delay`` of
      the event that uses its stage at the slot (0 where none does).
    update: 1 where an owner applies its stage's update before the slot.
    update_step: the step that update ends.
    state_ring: 1 where a forward reads the model state from the state ring,
      0 where it reads the one that came with the parameters (first step, worker 0).
    transfers: every message, by slot.
  """
  kind: np.ndarray
  stage: np.ndarray
  step: np.ndarray
  version: np.ndarray
  delay: np.ndarray
  source: np.ndarray
  serve_version: np.ndarray
  serve_delay: np.ndarray
  update: np.ndarray
  update_step: np.ndarray
  state_ring: np.ndarray
  transfers: list

  @property
  def num_slots(self) -> int:
    return self.kind.shape[0]

  def events(self) -> list[schedule_lib.Event]:
    """The call's events as ``schedule.Event``s, versions as global step indices (``>= 0``)."""
    num_stages = self.kind.shape[1]
    updates = np.cumsum(self.update, axis=0)  # [S, N]: an owner's updates up to each slot.
    events = []
    for s, i in zip(*np.nonzero(self.kind != IDLE)):
      j = int(self.stage[s, i])
      version = int(updates[s, num_stages - 1 - j]) - int(self.version[s, i])
      events.append(schedule_lib.Event(int(s), int(i), int(self.step[s, i]), j,
                                       "fwd" if self.kind[s, i] == FWD else "bwd",
                                       max(version, 0)))
    return sorted(events)

  def routes(self, kind: str, route: str, stages=None
             ) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """Per slot, which of the distinct pair lists the messages of ``(kind, route)`` use.

    Returns ``(index [S], pair lists)``; list 0 is empty (no message). Each
    list has distinct sources and targets: one ``ppermute``. ``stages``: only
    the messages of those stages (one message class, `zero.message_classes`);
    by default all. The stage messages also carry an owner's own use as a
    pair ``(o, o)`` (a copy on the device, no link): the permute's result is
    then the stage every user reads, where a select between it and the
    owner's would be a stage-sized buffer of its own (measured on the TPU:
    docs/design_notes.md).
    """
    stages = range(self.kind.shape[1]) if stages is None else stages
    by_slot = defaultdict(set)
    for t in self.transfers:
      if (t.kind, t.route) == (kind, route) and t.stage in stages:
        by_slot[t.slot].add((t.src, t.dst))
    if (kind, route) == ("param", "owner"):
      local = (self.source == LOCAL) & (self.kind != IDLE) & np.isin(self.stage, list(stages))
      for slot, i in zip(*np.nonzero(local)):
        by_slot[int(slot)].add((int(i), int(i)))
    lists, index = [()], np.zeros(self.num_slots, np.int32)
    for slot, pairs in sorted(by_slot.items()):
      pairs = tuple(sorted(pairs))
      assert len({p[0] for p in pairs}) == len({p[1] for p in pairs}) == len(pairs), pairs
      if pairs not in lists:
        lists.append(pairs)
      index[slot] = lists.index(pairs)
    return index, [list(p) for p in lists]

  def num_permutes(self, model_states: bool = True, classes=(None,)) -> int:
    """Collective-permutes a call runs: one per slot, route with messages and message class
    (``classes``: the stages of each, `zero.message_classes`; by default one of all stages),
    the model-state ring's only for a model with ``model_states``."""
    runs = [self.routes(*route, stages)[0] for route in ROUTES[:2] for stages in classes]
    if model_states:
      runs.append(self.routes(*ROUTES[2])[0])
    return sum(int((index != 0).sum()) for index in runs)


def zero_slots(num_stages: int, num_steps: int) -> int:
  """Slots of a ``K``-step cyclic ZeRO call: the pipeline's, plus the slot of stage 0's update."""
  return cyclic_slots(num_stages, num_steps) + 1


def zero_plan(delays, num_steps: int = 1) -> ZeroPlan:
  """The cyclic CDP-ZeRO timetable of ``num_steps`` steps for an ``(N, N)`` delay matrix."""
  delays = np.asarray(delays)
  num_workers, num_stages = delays.shape
  period, last = 2 * num_stages, num_workers - 1
  shape = (zero_slots(num_stages, num_steps), num_workers)
  tab = {k: np.zeros(shape, np.int32) for k in ZeroPlan._fields[:-1]}
  owner = lambda j: num_stages - 1 - j
  update_slot = lambda j, t: period * t + 2 * last + period - j  # After N-1's backward.
  transfers, served = [], set()
  for t in range(num_steps):
    for i in range(num_workers):
      for phase in range(period):
        s, backward = period * t + 2 * i + phase, phase >= num_stages
        j = period - 1 - phase if backward else phase
        d, o = int(delays[i, j]), owner(j)
        updates = sum(update_slot(j, u) <= s for u in range(num_steps))
        version = updates - t + d
        assert 0 <= version <= delays.max(), "not causal"
        assert (s, o) not in served, "two users of a stage in one slot"
        served.add((s, o))
        source = LOCAL if i == o else OWNER
        for key, value in (("kind", BWD if backward else FWD), ("stage", j), ("step", t),
                           ("version", version), ("delay", d), ("source", source)):
          tab[key][s, i] = value
        tab["serve_version"][s, o], tab["serve_delay"][s, o] = version, d
        if source == OWNER:
          transfers.append(Transfer(s, "param", o, i, j, "owner", version))
        if not backward:
          tab["state_ring"][s, i] = i > 0 or t > 0
          if tab["state_ring"][s, i]:
            transfers.append(Transfer(s, "state", (i - 1) % num_workers, i, j, "ring", 0))
          continue
        if source == OWNER:
          transfers.append(Transfer(s, "grad", i, o, j, "owner", 0))
        if i == last:
          tab["update"][s + 1, o], tab["update_step"][s + 1, o] = 1, t
  return ZeroPlan(**tab, transfers=sorted(transfers))


def cyclic_transfers(delays, num_steps: int = 1) -> list[Transfer]:
  """Every stage and gradient message of a cyclic ZeRO call, by slot (model states left out)."""
  return [t for t in zero_plan(delays, num_steps).transfers if t.kind != "state"]


def slot_traffic(timetable: str, num_workers: int, stage_bytes, rule="cdp-v2") -> dict[str, int]:
  """Bytes received per slot of one step, from the plan (balance figures).

  A cyclic transfer moves one stage's message (``stage_bytes``: one size, or one
  per stage); a ZeRO-3 all-gather or reduce-scatter of a stage moves ``(N-1)/N``
  of it per device, the gathers at the stage's forward and backward slots, the
  reduce-scatter at its backward slot.

  Returns:
    ``total_bytes`` (all devices), ``max_slot_bytes`` (all devices, busiest
    slot), ``max_slot_bytes_per_device`` (busiest device and slot) and
    ``num_slots``.
  """
  delays = schedule_lib.resolve(rule, num_workers, num_workers)
  stage_bytes = np.broadcast_to(stage_bytes, (num_workers,)).astype(int).tolist()
  inbound = defaultdict(int)  # (slot, device) -> bytes.
  if timetable == "cyclic":
    for t in cyclic_transfers(delays):
      inbound[t.slot, t.dst] += stage_bytes[t.stage]
  else:
    for j in range(num_workers):
      share = stage_bytes[j] * (num_workers - 1) // num_workers
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
