from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# The `backend` fixture sets a context for the whole test, so holding it across
# generated inputs is intended.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("moelab", max_examples=60, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moelab"))
