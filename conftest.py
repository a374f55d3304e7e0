"""A strict test environment, applied before any kvattn module is imported.

Shape annotations on kvattn's functions are checked at run time (jaxtyping +
beartype), and implicit rank promotion raises instead of broadcasting.
"""

import os

import jax
from hypothesis import HealthCheck, settings
from jaxtyping import install_import_hook

jax.config.update("jax_numpy_rank_promotion", "raise")

with install_import_hook("kvattn", "beartype.beartype"):
    import kvattn  # noqa: F401

settings.register_profile(
    "kvattn",
    deadline=None,
    max_examples=20,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
# A longer random search for local bug hunting, and the slowest cases CI leaves out
# (four JAX processes in test_multihost): HYPOTHESIS_PROFILE=wide make test
settings.register_profile("wide", parent=settings.get_profile("kvattn"), derandomize=False, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvattn"))
