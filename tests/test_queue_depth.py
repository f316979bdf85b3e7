"""The store's queue depth per drive, chosen from its drives' devices when not configured."""

import os
import stat

import pytest

from kvswarm import KVStore
from kvswarm.drive import block_device
from kvswarm.errors import ConfigError
from kvswarm.store import StoreConfig
from kvswarm.store.config import device_queue_depth


def test_directories_on_one_disk_share_its_hardware_queue(drive_dirs):
    dirs = drive_dirs(4)
    dev = block_device(dirs[0])
    if dev is None:  # no block device under the test's directory (tmpfs): the fallback
        want_one = want_four = 32
    else:
        assert dev == block_device(dirs[3]) and dev[1] >= 1
        want_one, want_four = max(8, min(128, dev[1])), max(8, min(128, dev[1] // 4))
    assert device_queue_depth(dirs[:1]) == want_one
    assert device_queue_depth(dirs) == want_four
    with KVStore.open(dirs, capacity_per_drive=1 << 20) as store:
        assert store.queue_depth == want_four
        if store.native is not None:
            assert store.native.queue_depth == want_four
    with KVStore.open(dirs, capacity_per_drive=1 << 20, queue_depth=5) as store:
        assert store.queue_depth == 5


def test_a_block_device_node_answers_for_its_device(tmp_path):
    """A drive given as a block device is looked up by the device it names (st_rdev), not by the file
    system its node lives on: a node made for the device under tmp_path answers as tmp_path does."""
    dev = os.stat(tmp_path).st_dev
    node = tmp_path / "node"
    os.mknod(node, stat.S_IFBLK | 0o600, dev)  # the tests run as root (loop devices, blkio caps)
    assert block_device(str(node)) == block_device(str(tmp_path))


def test_unknown_paths_fall_back(tmp_path):
    assert block_device(str(tmp_path / "missing")) is None
    assert device_queue_depth([str(tmp_path / "missing")]) == 32
    assert block_device("/proc") is None  # no block device under it


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_a_bad_queue_depth_is_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match="queue_depth"):
        StoreConfig(drives=[str(tmp_path)], queue_depth=bad)
