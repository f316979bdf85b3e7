"""Hardware catalog: load and validate the editable TOML file of drives, DRAM, links, GPUs and NICs.

The default catalog ships as package data (``kvswarm/data/hardware.toml``); every figure
in it carries its source.  Validation names the file, the entry and the field at fault.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from kvswarm.sim.devices import DriveSpec, LinkModel, pcie_link

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class CatalogError(ValueError):
    """The hardware catalog is missing, malformed or incomplete."""


_NUM = (int, float)
# section -> field -> (type, lower bound or None, strictly greater?)
_FIELDS: dict[str, dict[str, tuple]] = {
    "drives": {
        "name": (str,), "kind": (str,), "capacity_tb": (_NUM, 0, True), "read_gbps": (_NUM, 0, True),
        "write_gbps": (_NUM, 0, True), "read_iops": (_NUM, 0, True), "write_iops": (_NUM, 0, True),
        "read_latency_us": (_NUM, 0, False), "write_latency_us": (_NUM, 0, False), "queue_depth": (int, 1, False),
        "price_usd_per_tb": (_NUM, 0, False), "watts_active": (_NUM, 0, False), "watts_idle": (_NUM, 0, False),
        "source": (str,), "price_source": (str,),
    },
    "dram": {
        "name": (str,), "price_usd_per_gb": (_NUM, 0, False), "watts_per_gb": (_NUM, 0, False),
        "copy_gbps": (_NUM, 0, True), "max_gb": (_NUM, 0, True), "source": (str,), "price_source": (str,),
    },
    "links": {
        "name": (str,), "pcie_gen": (int, 3, False), "lanes": (int, 1, False), "efficiency": (_NUM, 0, True),
        "source": (str,),
    },
    "gpus": {
        "name": (str,), "bf16_tflops": (_NUM, 0, True), "mfu": (_NUM, 0, True), "hbm_gb": (_NUM, 0, True),
        "pcie_gen": (int, 3, False), "pcie_lanes": (int, 1, False), "pcie_efficiency": (_NUM, 0, True),
        "watts": (_NUM, 0, False), "price_usd": (_NUM, 0, False), "source": (str,),
    },
    "nics": {
        "name": (str,), "line_gbit": (_NUM, 0, True), "efficiency": (_NUM, 0, True), "price_usd": (_NUM, 0, False),
        "watts": (_NUM, 0, False), "source": (str,), "price_source": (str,),
    },
}
_OPTIONAL = {"nics"}  # sections a catalog may leave out (a single-node plan needs no NIC)
_ECONOMICS = {
    "electricity_usd_per_kwh": (_NUM, 0, False), "pue": (_NUM, 1, False),
    "storage_amortization_years": (_NUM, 0, True), "gpu_amortization_years": (_NUM, 0, True),
    "drive_slot_usd": (_NUM, 0, False),
}


@dataclass(frozen=True)
class DriveType:
    key: str
    name: str
    kind: str
    capacity_tb: float
    read_gbps: float
    write_gbps: float
    read_iops: float
    write_iops: float
    read_latency_us: float
    write_latency_us: float
    queue_depth: int
    price_usd_per_tb: float
    watts_active: float
    watts_idle: float
    source: str
    price_source: str
    assumed: tuple[str, ...] = ()

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_tb * 1e12)

    @property
    def price_usd(self) -> float:
        return self.price_usd_per_tb * self.capacity_tb

    def model(self) -> DriveSpec:
        return DriveSpec(self.key, self.read_gbps * 1e9, self.write_gbps * 1e9, self.read_iops, self.write_iops,
                          self.read_latency_us * 1e-6, self.write_latency_us * 1e-6, self.queue_depth, self.kind)


@dataclass(frozen=True)
class DramType:
    key: str
    name: str
    price_usd_per_gb: float
    watts_per_gb: float
    copy_gbps: float
    max_gb: float
    source: str
    price_source: str
    assumed: tuple[str, ...] = ()

    def model(self) -> LinkModel:
        return LinkModel(f"dram:{self.key}", self.copy_gbps * 1e9)


@dataclass(frozen=True)
class LinkType:
    key: str
    name: str
    pcie_gen: int
    lanes: int
    efficiency: float
    source: str
    assumed: tuple[str, ...] = ()

    def model(self) -> LinkModel:
        return pcie_link(self.pcie_gen, self.lanes, self.efficiency, name=self.key)


@dataclass(frozen=True)
class GpuType:
    key: str
    name: str
    bf16_tflops: float
    mfu: float
    hbm_gb: float
    pcie_gen: int
    pcie_lanes: int
    pcie_efficiency: float
    watts: float
    price_usd: float
    source: str
    assumed: tuple[str, ...] = ()

    @property
    def flops(self) -> float:
        """Sustained prefill FLOP/s."""
        return self.bf16_tflops * 1e12 * self.mfu

    def link(self) -> LinkModel:
        return pcie_link(self.pcie_gen, self.pcie_lanes, self.pcie_efficiency, name=f"gpu:{self.key}")


@dataclass(frozen=True)
class NicType:
    """A node's network interface for cluster traffic (Mooncake Transfer Engine: RDMA or TCP)."""

    key: str
    name: str
    line_gbit: float
    efficiency: float
    price_usd: float
    watts: float
    source: str
    price_source: str
    assumed: tuple[str, ...] = ()

    @property
    def bytes_per_s(self) -> float:
        """Payload rate in one direction (full duplex), B/s."""
        return self.line_gbit * 1e9 / 8 * self.efficiency


@dataclass(frozen=True)
class Economics:
    electricity_usd_per_kwh: float
    pue: float
    storage_amortization_years: float
    gpu_amortization_years: float
    drive_slot_usd: float
    assumed: tuple[str, ...] = ()


@dataclass
class HardwareCatalog:
    """The drives, DRAM, links and GPUs a plan may mix, with their economics (not the store's key
    catalog, :class:`kvswarm.catalog.Catalog`)."""

    path: str
    economics: Economics
    drives: dict[str, DriveType] = field(default_factory=dict)
    dram: dict[str, DramType] = field(default_factory=dict)
    links: dict[str, LinkType] = field(default_factory=dict)
    gpus: dict[str, GpuType] = field(default_factory=dict)
    nics: dict[str, NicType] = field(default_factory=dict)

    def get(self, section: str, key: str):
        table = getattr(self, section)
        if key not in table:
            raise CatalogError(f"{self.path}: no {section} entry {key!r}; have {sorted(table)}")
        return table[key]

    def by_kind(self, kind: str) -> list[DriveType]:
        return [d for d in self.drives.values() if d.kind == kind]


_TYPES = {"drives": DriveType, "dram": DramType, "links": LinkType, "gpus": GpuType, "nics": NicType}


def default_catalog_path() -> Path:
    return Path(str(resources.files("kvswarm") / "data" / "hardware.toml"))


def load_catalog(path: str | Path | None = None) -> HardwareCatalog:
    """Parse and validate a catalog file (default: the shipped one)."""
    p = Path(path) if path is not None else default_catalog_path()
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise CatalogError(f"hardware catalog {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"hardware catalog {p} is not valid TOML: {e}") from None
    return parse_catalog(raw, str(p))


def parse_catalog(raw: dict, where: str = "<catalog>") -> HardwareCatalog:
    econ = raw.get("economics")
    if not isinstance(econ, dict):
        raise CatalogError(f"{where}: missing [economics] table")
    cat = HardwareCatalog(where, Economics(**_check(where, "economics", econ, _ECONOMICS)))
    for section, cls in _TYPES.items():
        entries = raw.get(section)
        if section in _OPTIONAL and entries is None:
            continue
        if not isinstance(entries, dict) or not entries:
            raise CatalogError(f"{where}: missing or empty [{section}.*] tables")
        for key, entry in entries.items():
            if not isinstance(entry, dict):
                raise CatalogError(f"{where}: [{section}.{key}] must be a table")
            values = _check(where, f"{section}.{key}", entry, _FIELDS[section])
            getattr(cat, section)[key] = cls(key=key, **values)
    for key, d in cat.drives.items():
        if d.kind not in ("ssd", "hdd"):
            raise CatalogError(f"{where}: [drives.{key}] kind must be 'ssd' or 'hdd', not {d.kind!r}")
    return cat


def _check(where: str, name: str, entry: dict, spec: dict[str, tuple]) -> dict:
    missing = [f for f in spec if f not in entry]
    if missing:
        raise CatalogError(f"{where}: [{name}] is missing field(s) {', '.join(missing)}")
    unknown = [f for f in entry if f not in spec and f != "assumed"]
    if unknown:
        raise CatalogError(f"{where}: [{name}] has unknown field(s) {', '.join(unknown)}")
    out = {}
    for f, (typ, *bound) in spec.items():
        v = entry[f]
        if isinstance(v, bool) or not isinstance(v, typ):
            kind = "a number" if typ is _NUM else f"of type {typ.__name__}"
            raise CatalogError(f"{where}: [{name}] {f} must be {kind}, got {v!r}")
        if bound:
            lo, strict = bound
            if v < lo or (strict and v == lo):
                raise CatalogError(f"{where}: [{name}] {f} must be {'>' if strict else '>='} {lo}, got {v!r}")
        out[f] = v
    assumed = entry.get("assumed", [])
    if not isinstance(assumed, list) or any(a not in spec for a in assumed):
        raise CatalogError(f"{where}: [{name}] assumed must list field names of this entry, got {assumed!r}")
    out["assumed"] = tuple(assumed)
    return out
