"""
Benchmarks. Not part of the installed package; run from the repository root
(see C{bench/README.md}).
"""
