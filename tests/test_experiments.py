"""Smoke runs of every experiment script in ``--quick`` mode, in-process (JAX is already up)."""
import importlib
import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def _script(name: str):
  if str(EXPERIMENTS) not in sys.path:
    sys.path.insert(0, str(EXPERIMENTS))
  return importlib.import_module(name)


def test_timeline(tmp_path):
  results = _script("timeline").main(["--quick", "--results_dir", str(tmp_path)])
  assert (tmp_path / "timeline.png").stat().st_size > 0
  saved = json.loads((tmp_path / "timeline.json").read_text())
  assert set(saved["rules"]) == {"dp", "cdp-v1", "cdp-v2"}
  assert any(e["stale"] for e in saved["rules"]["cdp-v1"]["events"])
  assert not any(e["stale"] for e in saved["rules"]["dp"]["events"])
  assert results["dp"]["max_contributions_per_tick"] == 4  # All N workers at once.
  assert results["cdp-v2"]["max_contributions_per_tick"] < 4


def test_convergence(tmp_path):
  result = _script("convergence").main(["--quick", "--results_dir", str(tmp_path)])
  assert (tmp_path / "convergence.png").stat().st_size > 0
  assert json.loads((tmp_path / "convergence.json").read_text())["num_steps"] == 5
  runs = {(r["rule"], r["lr_times_L"]): r for r in result["runs"]}
  assert len(runs) == 6 and all(len(r["gaps"]) >= 2 for r in runs.values())
  (small,) = {lr for _, lr in runs if lr < 1}
  for rule in ("dp", "cdp-v1", "cdp-v2"):  # Below 1/L every rule descends.
    assert runs[(rule, small)]["gaps"][-1] < runs[(rule, small)]["gaps"][0]
  saved = json.loads((tmp_path / "thresholds.json").read_text())
  assert [r["rule"] for r in saved] == ["cdp-v1", "random uniform D=2"]
  assert all(0 < r["stable_up_to"] < r["diverges_from"] for r in saved)
  assert saved[0]["predicted"] == pytest.approx(1.0, abs=1e-3)  # lr * L < 1 for one step of delay.
  compensated = _script("convergence").main(["--quick", "--compensated", "--results_dir",
                                             str(tmp_path / "compensated")])
  (row,) = compensated["thresholds"]
  assert row["rule"] == "cdp-v1 + prediction"  # Extrapolating one step: lr * L < 0.618.
  assert row["predicted"] == pytest.approx((5 ** 0.5 - 1) / 2, abs=1e-3)
  assert 0 < row["stable_up_to"] < row["diverges_from"]
  assert compensated["plain_limits"]["cdp-v1"] == pytest.approx(1.0, abs=1e-3)


def test_delays(tmp_path):
  result = _script("delays").main(["--quick", "--results_dir", str(tmp_path)])
  assert (tmp_path / "delays.png").stat().st_size > 0
  saved = json.loads((tmp_path / "delays.json").read_text())
  assert saved["runs"][0]["steps"] == 4 and set(saved["table"]) == {"random:geometric:2"}
  assert 0 <= result["table"]["random:geometric:2"]["mean"] <= 1


def test_accuracy_digits(tmp_path):
  result = _script("accuracy_digits").main(
      ["--quick", "--rules", "cdp-v2", "--results_dir", str(tmp_path)])
  assert (tmp_path / "learning_curves.png").stat().st_size > 0
  saved = json.loads((tmp_path / "accuracy.json").read_text())
  assert saved["table"]["cdp-v2"]["n"] == 1 and saved["runs"][0]["steps"] == 4
  assert 0 <= result["table"]["cdp-v2"]["mean"] <= 1


def test_accuracy_lm(tmp_path):
  result = _script("accuracy_lm").main(
      ["--quick", "--rules", "cdp-v2", "--results_dir", str(tmp_path)])
  assert (tmp_path / "bits_per_byte.png").stat().st_size > 0
  saved = json.loads((tmp_path / "accuracy_lm.json").read_text())
  assert saved["table"]["cdp-v2"]["n"] == 1 and saved["runs"][0]["steps"] == 4
  assert 0 < result["table"]["cdp-v2"]["mean"] < 9 and saved["bigram_bits_per_byte"] > 0


# A stand-in for bench_overlap.py: rows in its schema, the tied backward's all-reduces apart.
FAKE_BENCH = '''
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--results_dir")
p.add_argument("--quick", action="store_true")
a = p.parse_args()
os.makedirs(a.results_dir, exist_ok=True)
rows = [{"compiler": "cpu", "backward": "tied", "rule": "dp", "combiner": "on",
         "compiled_all_reduces": 1, "compute_after": [0]},
        {"compiler": "tpu v5e:2x4", "backward": "tied", "rule": "dp", "combiner": "on",
         "compiled_all_reduces": 4, "compute_after": [7, 5, 3, 0]}]
name = os.path.basename(sys.argv[0])[:-3]
json.dump({"rows": rows}, open(os.path.join(a.results_dir, name + ".json"), "w"))
print("printed table")
'''
FAILING_BENCH = "import sys; sys.exit('this benchmark failed')"


def _section(text: str, title: str) -> str:
  return text.split(f"## {title}\n")[1].split("\n## ")[0]


@pytest.fixture
def benches(tmp_path):
  """A bench folder: bench_overlap writes a table and JSON, bench_zero fails."""
  folder = tmp_path / "benches"
  folder.mkdir()
  (folder / "bench_overlap.py").write_text(FAKE_BENCH)
  (folder / "bench_zero.py").write_text(FAILING_BENCH)
  return folder


def test_report_runs_benches_and_names_missing_ones(tmp_path, benches):
  report = _script("report")
  output = tmp_path / "BENCHMARKS.md"
  text = report.main(["--quick", "--bench_dir", str(benches), "--output", str(output),
                      "--results_dir", str(tmp_path / "results")])
  assert output.read_text() == text
  overlap = _section(text, "Gradient all-reduces against the backward (compiled)")
  assert "| measured | goal | figure | met |" in overlap
  assert ("| tpu v5e:2x4, tied backward, dp, combiner on | the J all-reduces spread over the "
          "backward | 4 all-reduce(s), compute after: [7, 5, 3, 0] | yes |") in overlap
  assert "produced by `python experiments/bench_overlap.py --quick`" in overlap
  saved = json.loads((tmp_path / "results/bench_overlap/bench_overlap.json").read_text())
  assert saved["source"].startswith("produced by") and len(saved["rows"]) == 2
  assert ("`results/bench_engine/bench_engine.json` is missing. "
          "Run `python experiments/bench_engine.py`.") in text
  assert "**Failed in the last run**" in text and "`bench_zero`" in text
  assert str(tmp_path) not in text


def test_report_reruns_only_the_named_benches(tmp_path, benches):
  report = _script("report")
  kept = tmp_path / "results/bench_pipeline/bench_pipeline.json"
  kept.parent.mkdir(parents=True)
  kept.write_text(json.dumps({"source": "kept from before", "rows": []}))
  text = report.main(["--quick", "--bench_dir", str(benches), "--output",
                      str(tmp_path / "BENCHMARKS.md"), "--results_dir", str(tmp_path / "results"),
                      "--benches", "bench_overlap"])
  assert "Failed" not in text  # bench_zero was not run.
  assert "compute after: [7, 5, 3, 0]" in text
  # A JSON report.py cannot read is named in its section, not a crash.
  pipeline = _section(text, "Cyclic pipeline against GPipe (CPU)")
  assert "Source: kept from before." in pipeline and "not readable by report.py" in pipeline


def test_report_render_reads_only_results_and_matches_benchmarks_md(tmp_path):
  report = _script("report")
  benches = tmp_path / "benches"
  benches.mkdir()
  (benches / "bench_overlap.py").write_text(FAILING_BENCH)  # Would fail if it ran.
  text = report.main(["--render", "--bench_dir", str(benches),
                      "--output", str(tmp_path / "BENCHMARKS.md")])
  assert "Failed" not in text
  # BENCHMARKS.md is this rendering of the committed results/, nothing else.
  assert text == (EXPERIMENTS.parent / "BENCHMARKS.md").read_text()
  for section in report.SECTIONS:
    body = _section(text, section.title)
    assert "| measured | goal | figure | met |" in body, section.name
    assert f"Regenerate: `{section.command}`" in body and "Source: " in body
  assert "/work/" not in text and "/tmp/" not in text and "/home/" not in text
  tpu = _section(text, "Pod plan on the TPU compiler (issue 34's goals)")
  assert "CDP+ZeRO peak / ZeRO-3's (HBM of the buffer assignment) | <= 1.25 |" in tpu
  assert "what the HBM holds, CDP+ZeRO; ZeRO-3" in tpu
  assert "ZeRO-3's collectives | all-gather and reduce-scatter |" in tpu
  assert "compiled peak / cost model, 7 strategies (activations: " in tpu
  assert "activations counted from shapes | - |" in tpu


def test_stage_padding_quick(tmp_path):
  result = _script("stage_padding").main(["--quick", "--results_dir", str(tmp_path)])
  r = result["models"]["resnet18"]
  for by in ("flops", "params"):
    sizes = r[by]["stage_params"]
    assert len(sizes) == r["num_stages"] == 4
    assert r[by]["padding"] == pytest.approx(4 * max(sizes) / sum(sizes))
  # Each cut is the better one on its own measure.
  assert r["params"]["padding"] < r["flops"]["padding"]
  assert r["flops"]["flops_max_over_mean"] < r["params"]["flops_max_over_mean"]


def test_bench_engine_quick(tmp_path):
  result = _script("bench_engine").main(["--quick", "--results_dir", str(tmp_path),
                                         "--workloads", "mlp"])
  saved = json.loads((tmp_path / "bench_engine.json").read_text())
  mlp, scanned = saved["workloads"]
  assert (mlp["steps_per_call"], scanned["steps_per_call"]) == (1, 2)
  for row in (mlp, scanned):
    assert set(row["variants"]) == {"engine dp", "engine dp, norms", "engine cdp-v1",
                                    "engine cdp-v2", "plain dp"}
    assert set(row["ratios"]) == {"cdp-v1/dp", "cdp-v2/dp", "engine dp/plain dp",
                                  "norms on/off"}
    # CDP's extra peak is the stale stages it keeps, with or without a scan (XLA's CPU
    # copy insertion without region analysis kept 1.75 parameter sizes in the scan).
    for rule in ("cdp-v1", "cdp-v2"):
      assert row["extra_peak_over_stale_bytes"][rule] == pytest.approx(1.0, abs=0.05)
    assert row["goals_met"]["no parameter copies beyond the scan's shift"]
  assert result["workloads"][0]["ratios"] == mlp["ratios"]
  # One step per call rotates the versions: no copy. The scan copies theta_t once into
  # each stale leaf's slot per step (without region analysis: three copies per leaf),
  # except where the slot carries the workers' views: all of cdp-v2's stale leaves.
  for rule in ("dp", "cdp-v1", "cdp-v2"):
    assert mlp["variants"][f"engine {rule}"]["parameter_copies"] == 0
    scanned_rule = scanned["variants"][f"engine {rule}"]
    shifted = 0 if rule == "cdp-v2" else scanned_rule["stale_leaves"]
    assert scanned_rule["parameter_copies"] == shifted
  # cdp-v1 reads every stage stale: dp's traffic. cdp-v2's select of a version per worker
  # reads two versions and writes one: three parameter sizes more.
  traffic = mlp["extra_bytes_accessed_over_dp_in_params"]
  assert abs(traffic["engine cdp-v1"]) < 0.05 and 2.9 < traffic["engine cdp-v2"] < 3.2
  # So cdp-v1's step is dp's operations on other buffers (its time ratio is the noise
  # floor); cdp-v2 adds the selects, and the scan the copies.
  assert mlp["variants"]["engine cdp-v1"]["same_ops_as_dp"]
  assert not mlp["variants"]["engine cdp-v2"]["same_ops_as_dp"]
  assert not scanned["variants"]["engine cdp-v1"]["same_ops_as_dp"]
  with pytest.raises(SystemExit):
    _script("bench_engine").main(["--quick", "--workers", "9"])


def test_bench_zero_script_pins_one_cpu(tmp_path):
  # BENCHMARKS.md's timed benchmarks (bench_engine, bench_pipeline, bench_zero) share the flag
  # (`_common.parser(timed=True)`); this one is quick.
  subprocess.run([sys.executable, str(EXPERIMENTS / "bench_zero.py"), "--quick", "--no-floors",
                  "--results_dir", str(tmp_path)], check=True, capture_output=True, timeout=600)
  saved = json.loads((tmp_path / "bench_zero.json").read_text())
  assert saved["machine"]["cores_used"] == 1


def test_bench_overlap_quick(tmp_path):
  result = _script("bench_overlap").main(["--quick", "--results_dir", str(tmp_path)])
  saved = json.loads((tmp_path / "bench_overlap.json").read_text())
  assert saved["rows"] == result["rows"]
  for row in result["rows"]:  # The engine lowers exactly J all-reduces, whatever XLA does next.
    if row["reduction"] == "permutes":  # J sums of N-1 permutes and an all-gather each.
      assert row["stablehlo_all_reduces"] == row["compiled_all_reduces"] == 0
      assert len(row["permutes_compute_during"]) == saved["num_stages"] * (saved["num_workers"] - 1)
      assert len(row["all_gathers_compute_after"]) == saved["num_stages"]  # The CPU's: apart.
      continue
    assert row["stablehlo_all_reduces"] == saved["num_stages"]
    assert 1 <= row["compiled_all_reduces"] <= saved["num_stages"]
    assert len(row["compute_after"]) == row["compiled_all_reduces"]
    assert all(0 <= n <= row["compute_instructions"] for n in row["compute_after"])
  assert {r["combiner"] for r in result["rows"]} == {"on", "off"}
  assert {r["reduction"] for r in result["rows"]} == {"all-reduce", "permutes"}


def test_lm_sweep(tmp_path):
  sweep = _script("lm_sweep")
  result = sweep.main(["--quick", "--task", "lm", "--results_dir", str(tmp_path)])
  saved = json.loads((tmp_path / "lm_sweep.json").read_text())
  (lrs, (warmup,), _), = sweep.QUICK_GRIDS["lm"].values()
  assert saved["finished_runs"] == saved["planned_runs"] == len(lrs) * len(sweep.QUICK_RULES)
  table = saved["tasks"]["lm"]["optimizers"]["adamw"]
  assert set(table) == set(sweep.QUICK_RULES) and result["tasks"] == saved["tasks"]
  for rule, best in table.items():
    assert [g["learning_rate"] for g in best["grid"]] == list(lrs)  # Every grid point, once.
    finite = [g["final_bits_per_byte"] for g in best["grid"] if not g["diverged"]]
    assert finite and all(0 < v < 9 for v in finite)
    assert best["mean"] == min(finite) and best["n"] == 1 and best["warmup_fraction"] == warmup
    name = sweep.run_name("lm", "adamw", rule, best["learning_rate"], warmup, 0)
    run = json.loads((tmp_path / "runs" / f"{name}.json").read_text())
    assert run["steps"] == 4 and run["curve"]["values"][-1] == best["mean"]
    assert run["weight_prediction"] == rule.endswith("+predict")  # The compensation's key, set.
  assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())
  # A rerun trains nothing: every run's JSON is there.
  mtimes = {p.name: p.stat().st_mtime for p in (tmp_path / "runs").iterdir()}
  assert sweep.main(["--quick", "--task", "lm", "--results_dir", str(tmp_path)])["tasks"] == \
      saved["tasks"]
  assert {p.name: p.stat().st_mtime for p in (tmp_path / "runs").iterdir()} == mtimes


def test_compensation_quick(tmp_path):
  study = _script("compensation")
  result = study.main(["--quick", "--results_dir", str(tmp_path)])
  assert json.loads((tmp_path / "compensation.json").read_text())["table"] == result["table"]
  table = result["table"]
  assert set(table) == {"dp", *study.RULES} and set(table["cdp-v2"]) == set(study.QUICK_VARIANTS)
  assert table["dp"]["none"]["gap_to_dp"] == 0.0
  for rule in study.RULES:
    row = table[rule]["predict"]
    assert row["weight_prediction"] is True and row["n"] == 1 and 0 < row["mean"] < 9
    assert row["gap_to_dp"] == pytest.approx(row["mean"] / table["dp"]["none"]["mean"] - 1)
  assert len(list((tmp_path / "runs").iterdir())) == 1 + len(study.RULES) * len(
      study.QUICK_VARIANTS)


def test_adam_betas_quick(tmp_path):
  study = _script("adam_betas")
  result = study.main(["--quick", "--results_dir", str(tmp_path)])
  assert json.loads((tmp_path / "adam_betas.json").read_text())["table"] == result["table"]
  runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").iterdir()]
  assert len(runs) == 2 * len(study.RULES)
  assert {(r["adam_b1"], r["adam_b2"]) for r in runs} == {(0.9, 0.999), (0.0, 0.999)}
  for point, row in result["table"].items():
    assert set(row) == set(study.RULES) and 0 < row["dp"]["mean"] < 9, point
    assert "gap_to_dp" not in row["dp"]
    for rule in study.RULES[1:]:
      assert row[rule]["gap_to_dp"] == pytest.approx(row[rule]["mean"] / row["dp"]["mean"] - 1)
  # The decay reaches the optimizer: b1 0 trains otherwise than b1 0.9.
  assert len({row["dp"]["mean"] for row in result["table"].values()}) == 2
