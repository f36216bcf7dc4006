"""Traces of expert loads, the online policy simulator, plots and synthetic workloads."""
