"""The Swarm core: co-activation statistics, clustering, placement and retrieval over many drives."""
