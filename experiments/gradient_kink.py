"""Why dp cannot meet 1e-5 on the digits ResNet-18: its step-2 gradient has a kink within float32
rounding of ``theta_1``.

  python experiments/gradient_kink.py            # configs/digits.py:model=resnet18, N = J = 4
  python experiments/gradient_kink.py --quick    # the smoke config

Trains one dp step under ``parallelism=data`` (the engine) and ``model`` (the
executed pipeline) through the launcher, then evaluates the dp gradient of
step 2 (each worker's mean loss on its micro-batch, BatchNorm in train mode,
averaged over workers; `jax.grad` of the unstaged model) at both ``theta_1``
and at ``theta_1`` plus Gaussian noise of ``1e-7`` of each leaf's largest
magnitude (float32 rounding size), in float32 and in float64. Where the
gradient norm jumps between draws in float64 too, the loss is not smooth
there: two correct programs whose ``theta_1`` differ by rounding can take
different step-2 gradients, so no equivalence test can hold them within 1e-5
after it. Results go to ``<results_dir>/gradient_kink.json``.
"""
from __future__ import annotations

import os
import sys
import tempfile

import _common
import executed_equivalence  # Emulates the CPU devices before JAX starts.

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cdpjax import config as config_lib  # noqa: E402
from cdpjax import tasks, train  # noqa: E402

NOISE = 1e-7
DRAWS = 3


def dp_gradient_norm(run, pairs, variables, num_workers: int, dtype) -> float:
  """The norm of the dp gradient of one step on ``pairs``, computed in ``dtype``."""
  cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)
  params, state = cast(variables["params"]), cast(variables.get("model_state"))
  x, y = jnp.asarray(pairs["image"], dtype), jnp.asarray(pairs["label"])
  rows = x.shape[0] // num_workers

  def worker_loss(p, i):
    logits, _ = run.model.apply({"params": p, **({"batch_stats": state} if state else {})},
                                x[i * rows:(i + 1) * rows], train=True, mutable=["batch_stats"])
    return tasks.cross_entropy(logits, y[i * rows:(i + 1) * rows])

  grads = jax.jit(lambda p: [jax.grad(worker_loss)(p, i) for i in range(num_workers)])(params)
  mean = jax.tree.map(lambda *g: sum(g) / num_workers, *grads)
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(mean))))


def main(argv=None) -> dict:
  args = _common.parser("gradient_kink", __doc__).parse_args(argv)
  arg = "smoke," if args.quick else "model=resnet18,"
  thetas = {}
  with tempfile.TemporaryDirectory() as root:
    for p in ("data", "model"):
      thetas[p] = executed_equivalence.run_one(arg, 1, p, "dp", os.path.join(root, p))["final"]
  c = config_lib.load(str(_common.REPO / "configs" / "digits.py"), f"{arg}rule=dp",
                      num_workers=4, num_stages=4)
  run = train.build_run(c)
  batch = next(run.dataset.train_batches(run.global_batch, seed=c.seed, start_step=1,
                                         process_index=0, process_count=1))
  pairs = run.task.pairs(batch)
  rng = np.random.default_rng(0)
  noisy = [{**thetas["data"], "params": jax.tree.map(
      lambda a: a + NOISE * np.abs(a).max() * rng.standard_normal(a.shape).astype(a.dtype),
      thetas["data"]["params"])} for _ in range(DRAWS)]
  out = {"config": f"configs/digits.py:{arg}rule=dp, N=J=4", "noise_of_scale": NOISE,
         "machine": _common.machine()}
  for dtype in ("float32", "float64"):
    jax.config.update("jax_enable_x64", dtype == "float64")
    norm = lambda v: dp_gradient_norm(run, pairs, v, c.num_workers, jnp.dtype(dtype))
    out[dtype] = {"theta_1 of data": norm(thetas["data"]),
                  "theta_1 of model": norm(thetas["model"]),
                  "perturbed": [norm(v) for v in noisy]}
    values = [out[dtype]["theta_1 of data"], *out[dtype]["perturbed"]]
    out[dtype]["largest_jump_rel"] = float((max(values) - min(values)) / max(values))
    print(f"{dtype}: step-2 gradient norm at data's theta_1 {out[dtype]['theta_1 of data']:.7f}, "
          f"model's {out[dtype]['theta_1 of model']:.7f}, perturbed by {NOISE:g} of scale: "
          + ", ".join(f"{v:.7f}" for v in out[dtype]["perturbed"])
          + f" (largest jump {out[dtype]['largest_jump_rel']:.1e})", flush=True)
  jax.config.update("jax_enable_x64", False)
  _common.write_json(_common.results_dir(args) / "gradient_kink.json", out)
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
