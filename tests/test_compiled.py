"""Collectives, memory and FLOPs read from small compiled programs on 8 CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import compiled, hlo

SHARD_BYTES = 4 * 16 * 4  # One device's f32[4, 16] shard of the f32[32, 16] input.
ALL_DEVICES = (tuple(range(8)),)
RING = tuple((i, (i + 1) % 8) for i in range(8))


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def x(mesh):
  # make_mesh axes are Explicit: the input must already carry the sharding.
  return jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("data")))


def _lower(mesh, x, body, out_specs=P("data")):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs)).lower(x)


# Received bytes per device of a ring algorithm over 8 devices: an all-reduce receives 2 * 7/8
# of its result, an all-gather 7 of the 8 shards, a reduce-scatter 7 partial shards.
@pytest.mark.parametrize("body, out_specs, kind, nbytes, groups, pairs, received", [
    (lambda a: jax.lax.psum(a, "data"), P(), "all-reduce", SHARD_BYTES, ALL_DEVICES, None,
     2 * 7 / 8 * SHARD_BYTES),
    (lambda a: jax.lax.ppermute(a, "data", RING), P("data"), "collective-permute", SHARD_BYTES,
     None, RING, SHARD_BYTES),
    (lambda a: jax.lax.ppermute(a, "data", RING[:2]), P("data"), "collective-permute",
     SHARD_BYTES, None, RING[:2], SHARD_BYTES * 2 / 8),
    (lambda a: jax.lax.all_gather(a, "data", tiled=True), P("data"), "all-gather",
     8 * SHARD_BYTES, ALL_DEVICES, None, 7 * SHARD_BYTES),
    (lambda a: jax.lax.psum_scatter(a, "data", scatter_dimension=1, tiled=True), P("data"),
     "reduce-scatter", SHARD_BYTES // 8, ALL_DEVICES, None, 7 * SHARD_BYTES / 8),
], ids=["psum", "ppermute", "ppermute_two_pairs", "all_gather", "psum_scatter"])
def test_one_collective(mesh, x, body, out_specs, kind, nbytes, groups, pairs, received):
  lowered = _lower(mesh, x, body, out_specs)
  hlo_text = lowered.compile().as_text()
  (found,) = hlo.collectives(hlo_text)
  assert (found.kind, found.bytes, found.replica_groups, found.source_target_pairs) == (
      kind, nbytes, groups, pairs)
  assert not found.is_async
  summary = hlo.collective_summary(hlo_text)
  assert summary == {k: {"count": int(k == kind), "bytes": nbytes * (k == kind),
                         "count_min": int(k == kind), "count_max": int(k == kind),
                         "bytes_min": nbytes * (k == kind), "bytes_max": nbytes * (k == kind),
                         "count_mean": int(k == kind), "bytes_mean": nbytes * (k == kind),
                         "received_min": pytest.approx(received * (k == kind)),
                         "received_max": pytest.approx(received * (k == kind)),
                         "received_mean": pytest.approx(received * (k == kind))}
                     for k in hlo.KINDS}
  assert hlo.stablehlo_collectives(lowered.as_text()) == {
      k: int(k == kind) for k in hlo.KINDS}


def test_three_psums_are_three_stablehlo_all_reduces(mesh, x):
  lowered = _lower(mesh, x, lambda a: sum(jax.lax.psum(a * c, "data") for c in (1., 2., 3.)), P())
  assert hlo.stablehlo_collectives(lowered.as_text())["all-reduce"] == 3
  # XLA may combine them into one tuple-shaped all-reduce; the bytes are unchanged.
  assert hlo.collective_summary(lowered.compile().as_text())["all-reduce"]["bytes"] == (
      3 * SHARD_BYTES)


def test_memory_reads_the_per_device_shard(mesh, x):
  stats = compiled.memory(_lower(mesh, x, lambda a: jnp.tanh(a) @ a.T @ a).compile())
  assert stats["argument_bytes"] == SHARD_BYTES
  assert stats["output_bytes"] == SHARD_BYTES
  assert min(stats.values()) >= 0 and stats["peak_bytes"] > 0
  assert stats["peak_bytes"] == (stats["argument_bytes"] + stats["output_bytes"]
                                 + stats["temp_bytes"] - stats["alias_bytes"])


def test_buffer_assignment_holds_arguments_and_outputs(mesh, x, tmp_path):
  """The dumped buffer assignment of the default memory space: at least the shard passed in
  and the one returned (not donated)."""
  program = _lower(mesh, x, lambda a: jnp.tanh(a) @ a.T @ a).compile(
      compiler_options={"xla_dump_to": str(tmp_path)})
  assignment = compiled.buffer_assignment(str(tmp_path))
  total, by_kind = assignment["spaces"]["default"], assignment["default_by_kind"]
  assert total >= 2 * SHARD_BYTES and by_kind["parameter"] >= SHARD_BYTES, assignment
  assert sum(by_kind.values()) == total  # The allocations add up to the report's total.
  ranges = assignment["temp_ranges"]  # Disjoint, inside the heap, each a large value's.
  assert all(a["offset"] + a["bytes"] <= b["offset"] for a, b in zip(ranges, ranges[1:]))
  assert all(0.02 * by_kind["temp"] <= r["bytes"] and r["offset"] + r["bytes"] <= by_kind["temp"]
             and r["values"] for r in ranges)
  # The heap's array slots: the large ranges' values are arrays, all within the heap.
  assert sum(r["bytes"] for r in ranges) <= assignment["temp_arrays"] <= by_kind.get("temp", 0)
  assert assignment["temp_tuple_tables"] == sum(assignment["temp_tuple_tables_by_kind"].values())
  peak = assignment["temp_live_peak"]  # The most of the heap live at once: within it, and what.
  assert 0 < peak["bytes"] <= by_kind["temp"] and peak["at"], peak
  assert 0 < sum(v["bytes"] for v in peak["values"]) <= peak["bytes"], peak
  with pytest.raises(ValueError, match="found 0"):
    compiled.buffer_assignment(str(tmp_path / "empty"))
  del program


def test_flops_of_a_matmul():
  a, b = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.float32)
  assert compiled.flops(jax.jit(jnp.matmul).lower(a, b).compile()) == 2 * 8 * 16 * 4


# GPU-style async pairs (not emitted on CPU): operands typed, tiled layouts, iota groups.
ASYNC_HLO = """
  %ag-start = (f32[4,16]{1,0}, f32[32,16]{1,0}) all-gather-start(f32[4,16]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %ag-done = f32[32,16]{1,0} all-gather-done((f32[4,16]{1,0}, f32[32,16]{1,0}) %ag-start)
  %cp-start = (bf16[8]{0:T(128)}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[8]{0} collective-permute-done(%cp-start)
  ROOT %ar = (pred[3]{0}, s8[5]{0}) all-reduce(%r, %s), replica_groups={{0,1},{2,3}}, to_apply=%or
  %gte = pred[3]{0} get-tuple-element(%ar), index=0, metadata={op_name="all-reduce(x)"}
"""


def test_async_pairs_count_once_with_the_done_payload():
  found = hlo.collectives(ASYNC_HLO)
  assert [(c.name, c.kind, c.bytes, c.is_async) for c in found] == [
      ("ag-start", "all-gather", 32 * 16 * 4, True),
      ("cp-start", "collective-permute", 8 * 2, True),
      ("ar", "all-reduce", 3 + 5, False)]
  assert found[0].replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert found[1].source_target_pairs == ((0, 1), (1, 0))
  assert found[2].replica_groups == ((0, 1), (2, 3))


@pytest.mark.parametrize("shape, nbytes", [
    ("f32[4,16]{1,0}", 256), ("bf16[3]", 6), ("f16[2,2]", 8), ("f64[2]", 16), ("s32[]", 4),
    ("u32[2]", 8), ("pred[7]", 7), ("s8[3]", 3), ("u8[3]", 3), ("s4[3]", 2), ("c64[1]", 8),
    ("f8e4m3fn[4]", 4), ("(f32[2], /*index=1*/u32[], token[])", 12), ("f32[<=8]", 32)])
def test_shape_bytes(shape, nbytes):
  assert hlo.shape_bytes(shape) == nbytes


def test_collective_schedule_counts_compute_after_each_collective(mesh, x):
  """psum(x @ w) needs the dot first; psum(x) then a dot leaves the dot after it."""
  w = jnp.ones((16, 16))

  def reduce_after(a):
    return jax.lax.psum(jnp.tanh(a @ w), "data")

  def reduce_before(a):
    return jnp.tanh(jax.lax.psum(a, "data") @ w)

  after, num_after = hlo.collective_schedule(
      _lower(mesh, x, reduce_after, P()).compile().as_text())
  before, num_before = hlo.collective_schedule(
      _lower(mesh, x, reduce_before, P()).compile().as_text())
  assert num_after == num_before == 1
  assert [(c.kind, c.compute_after) for c in after] == [("all-reduce", 0)]
  assert [(c.kind, c.compute_after) for c in before] == [("all-reduce", 1)]
  assert before[0].bytes == SHARD_BYTES


FUSED_HLO = """HloModule m, num_partitions=2

%fused (p.0: f32[4]) -> f32[8] {
  %p.0 = f32[4]{0} parameter(0)
  ROOT %ag = f32[8]{0} all-gather(%p.0), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[4], w: f32[8,8]) -> f32[8] {
  %a = f32[4]{0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %f = f32[8]{0} fusion(%a), kind=kCustom, calls=%fused
  ROOT %d = f32[8]{0} dot(%w, %f), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_collective_schedule_places_a_fused_collective_at_its_fusion():
  scheduled, num_compute = hlo.collective_schedule(FUSED_HLO)
  assert [(c.kind, c.bytes, c.position, c.compute_after) for c in scheduled] == [
      ("all-gather", 32, 2, 1)]
  assert num_compute == 1


ASYNC_SCHEDULE_HLO = """HloModule m, num_partitions=2

ENTRY %main (a: f32[4], w: f32[4,4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %w = f32[4,4]{1,0} parameter(1)
  %cp = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %d.0 = f32[4]{0} dot(%w, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d.1 = f32[4]{0} dot(%w, %d.0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %got = f32[4]{0} collective-permute-done(%cp)
  %ar = f32[4]{0} all-reduce(%got), replica_groups={{0,1}}, to_apply=%add
  ROOT %d.2 = f32[4]{0} dot(%w, %ar), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_collective_schedule_counts_the_compute_an_async_collective_runs_beside():
  """Two dots between the permute's start and done; the synchronous all-reduce runs beside none."""
  scheduled, num_compute = hlo.collective_schedule(ASYNC_SCHEDULE_HLO)
  assert [(c.kind, c.bytes, c.compute_after, c.compute_during) for c in scheduled] == [
      ("collective-permute", 16, 3, 2), ("all-reduce", 16, 1, 0)]
  assert num_compute == 3


def test_collective_schedule_needs_an_entry():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo.collective_schedule("HloModule m\n")


def _scan_with_conds(a):
  """In a 5-trip scan: a psum runs 5 times; a ppermute under ``i % 2 == 0`` (i = 0..4) 3 times;
  one under a data-dependent predicate 0 to 5 times (bounded)."""
  back = tuple((d, s) for s, d in RING)

  def step(c, i):
    c = jax.lax.cond(i % 2 == 0, lambda c: jax.lax.ppermute(c, "data", RING), lambda c: 2 * c, c)
    c = jax.lax.cond(c[0, 0] > 1, lambda c: jax.lax.ppermute(c, "data", back), lambda c: 3 * c, c)
    return c + jax.lax.psum(c, "data"), None
  return jax.lax.scan(step, a, jnp.arange(5))[0]


def _check_scan_with_conds(summary):
  assert summary["all-reduce"] == {"count": 1, "bytes": SHARD_BYTES, "count_min": 5,
                                   "count_max": 5, "count_mean": 5, "bytes_min": 5 * SHARD_BYTES,
                                   "bytes_max": 5 * SHARD_BYTES, "bytes_mean": 5 * SHARD_BYTES,
                                   "received_min": pytest.approx(5 * 2 * 7 / 8 * SHARD_BYTES),
                                   "received_max": pytest.approx(5 * 2 * 7 / 8 * SHARD_BYTES),
                                   "received_mean": pytest.approx(5 * 2 * 7 / 8 * SHARD_BYTES)}
  permute = summary["collective-permute"]
  assert permute["count"] == 2
  assert (permute["count_min"], permute["count_max"]) == (3, 3 + 5)
  # Every pair of the ring targets another device: each permute receives its whole result.
  assert (permute["received_min"], permute["received_max"]) == (
      pytest.approx(3 * SHARD_BYTES), pytest.approx(8 * SHARD_BYTES))


def test_per_step_on_the_tpu_compiler():
  """The same program compiled for v5e:2x4 (whose loops carry no known_trip_count): the same
  figures, as `aot.report` gives them."""
  pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu: pip install -e '.[test]'")
  from cdpjax import aot  # pylint: disable=g-import-not-at-top
  tpu_mesh = jax.sharding.Mesh(aot.topology_devices("v5e:2x4"), ("data",))
  x = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(tpu_mesh, P("data")))
  _check_scan_with_conds(aot.report(_lower(tpu_mesh, x, _scan_with_conds), "v5e:2x4")[
      "collectives"])


def test_per_step_weights_a_scan_and_follows_or_bounds_conds(mesh, x):
  text = compiled.hlo_text(_lower(mesh, x, _scan_with_conds).compile())
  assert '"known_trip_count":{"n":"5"}' in text  # The CPU compiler's annotation, read first.
  _check_scan_with_conds(hlo.collective_summary(text))
  per_step = hlo.collectives_per_step(text, steps_per_call=5)
  assert per_step["all-reduce"]["bytes_min"] == SHARD_BYTES
  with pytest.raises(ValueError, match="steps_per_call"):
    hlo.collectives_per_step(text, steps_per_call=0)


# The TPU compiler's form (no known_trip_count): the trip count is read off the condition,
# counter < 6 from a counter copied from constant 2 (4 trips). The first conditional takes
# branch counter % 2 (small, large, small, large); the second's index is loop state that
# changes (data): bounded by its cheapest and costliest branch.
TPU_LOOP_HLO = """HloModule m, num_partitions=4

%cond (p.0: (s32[], f32[4], s32[])) -> pred[] {
  %c6 = s32[]{:T(128)} constant(6)
  %p.0 = (s32[], f32[4], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p.0), index=0
  ROOT %lt = pred[] compare(%i, %c6), direction=LT
}

%small (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p.1), replica_groups={{0,1}}, to_apply=%add
}

%large (p.2: f32[4]) -> f32[16] {
  %p.2 = f32[4]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-gather(%p.2), replica_groups={{0,1,2,3}}, dimensions={0}
}

%body (p.3: (s32[], f32[4], s32[])) -> (s32[], f32[4], s32[]) {
  %p.3 = (s32[], f32[4], s32[]) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p.3), index=1
  %k = s32[] get-tuple-element(%p.3), index=0
  %two = s32[] constant(2)
  %parity = s32[] remainder(%k, %two)
  %b = f32[4]{0} conditional(%parity, %x, %x), branch_computations={%small, %large}
  %data = s32[] get-tuple-element(%p.3), index=2
  %c = f32[4]{0} conditional(%data, %b, %b), branch_computations={%small, %large}
  %cp = f32[4]{0} collective-permute(%c), source_target_pairs={{0,1},{1,0}}
  %one = s32[] constant(1)
  %next = s32[] add(%k, %one)
  %moved = s32[] add(%data, %one)
  ROOT %t = (s32[], f32[4], s32[]) tuple(%next, %cp, %moved)
}

ENTRY %main (a: f32[4]) -> (s32[], f32[4], s32[]) {
  %a = f32[4]{0} parameter(0)
  %c2 = s32[] constant(2)
  %start = s32[]{:T(128)} copy(%c2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4], s32[]) tuple(%start, /*index=1*/%a, %zero)
  ROOT %w = (s32[], f32[4], s32[]) while(%init), condition=%cond, body=%body
}
"""


def test_per_step_reads_a_tpu_loop_and_its_branches():
  per_step = hlo.collectives_per_step(TPU_LOOP_HLO)
  figures = lambda kind: (per_step[kind]["bytes_min"], per_step[kind]["bytes_max"])
  assert figures("collective-permute") == (4 * 16, 4 * 16)
  assert figures("all-reduce") == (2 * 16, 2 * 16 + 4 * 16)  # 2 exact, + 0 to 4 bounded.
  assert figures("all-gather") == (2 * 64, 2 * 64 + 4 * 64)
  with pytest.warns(UserWarning, match="trip count"):
    once = hlo.collectives_per_step(TPU_LOOP_HLO.replace("constant(2)\n  %start",
                                                              "parameter(1)\n  %start"))
  assert once["collective-permute"]["count_max"] == 1


def test_per_step_follows_a_device_dependent_branch():
  """A branch on ``partition-id``: devices 0 and 1 all-reduce each trip, 2 and 3 all-gather."""
  text = TPU_LOOP_HLO.replace("%parity = s32[] remainder(%k, %two)",
                             "%pid = u32[] partition-id()\n  %parity = s32[] divide(%pid, %two)")
  per_step = hlo.collectives_per_step(text)
  assert per_step["all-reduce"]["bytes_min"] == 0  # Devices 2 and 3.
  assert per_step["all-reduce"]["bytes_max"] == 4 * 16 + 4 * 16  # Devices 0 and 1, + bounded.
  assert per_step["all-gather"]["bytes_max"] == 4 * 64 + 4 * 64
  # The mean device: half of them take each branch; the bounded conditional at its costliest.
  assert per_step["all-reduce"]["bytes_mean"] == 4 * 16 / 2 + 4 * 16
  assert per_step["all-gather"]["bytes_mean"] == 4 * 64 / 2 + 4 * 64


def test_per_step_follows_a_predicate_conditional():
  """``true_computation`` runs when the predicate holds: counter % 2 == 0 picks the all-reduce."""
  text = TPU_LOOP_HLO.replace(
      "%parity = s32[] remainder(%k, %two)",
      "%r = s32[] remainder(%k, %two)\n  %z = s32[] constant(0)\n"
      "  %parity = pred[] compare(%r, %z), direction=EQ").replace(
          "branch_computations={%small, %large}\n  %data",
          "true_computation=%small, false_computation=%large\n  %data")
  per_step = hlo.collectives_per_step(text)
  assert (per_step["all-reduce"]["bytes_min"], per_step["all-gather"]["bytes_min"]) == (
      2 * 16, 2 * 64)




def _table_copied_from_a_fourth_element(start: str) -> str:
  """Element 2 (the second conditional's index) returned as a copy of element 3, which the
  body passes through and which starts at ``start``: how the TPU compiler keeps a table in two
  memory spaces."""
  return TPU_LOOP_HLO.replace("(s32[], f32[4], s32[])", "(s32[], f32[4], s32[], s32[])").replace(
      "%moved = s32[] add(%data, %one)",
      "%keep = s32[] get-tuple-element(%p.3), index=3\n"
      "  %start.0 = (s32[], s32[], u32[]) copy-start(%keep)\n"
      "  %moved = s32[] copy-done(%start.0)").replace(
          "tuple(%next, %cp, %moved)", "tuple(%next, %cp, %moved, %keep)").replace(
              "tuple(%start, /*index=1*/%a, %zero)", f"tuple(%start, /*index=1*/%a, %zero, {start})"
          ).replace("%zero = s32[] constant(0)", "%zero = s32[] constant(0)\n  %c1 = s32[] constant(1)")


@pytest.mark.parametrize("text", [
    TPU_LOOP_HLO.replace("%moved = s32[] add(%data, %one)",
                         "%start.0 = (s32[], s32[], u32[]) copy-start(%data)\n"
                         "  %moved = s32[] copy-done(%start.0)"),
    _table_copied_from_a_fourth_element("%zero"),
], ids=["passed-through", "copied-from-its-twin"])
def test_per_step_sees_through_a_move_between_memory_spaces(text):
  """The TPU compiler may return loop-invariant state (a slot table) through
  ``copy-start``/``copy-done``, or from a twin element that holds the same table: still
  invariant, so the second conditional's index (0, the initial value) is evaluated, not
  bounded."""
  per_step = hlo.collectives_per_step(text)
  figures = lambda kind: (per_step[kind]["bytes_min"], per_step[kind]["bytes_max"])
  assert figures("all-reduce") == (6 * 16, 6 * 16)  # 2 by parity, 4 by the table.
  assert figures("all-gather") == (2 * 64, 2 * 64)


def test_per_step_bounds_a_twin_that_starts_different():
  """Element 2 starts at 0 and becomes element 3's 1 after a trip: not invariant, bounded."""
  per_step = hlo.collectives_per_step(_table_copied_from_a_fourth_element("%c1"))
  assert (per_step["all-reduce"]["bytes_min"], per_step["all-reduce"]["bytes_max"]) == (
      2 * 16, 6 * 16)


def test_per_trip_shows_each_device_and_trip():
  """The branch on ``partition-id`` per device, the bounded one at its costliest, the permute
  every trip."""
  text = TPU_LOOP_HLO.replace("%parity = s32[] remainder(%k, %two)",
                             "%pid = u32[] partition-id()\n  %parity = s32[] divide(%pid, %two)")
  per_trip = hlo.collectives_per_trip(text)
  assert per_trip.shape == (4, 4, len(hlo.KINDS))
  kind = lambda name: per_trip[..., hlo.KINDS.index(name)]
  np.testing.assert_array_equal(kind("collective-permute"), 16)
  np.testing.assert_array_equal(kind("all-reduce"), [[16 + 16, 16 + 16, 16, 16]] * 4)
  np.testing.assert_array_equal(kind("all-gather"), [[64, 64, 64 + 64, 64 + 64]] * 4)
  # The counter's parity: trips 0 and 2 all-reduce, 1 and 3 all-gather.
  np.testing.assert_array_equal(
      hlo.collectives_per_trip(TPU_LOOP_HLO)[:, 0, hlo.KINDS.index("all-gather")],
      [64, 2 * 64, 64, 2 * 64])
  with pytest.raises(ValueError, match="no loop with conditionals"):
    hlo.collectives_per_trip("HloModule m\n\nENTRY %main (a: f32[4]) -> f32[4] {\n"
                             "  ROOT %a = f32[4]{0} parameter(0)\n}\n")
