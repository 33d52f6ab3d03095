"""The executed timetables' device toolkit: ordering, varying types, step batches, version rings.

Shared by `staged`, `pipeline` and `zero`; none of it knows a model.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


TPU_TILE = 1024
"""Float32 elements in one tile of a 1-D array on the TPU (layout ``T(1024)``). The executed
modes pad their stage buffers to a multiple of it: a device's row ``[1, P]`` of the state then
becomes the flat ``[P]`` its loop carries by a bitcast, where another ``P`` costs a copy in and
out of every call (digits ResNet-18 on v5e:2x4: GPipe 15.40 -> 13.00 MiB of HBM, CDP+ZeRO
26.79 -> 18.66; BENCHMARKS.md, "Pod plan")."""


def varying(tree) -> frozenset:
  """The mesh axes any leaf of ``tree`` varies over (inside ``shard_map``)."""
  return frozenset().union(*(jax.typeof(x).mat.varying for x in jax.tree.leaves(tree)))


def after(x, previous):
  """``x``, made to depend on ``previous`` (an array; None: ``x`` as it is).

  XLA on CPU may start two independent conditionals in either order on each
  device, and devices that order two collectives differently deadlock. Adding
  0 times a flag of ``previous`` (exactly 0 even where it is not finite; XLA
  does not fold ``0 * x`` for floats) orders a collective on ``x`` after the
  one that produced ``previous``.
  """
  if previous is None:
    return x
  return x + 0 * jnp.isfinite(previous).all().astype(x.dtype)


def vary(tree, axes):
  """Marks every leaf varying over ``axes``, so branches and loop carries type-check."""
  def cast(x):
    missing = tuple(sorted(a for a in axes if a not in jax.typeof(x).mat.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def steps_batch(batch, scan_steps: int | None, num_micro: int) -> dict:
  """``batch`` checked: ``[N*b, ...]`` rows for one step, ``[K, N*b, ...]`` for ``K``.

  The executed schedules' input: ``{"image", "label"}`` of ``N*b`` rows each,
  micro-batch ``i`` = rows ``i*b:(i+1)*b``; host arrays become numpy arrays,
  abstract leaves (``jax.ShapeDtypeStruct``, `cdpjax.aot`) keep their
  abstract form. The compiled step gives one step's batch its steps axis
  (`with_steps_axis`).
  """
  if not isinstance(batch, dict) or set(batch) != {"image", "label"}:
    raise ValueError("The batch must be a dict with keys 'image' [N*b, ...] and 'label' "
                     "[N*b, ...].")
  batch = {k: v if isinstance(v, (jax.Array, jax.ShapeDtypeStruct)) else np.asarray(v)
           for k, v in batch.items()}
  if scan_steps is not None and any(len(v.shape) < 2 or v.shape[0] != scan_steps
                                    for v in batch.values()):
    raise ValueError(f"With scan_steps={scan_steps} batch leaves need shape "
                     f"[{scan_steps}, N*b, ...]; got {[tuple(v.shape) for v in batch.values()]}.")
  lead = 0 if scan_steps is None else 1
  rows = batch["image"].shape[lead] if len(batch["image"].shape) > lead else 0
  labels = batch["label"].shape[lead] if len(batch["label"].shape) > lead else 0
  if labels != rows or rows == 0 or rows % num_micro:
    raise ValueError(
        f"Batch of {rows} images and {labels} labels is not divisible by the "
        f"N={num_micro} micro-batches: use N * b rows for both (num_workers * b rows; "
        "micro-batch i = rows i*b:(i+1)*b, replica-major with replicas).")
  return batch


def with_steps_axis(batch, scan_steps: int | None):
  """Inside a compiled step: one step's batch as ``[1, N*b, ...]`` (``K`` steps' as they are).

  Done in the step, where it is a free reshape: outside it was a program per
  leaf and call.
  """
  return batch if scan_steps is not None else jax.tree.map(lambda x: x[None], batch)


class VersionRing(NamedTuple):
  """The versions ``(theta_t, ..., theta_{t-D})`` of flat stages as the flat ring a
  ``K``-step scan carries: ``[R, (D+1)*P]``, block ``(head + v) % V`` holding
  ``theta_{t-v}``, the newest written into the oldest block in place.

  The ring is built and taken apart by programs of their own (a copy of the
  versions per call of ``K`` steps) and is the step's argument: stacked inside
  the step, the state's version buffers, aliased to its outputs, and the ring
  both live through the call, the stale rows held twice. Flat, not ``[V, P]``:
  with ``[V, P]`` the TPU compiler's temporaries grew. CDP+ZeRO, where the flat
  argument raised the TPU peak, carries the state's own buffers through its
  scan (one owned stage a worker, a select per buffer at an update); not so
  here, where XLA then copies a stage buffer at each update, ``K`` copies a
  call against the ring's ``2V`` (docs/design_notes.md, "What was tried in
  the code").
  """
  size: int       # P.
  num_steps: int  # K: the scan applies K updates, so it ends with head = -K % V.
  sharding: jax.sharding.Sharding
  donate: bool

  def of(self, versions):
    """The ring of ``versions``; they are deleted if ``donate`` (no output can alias them)."""
    return _consumed(_concat_rows, tuple(versions), self.sharding, self.donate)

  def abstract(self, versions) -> jax.ShapeDtypeStruct:
    """The ring of abstract ``versions``, for lowering."""
    rows, size = versions[0].shape
    return jax.ShapeDtypeStruct((rows, len(versions) * size), versions[0].dtype,
                                sharding=self.sharding)

  def versions(self, ring) -> tuple:
    """``(theta_t, ..., theta_{t-D})`` of the ring after the scan's ``K`` updates."""
    return _consumed(_ring_blocks(self.size, self.num_steps), ring, self.sharding, self.donate)


def block(flat, index, size: int):
  """Block ``index`` (traced) of size ``size`` of the flat vector ``flat``."""
  return jax.lax.dynamic_slice(flat, (index * size,), (size,))


def set_block(flat, index, size: int, value):
  """``flat`` with block ``index`` (traced) of size ``size`` set to ``value``, in place."""
  return jax.lax.dynamic_update_slice(flat, value, (index * size,))


def _concat_rows(versions):
  return jnp.concatenate(versions, axis=1)


@functools.cache  # One function per (P, K), so that `_jitted` compiles it once.
def _ring_blocks(size: int, num_steps: int):
  def blocks(ring):
    num_versions = ring.shape[1] // size
    starts = [(v - num_steps) % num_versions * size for v in range(num_versions)]
    return tuple(ring[:, s:s + size] for s in starts)
  return blocks


@functools.cache
def _jitted(fn, sharding):
  return jax.jit(fn, out_shardings=sharding)


def _consumed(fn, arrays, sharding, donate: bool):
  """``fn(arrays)`` compiled, then ``arrays`` deleted if ``donate``: what donation does where
  XLA cannot alias an input to an output of another shape (JAX would warn and keep it)."""
  out = _jitted(fn, sharding)(arrays)
  if donate:
    for a in jax.tree.leaves(arrays):
      a.delete()
  return out
