"""Planner: hardware catalog, model presets, workloads, cost model and the mix recommendation search.

`kvswarm plan` (kvswarm.planner.cli) projects a workload onto DRAM/SSD/HDD mixes with the
discrete-event simulator of kvswarm.sim; `kvswarm plan scale` and `kvswarm plan validate`
project drive scaling and check the simulator against measured runs.
"""
