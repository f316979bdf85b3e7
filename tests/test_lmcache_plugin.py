"""The LMCache plugin suite (tests/lmcache_plugin/: kvswarm under LMCache 0.5.6's own storage manager,
and the benchmark at toy sizes), run inside .venv-lmcache as part of the normal test run."""

from engine_venv import run_suite


def test_lmcache_suite_in_lmcache_venv() -> None:
    run_suite("lmcache_plugin", venv=".venv-lmcache", setup="scripts/setup-lmcache.sh")
