"""Collect ``bench_*.py`` files as test modules (pytest-benchmark suites).

A file named on the command line is collected by pytest itself; this hook adds the
``bench_*.py`` files found when a directory is given (``pytest bench``).
"""
import pytest


def pytest_collect_file(parent, file_path):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
