"""pytest-benchmark suites (``bench_<op>.py``) and their shared helpers (``bench.common``)."""
