"""Shared pytest set-up: a deterministic, bounded hypothesis profile for CI and local runs."""
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# The project is a flat set of top-level modules; make them importable from tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# "ci": deterministic (derandomize) and bounded, so the suite is reproducible and quick on 2 cores.
settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory):
    """One warm-start cache directory for every end-to-end toy run of one pytest run (tests/runfix.py):
    the first run trains the tiny SFT policy, the others load it."""
    return tmp_path_factory.mktemp("toy-cache")
