import os

# Keep multi-process CPU tests from oversubscribing the two cores (before torch is imported).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.dist_pool import ranks  # noqa: E402, F401 - the module-scoped ranks of ModuleRanksTest, for every module


def pytest_collection_modifyitems(config, items):
    """Keep the tests of one DistributedTest class on one pytest-xdist worker (``--dist loadgroup``: they share one
    set of ranks), and those of a module with a module-scoped fixture of its own; skip ``gpu`` tests where there is
    no CUDA device."""
    import pytest
    import torch

    from tests.dist_pool import DistributedTest

    no_cuda = pytest.mark.skip(reason="gpu test: no CUDA device here")
    for item in items:
        cls = getattr(item, "cls", None)
        if item.get_closest_marker("xdist_group") is None:
            if _uses_module_fixture(item):
                # A module-scoped fixture (ranks shared by the module's classes, a checkpoint one world size saves
                # for the others to load, recipe runs): one worker, so it is set up once.
                item.add_marker(pytest.mark.xdist_group(name=item.module.__name__))
            elif cls is not None and issubclass(cls, DistributedTest):
                item.add_marker(pytest.mark.xdist_group(name=f"{item.module.__name__}.{cls.__name__}"))
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)


def _uses_module_fixture(item) -> bool:
    """Whether ``item`` uses a module-scoped fixture of the tests (not of pytest or a plugin: their ids are empty)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope == "module" and defs[-1].baseid
                                    for defs in info.name2fixturedefs.values())
