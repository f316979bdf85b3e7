"""Batched asynchronous I/O engines (submit, then poll), and the choice between them."""

from kvswarm.io.base import IOEngine, IORequest, Op

__all__ = ["IOEngine", "IORequest", "Op", "make_engine", "uring_available"]


def uring_available() -> bool:
    """uring-api is installed and the kernel lets this process use io_uring."""
    try:
        import uring_api
    except ImportError:
        return False
    return bool(uring_api.is_available())


def make_engine(backend: str, queue_depth: int = 32, single_thread: bool = False) -> IOEngine:
    """``threads`` (os.preadv/pwritev workers), ``uring`` (io_uring via uring-api) or ``auto``
    (uring where available: its completions are reaped by the caller's thread, with no worker
    threads retaking the GIL per I/O, which matters in an engine's busy process).

    ``single_thread``: only one thread ever submits and waits (see ``uring.make_ring``).
    The backends are imported here, on first use: uring-api is optional."""
    if backend == "auto":
        backend = "uring" if uring_available() else "threads"
    if backend == "threads":
        from kvswarm.io.threads import ThreadEngine

        return ThreadEngine(queue_depth)
    if backend == "uring":
        from kvswarm.io.uring import UringEngine

        return UringEngine(queue_depth, single_thread=single_thread)
    raise ValueError(f"unknown I/O backend {backend!r}: use 'threads', 'uring' or 'auto'")
