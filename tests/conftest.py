"""Test-session setup shared by every test module (pytest loads this before any test imports torch)."""

import multiprocessing
from collections.abc import Iterator

import pytest

from vexpert_runtime.threads import configure_cpu_threads

# The suite's tensors are small, as the CLI's are: one intra-op thread whose idle waits sleep, so a
# busy machine slows the suite in proportion to its load (VEXPERT_THREADS=N overrides).
configure_cpu_threads()


@pytest.fixture(autouse=True)
def _semaphore_names_restored() -> Iterator[None]:
    """A test that runs ``vexpert_runtime.cli.main`` in the test process names that process's semaphores
    after its pid for good (``shm_names.name_semaphores_by_run``, right for a CLI process); restored
    after each test, so a later test's leak check (``shm_support.run_objects``) sees the same names
    whatever ran before it in the same process."""
    config = getattr(multiprocessing.current_process(), "_config", None)
    before = config.get("semprefix") if isinstance(config, dict) else None
    yield
    if isinstance(config, dict) and before is not None:
        config["semprefix"] = before
