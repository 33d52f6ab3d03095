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


FAKE_BENCH = '''
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--results_dir")
p.add_argument("--quick", action="store_true")
a = p.parse_args()
os.makedirs(a.results_dir, exist_ok=True)
rows = [{"schedule": "cyclic", "memory": {"params": 10}, "ratio": 0.5}]
json.dump({"runs": rows, "quick": a.quick}, open(os.path.join(a.results_dir, "x.json"), "w"))
print("schedule ratio\\ncyclic 0.5")
'''


def test_report_runs_benches_and_names_missing_ones(tmp_path):
  report = _script("report")
  benches = tmp_path / "benches"
  benches.mkdir()
  (benches / "bench_engine.py").write_text(FAKE_BENCH)
  (benches / "bench_zero.py").write_text(FAKE_BENCH)
  output = tmp_path / "BENCHMARKS.md"
  text = report.main(["--quick", "--bench_dir", str(benches), "--output", str(output),
                      "--results_dir", str(tmp_path / "results")])
  assert output.read_text() == text
  assert "| jax |" in text and "| cores |" in text
  engine_part = text.split("## bench_engine")[1].split("## ")[0]
  assert "cyclic 0.5" in engine_part and "| cyclic | 10 | 0.5 |" in engine_part
  assert "Not run: `bench_pipeline.py` does not exist yet." in text
  assert "## bench_zero" in text and "Failed" not in text


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


def test_bench_engine_script_pins_one_cpu(tmp_path):
  # BENCHMARKS.md's command at smoke size: as a script the benchmark runs on one CPU.
  subprocess.run([sys.executable, str(EXPERIMENTS / "bench_engine.py"), "--quick",
                  "--results_dir", str(tmp_path), "--workloads", "mlp", "--workers", "2",
                  "--per_worker_batch", "128", "--steps_per_call", "1"],
                 check=True, capture_output=True, timeout=600)
  saved = json.loads((tmp_path / "bench_engine.json").read_text())
  assert saved["machine"]["cores_used"] == 1 and saved["devices"] == 2
  assert saved["workloads"][0]["variants"]["engine cdp-v1"]["same_ops_as_dp"]


def test_bench_zero_script_pins_one_cpu(tmp_path):
  # bench_pipeline and bench_zero share the flag (`_common.parser(timed=True)`); this one is quick.
  subprocess.run([sys.executable, str(EXPERIMENTS / "bench_zero.py"), "--quick", "--no-floors",
                  "--results_dir", str(tmp_path)], check=True, capture_output=True, timeout=600)
  saved = json.loads((tmp_path / "bench_zero.json").read_text())
  assert saved["machine"]["cores_used"] == 1


def test_bench_overlap_quick(tmp_path):
  result = _script("bench_overlap").main(["--quick", "--results_dir", str(tmp_path)])
  saved = json.loads((tmp_path / "bench_overlap.json").read_text())
  assert saved["rows"] == result["rows"]
  for row in result["rows"]:  # The engine lowers exactly J all-reduces, whatever XLA does next.
    assert row["stablehlo_all_reduces"] == saved["num_stages"]
    assert 1 <= row["compiled_all_reduces"] <= saved["num_stages"]
    assert len(row["compute_after"]) == row["compiled_all_reduces"]
    assert all(0 <= n <= row["compute_instructions"] for n in row["compute_after"])
  assert {r["combiner"] for r in result["rows"]} == {"on", "off"}


def test_report_reruns_only_the_named_benches(tmp_path):
  report = _script("report")
  benches = tmp_path / "benches"
  benches.mkdir()
  (benches / "bench_engine.py").write_text(FAKE_BENCH)
  output = tmp_path / "BENCHMARKS.md"
  output.write_text("# Benchmarks\n\n## bench_zero\n\nkept zero table\n\n## bench_engine\n\nold\n"
                    "\n## Delays and stability\n\nhand-written study\n")
  text = report.main(["--quick", "--bench_dir", str(benches), "--output", str(output),
                      "--results_dir", str(tmp_path / "results"), "--benches", "bench_engine"])
  # Whole lines: the old section's text ("old") could be part of a temporary path.
  lines = text.splitlines()
  assert "kept zero table" in lines and "old" not in lines and "cyclic 0.5" in text
  assert text.rstrip().endswith("hand-written study")
  assert "Not run: `bench_pipeline.py` does not exist yet." in text
