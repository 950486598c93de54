import os

# Keep multi-process CPU tests from oversubscribing the two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Keep the tests of one DistributedTest class on one pytest-xdist worker (``--dist loadgroup``: they share one
    set of ranks), and skip ``gpu`` tests where there is no CUDA device."""
    import pytest
    import torch

    from tests.dist_pool import DistributedTest

    no_cuda = pytest.mark.skip(reason="gpu test: no CUDA device here")
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, DistributedTest):
            item.add_marker(pytest.mark.xdist_group(name=f"{item.module.__name__}.{cls.__name__}"))
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)
