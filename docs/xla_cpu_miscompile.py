"""XLA:CPU (YNN fusion) miscompile: jit(grad) of a flat parameter vector cut by slices.

A flat float32 vector holds the leaves; each leaf is cut with its own slice, so
the gradient wrt the vector is a chain of pad-to-full-length + add, one per
leaf. `bias` and `proj_bias` are added into the same ReLU input, so their
gradients are one reduce, which XLA merges and feeds to two pads. Under
jax.jit the `bias` entries come out zero; eager evaluation is exact, and so is
jit with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= (no YNN fusion).

  python docs/xla_cpu_miscompile.py            # default flags
  python docs/xla_cpu_miscompile.py --no-ynn   # re-runs itself with YNN fusion off
"""
import os
import sys

if "--no-ynn" in sys.argv and "--xla_cpu_experimental_ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type=").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

FILL = int(os.environ.get("FILL", 36864))  # an unused leaf; small values hide the bug
B, H, CIN, C = 16, 4, 32, 64
shapes = {"scale": (C,), "bias": (C,), "kernel": (CIN, C), "unused": (FILL,), "proj_bias": (C,), "proj_kernel": (CIN, C)}
names = list(shapes)
sizes = [int(np.prod(shapes[n])) for n in names]
offsets = dict(zip(names, np.cumsum([0] + sizes)))


def f(flat, x, y):
  p = {n: flat[offsets[n]:offsets[n] + s].reshape(shapes[n]) for n, s in zip(names, sizes)}  # one slice per leaf
  t = (x @ p["kernel"]) * p["scale"] + p["bias"]
  r = x @ p["proj_kernel"] + p["proj_bias"]
  return jnp.sum(jax.nn.relu(t + r) * y)  # bias and proj_bias: same gradient


rng = np.random.default_rng(0)
flat = (0.1 * rng.standard_normal(sum(sizes))).astype(np.float32)
x = rng.standard_normal((B, H, H, CIN)).astype(np.float32)
y = rng.standard_normal((B, H, H, C)).astype(np.float32)

g_jit = np.asarray(jax.jit(jax.grad(f))(flat, x, y))
with jax.disable_jit():
  g_ref = np.asarray(jax.grad(f)(flat, x, y))

print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "XLA_FLAGS=%r" % os.environ.get("XLA_FLAGS", ""))
d = np.abs(g_jit - g_ref)
print("max |jit - eager| = %.3g; entries zero under jit but not eager: %d" % (d.max(), ((g_jit == 0) & (g_ref != 0)).sum()))
for n, s in zip(names, sizes):
  o = offsets[n]
  if d[o:o + s].max() > 1e-3 * max(1.0, np.abs(g_ref[o:o + s]).max()):
    print("  wrong leaf %-11s jit[:4] =" % n, g_jit[o:o + 4], " eager[:4] =", g_ref[o:o + 4])
ok = np.allclose(g_jit, g_ref, rtol=1e-4, atol=1e-4)
print("correct" if ok else "MISCOMPILED")
