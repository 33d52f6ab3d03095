"""Ahead-of-time compilation for a TPU topology (cdpjax.aot, cdpjax-compile), with libtpu on a CPU host."""
import json
import os
import subprocess
import sys

import pytest

from cdpjax import aot, config as config_lib
from cdpjax.data import digits

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

TOPOLOGY = "v5e:2x4"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu: pip install -e '.[test]'")


def _digits(**overrides):
  return config_lib.load(os.path.join(REPO, "configs/digits.py"), None,
                         **{"num_workers": 2, "num_stages": 2, "eval_batch_size": 16, **overrides})


@pytest.fixture(scope="module")
def executed():
  """CDP + MP (cyclic pipeline) and ZeRO-3 on all 8 chips (4 replicas of 2 workers), compiled
  for v5e:2x4 in this process."""
  return {par: aot.compile_config(_digits(parallelism=par, rule=rule, **kw), TOPOLOGY)
          for par, rule, kw in (("model", "cdp-v2", {}), ("zero", "dp", {"num_replicas": 4}))}


def _compile_engine(workdir, flag):
  """The engine (CDP-v1) compiled by the launcher as a user runs it, with ``flag``: its output
  and JSON."""
  proc = subprocess.run(
      [sys.executable, "-m", "cdpjax.compile_main", "--config", "configs/digits.py:rule=cdp-v1",
       "--config.num_workers=2", "--config.num_stages=2", "--config.eval_batch_size=16",
       "--topology", TOPOLOGY, "--workdir", str(workdir), flag],
      cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr
  return proc, json.loads((workdir / "compile.json").read_text())


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
  """The engine (CDP-v1) beside its baseline (DP), compiled by the launcher."""
  return _compile_engine(tmp_path_factory.mktemp("plan"), "--baseline")


def test_baseline_is_the_same_step_under_dp(engine_run):
  """``--baseline``: the config compiled again under rule dp, and the two printed side by side."""
  proc, result = engine_run
  base = result["baseline"]
  assert base["config"] == {**result["config"], "rule": "dp"}
  assert base["mesh"] == result["mesh"] and base["num_params"] == result["num_params"]
  assert len(result["stage_params"]) == 2 and sum(result["stage_params"]) == result["num_params"]
  hbm = [r["memory_per_chip"]["hbm_bytes"] for r in (result, base)]
  assert "against DP (rule dp, the same parallelism, mesh and batch)" in proc.stdout
  assert f"= {hbm[0] / hbm[1]:.2f}x" in proc.stdout
  with pytest.raises(ValueError, match="set --config.rule"):
    aot.baseline_config(_digits(rule="dp"))


def test_hbm_only_places_no_buffer_on_chip(engine_run, tmp_path):
  """``--hbm_only``: the same step with no buffer in on-chip VMEM (the compiler would put some
  there). Its HBM need not be larger: placement in VMEM brings copies of its own."""
  proc, result = _compile_engine(tmp_path, "--hbm_only")
  assert "memory-space assignment off" in proc.stdout
  placed, in_hbm = (r["memory_per_chip"] for r in (engine_run[1], result))
  assert not engine_run[1]["hbm_only"] and placed["vmem_bytes"] > 0
  assert in_hbm["vmem_bytes"] == 0 and in_hbm["hbm_bytes"] > 0


def _counts(result):
  return {kind: c["count"] for kind, c in result["collectives"].items() if c["count"]}


def test_launcher_writes_the_report_quietly(engine_run):
  proc, result = engine_run
  assert tuple(result) == (*aot.REPORT_KEYS, "baseline")
  assert tuple(result["baseline"]) == aot.REPORT_KEYS
  assert "runs as the update-rule engine" in proc.stdout and "fits" in proc.stdout
  assert "HBM used" in proc.stdout and "the temp heap's large ranges:" in proc.stdout
  # The TPU VM look-ups libtpu would complain about are switched off for this process.
  assert "TPU_WORKER_HOSTNAMES" not in proc.stderr and "InitGoogle" not in proc.stderr
  assert result["chips"] == 8 and result["devices_used"] == 2 and result["mesh"] == {"data": 2}
  assert result["config"]["rule"] == "cdp-v1"


def test_engine_reduces_gradients_with_an_all_reduce(engine_run):
  counts = _counts(engine_run[1])
  assert counts.get("all-reduce", 0) >= 1 and "collective-permute" not in counts


def test_cyclic_pipeline_communicates_by_collective_permutes_only(executed):
  counts = _counts(executed["model"])
  assert set(counts) == {"collective-permute"}, counts
  assert executed["model"]["mesh"] == {"stage": 2}
  # Each permute instruction's start is a tuple, and the TPU gives each a 16 KiB table.
  tables = executed["model"]["memory_per_chip"]["hbm_tuple_tables_by_kind"]
  assert tables.get("collective-permute-start", 0) >= 1, tables


def test_zero3_gathers_and_reduce_scatters_on_tpu(executed):
  """The launcher pads ZeRO-3's stages to `zero.TPU_SHARD` rows: the TPU compiler keeps their
  all-gathers and reduce-scatters (a flat buffer's become whole-buffer all-reduces)."""
  counts = _counts(executed["zero"])
  assert {"all-gather", "reduce-scatter"} <= set(counts), counts
  assert "collective-permute" not in counts, counts
  assert "ZeRO-3" in executed["zero"]["runs"]
  assert executed["zero"]["mesh"] == {"replica": 4, "data": 2}
  assert executed["zero"]["devices_used"] == executed["zero"]["chips"] == 8


def test_memory_and_fit_are_consistent_and_no_loop_blind_flops(executed, engine_run):
  for result in (*executed.values(), engine_run[1]):
    m = result["memory_per_chip"]
    assert m["peak_bytes"] > m["argument_bytes"] > 0
    assert m["peak_bytes"] == (m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"]
                               - m["alias_bytes"])
    assert result["hbm_per_chip_bytes"] == aot.CHIP_HBM_BYTES["v5e"] == 16 * aot.GIB
    # The buffer assignment's HBM holds the arguments; the fit is judged on it.
    assert m["hbm_bytes"] >= m["argument_bytes"] and m["vmem_bytes"] >= 0
    # The heap holds arrays and tuple tables; the TPU's are 16 KiB slots.
    assert 0 <= m["hbm_temp_arrays_bytes"] <= m["hbm_by_kind"].get("temp", 0)
    assert m["hbm_tuple_tables"] * 16 * 1024 <= m["hbm_by_kind"].get("temp", 0)
    assert sum(m["hbm_tuple_tables_by_kind"].values()) == m["hbm_tuple_tables"]
    assert result["fits"] == (m["hbm_bytes"] <= result["hbm_per_chip_bytes"])
    assert "flops" not in result and "optimal_seconds" not in result  # A loop body counted once.
  # The parameters of the same model: a replicated engine state holds them all on every chip.
  assert engine_run[1]["num_params"] == executed["model"]["num_params"]


def test_executed_steps_report_their_collectives_slot_by_slot(executed, engine_run):
  """Slot by slot, summed over the chips, the step's collective bytes (`collectives`, per chip,
  the chips' mean); none for programs without a slot loop."""
  result = executed["model"]
  by_slot = result["collectives_by_slot"]
  assert set(by_slot) == {"collective-permute"} and len(by_slot["collective-permute"]) > 1
  assert sum(by_slot["collective-permute"]) == pytest.approx(
      result["collectives"]["collective-permute"]["bytes_mean"] * result["devices_used"])
  assert executed["zero"]["collectives_by_slot"] is None  # ZeRO-3: lockstep, no slots.
  assert engine_run[1]["collectives_by_slot"] is None
  assert result["collective_schedule"] is None  # The slots say when instead.


def test_steps_without_slots_report_their_collectives_against_compute(executed, engine_run):
  """The engine's all-reduce after its last compute instruction, synchronous (the launcher
  prints it); ZeRO-3's reduce-scatters as its stages' backwards end, some before the last."""
  proc, result = engine_run
  schedule = result["collective_schedule"]
  assert schedule["compute_instructions"] > 0
  assert [(kind, after, during) for kind, _, after, during in schedule["collectives"]
          if kind == "all-reduce"] == [("all-reduce", 0, 0)]
  assert "against compute, in schedule order" in proc.stdout
  zero3 = executed["zero"]["collective_schedule"]["collectives"]
  assert any(kind == "reduce-scatter" and after > 0 for kind, _, after, _ in zero3), zero3


def test_cdp_spreads_the_replicas_gradient_all_reduces_over_the_step():
  """4 replicas of a 2-stage pipeline: GPipe all-reduces both stages' gradients in one slot,
  after the flush; CDP+MP each stage's at its own slot (the paper's claim 2)."""
  shares = {}
  for rule in ("dp", "cdp-v2"):
    result = aot.compile_config(_digits(parallelism="model", rule=rule, num_replicas=4),
                                TOPOLOGY)
    per_slot = result["collectives_by_slot"]["all-reduce"]
    shares[rule] = max(per_slot) / sum(per_slot)
  assert shares["dp"] == 1.0 and shares["cdp-v2"] < 0.6, shares


def test_bad_topology_and_mesh_are_refused():
  with pytest.raises(ValueError, match="v5e:16x16"):
    aot.parse_topology("v5e-256")
  with pytest.raises(ValueError, match="topology has 8 chips"):
    aot.build(_digits(num_workers=16, eval_batch_size=16), aot.topology_devices(TOPOLOGY))


def test_a_step_past_the_chips_hbm_is_refused_with_the_fix():
  """The TPU compiler's own out-of-memory becomes a ValueError that names the fix (tpu_plan
  caches it as a refused point)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(aot.topology_devices(TOPOLOGY), ("chip",))
  x = jax.ShapeDtypeStruct((70_000,), jnp.float32,
                           sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  too_big = jax.jit(lambda x: jnp.cumsum(jnp.outer(x, x), axis=0))  # 18 GiB a 16 GiB chip.
  with pytest.raises(ValueError, match="does not fit one chip.*Use fewer layers"):
    aot.report(too_big.lower(x), TOPOLOGY)


def test_dataset_shapes_match_the_datasets():
  assert aot.IMAGE_DATASETS["digits"] == (digits.Digits.num_classes, digits.Digits.image_shape)


def test_tied_backward_keeps_the_all_reduces_apart_on_tpu():
  """The engine's tied backward on the TPU compiler (bench_overlap): J all-reduces between the
  stages' backwards, where the engine's own backward gets them combined into one, last."""
  sys.path.insert(0, os.path.join(REPO, "experiments"))
  import bench_overlap  # pylint: disable=g-import-not-at-top
  aot.topology_devices(bench_overlap.TPU_TOPOLOGY)  # Quiets libtpu before the mesh.
  mesh = bench_overlap.tpu_mesh()
  free = bench_overlap.measure(bench_overlap.lowered_step(mesh, "dp", 64, 8), None)
  tied = bench_overlap.measure(bench_overlap.lowered_step(mesh, "dp", 64, 8, tied=True), None)
  assert free["compiled_all_reduces"] == 1 and free["compute_after"] == [0]
  assert tied["compiled_all_reduces"] == bench_overlap.NUM_STAGES
  after = tied["compute_after"]
  assert after[-1] == 0 and all(a > b for a, b in zip(after, after[1:])), after


def test_permuted_gradient_sums_run_beside_the_backward_on_tpu():
  """``gradient_reduction="permutes"`` on the TPU compiler (bench_overlap): no all-reduce, one
  all-gather a stage, and asynchronous permutes, some with compute between start and done,
  where the engine's all-reduce runs beside none."""
  sys.path.insert(0, os.path.join(REPO, "experiments"))
  import bench_overlap  # pylint: disable=g-import-not-at-top
  aot.topology_devices(bench_overlap.TPU_TOPOLOGY)
  mesh = bench_overlap.tpu_mesh()
  found = bench_overlap.measure(
      bench_overlap.lowered_step(mesh, "dp", 64, 8, reduction="permutes"), None)
  assert found["compiled_all_reduces"] == 0
  assert len(found["all_gathers_compute_after"]) == bench_overlap.NUM_STAGES
  assert len(found["permutes_compute_during"]) == bench_overlap.NUM_STAGES * (
      bench_overlap.NUM_WORKERS - 1)
  assert max(found["permutes_compute_during"]) > 0, found


def test_tpu_plan_quick_compiles_every_strategy_with_the_predicted_collectives(tmp_path):
  """The documented ``python experiments/tpu_plan.py --quick``: the digits MLP under every
  strategy compiles for v5e:2x4, and its collective bytes per step are the cost model's."""
  sys.path.insert(0, os.path.join(REPO, "experiments"))
  import tpu_plan  # pylint: disable=g-import-not-at-top
  result = tpu_plan.main(["--quick", "--results_dir", str(tmp_path)])
  assert not result["not_compiled"]
  # The MLP is cut by blocks: no point with stages of equal parameters (only the ResNets').
  assert sorted(r["strategy"] for r in result["rows"]) == sorted(
      s for s in tpu_plan.STRATEGIES if not s.endswith(tpu_plan.BY_PARAMS))
  assert {r["model_activations"] for r in result["rows"]} == {"compiled"}
  calibrations = [json.loads(p.read_text()) for p in (tmp_path / "points").glob("*calibration*")]
  assert len(calibrations) == 4  # The engine; the pipelines, recomputing or kept; ZeRO's pad.
  largest_stage = min(r["largest_stage_MiB"] for r in result["rows"]
                      if tpu_plan.STRATEGIES[r["strategy"]][1] != "data") * 2**20
  for found in calibrations:  # A backward holds its (padded) stage's gradient, at least.
    assert all(b >= largest_stage for b in found.get("stage_transient_bytes", [])), found
    assert found.get("engine_bytes", 1) > 0, found
  for r in result["rows"]:
    assert r["collective_ratio_min"] == pytest.approx(1.0, rel=1e-3), r
    assert r["collective_ratio_max"] == pytest.approx(1.0, rel=1e-3), r
  # What the cyclic timetables' events read in their per-chip conditional stays in HBM; read
  # unconditionally (ZeRO-3's gathered stage), or made in the conditional, it goes on chip.
  placed = {r["stage"]: r["stage_in_hbm"] for r in result["conditional_placement"]}
  assert placed == dict(zip(tpu_plan.PLACEMENT_READS, (False, True, False)))


def test_tpu_plan_predicts_the_kept_stash():
  """With activations kept, the cost model's stash holds what a backward needs, not a stage's
  input: GPipe's busiest chip N rows of it, CDP+MP's J - 1 (the first stage recomputes)."""
  sys.path.insert(0, os.path.join(REPO, "experiments"))
  import tpu_plan  # pylint: disable=g-import-not-at-top
  name, path, overrides, model_kwargs, _ = tpu_plan.PLANS["quick"][0]
  predicted, rows = {}, {}
  for strategy in ("gpipe", "gpipe-kept", "cdp+mp-kept"):
    c = tpu_plan.point_config(path, overrides, model_kwargs, strategy, 8,
                              tpu_plan.NUM_STAGES["quick"])
    w = tpu_plan.workload(c, executed=True)
    predicted[strategy] = tpu_plan.predicted(strategy, c, w)["activations_bytes"]
    rows[strategy] = w.stage_activation_bytes
  n, j = c.num_workers, c.num_stages
  kept, stage_input = rows["gpipe-kept"][1], rows["gpipe"][1]
  assert rows["gpipe-kept"] == (0.0,) + (kept,) * (j - 1) and kept > stage_input
  assert predicted["gpipe-kept"] - predicted["cdp+mp-kept"] == (n - (j - 1)) * kept


def test_tpu_plan_records_a_refused_point_with_why(tmp_path, monkeypatch):
  """A point the launcher refuses (its ValueError names the fix) is cached as refused, read
  back as such without compiling again, and listed apart from the points not yet compiled."""
  sys.path.insert(0, os.path.join(REPO, "experiments"))
  import tpu_plan  # pylint: disable=g-import-not-at-top

  def refuse(c, topology, hbm_only):
    raise ValueError("too large: use fewer rows")
  monkeypatch.setattr(aot, "compile_config", refuse)
  first = tpu_plan.compile_point(tmp_path, "m", None, "gpipe-kept", "v5e:2x4")
  assert first == {"refused": "too large: use fewer rows"}
  monkeypatch.setattr(aot, "compile_config", lambda c, t, hbm_only: pytest.fail("compiled again"))
  assert tpu_plan.compile_point(tmp_path, "m", None, "gpipe-kept", "v5e:2x4") == first
