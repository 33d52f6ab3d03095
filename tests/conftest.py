"""Test-wide JAX set-up: 8 emulated CPU devices, set before JAX starts."""
import os

# Must run before anything imports jax: the device count is fixed when the backend starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
