"""SGLang's built-in ``file`` HiCache backend vs kvswarm's, driven by SGLang's own cache-controller code.

SGLang's engine needs its CUDA kernels, so this runs, for real on CPU, everything below the
scheduler: SGLang's host KV pool (``MHATokenToKVPoolHost``, in the geometry of SmolLM2-135M:
30 layers, 3 KV heads of 64, bf16, 64-token pages, ~1.4 MiB a page), its ``HiCacheFile``
backend, kvswarm's backend built by SGLang's backend factory, and the cache controller's own page
functions, called batch by batch (``STORAGE_BATCH_SIZE`` pages) on one thread as its backup and
prefetch threads call them: ``_generic_page_set`` / ``_generic_page_get`` for the file backend
(how the controller drives a backend without the v1 interface), ``_page_set_zero_copy`` /
``_page_get_zero_copy`` for kvswarm (``interface_v1``).

Per host-pool layout, in rounds that alternate the backends' order, with no load and under each
engine load (:class:`~kvswarm.bench.engine_host.EngineLoad`: the scheduler thread holding the
GIL), each backend forgets every page, backs them all up and restores them cold (page cache
dropped) into other host pages.  Every restore is checked byte for byte against the pages
backed up.

SGLang is imported only inside ``.venv-vllm`` (scripts/setup-vllm.sh); run from another
interpreter this command re-executes itself there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from kvswarm.bench import engine_host as host

MiB = 1 << 20
PAGE, LAYERS, HEADS, DIM = 64, 30, 3, 64  # SmolLM2-135M's KV geometry, SGLang's usual page
BACKENDS = ("file", "kvswarm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    p.add_argument("--json", metavar="PATH", help="write results (with a 'summary' dict) here")
    p.add_argument("--dir", help="scratch directory on the disk under test (default: a temp dir in /var/tmp)")
    p.add_argument("--pages", type=int, default=None, help="pages backed up and restored (default 384, quick 96)")
    p.add_argument("--layouts", default="layer_first,page_first", help="host-pool layouts, comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="restore rounds, the median kept (default 7, quick 3)")
    p.add_argument("--engine-load", type=host.engine_loads, default="1/1,3/1", metavar="HOLD/IDLE,...",
                   help="GIL duty cycles of the emulated scheduler thread, ms held / ms idle ('' for none)")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("sglang") is None:
        return host.reexec_in_engine_venv("kvswarm.bench.sglang_bench", "sglang")
    from rich.console import Console

    from kvswarm.integrations.sglang_cpu import allow_cpu_import

    allow_cpu_import()
    console = Console(width=max(150, Console().width))
    pages = args.pages or (96 if args.quick else 384)
    rounds = args.rounds or (3 if args.quick else 7)
    loads = [(0.0, 0.0), *args.engine_load]
    root = tempfile.mkdtemp(prefix="kvswarm-bench-sglang-", dir=args.dir or "/var/tmp")
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "pages": pages, "rounds": rounds,
                     "geometry": {"page_tokens": PAGE, "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM,
                                  "dtype": "bfloat16"}, "layouts": {}}
    try:
        for layout in filter(None, args.layouts.split(",")):
            console.print(f"[bold]{layout} host pool: {pages} pages[/bold]")
            results["layouts"][layout] = measure_layout(os.path.join(root, layout), layout, pages, rounds, loads,
                                                        console)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return host.finish(results, summarize, report, console, args.json)


class Case:
    """One backend on one host pool, driven through the cache controller's page functions."""

    def __init__(self, name: str, backend, pool, get, put, forget) -> None:
        from sglang.srt.managers.cache_controller import STORAGE_BATCH_SIZE

        self.name, self.backend, self.pool, self.batch = name, backend, pool, STORAGE_BATCH_SIZE
        # The controller's methods read only these attributes of the controller.
        self.ctrl = SimpleNamespace(storage_host_pool=pool, storage_backend=backend, page_size=PAGE)
        self._get, self._put, self.forget = get, put, forget
        self.op = SimpleNamespace(request_id=f"bench-{name}", is_terminated=lambda: False)

    def _batches(self, keys: list[str], first_page: int):
        import torch

        for i in range(0, len(keys), self.batch):
            n = min(self.batch, len(keys) - i)
            yield keys[i:i + n], torch.arange((first_page + i) * PAGE, (first_page + i + n) * PAGE, dtype=torch.int64)

    def backup(self, keys: list[str], first_page: int) -> None:
        for hashes, idx in self._batches(keys, first_page):
            if not self._put(self.ctrl, hashes, idx):
                raise RuntimeError(f"{self.name}: backup of {len(hashes)} pages failed")

    def restore(self, keys: list[str], first_page: int) -> int:
        """Pages that came back (the controller stops a batch at its first miss)."""
        return sum(self._get(self.ctrl, self.op, hashes, idx) for hashes, idx in self._batches(keys, first_page))


def host_pool(layout: str, pages: int, seed: int):
    """A real SGLang host pool (twice the device pool) whose pages hold random bytes."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(pages * PAGE, PAGE, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                           end_layer=LAYERS - 1)
    pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
                                device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging)
    flat = pool.kv_buffer.view(-1).view(torch.uint8).numpy()
    flat[:] = np.random.default_rng(seed).integers(0, 256, flat.size, np.uint8)
    return pool


def storage_config(model: str, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model, extra_config=extra)


def open_cases(root: str, pool, pages: int, page_bytes: int) -> dict[str, Case]:
    """Both backends as SGLang builds them: ``file`` (HiCacheFile) and ``dynamic`` (kvswarm, v1)."""
    from sglang.srt.managers.cache_controller import HiCacheController as C
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    file_backend = HiCacheFile(storage_config("bench", {}), file_path=os.path.join(root, "file"))
    kv_extra = {"backend_name": "kvswarm", "module_path": "kvswarm.integrations.sglang",
                "class_name": "KVSwarmHiCacheStorage", "interface_v1": 1, "drives": [os.path.join(root, "kv")],
                "capacity_per_drive": pages * (page_bytes + 64 * 1024) + 64 * MiB}
    kv_backend = StorageBackendFactory.create_backend("dynamic", storage_config("bench", kv_extra), pool)
    cases = {}
    for name, backend, get, put, forget in (
            ("file", file_backend, C._generic_page_get, C._generic_page_set, lambda keys: file_backend.clear()),
            ("kvswarm", kv_backend, C._page_get_zero_copy, C._page_set_zero_copy, kv_backend.forget)):
        backend.register_mem_pool_host(pool)
        cases[name] = Case(name, backend, pool, get, put, forget)
    return cases


def same_pages(pool, src_first: int, dst_first: int, n: int) -> bool:
    import torch

    return all(torch.equal(pool.get_data_page((src_first + i) * PAGE, flat=True).view(torch.uint8),
                           pool.get_data_page((dst_first + i) * PAGE, flat=True).view(torch.uint8))
               for i in range(n))


def measure_layout(root: str, layout: str, pages: int, rounds: int, loads: list[tuple[float, float]],
                   console) -> dict:
    pool = host_pool(layout, pages, seed=len(layout))
    page_bytes = LAYERS * 2 * PAGE * HEADS * DIM * 2
    total = pages * page_bytes
    os.makedirs(root)
    cases = open_cases(root, pool, pages, page_bytes)
    keys = [f"{layout}-page{i:06d}" for i in range(pages)]
    blank = pool.get_dummy_flat_data_page().zero_()
    out: dict = {"page_bytes": page_bytes, "backup_gbps_rounds": {}, "restore_gbps_rounds": {}}

    def timed(hold: float, idle: float, work) -> float:
        host.drop_caches()
        with host.EngineLoad(hold, idle):
            t0 = time.perf_counter()
            work()
            return total / (time.perf_counter() - t0) / 1e9

    try:
        for r in range(rounds):
            for hold, idle in loads:
                load = host.load_name(hold, idle)
                for name, c in (cases.items() if r % 2 == 0 else list(cases.items())[::-1]):
                    c.forget(keys)
                    backup = timed(hold, idle, lambda: c.backup(keys, 0))
                    for i in range(pages, 2 * pages):
                        pool.set_from_flat_data_page(i * PAGE, blank)
                    got: list[int] = []
                    restore = timed(hold, idle, lambda: got.append(c.restore(keys, pages)))
                    if got != [pages] or not same_pages(pool, 0, pages, pages):
                        raise RuntimeError(f"{name} restored {got} of {pages} pages, or other bytes")
                    for what, gbps in (("backup", backup), ("restore", restore)):
                        out[f"{what}_gbps_rounds"].setdefault(load, {}).setdefault(name, []).append(gbps)
    finally:
        for c in cases.values():
            if hasattr(c.backend, "close"):  # HiCacheFile has none
                c.backend.close()
    for what in ("backup", "restore"):
        out[f"{what}_gbps"] = {load: {n: float(np.median(g)) for n, g in per.items()}
                               for load, per in out[f"{what}_gbps_rounds"].items()}
        for load, g in out[f"{what}_gbps"].items():
            console.print(f"  {what}, scheduler holding the GIL {load} ms: file {g['file']:.2f}, kvswarm "
                          f"{g['kvswarm']:.2f} GB/s (x{g['kvswarm'] / g['file']:.2f}; medians of {rounds})")
    return out


# ---- output ------------------------------------------------------------------------------------
def summarize(r: dict) -> dict:
    s: dict = {}
    for layout, row in r["layouts"].items():
        for what in ("backup", "restore"):
            for load, g in row[f"{what}_gbps"].items():
                k = f"sglang_{layout}_load_{load.replace('/', 'of')}"
                for name in BACKENDS:
                    s[f"{k}_{name}_{what}_gbps"] = g[name]
                s[f"{k}_{what}_speedup_vs_file"] = g["kvswarm"] / g["file"]
    return s


def report(r: dict, console) -> None:
    from rich.table import Table

    t = Table(title="SGLang HiCache storage: file (SGLang built-in) vs kvswarm, through SGLang's cache controller")
    t.caption = (f"{r['pages']} pages of {PAGE} tokens, GB/s, medians of {r['rounds']} rounds, caches dropped before "
                 "each; engine load: ms the scheduler thread holds the GIL / ms it sleeps; backups: file leaves them "
                 "in the page cache (no fsync), kvswarm's are durable")
    for c in ("host layout", "engine load", "restore file", "restore kvswarm", "kv/file", "backup file",
              "backup kvswarm", "kv/file "):
        t.add_column(c)
    for layout, row in r["layouts"].items():
        for load, g in row["restore_gbps"].items():
            b = row["backup_gbps"][load]
            t.add_row(layout, load, f"{g['file']:.2f}", f"{g['kvswarm']:.2f}", f"x{g['kvswarm'] / g['file']:.2f}",
                      f"{b['file']:.2f}", f"{b['kvswarm']:.2f}", f"x{b['kvswarm'] / b['file']:.2f}")
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    return host.standalone_main("sglang", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
