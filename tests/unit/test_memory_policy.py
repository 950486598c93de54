"""The memory manager's pure parts: budgets, policies, the placement a budget chooses."""

from __future__ import annotations

import pytest

from lightning_vescale.memory import MemoryPolicy, parse_bytes
from lightning_vescale.memory.budget import MemoryEstimate, choose_placement

MiB = 2**20


def test_budgets_read_like_people_write_them() -> None:
    assert parse_bytes("6GiB") == 6 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes(1024) == 1024
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    with pytest.raises(ValueError, match="cannot read '6 gigs' as bytes"):
        parse_bytes("6 gigs")


def test_a_disk_tier_needs_a_directory() -> None:
    with pytest.raises(ValueError, match="needs disk_dir"):
        MemoryPolicy(optimizer_states="disk")
    with pytest.raises(ValueError, match="must be one of"):
        MemoryPolicy(optimizer_states="nvme")


def test_prefetch_needs_room_for_the_bucket_stepping() -> None:
    with pytest.raises(ValueError, match=r"prefetch_buckets must be >= 1 \(the bucket stepping\), got 0"):
        MemoryPolicy(prefetch_buckets=0)


def estimate(**kw) -> MemoryEstimate:
    base = dict(params=100 * MiB, grads=100 * MiB, optimizer_states=200 * MiB, gathered_params=50 * MiB,
                activations=400 * MiB, num_blocks=8, block_inputs=20 * MiB, forward_seconds=1.0, bucket_bytes=10 * MiB)
    base.update(kw)
    return MemoryEstimate(**base)


def test_everything_stays_on_the_device_when_it_fits() -> None:
    placement = choose_placement(estimate(), "1GiB", disk_bandwidth=1e9)
    assert set(placement.tiers.values()) == {"device"} and placement.total == 850 * MiB


def test_the_cheapest_combination_that_fits_is_chosen() -> None:
    # Fast disk (850 -> 620 MiB): gradients (saves 80 MiB for 0.21 s: all but two buckets) and optimizer states
    # (150 MiB, 0.42 s: all but the 5 buckets in memory around a step) to disk cost less than the activations
    # (300 MiB, 0.84 s); weights (80 MiB, 0.42 s) are not needed.
    fast = choose_placement(estimate(), "620MiB", disk_bandwidth=1e9)
    assert (fast.tiers["grads"], fast.tiers["optimizer_states"]) == ("disk", "disk")
    assert (fast.tiers["params"], fast.tiers["activations"]) == ("device", "device") and fast.total <= 620 * MiB
    # Slow disk: recomputing is cheaper; states, then weights and gradients move only when that is not enough.
    slow = choose_placement(estimate(), "600MiB", disk_bandwidth=1e8)
    assert slow.tiers["activations"] == "checkpoint" and slow.total <= 600 * MiB
    assert {slow.tiers[c] for c in ("params", "grads", "optimizer_states")} == {"device"}
    tight = choose_placement(estimate(), "350MiB", disk_bandwidth=1e8)
    assert tight.tiers["optimizer_states"] == "disk" and tight.tiers["params"] == "device" and tight.total <= 350 * MiB
    assert "| optimizer_states | disk |" in tight.table()
    tighter = choose_placement(estimate(), "210MiB", disk_bandwidth=1e8)
    assert (tighter.tiers["params"], tighter.tiers["grads"]) == ("disk", "disk") and tighter.total <= 210 * MiB
    assert "| params | disk |" in tighter.table()


def test_a_budget_too_small_says_the_minimum_and_what_needs_it() -> None:
    needs = r"still needs 210\.0 MiB \(params 20\.0 MiB, grads 20\.0 MiB, optimizer_states 50\.0 MiB"
    with pytest.raises(ValueError, match=r"too small .* " + needs):
        choose_placement(estimate(), "130MiB", disk_bandwidth=1e9)


def test_a_disk_dir_whose_parent_is_missing_is_refused(tmp_path) -> None:
    missing = tmp_path / "not_mounted" / "swap"
    with pytest.raises(ValueError, match=r"does not exist, nor does its parent .* create it or pick an existing"):
        MemoryPolicy(params="disk", disk_dir=str(missing))
    assert not missing.parent.exists(), "nothing was created"
    MemoryPolicy(params="disk", disk_dir=str(tmp_path / "swap"))  # only the last component missing: created
    assert (tmp_path / "swap").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot be created|is not a directory"):
        MemoryPolicy(grads="disk", disk_dir=str(tmp_path / "file"))


def test_weights_and_gradient_tiers_are_checked() -> None:
    with pytest.raises(ValueError, match=r"MemoryPolicy.params must be one of"):
        MemoryPolicy(params="nvme")
    with pytest.raises(ValueError, match="needs disk_dir"):
        MemoryPolicy(grads="disk")


def test_a_read_only_disk_dir_is_refused(tmp_path) -> None:
    """A read-only file system refuses even root (who passes os.access): the policy writes a byte to be sure."""
    import errno
    from unittest import mock

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    with mock.patch("tempfile.TemporaryFile", read_only):
        with pytest.raises(ValueError, match=r"cannot be written \(\[Errno 30\] Read-only file system\); pick a writable"):
            MemoryPolicy(params="disk", disk_dir=str(tmp_path))


_KILLED_STORE = """
import os, signal, sys
from lightning_vescale.memory import DiskStore
store = DiskStore(sys.argv[1], tag="_pieces")
open(os.path.join(store.root, "b0_params.bin"), "wb").write(b"x" * 10)
print(store.root, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # before close()
"""


def test_swap_files_of_a_killed_process_are_removed_but_never_a_live_ones(tmp_path) -> None:
    """A process killed before close() leaves its swap directory; the next store under the directory removes it.
    A folder whose owner still runs is kept, even when its pid is one this process cannot see (a live job in
    another container's pid namespace, issue 25)."""
    import fcntl
    import os
    import subprocess
    import sys

    from lightning_vescale.memory import DiskStore

    proc = subprocess.run([sys.executable, "-c", _KILLED_STORE, str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    dead = proc.stdout.strip()
    assert proc.returncode == -9 and os.path.isdir(dead)
    other = tmp_path / "lightning_vescale_swap_999999999_pieces"  # a pid this namespace does not have
    other.mkdir()
    (other / "b0_params.bin").write_bytes(b"x" * 10)
    lock = os.open(other / ".owner.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # its owner is alive
    try:
        store = DiskStore(str(tmp_path))
        assert not os.path.exists(dead), "a killed process's swap folder was left behind"
        assert (other / "b0_params.bin").exists(), "a live job's swap folder was deleted"
        assert os.path.isdir(store.root)
        store.close()
    finally:
        os.close(lock)


def test_recipe_memory_config_holds_the_policys_fields_and_defaults():
    """The recipes' ``memory`` group mirrors MemoryPolicy for Hydra; names and defaults must not drift apart."""
    import dataclasses

    from lightning_vescale.memory import MemoryPolicy
    from lightning_vescale.recipe.schema import MemoryConfig

    policy = {f.name: f for f in dataclasses.fields(MemoryPolicy)}
    config = {f.name: f for f in dataclasses.fields(MemoryConfig)}
    assert list(config) == list(policy)
    for name, f in policy.items():
        mine = config[name]
        want = f.default_factory() if f.default is dataclasses.MISSING else f.default
        got = mine.default_factory() if mine.default is dataclasses.MISSING else mine.default
        assert tuple(got) == tuple(want) if isinstance(want, tuple) else got == want, name


def test_recipe_memory_config_uses_the_policys_checks():
    import pytest

    from lightning_vescale.recipe.schema import MemoryConfig

    with pytest.raises(ValueError, match=r"memory.params must be one of device, host, disk, got 'gpu'"):
        MemoryConfig(params="gpu")
    with pytest.raises(ValueError, match=r"memory.budget: "):
        MemoryConfig(budget="lots")
    with pytest.raises(ValueError, match=r"memory.prefetch_buckets must be >= 1"):
        MemoryConfig(prefetch_buckets=0)
