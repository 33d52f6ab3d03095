"""cdpjax: Cyclic Data Parallelism in JAX."""

__version__ = "0.1.0"
