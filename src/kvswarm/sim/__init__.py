"""Discrete-event simulator (simpy) of a kvswarm store: drives, links, DRAM and GPU copies.

It reuses the store's placement strategies, allocator and extent format, so a strategy's
simulated result and its measured result come from one code path.
"""

from kvswarm.sim.devices import DriveSpec, LinkModel, SimDrive, SimLink, pcie_link
from kvswarm.sim.replay import Request, measure, replay, summarise
from kvswarm.sim.system import BatchRecord, SimStore, SystemModel

__all__ = ["BatchRecord", "DriveSpec", "LinkModel", "Request", "SimDrive", "SimLink", "SimStore",
           "SystemModel", "measure", "pcie_link", "replay", "summarise"]
