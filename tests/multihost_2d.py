"""The 2-D meshes stepped by one script: by each of 2 processes, or by the test for its reference.

``python tests/multihost_2d.py OUT COORDINATOR NUM_PROCESSES PROCESS_ID`` joins the run
(gloo CPU collectives, 8 devices in all), runs `run` (the launcher's workdir next to ``OUT``)
and writes its result to ``OUT`` as JSON. tests/test_multihost.py compares it with `run` on the 8 devices
of its own process.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # executed_reference

from cdpjax import distributed  # (imports no JAX)

NUM_CALLS, STEPS_PER_CALL = 2, 2


def _host(x):
  """A global array's value, read on any process (replicated first where it is split)."""
  import jax  # pylint: disable=g-import-not-at-top
  from cdpjax.executed import pipeline  # pylint: disable=g-import-not-at-top
  return jax.numpy.asarray(pipeline.replicated(x).addressable_data(0)).tolist()


def _calls(ex, params, data, name: str) -> dict:
  """``NUM_CALLS`` calls of an executed step: its losses and final stage buffers."""
  import jax  # pylint: disable=g-import-not-at-top
  state, losses = ex.init(params), []
  for c in range(NUM_CALLS):
    state, metrics = ex.step(state, jax.tree.map(
        lambda x, c=c: x[c * STEPS_PER_CALL:(c + 1) * STEPS_PER_CALL], data))
    losses += _host(metrics["loss"])
  return {f"{name}_losses": losses, f"{name}_params": _host(state.params)}


def _launcher(workdir: str) -> dict:
  """The final evaluation of the launcher's replicated pipeline (every process returns it)."""
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  from cdpjax import train  # pylint: disable=g-import-not-at-top
  c = config_lib.load(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "digits.py"),
                      "parallelism=model,smoke", num_workers=2, num_stages=2, num_replicas=2,
                      num_train_steps=2)
  summary = train.train_and_evaluate(c, workdir)
  return {k: summary[k] for k in ("final_loss", "final_accuracy")}


def run(workdir: str) -> dict:
  """Losses and final parameters of the replicated pipeline, ZeRO ring and sharded-worker engine.

  Pipeline: ``(replica, stage)`` = 4 x 2, cdp-v2, ``K = 2`` steps per call. CDP-ZeRO:
  ``(replica, data)`` = 4 x 2, the same. The launcher: the digits smoke config with
  ``parallelism=model, num_replicas=2`` (``(replica, stage)`` = 2 x 2, 2 steps), its final
  evaluation (in ``workdir``). Engine:
  ``(data, fsdp)`` = 4 x 2, cdp-v2. On 2 processes, replicas (workers) 0-1 are on
  process 0 and 2-3 on process 1: the reductions over them cross processes.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import executed_reference as ref  # pylint: disable=g-import-not-at-top
  from cdpjax import executors  # pylint: disable=g-import-not-at-top
  from cdpjax.executed import pipeline, staged, zero  # pylint: disable=g-import-not-at-top

  name, num_stages, replicas = "residual_mlp", 2, 4
  model, params, _, stage_ids = ref.model_of(name, num_stages)
  steps = NUM_CALLS * STEPS_PER_CALL
  data = ref.batches(name, replicas * num_stages, num_steps=steps)
  ex = pipeline.make_executor(
      ref.staged_of(name, num_stages), ref.make_tx(name), rule="cdp-v2", scan_steps=STEPS_PER_CALL,
      mesh=jax.make_mesh((replicas, num_stages), ("replica", "stage"), devices=jax.devices()))
  result = _calls(ex, params, data, "pipeline")
  ex = zero.make_executor(
      ref.staged_of(name, num_stages, pad_to=num_stages), ref.make_tx(name), rule="cdp-v2",
      scan_steps=STEPS_PER_CALL,
      mesh=jax.make_mesh((replicas, num_stages), ("replica", "data"), devices=jax.devices()))
  result.update(_calls(ex, params, data, "zero"))

  ex = executors.engine_executor(
      model, ref.make_tx(name), stage_ids=stage_ids, rule="cdp-v2", loss_fn=staged.cross_entropy,
      mesh=jax.make_mesh((4, 2), ("data", "fsdp"), devices=jax.devices()), with_model_state=False)
  state, engine_losses = ex.init(params), []
  data = ref.batches(name, 4, num_steps=steps)
  for k in range(steps):
    state, metrics = ex.step(state, ref.step_batch(data, k))
    engine_losses.append(_host(metrics["loss"]))
  result.update(engine_losses=engine_losses, engine_params=np.concatenate(
      [np.ravel(_host(x)) for x in jax.tree.leaves(state.params)]).tolist())
  result.update(_launcher(workdir))
  assert all(np.isfinite(result["pipeline_losses"] + result["zero_losses"]
                         + result["engine_losses"]))
  return result


if __name__ == "__main__":
  out, coordinator, num_processes, process_id = sys.argv[1:5]
  # 60 s once let both processes be declared dead mid-run (no heartbeat reached the
  # coordinator on the loaded 2 cores, 2026-12-03); a hang still ends at RUN_TIMEOUT_S = 240.
  distributed.initialize(8, coordinator_address=coordinator, num_processes=int(num_processes),
                         process_id=int(process_id), timeout_s=200)
  pathlib.Path(out).write_text(json.dumps(run(str(pathlib.Path(out).parent / "launcher"))))
