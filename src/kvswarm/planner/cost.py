"""Hardware mixes and their cost and power: capital cost, amortised hourly cost, watts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvswarm.planner.hardware import DramType, DriveType, GpuType, HardwareCatalog

HOURS_PER_YEAR = 8760.0


@dataclass(frozen=True)
class Mix:
    """A KV-tier build: DRAM plus an SSD pool plus a capacity (HDD) pool."""

    dram_gb: float
    dram: DramType
    ssd: DriveType | None = None
    n_ssd: int = 0
    hdd: DriveType | None = None
    n_hdd: int = 0

    def __post_init__(self) -> None:
        if self.dram_gb < 0 or self.n_ssd < 0 or self.n_hdd < 0:
            raise ValueError(f"a mix needs non-negative sizes, got {self.dram_gb} GB, {self.n_ssd} SSD, "
                             f"{self.n_hdd} HDD")
        if (self.n_ssd and self.ssd is None) or (self.n_hdd and self.hdd is None):
            raise ValueError("a mix with drives needs their drive type")

    @property
    def label(self) -> str:
        parts = [f"{self.dram_gb:g} GB DRAM"]
        if self.n_ssd:
            parts.append(f"{self.n_ssd}x {self.ssd.key}")
        if self.n_hdd:
            parts.append(f"{self.n_hdd}x {self.hdd.key}")
        return " + ".join(parts)

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_gb * 1e9)

    @property
    def ssd_bytes(self) -> int:
        return self.n_ssd * self.ssd.capacity_bytes if self.n_ssd else 0

    @property
    def hdd_bytes(self) -> int:
        return self.n_hdd * self.hdd.capacity_bytes if self.n_hdd else 0

    def capex(self, cat: HardwareCatalog) -> float:
        """Purchase cost of the KV tier (DRAM, drives, their slots), USD."""
        slot = cat.economics.drive_slot_usd
        usd = self.dram_gb * self.dram.price_usd_per_gb
        if self.n_ssd:
            usd += self.n_ssd * (self.ssd.price_usd + slot)
        if self.n_hdd:
            usd += self.n_hdd * (self.hdd.price_usd + slot)
        return usd

    def watts(self, ssd_util: float = 0.0, hdd_util: float = 0.0) -> float:
        """Average power at the given drive utilisations (idle + busy share of the active increment)."""
        w = self.dram_gb * self.dram.watts_per_gb
        for d, n, u in ((self.ssd, self.n_ssd, ssd_util), (self.hdd, self.n_hdd, hdd_util)):
            if n:
                w += n * (d.watts_idle + (d.watts_active - d.watts_idle) * min(1.0, u))
        return w


def hourly_usd(capex: float, years: float, watts: float, cat: HardwareCatalog) -> float:
    """Amortised capital plus energy (with PUE), USD per hour."""
    e = cat.economics
    return capex / (years * HOURS_PER_YEAR) + watts / 1000.0 * e.pue * e.electricity_usd_per_kwh


def gpu_hourly_usd(gpu: GpuType, count: float, util: float, cat: HardwareCatalog) -> float:
    return hourly_usd(gpu.price_usd * count, cat.economics.gpu_amortization_years,
                      gpu.watts * count * min(1.0, util), cat)


def enumerate_mixes(cat: HardwareCatalog, dram_gb: Iterable[float], ssd_counts: Iterable[int],
                    hdd_counts: Iterable[int], ssd_types: Iterable[str] | None = None,
                    hdd_types: Iterable[str] | None = None,
                    dram_type: str | None = None) -> list[Mix]:
    """Every combination of the given sizes over the catalog's (or the named) SSD and HDD types
    (an HDD pool only below an SSD pool)."""
    dram = cat.get("dram", dram_type) if dram_type else next(iter(cat.dram.values()))
    ssds = [cat.get("drives", k) for k in ssd_types] if ssd_types else cat.by_kind("ssd")
    hdds = [cat.get("drives", k) for k in hdd_types] if hdd_types else cat.by_kind("hdd")
    for d in ssds + hdds:
        if (d in ssds and d.kind != "ssd") or (d in hdds and d.kind != "hdd"):
            raise ValueError(f"drive {d.key!r} is an {d.kind}, not usable in that pool")
    sizes = sorted({float(g) for g in dram_gb})
    if any(g < 0 for g in sizes) or any(n < 0 for n in (*ssd_counts, *hdd_counts)):
        raise ValueError("DRAM sizes and drive counts must be >= 0")
    if sizes and sizes[-1] > dram.max_gb:
        raise ValueError(f"{sizes[-1]:g} GB DRAM exceeds the catalog's max_gb {dram.max_gb:g} for {dram.key}")
    ssd_opts = [(None, 0)] + [(d, n) for d in ssds for n in sorted(set(ssd_counts)) if n > 0]
    hdd_opts = [(None, 0)] + [(d, n) for d in hdds for n in sorted(set(hdd_counts)) if n > 0]
    # The capacity pool holds what the SSD pool demotes: no HDD pool without SSDs (as in the tiered store).
    return [Mix(g, dram, s, ns, h, nh) for g in sizes for s, ns in ssd_opts for h, nh in hdd_opts if ns or not nh]
