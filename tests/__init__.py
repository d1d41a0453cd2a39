"""
llmgw's trial tests.

Property tests explore fresh random examples on a developer's machine; under
CI (the CI variable set) they run a fixed set, so a run is repeatable.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
