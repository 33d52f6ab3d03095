"""Test-wide JAX set-up: 8 emulated CPU devices, set before JAX starts."""
import os

# Must run before anything imports jax: the device count is fixed when the backend starts.
# Cheaper LLVM code generation: the suite is compile-bound; the optimised HLO
# (and so every collective and buffer the tests read) is unchanged.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Programs that several tests compile (model init, evaluation, per-unit FLOPs)
# are compiled once per session.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"cdpjax-test-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
