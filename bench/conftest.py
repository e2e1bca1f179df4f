"""Collect ``bench_*.py`` files as test modules (pytest-benchmark suites), and the
``torch_threads`` fixture.

A file named on the command line is collected by pytest itself; this hook adds the
``bench_*.py`` files found when a directory is given (``pytest bench``).
"""

import osd  # noqa: F401  first: its libgomp setting applies only before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.common import THREADS


def pytest_collect_file(parent, file_path):
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="module")
def torch_threads():
    """Torch's CPU thread count set to ``bench.common.THREADS`` for a module's benchmarks
    (``pytestmark = pytest.mark.usefixtures("torch_threads")``), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)
