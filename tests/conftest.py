"""Test-session setup shared by every test module (pytest loads this before any test imports torch)."""

from vexpert_runtime.threads import configure_cpu_threads

# The suite's tensors are small, as the CLI's are: one intra-op thread whose idle waits sleep, so a
# busy machine slows the suite in proportion to its load (VEXPERT_THREADS=N overrides).
configure_cpu_threads()
