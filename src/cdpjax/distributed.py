"""Joining the processes of a multi-host run, before JAX starts a backend.

``initialize`` calls ``jax.distributed.initialize`` when ``mode`` says so:

- ``"on"``: always. Flags left unset are detected by JAX (Cloud TPU metadata,
  SLURM, Open MPI, Kubernetes).
- ``"off"``: never; one process.
- ``"auto"``: when any of ``coordinator_address``, ``num_processes`` or
  ``process_id`` is given, or the environment is a multi-process launch:
  ``JAX_COORDINATOR_ADDRESS`` set, a SLURM step of several tasks, an Open MPI
  job of several ranks, or a Cloud TPU VM. A plain single-host run never joins,
  so it cannot wait for peers that do not exist.

One timeout bounds every wait on the other processes: joining (a watchdog
exits with a message naming the fix), a peer that stops sending heartbeats (JAX
aborts the survivors) and the barrier at exit.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from typing import NamedTuple

MODES = ("auto", "on", "off")

_COUNT_FLAG = "--xla_force_host_platform_device_count"


class Processes(NamedTuple):
  """This process's place in the run."""
  index: int
  count: int


def emulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices unless ``XLA_FLAGS`` already sets a count.

  Only the CPU platform reads this flag, so it is harmless on GPU and TPU hosts.
  It takes effect when the backend starts, so set it before anything touches
  devices. On a host without TPU chips or NVIDIA/AMD GPUs, and without
  ``JAX_PLATFORMS``, JAX is also kept to the CPU: it would otherwise start
  libtpu where ``jax[tpu]`` is installed (cdpjax-compile's ahead-of-time
  compiler), which prints errors about the missing TPU environment.
  """
  flags_now = os.environ.get("XLA_FLAGS", "")
  if not re.search(_COUNT_FLAG + r"=\d+", flags_now):
    os.environ["XLA_FLAGS"] = f"{flags_now} {_COUNT_FLAG}={count}".strip()
  import jax  # pylint: disable=g-import-not-at-top  (importing it starts no backend)
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if jax.config.jax_platforms is None and not (
      hardware_utils.num_available_tpu_chips_and_device_id()[0]
      or hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus()):
    jax.config.update("jax_platforms", "cpu")


def multi_process_launch() -> str | None:
  """The multi-process launcher this process runs under, or None."""
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_NODELIST" in env:
    return "SLURM"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "Open MPI"
  from jax._src import cloud_tpu_init  # pylint: disable=g-import-not-at-top  (set by `import jax`)
  return "Cloud TPU" if cloud_tpu_init.running_in_cloud_tpu_vm else None


def initialize(num_devices: int, *, mode: str = "auto", coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               timeout_s: int = 300) -> Processes:
  """Joins the run's processes if ``mode`` says so and sets this host's CPU devices.

  Args:
    num_devices: devices the run's mesh needs in all; on CPU each process
      emulates its share.
    mode: ``"auto"``, ``"on"`` or ``"off"`` (see the module docstring).
    coordinator_address: ``host:port`` of process 0, reachable from every process.
    num_processes: processes in the run.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    timeout_s: seconds to wait for every process to join, and after which a
      process that stopped answering fails the others.

  Returns:
    This process's index and the number of processes.
  """
  if mode not in MODES:
    raise ValueError(f"Unknown distributed mode {mode!r}: use one of {MODES}.")
  explicit = {k: v for k, v in [("coordinator_address", coordinator_address),
                                ("num_processes", num_processes),
                                ("process_id", process_id)] if v is not None}
  if mode == "off" and explicit:
    raise ValueError(f"--distributed=off contradicts --{', --'.join(explicit)}: drop one.")
  processes = Processes(0, 1)
  if mode == "on" or (mode == "auto" and (explicit or multi_process_launch())):
    processes = _join(coordinator_address, num_processes, process_id, timeout_s)
  emulate_cpu_devices(-(-num_devices // processes.count))
  return processes


def _join(coordinator_address, num_processes, process_id, timeout_s) -> Processes:
  """``jax.distributed.initialize``, or exit with a message after ``timeout_s``."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top

  def give_up():
    sys.stderr.write(
        f"process {_or_unknown(process_id)}/{_or_unknown(num_processes)}: not every process "
        f"joined the run at {coordinator_address or 'the detected coordinator'} within "
        f"{timeout_s} s. Start all processes with the same --coordinator_address (host:port of "
        "process 0, reachable from every host) and --num_processes, each with its own "
        "--process_id, or raise --distributed_timeout_s.\n")
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access  (the join blocks the main thread)

  # JAX's own join deadline aborts without naming the fix; the watchdog fires first.
  watchdog = threading.Timer(timeout_s, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id, initialization_timeout=2 * timeout_s,
        heartbeat_timeout_seconds=timeout_s, shutdown_timeout_seconds=timeout_s)
  finally:
    watchdog.cancel()
  # Known before any backend starts, unlike jax.process_count().
  state = jax_distributed.global_state
  return Processes(state.process_id, state.num_processes)


def _or_unknown(value) -> str:
  return "?" if value is None else str(value)
