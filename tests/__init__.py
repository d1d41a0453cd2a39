"""
llmgw's trial tests.

Property tests explore fresh random examples on a developer's machine; under
CI (the CI variable set) they run a fixed set, so a run is repeatable.
Neither times an example.
"""

import os

from hypothesis import HealthCheck, settings

# No example is timed (no deadline, no health check on slow generation): on a
# loaded machine those are wall-clock assertions that fail a correct run.
untimed = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("untimed", **untimed)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **untimed)
settings.load_profile("ci" if os.environ.get("CI") else "untimed")
