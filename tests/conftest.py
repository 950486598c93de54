import os

# Keep multi-process CPU tests from oversubscribing the two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
