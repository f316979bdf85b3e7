"""kill -9 at random moments: every flushed object survives, nothing torn or corrupt is ever served."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvswarm import KVStore

sys.path.insert(0, str(Path(__file__).parent))
from crash_writer import FLUSH_EVERY, payload, state_after  # noqa: E402

NKEYS = 60
KILLS = 6


@pytest.mark.parametrize("backend", ["threads", "uring"])
def test_sigkill_loop(tmp_path, drive_dirs, backend):
    paths = drive_dirs(3)
    rng = random.Random(1234)
    durable_round = -1  # state after this round is durable (-1: nothing flushed yet)
    checked = 0
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "crash_writer.py"), ",".join(paths),
                                 backend, str(NKEYS), str(durable_round + 1)], stdout=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(1.0, 2.5))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        flushed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("FLUSHED")]
        durable_round = flushed[-1] if flushed else durable_round
        # Rounds after the last reported flush up to the next flush point may have reached the disk too.
        possible = [state_after(r, NKEYS) for r in range(durable_round, durable_round + FLUSH_EVERY + 1)]
        s = KVStore.open(paths, backend=backend, capacity_per_drive=64 << 20, buffer_pool_bytes=16 << 20)
        try:
            with s.get_many([b"key%d" % k for k in range(NKEYS)]) as r:
                assert r.corrupt == 0  # deferred frees: a live extent is never overwritten before the flush
                for k, v in enumerate(r.views):
                    allowed = {st.get(k) for st in possible}
                    if v is None:
                        assert None in allowed, f"key {k}: flushed version lost (allowed {allowed})"
                    else:
                        got = bytes(v)
                        assert any(ver is not None and got == payload(k, ver) for ver in allowed), \
                            f"key {k}: served bytes of no allowed version"
                        checked += 1
        finally:
            s.close()
    assert checked > 0
