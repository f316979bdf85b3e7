"""Prices for ``bench prefix``: what each tier configuration costs, and configurations of equal cost.

Prices per GB come from the hardware catalog (``kvswarm/data/hardware.toml``: DRAM, an SSD and
an HDD, each with its ``price_source``).  A configuration's cost is the capacity it provisions in
each tier times that tier's price; cost is linear in the bytes per block, so the replay's scaled
payload changes every configuration's cost by the same factor and leaves every ratio alone.

Mean TTFT of a replayed trace is modelled from the TTFT part's measured cases: each reused
block is served at the speed its tier was measured at, each missed one recomputed,
``sum(share_tier x TTFT_tier) + miss_share x TTFT_recompute`` for the measured prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Prices:
    """US$ per GB of DRAM, SSD and HDD capacity, and where each figure comes from."""

    dram_usd_per_gb: float
    ssd_usd_per_gb: float
    hdd_usd_per_gb: float
    sources: dict[str, str]

    @classmethod
    def from_catalog(cls, path: str | None = None, dram: str = "ddr5", ssd: str = "pm9a3",
                     hdd: str = "exos_x20") -> Prices:
        from kvswarm.planner.hardware import load_catalog

        cat = load_catalog(path)
        d, s, h = cat.get("dram", dram), cat.get("drives", ssd), cat.get("drives", hdd)
        return cls(d.price_usd_per_gb, s.price_usd_per_tb / 1000, h.price_usd_per_tb / 1000,
                   {"catalog": cat.path, "dram": f"{d.name}: {d.price_source}", "ssd": f"{s.name}: {s.price_source}",
                    "hdd": f"{h.name}: {h.price_source}"})

    def cost(self, dram_blocks: int, ssd_blocks: int, hdd_blocks: int, block_bytes: int) -> float:
        """US$ of a configuration holding the given blocks per tier."""
        return block_bytes / GB * (dram_blocks * self.dram_usd_per_gb + ssd_blocks * self.ssd_usd_per_gb
                                   + hdd_blocks * self.hdd_usd_per_gb)

    def ssd_blocks_for(self, usd: float, block_bytes: int) -> int:
        """SSD blocks that ``usd`` buys (one plain SSD cache of that cost)."""
        return int(usd / (block_bytes / GB * self.ssd_usd_per_gb))

    def as_dict(self) -> dict:
        return {"dram_usd_per_gb": self.dram_usd_per_gb, "ssd_usd_per_gb": self.ssd_usd_per_gb,
                "hdd_usd_per_gb": self.hdd_usd_per_gb, "sources": self.sources}


def modelled_ttft(hit_rate: dict[str, float], ttft: dict[str, float]) -> float:
    """Mean TTFT (s) of the measured prompt when its blocks are served in the shares of ``hit_rate``
    (keys ``dram``, ``ssd``, ``capacity``, ``total``) at the measured per-tier ``ttft`` (same keys
    and ``recompute``)."""
    served = sum(hit_rate[t] * ttft[t] for t in ("dram", "ssd", "capacity"))
    return served + (1.0 - hit_rate["total"]) * ttft["recompute"]
