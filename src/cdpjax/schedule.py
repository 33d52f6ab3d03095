"""Cyclic schedules: delay matrices for DP, CDP-v1, CDP-v2 and general staleness.

Pure numpy, no JAX. ``d[i, j]`` is how many steps old the parameters of stage
``j`` are when worker ``i`` uses them: worker ``i`` at stage ``j`` of step ``t``
computes with ``theta^j_{t - d[i, j]}`` (``theta_{-1} := theta_0``).

The time model (DESIGN.md section 1): every stage forward or backward takes one
slot; worker ``i`` starts step ``t`` at slot ``t*2J + o_i``, with
``o_i = i*2J/N`` on the cyclic timeline and ``o_i = 0`` in lockstep (DP). The
forward of stage ``j`` runs at ``start + j``, its backward at ``start + 2J-1-j``.
``timeline`` lists these events; the profiles below are read off it.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, NamedTuple

import numpy as np

RULES = ("dp", "cdp-v1", "cdp-v2", "cdp-v2-paper")
"""Named rules. ``cdp-v2-paper`` is the authors' code variant (``j >= J-1-i`` fresh)."""

DYNAMIC_RULES = ("random", "straggler")
"""Named rules whose delays are given per step by a ``DelayRule`` (see ``make_rule``)."""

DISTRIBUTIONS = ("uniform", "geometric")
"""Laws of the ``random`` rule's entries on ``0..D``; see ``random_rule``."""


def _check_sizes(num_workers: int, num_stages: int) -> None:
  if int(num_workers) != num_workers or num_workers < 1:
    raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}.")
  if int(num_stages) != num_stages or num_stages < 1:
    raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}.")


def delay_matrix(rule: str, num_workers: int, num_stages: int) -> np.ndarray:
  """The delay matrix ``d`` of a named rule, int array of shape ``(N, J)``.

  Args:
    rule: ``dp`` (no delay), ``cdp-v1`` (every pair one step late),
      ``cdp-v2`` (stale iff ``j*N < (N-1-i)*J``, from the timeline) or
      ``cdp-v2-paper`` (the authors' code: stale iff ``j < J-1-i``).
    num_workers: ``N``, the number of workers (micro-batches per step).
    num_stages: ``J``, the number of model stages.
  """
  _check_sizes(num_workers, num_stages)
  i = np.arange(num_workers)[:, None]
  j = np.arange(num_stages)[None, :]
  shape = (num_workers, num_stages)
  if rule == "dp":
    return np.zeros(shape, dtype=np.int32)
  if rule == "cdp-v1":
    return np.ones(shape, dtype=np.int32)
  if rule == "cdp-v2":
    return (j * num_workers < (num_workers - 1 - i) * num_stages).astype(np.int32)
  if rule == "cdp-v2-paper":
    return np.broadcast_to(j < num_stages - 1 - i, shape).astype(np.int32)
  raise ValueError(
      f"Unknown rule {rule!r}. Use one of {', '.join(RULES)}, or pass an explicit "
      "(num_workers, num_stages) integer delay matrix.")


def validate_delay_matrix(delays, num_workers: int, num_stages: int) -> np.ndarray:
  """Checks a user-supplied delay matrix and returns it as an int32 array.

  Entries must be integers in ``0..D`` for some ``D >= 0``; the state then keeps
  the ``D + 1`` newest parameter versions.
  """
  _check_sizes(num_workers, num_stages)
  d = np.asarray(delays)
  if d.shape != (num_workers, num_stages):
    raise ValueError(
        f"Delay matrix has shape {d.shape}, expected (num_workers, num_stages) = "
        f"({num_workers}, {num_stages}): one row per worker, one column per stage.")
  if d.size and not np.issubdtype(d.dtype, np.integer):
    if not np.all(np.isfinite(d)) or not np.all(d == np.round(d)):
      raise ValueError(f"Delay matrix entries must be whole numbers of steps, got {d!r}.")
  if d.size and d.min() < 0:
    raise ValueError(f"Delay matrix entries must be >= 0 (steps of staleness), got min {d.min()}.")
  return d.astype(np.int32)


def resolve(rule, num_workers: int, num_stages: int) -> np.ndarray:
  """``delay_matrix`` for a rule name, ``validate_delay_matrix`` for an array."""
  if isinstance(rule, DelayRule):
    raise ValueError(
        f"{rule.name} gives a new delay matrix every step, which only cdpjax.engine runs; "
        "take one step's matrix with rule(step), or use a fixed rule here.")
  if isinstance(rule, str):
    return delay_matrix(rule, num_workers, num_stages)
  return validate_delay_matrix(rule, num_workers, num_stages)


def max_delay(rule) -> int:
  """``D``, the staleness bound a rule needs state for (``D + 1`` versions kept).

  Named rules other than ``dp`` keep one stale version whatever ``N`` and ``J``
  are, so the state's layout depends on the rule only. A ``DelayRule`` states
  its own bound.
  """
  if isinstance(rule, DelayRule):
    return rule.max_delay
  if isinstance(rule, str):
    if rule not in RULES:
      delay_matrix(rule, 1, 1)  # Raises the unknown-rule error.
    return 0 if rule == "dp" else 1
  d = np.asarray(rule)
  return int(d.max()) if d.size else 0


def is_causal(rule, num_workers: int, num_stages: int) -> bool:
  """Whether every version ``rule`` reads exists in time on the rule's timeline.

  ``dp`` runs in lockstep, where any delays ``>= 0`` are causal. Every other
  rule runs on the cyclic timeline, where ``cdp-v2`` is the freshest causal
  rule: a rule is causal iff its matrix is elementwise ``>=`` the ``cdp-v2``
  matrix. ``cdp-v2-paper`` with ``N > J`` is not causal, for example.
  """
  if isinstance(rule, str) and rule == "dp":
    return True
  delays = resolve(rule, num_workers, num_stages)
  return bool(np.all(delays >= delay_matrix("cdp-v2", num_workers, num_stages)))


class Event(NamedTuple):
  """One stage forward or backward on the timeline.

  Attributes:
    slot: exact start time, in slots (the event lasts one slot).
    worker: ``i``, the worker running it.
    step: ``t``, the training step of the micro-batch.
    stage: ``j``, the model stage.
    kind: ``"fwd"`` or ``"bwd"``.
    version: index ``v`` of the parameters ``theta^j_v`` used; the backward uses
      its forward's version.
    duration: how long the event lasts, in slots: 1 on the equal-speed
      timeline, ``(1 + jitter) / speed`` of its worker with ``speeds``.
  """
  slot: Fraction
  worker: int
  step: int
  stage: int
  kind: str
  version: int
  duration: Fraction = Fraction(1)

  @property
  def end(self) -> Fraction:
    return self.slot + self.duration


def timeline(rule, num_workers: int, num_stages: int, num_steps: int, *,
             lockstep: bool | None = None, speeds=None, jitter=None,
             max_delay: int = 1) -> list[Event]:
  """Every stage forward and backward of ``num_steps`` steps, sorted by time.

  Versions: ``dp`` reads ``theta_t``; ``cdp-v2`` reads, at each forward's start,
  the newest version of its stage available then, computed from the timing
  (stage ``j`` of ``theta_{t+1}`` becomes available when the last of the ``N``
  backwards of stage ``j`` of step ``t`` completes); ``cdp-v1``,
  ``cdp-v2-paper`` and explicit matrices read ``theta_{max(t - d[i, j], 0)}``.

  With ``speeds`` (workers of unequal speed), the rule must be ``cdp-v2``, the
  rule that reads the newest version available; see ``_uneven_timeline``.
  Equal speeds give the equal-speed timeline exactly.

  Args:
    rule: a name in ``RULES`` or an ``(N, J)`` integer delay matrix.
    num_workers: ``N``.
    num_stages: ``J``.
    num_steps: number of training steps, ``>= 1``.
    lockstep: start every worker at offset 0 (the DP timeline). Defaults to
      ``True`` for ``dp`` only.
    speeds: ``N`` positive numbers; worker ``i``'s events last ``1 / speeds[i]``
      slots. Floats are taken exactly (as binary fractions).
    jitter: optional ``(num_steps, N)`` array of numbers ``>= 0``: at step ``t``
      worker ``i``'s events last ``(1 + jitter[t, i]) / speeds[i]``.
    max_delay: ``D`` with ``speeds``: a forward waits until its stage has
      ``theta_{t-D}``, so delays stay in ``0..D`` (bounded staleness).

  Returns:
    ``Event``s sorted by ``(slot, worker, step, stage, kind)``.
  """
  delays = resolve(rule, num_workers, num_stages)
  if int(num_steps) != num_steps or num_steps < 1:
    raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}.")
  if lockstep is None:
    lockstep = isinstance(rule, str) and rule == "dp"
  if speeds is not None or jitter is not None:
    if not (isinstance(rule, str) and rule == "cdp-v2"):
      raise ValueError(
          f"speeds and jitter derive the delays from the timeline, which is the cdp-v2 rule "
          f"(read the newest version available); got rule {rule!r}. Use rule='cdp-v2'.")
    return _uneven_timeline(num_workers, num_stages, num_steps, speeds, jitter,
                            _check_max_delay(max_delay), lockstep)
  period = 2 * num_stages

  def start(i, t):
    return Fraction(t * period) + (0 if lockstep else Fraction(i * period, num_workers))

  def fwd_slot(i, t, j):
    return start(i, t) + j

  def bwd_slot(i, t, j):
    return start(i, t) + period - 1 - j

  if isinstance(rule, str) and rule == "cdp-v2":
    # ready[v][j]: when stage j of theta_{v+1} exists, i.e. when the last
    # backward of stage j of step v completes.
    ready = [[max(bwd_slot(i, v, j) for i in range(num_workers)) + 1
              for j in range(num_stages)] for v in range(num_steps)]

    def version(i, t, j):  # Ready times grow with v, so counting gives the newest.
      return sum(1 for row in ready if row[j] <= fwd_slot(i, t, j))
  else:

    def version(i, t, j):
      return max(t - int(delays[i, j]), 0)

  events = []
  for t in range(num_steps):
    for i in range(num_workers):
      for j in range(num_stages):
        v = version(i, t, j)
        events.append(Event(fwd_slot(i, t, j), i, t, j, "fwd", v))
        events.append(Event(bwd_slot(i, t, j), i, t, j, "bwd", v))
  return sorted(events)


def _exact(x, what: str) -> Fraction:
  try:
    return Fraction(x)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what} must be finite numbers, got {x!r}.") from e


def _uneven_timeline(num_workers, num_stages, num_steps, speeds, jitter, max_delay, lockstep):
  """The cyclic timeline with workers of unequal (and jittered) speeds.

  Worker ``i`` runs its steps back to back from offset ``i*2J/N`` (0 in
  lockstep), each event lasting ``u = (1 + jitter[t, i]) / speeds[i]`` slots.
  Stage ``j`` of ``theta_{t+1}`` exists once the last of the ``N`` backwards of
  stage ``j`` of step ``t`` has ended. A forward reads the newest version of
  its stage that exists when it starts, and first waits, if needed, until
  ``theta_{t-D}`` exists; so ``0 <= t - version <= D``. Exact arithmetic.
  """
  speeds = [Fraction(1)] * num_workers if speeds is None else [
      _exact(s, "speeds") for s in speeds]
  if len(speeds) != num_workers or min(speeds) <= 0:
    raise ValueError(f"speeds needs {num_workers} positive numbers (one per worker), got {speeds}.")
  jitter = np.zeros((num_steps, num_workers)) if jitter is None else np.asarray(jitter)
  if jitter.shape != (num_steps, num_workers) or not np.all(jitter >= 0):
    raise ValueError(
        f"jitter must be a (num_steps, num_workers) = ({num_steps}, {num_workers}) array of "
        f"numbers >= 0 (extra time per slot, relative); got shape {jitter.shape}.")
  period = 2 * num_stages
  clocks = [Fraction(0) if lockstep else Fraction(i * period, num_workers)
            for i in range(num_workers)]
  ready = []  # ready[v][j]: when stage j of theta_{v+1} exists.
  events = []
  for t in range(num_steps):
    bwd_ends = np.empty((num_workers, num_stages), dtype=object)
    for i in range(num_workers):
      u = (1 + _exact(jitter[t, i], "jitter")) / speeds[i]
      versions = []
      for j in range(num_stages):
        if t - max_delay >= 1:  # Bounded staleness: wait for theta_{t-D}.
          clocks[i] = max(clocks[i], ready[t - max_delay - 1][j])
        versions.append(sum(1 for row in ready if row[j] <= clocks[i]))
        events.append(Event(clocks[i], i, t, j, "fwd", versions[j], u))
        clocks[i] += u
      for j in reversed(range(num_stages)):
        events.append(Event(clocks[i], i, t, j, "bwd", versions[j], u))
        clocks[i] += u
        bwd_ends[i, j] = clocks[i]
    ready.append([max(bwd_ends[:, j]) for j in range(num_stages)])
  return sorted(events)


def delays_per_step(events, num_workers: int, num_stages: int) -> np.ndarray:
  """``t - version`` of every forward: the ``(num_steps, N, J)`` delays a timeline realises.

  Unlike ``delays_from_timeline`` (the steady state), every step is kept: a
  rule replaying them reads exactly the timeline's versions, ``theta_0``
  included.
  """
  _check_sizes(num_workers, num_stages)
  num_steps = max(e.step for e in events) + 1
  delays = np.full((num_steps, num_workers, num_stages), -1, dtype=np.int32)
  for e in events:
    if e.kind == "fwd":
      delays[e.step, e.worker, e.stage] = e.step - e.version
  if delays.min() < 0:
    raise ValueError("The timeline misses the forward of some (step, worker, stage).")
  return delays


def timeline_rule(speeds, num_stages: int, num_steps: int, *, jitter=None,
                  max_delay: int = 1) -> DelayRule:
  """The ``DelayRule`` of the uneven timeline: step ``t``'s delays from its events.

  Defined for steps ``0 .. num_steps - 1`` (the timeline is computed once).
  """
  num_workers = len(speeds)
  events = timeline("cdp-v2", num_workers, num_stages, num_steps, speeds=speeds,
                    jitter=jitter, max_delay=max_delay)
  table = delays_per_step(events, num_workers, num_stages)

  def delays_at(step):
    if not 0 <= step < num_steps:
      raise ValueError(f"This timeline rule covers steps 0..{num_steps - 1}, not {step}: "
                       "build it with a larger num_steps.")
    return table[step]

  return DelayRule(f"timeline(speeds={list(speeds)}, D={max_delay})", num_workers, num_stages,
                   int(max_delay), delays_at)


def delays_from_timeline(events, num_workers: int, num_stages: int) -> np.ndarray:
  """The delay matrix a timeline realises: ``t - version`` at its last step.

  The last step is the steady state once ``num_steps > D``: earlier steps may
  read ``theta_0`` in place of an older, non-existent version.
  """
  _check_sizes(num_workers, num_stages)
  last = max(e.step for e in events)
  if last < 1:
    raise ValueError("delays_from_timeline needs a timeline of at least 2 steps.")
  delays = np.full((num_workers, num_stages), -1, dtype=np.int32)
  for e in events:
    if e.step == last and e.kind == "fwd":
      delays[e.worker, e.stage] = last - e.version
  if delays.min() < 0:
    raise ValueError("The timeline misses forwards of some (worker, stage) pair at its last step.")
  return delays


class ActivationProfile(NamedTuple):
  """Stage activations alive across all workers, on a grid of ``1/N`` slot.

  Attributes:
    times: float array, ``times[k] = k / N`` in slots.
    alive: int array, the number of (worker, step, stage) activations alive
      during ``[times[k], times[k] + 1/N)``; one activation is what one stage
      stores for its backward, alive from the start of its forward to the end
      of its backward.
  """
  times: np.ndarray
  alive: np.ndarray


class CommunicationProfile(NamedTuple):
  """When gradient contributions arrive and stage reductions can start.

  Attributes:
    times: float array, ``times[k] = k / N`` in slots.
    contributions: int array, the number of (worker, stage) gradient
      contributions completed at exactly ``times[k]`` (one per backward, at its
      end).
    reduction_slots: float array of shape ``(num_steps, J)``: when the last of
      the ``N`` contributions to stage ``j`` of step ``t`` arrives, in slots;
      the stage's reduction (and so its update) can start then.
  """
  times: np.ndarray
  contributions: np.ndarray
  reduction_slots: np.ndarray


def _ticks(slot: Fraction, num_workers: int) -> int:
  """A time in grid units of ``1/N`` slot."""
  ticks = slot * num_workers
  if ticks.denominator != 1:
    raise ValueError(f"Event time {slot} is not on the 1/{num_workers} slot grid.")
  return int(ticks)


def _check_events(events, num_workers: int, num_stages: int) -> None:
  _check_sizes(num_workers, num_stages)
  if not events:
    raise ValueError("The timeline has no events.")
  for e in events:
    if not (0 <= e.worker < num_workers and 0 <= e.stage < num_stages):
      raise ValueError(
          f"{e} does not fit num_workers={num_workers}, num_stages={num_stages}; "
          "pass the sizes the timeline was built with.")


def activation_profile(events, num_workers: int, num_stages: int) -> ActivationProfile:
  """Counts the stage activations alive over time; see ``ActivationProfile``."""
  _check_events(events, num_workers, num_stages)
  ends = [_ticks(e.slot + 1, num_workers) for e in events]
  change = np.zeros(max(ends) + 1, dtype=np.int64)
  for e, end in zip(events, ends):
    if e.kind == "fwd":
      change[_ticks(e.slot, num_workers)] += 1
    else:
      change[end] -= 1
  alive = np.cumsum(change)[:-1]
  return ActivationProfile(np.arange(alive.size) / num_workers, alive)


def communication_profile(events, num_workers: int, num_stages: int) -> CommunicationProfile:
  """Counts gradient contributions over time; see ``CommunicationProfile``."""
  _check_events(events, num_workers, num_stages)
  num_steps = max(e.step for e in events) + 1
  backwards = [e for e in events if e.kind == "bwd"]
  ends = [_ticks(e.slot + 1, num_workers) for e in backwards]
  contributions = np.zeros(max(ends) + 1, dtype=np.int64)
  reduction_ticks = np.full((num_steps, num_stages), -1, dtype=np.int64)
  for e, end in zip(backwards, ends):
    contributions[end] += 1
    reduction_ticks[e.step, e.stage] = max(reduction_ticks[e.step, e.stage], end)
  times = np.arange(contributions.size) / num_workers
  return CommunicationProfile(times, contributions, reduction_ticks / num_workers)


# Delays that change every step.


class DelayRule(NamedTuple):
  """A rule whose ``(N, J)`` delay matrix may change at every step.

  ``rule(step)`` is the matrix of step ``step``: int32 entries in
  ``0..max_delay``, a pure function of the step (and of the seed the factory
  closed over), so a resumed run reads the same delays and any run can be
  replayed from its config. The engine takes the matrix as data: a new matrix
  never recompiles the step.

  Attributes:
    name: what the rule is, for logs (``"random(uniform, D=2, seed=0)"``).
    num_workers: ``N``.
    num_stages: ``J``.
    max_delay: ``D``; the state keeps the ``D + 1`` newest versions.
    delays_at: ``step -> (N, J)`` integer array.
  """
  name: str
  num_workers: int
  num_stages: int
  max_delay: int
  delays_at: Callable[[int], np.ndarray]

  def __call__(self, step: int) -> np.ndarray:
    """The checked delay matrix of ``step``."""
    d = validate_delay_matrix(self.delays_at(int(step)), self.num_workers, self.num_stages)
    if d.max(initial=0) > self.max_delay:
      raise ValueError(
          f"{self.name} gave delay {d.max()} at step {step}, above its max_delay "
          f"{self.max_delay}: clip the function's output or raise max_delay.")
    return d

  def window(self, start: int, count: int) -> np.ndarray:
    """The matrices of steps ``start .. start + count - 1``, shape ``(count, N, J)``."""
    return np.stack([self(start + k) for k in range(count)])


def _check_max_delay(value) -> int:
  if isinstance(value, (bool, np.bool_)) or int(value) != value or value < 0:
    raise ValueError(f"max_delay must be an integer >= 0, got {value!r}.")
  return int(value)


def truncated_geometric(max_delay: int, p: float) -> np.ndarray:
  """``P(d = k) = p (1-p)^k / Z`` on ``k = 0..D``: a geometric law truncated at ``D``."""
  if not 0 < p <= 1:
    raise ValueError(f"The geometric law needs 0 < p <= 1, got p={p!r}.")
  probs = p * (1 - p) ** np.arange(_check_max_delay(max_delay) + 1)
  return probs / probs.sum()


def delay_probabilities(distribution: str, max_delay: int, p: float = 0.5) -> np.ndarray:
  """The law of one entry of the ``random`` rule on ``0..D``."""
  max_delay = _check_max_delay(max_delay)
  if distribution == "uniform":
    return np.full(max_delay + 1, 1.0 / (max_delay + 1))
  if distribution == "geometric":
    return truncated_geometric(max_delay, p)
  raise ValueError(f"Unknown delay distribution {distribution!r}: use one of {DISTRIBUTIONS}.")


def random_rule(num_workers: int, num_stages: int, max_delay: int, *,
                distribution: str = "uniform", p: float = 0.5, seed: int = 0) -> DelayRule:
  """Entries drawn i.i.d. from ``distribution`` on ``0..D``, afresh every step.

  ``uniform``: each of ``0..D`` with probability ``1/(D+1)``. ``geometric``:
  ``P(k) = p (1-p)^k`` renormalised on ``0..D`` (``truncated_geometric``). The
  draws of step ``t`` come from ``numpy.random.default_rng((seed, t))``: a pure
  function of ``(seed, t)``.
  """
  _check_sizes(num_workers, num_stages)
  probs = delay_probabilities(distribution, max_delay, p)
  law = distribution if distribution == "uniform" else f"geometric p={p}"

  def delays_at(step):
    rng = np.random.default_rng((int(seed), int(step)))
    return rng.choice(probs.size, size=(num_workers, num_stages), p=probs).astype(np.int32)

  return DelayRule(f"random({law}, D={max_delay}, seed={seed})", num_workers, num_stages,
                   int(max_delay), delays_at)


def straggler_rule(num_workers: int, num_stages: int, max_delay: int, *,
                   stragglers=1, base: str = "cdp-v2") -> DelayRule:
  """Persistent stragglers: their gradients are ``D`` steps old at every stage.

  The slow workers' gradients reach the update ``D`` steps after they read
  their parameters, as in asynchronous SGD with a slow node, so every stage of
  their rows reads ``theta_{t-D}``; the other workers follow ``base``.

  Args:
    num_workers: ``N``.
    num_stages: ``J``.
    max_delay: ``D >= 1``, the stragglers' delay.
    stragglers: how many slow workers (the last ones, which start last on the
      cyclic timeline) as an int, or their indices as a sequence.
    base: the named rule of the other workers.
  """
  _check_sizes(num_workers, num_stages)
  max_delay = _check_max_delay(max_delay)
  if isinstance(stragglers, (int, np.integer)):
    if not 0 <= stragglers <= num_workers:
      raise ValueError(f"stragglers={stragglers} must be in 0..num_workers={num_workers}.")
    rows = list(range(num_workers - int(stragglers), num_workers))
  else:
    rows = sorted({int(i) for i in stragglers})
    if any(not 0 <= i < num_workers for i in rows):
      raise ValueError(f"Straggler indices {rows} must lie in 0..{num_workers - 1}.")
  matrix = delay_matrix(base, num_workers, num_stages).copy()
  if matrix.max(initial=0) > max_delay:
    raise ValueError(f"max_delay={max_delay} is below the {base!r} rule's delays: use max_delay >= 1.")
  matrix[rows] = max_delay
  return DelayRule(f"straggler(workers={rows}, D={max_delay}, base={base})", num_workers,
                   num_stages, max_delay, lambda step: matrix)


def function_rule(fn: Callable[[int, int, int], np.ndarray], num_workers: int, num_stages: int,
                  max_delay: int, name: str = "function") -> DelayRule:
  """Any user function ``fn(step, N, J) -> (N, J)`` matrix with entries in ``0..D``.

  ``fn`` must be a pure function of its arguments for runs to resume exactly.
  """
  _check_sizes(num_workers, num_stages)
  return DelayRule(name, num_workers, num_stages, _check_max_delay(max_delay),
                   lambda step: fn(step, num_workers, num_stages))


def make_rule(rule: str, num_workers: int, num_stages: int, *, max_delay: int = 1,
              distribution: str = "uniform", p: float = 0.5, stragglers=1, seed: int = 0):
  """A named rule: the matrix of ``RULES`` or the ``DelayRule`` of ``DYNAMIC_RULES``."""
  if rule == "random":
    return random_rule(num_workers, num_stages, max_delay, distribution=distribution, p=p,
                       seed=seed)
  if rule == "straggler":
    return straggler_rule(num_workers, num_stages, max_delay, stragglers=stragglers)
  if isinstance(rule, str) and rule not in RULES:
    raise ValueError(f"Unknown rule {rule!r}. Use one of {', '.join(RULES + DYNAMIC_RULES)}.")
  return rule
