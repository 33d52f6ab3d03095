"""Delay matrices, the timeline they come from, and its memory/communication profiles."""
import math
from fractions import Fraction

import numpy as np
import pytest

from cdpjax import schedule

SIZES = [(n, j) for n in range(1, 9) for j in range(1, 9)]


def newest_available(events):
  """Per forward, the newest version of its stage whose backwards have all ended.

  Stage ``j`` of ``theta_{v+1}`` exists once every backward of stage ``j`` of
  step ``v`` has ended; ``theta_0`` always exists. Recomputed here from the
  events alone, independently of ``schedule.timeline``.
  """
  ready = {}
  for e in events:
    if e.kind == "bwd":
      key = (e.step + 1, e.stage)
      ready[key] = max(ready.get(key, e.end), e.end)
  def newest(e):
    return max(v for v in range(e.step + 2)
               if v == 0 or ready.get((v, e.stage), math.inf) <= e.slot)

  return {(e.worker, e.step, e.stage): newest(e) for e in events if e.kind == "fwd"}


# Delay matrices.


@pytest.mark.parametrize("n,j,expected", [
    (3, 3, [[1, 1, 0], [1, 0, 0], [0, 0, 0]]),
    (4, 2, [[1, 1], [1, 0], [1, 0], [0, 0]]),
    (2, 4, [[1, 1, 0, 0], [0, 0, 0, 0]]),
])
def test_cdp_v2_design_examples(n, j, expected):
  np.testing.assert_array_equal(schedule.delay_matrix("cdp-v2", n, j), expected)


@pytest.mark.parametrize("n,j", SIZES)
def test_named_rules(n, j):
  assert not schedule.delay_matrix("dp", n, j).any()
  assert (schedule.delay_matrix("cdp-v1", n, j) == 1).all()
  v2 = schedule.delay_matrix("cdp-v2", n, j)
  assert v2.shape == (n, j) and v2.dtype == np.int32 and v2.max() <= 1
  assert not v2[-1].any()  # The last worker starts last: always fresh.
  if n == j:  # The formula equals the authors' code when N == J.
    np.testing.assert_array_equal(v2, schedule.delay_matrix("cdp-v2-paper", n, j))


def test_max_delay_and_resolve():
  assert schedule.max_delay("dp") == 0
  assert schedule.max_delay("cdp-v2") == 1
  assert schedule.max_delay(np.array([[0, 2], [3, 0]])) == 3
  np.testing.assert_array_equal(schedule.resolve([[0, 2], [1, 0]], 2, 2), [[0, 2], [1, 0]])
  np.testing.assert_array_equal(schedule.resolve("cdp-v1", 2, 3), np.ones((2, 3)))


# The timeline.


def test_timeline_time_model():
  n, j, t = 3, 2, 2
  events = schedule.timeline("cdp-v2", n, j, t)
  assert events == sorted(events) and len(events) == 2 * n * j * t
  by_key = {(e.worker, e.step, e.stage, e.kind): e for e in events}
  for (i, step, stage, kind), e in by_key.items():
    start = step * 2 * j + Fraction(i * 2 * j, n)
    assert e.slot == start + (stage if kind == "fwd" else 2 * j - 1 - stage)
    assert e.version == by_key[(i, step, stage, "fwd")].version
  dp_events = schedule.timeline("dp", n, j, t)
  assert {e.slot for e in dp_events if e.step == 1 and e.stage == 0} == {4, 7}


def test_timeline_cdp_v2_worked_example():
  # N = J = 2: worker 1 starts 2 slots after worker 0. Stage 0 of theta_1 needs
  # worker 1's stage-0 backward (slots 5..6), so worker 0's step-1 forward of
  # stage 0 (slot 4) reads theta_0; its stage 1 (slot 5) reads theta_1, which
  # exists from slot 5 (worker 1's stage-1 backward ran at slots 4..5).
  events = schedule.timeline("cdp-v2", 2, 2, 2)
  fwd = {(e.worker, e.step, e.stage): (e.slot, e.version) for e in events if e.kind == "fwd"}
  assert fwd[(0, 1, 0)] == (4, 0)
  assert fwd[(0, 1, 1)] == (5, 1)
  assert fwd[(1, 1, 0)] == (6, 1)


@pytest.mark.parametrize("rule", ["dp", "cdp-v1", "cdp-v2"])
def test_timeline_delays_equal_closed_form(rule):
  for n, j in SIZES:
    events = schedule.timeline(rule, n, j, 3)
    np.testing.assert_array_equal(
        schedule.delays_from_timeline(events, n, j), schedule.delay_matrix(rule, n, j),
        err_msg=f"{rule} N={n} J={j}")


@pytest.mark.parametrize("rule", ["dp", "cdp-v2"])
def test_versions_are_the_newest_available(rule):
  for n, j in SIZES[::3]:
    events = schedule.timeline(rule, n, j, 3)
    newest = newest_available(events)
    assert all(e.version == newest[(e.worker, e.step, e.stage)] for e in events if e.kind == "fwd")


def test_is_causal_matches_the_timeline():
  rules = ["dp", "cdp-v1", "cdp-v2", "cdp-v2-paper", np.zeros, np.ones]
  for n, j in SIZES[::5]:
    for rule in rules:
      rule = rule if isinstance(rule, str) else rule((n, j), dtype=int)
      events = schedule.timeline(rule, n, j, 3)
      newest = newest_available(events)
      causal = all(e.version <= newest[(e.worker, e.step, e.stage)]
                   for e in events if e.kind == "fwd")
      assert schedule.is_causal(rule, n, j) == causal, (rule, n, j)
  assert not schedule.is_causal("cdp-v2-paper", 4, 2)
  assert schedule.is_causal("cdp-v2-paper", 2, 4)


def test_explicit_matrix_versions_clip_at_zero():
  delays = np.array([[2, 0], [1, 3]])
  events = schedule.timeline(delays, 2, 2, 4)
  for e in events:
    assert e.version == max(e.step - delays[e.worker, e.stage], 0)
  np.testing.assert_array_equal(schedule.delays_from_timeline(events, 2, 2), delays)


def test_lockstep_cdp_v2_is_dp():
  events = schedule.timeline("cdp-v2", 3, 2, 3, lockstep=True)
  assert events == schedule.timeline("dp", 3, 2, 3)


# Activation memory.


@pytest.mark.parametrize("n,j", SIZES)
def test_cdp_activation_profile(n, j):
  steps = 3
  alive = schedule.activation_profile(schedule.timeline("cdp-v2", n, j, steps), n, j).alive
  # Steady state: from the last worker's start until the first worker's end.
  # Each activation of stage j lives 2J - 2j slots, J(J+1) slot-activations per
  # micro-batch, N micro-batches per 2J slots: the mean is N(J+1)/2.
  first = 2 * j * (n - 1)  # o_{N-1} in ticks of 1/N slot.
  steady = alive[first:steps * 2 * j * n]
  assert steady[:2 * j * n].sum() * 2 == n * (j + 1) * 2 * j * n
  if n % 2 == 0 or n == j:
    # Workers i and i + N/2 are J slots apart and hold J+1 activations together
    # (N = J: the offsets cover every other slot, and the same sum follows).
    assert steady.min() == steady.max() == n * (j + 1) / 2
  assert alive.max() <= n * j


@pytest.mark.parametrize("n,j", [(1, 1), (2, 2), (4, 3), (3, 5)])
def test_dp_activation_profile(n, j):
  steps = 3
  profile = schedule.activation_profile(schedule.timeline("dp", n, j, steps), n, j)
  # Slot k of each step: stages 0..k alive going up, then freed one per slot.
  per_step = np.repeat([n * min(k + 1, 2 * j - k) for k in range(2 * j)], n)
  np.testing.assert_array_equal(profile.alive, np.tile(per_step, steps))
  np.testing.assert_array_equal(profile.times, np.arange(steps * 2 * j * n) / n)
  assert profile.alive.max() == n * j  # Peak at the end of the forward pass.
  assert profile.alive[::2 * j * n].tolist() == [n] * steps  # Only stage 0 at step boundaries.


# Communication.


@pytest.mark.parametrize("n,j", SIZES)
def test_communication_profile(n, j):
  steps = 3
  dp = schedule.communication_profile(schedule.timeline("dp", n, j, steps), n, j)
  cdp = schedule.communication_profile(schedule.timeline("cdp-v2", n, j, steps), n, j)
  for profile in (dp, cdp):
    assert profile.contributions.sum() == n * j * steps
    assert profile.times.shape == profile.contributions.shape
  # DP: the N contributions of a stage arrive together, one stage per slot.
  assert set(dp.contributions[dp.contributions > 0].tolist()) == {n}
  np.testing.assert_array_equal(
      dp.reduction_slots, [[t * 2 * j + 2 * j - s for s in range(j)] for t in range(steps)])
  # CDP: a stage's N contributions arrive 2J/N slots apart. At one instant, the
  # gcd(N, 2J) workers whose offsets agree modulo 1 slot are 2J/gcd apart and a
  # worker's backwards end in J consecutive slots of 2J, so at most
  # ceil(gcd(N, 2J) / 2) contributions coincide, and that many do in steady state.
  assert cdp.contributions.max() == math.ceil(math.gcd(n, 2 * j) / 2)
  events = schedule.timeline("cdp-v2", n, j, steps)
  for t in range(steps):
    for s in range(j):
      ends = sorted(e.slot + 1 for e in events if e.kind == "bwd" and (e.step, e.stage) == (t, s))
      assert [b - a for a, b in zip(ends, ends[1:])] == [Fraction(2 * j, n)] * (n - 1)
      last_offset = Fraction(2 * j * (n - 1), n)
      assert cdp.reduction_slots[t, s] == float(t * 2 * j + last_offset + 2 * j - s)
      assert cdp.reduction_slots[t, s] == float(ends[-1])


# Errors.


@pytest.mark.parametrize("args,match", [
    (("cdp-v3", 2, 2, 1), "Unknown rule"),
    (("dp", 0, 2, 1), "num_workers"),
    (("dp", 2, 0, 1), "num_stages"),
    (("dp", 2, 2, 0), "num_steps"),
    (("dp", 2, 2, 1.5), "num_steps"),
    ((np.zeros((2, 3), int), 2, 2, 1), "shape"),
    ((-np.ones((2, 2), int), 2, 2, 1), ">= 0"),
    ((np.full((2, 2), 0.5), 2, 2, 1), "whole numbers"),
])
def test_timeline_errors(args, match):
  with pytest.raises(ValueError, match=match):
    schedule.timeline(*args)


def test_profile_errors():
  one_step = schedule.timeline("cdp-v2", 2, 2, 1)
  with pytest.raises(ValueError, match="at least 2 steps"):
    schedule.delays_from_timeline(one_step, 2, 2)
  with pytest.raises(ValueError, match="num_workers=1"):
    schedule.activation_profile(one_step, 1, 2)
  with pytest.raises(ValueError, match="no events"):
    schedule.communication_profile([], 2, 2)
  with pytest.raises(ValueError, match="1/2 slot grid"):
    schedule.activation_profile([schedule.Event(Fraction(1, 3), 0, 0, 0, "fwd", 0)], 2, 1)


# Workers of unequal speed.


@pytest.mark.parametrize("n,j", [(1, 1), (2, 4), (3, 3), (4, 2), (5, 3), (8, 4)])
def test_equal_speeds_reduce_to_cdp_v2(n, j):
  events = schedule.timeline("cdp-v2", n, j, 5, speeds=[1.0] * n, max_delay=2)
  assert events == schedule.timeline("cdp-v2", n, j, 5)
  np.testing.assert_array_equal(schedule.delays_per_step(events, n, j)[-1],
                                schedule.delay_matrix("cdp-v2", n, j))


def test_uneven_speeds_read_the_newest_version_within_the_bound():
  n, j, steps, bound = 4, 3, 10, 2
  jitter = np.random.default_rng(0).uniform(0, 0.6, size=(steps, n))
  events = schedule.timeline("cdp-v2", n, j, steps, speeds=[1, 1.5, 1, 0.6], jitter=jitter,
                             max_delay=bound)
  delays = schedule.delays_per_step(events, n, j)
  assert delays.max() == bound and delays.min() == 0
  newest = newest_available(events)
  by_key = {(e.worker, e.step, e.stage): e for e in events if e.kind == "fwd"}
  for key, e in by_key.items():
    # The newest version, unless the forward waited for theta_{t-D} (then it is exactly that).
    assert e.version == newest[key] or e.version == e.step - bound
  # Each worker's events are back to back, each (1 + jitter) / speed long.
  for i, speed in enumerate([1, 1.5, 1, 0.6]):
    mine = [e for e in events if e.worker == i]
    assert all(e.duration == (1 + Fraction(jitter[e.step, i])) / Fraction(speed) for e in mine)
    assert all(a.end <= b.slot for a, b in zip(mine, mine[1:]))
  # The slowest worker's gradients close every update: it never waits, so it reads fresh.
  assert not delays[2:, 3].any() and (delays[-1, :3] == bound).all()


def test_timeline_rule_replays_the_timeline():
  rule = schedule.timeline_rule([1, 1, 0.5], 2, 6, max_delay=2)
  events = schedule.timeline("cdp-v2", 3, 2, 6, speeds=[1, 1, 0.5], max_delay=2)
  np.testing.assert_array_equal(rule.window(0, 6), schedule.delays_per_step(events, 3, 2))
  with pytest.raises(ValueError, match="covers steps 0..5, not 6"):
    rule(6)
  with pytest.raises(ValueError, match="rule='cdp-v2'"):
    schedule.timeline("cdp-v1", 3, 2, 2, speeds=[1, 1, 1])
  with pytest.raises(ValueError, match="speeds needs 3 positive numbers"):
    schedule.timeline("cdp-v2", 3, 2, 2, speeds=[1, 0, 1])
  with pytest.raises(ValueError, match="jitter must be a"):
    schedule.timeline("cdp-v2", 3, 2, 2, jitter=np.ones((3, 3)))
