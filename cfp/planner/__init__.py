"""Heterogeneous-cluster planner (HexiScale): from a cluster of mixed devices to a runnable layout."""
