"""LMCache plugin tests; they run inside .venv-lmcache (scripts/setup-lmcache.sh) and are skipped by the
other venvs; tests/test_lmcache_plugin.py runs them.  Everything they exercise above kvswarm (the
storage manager, its plugin launcher, the CPU back end and allocator, chunk keys) is LMCache's real code."""

import importlib.util

import pytest

if importlib.util.find_spec("lmcache") is None:
    collect_ignore_glob = ["*.py"]


@pytest.fixture
def drives(tmp_path):
    """Three directory drives."""
    out = []
    for i in range(3):
        d = tmp_path / f"nvme{i}"
        d.mkdir()
        out.append(str(d))
    return out
