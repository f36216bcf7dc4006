"""Calibration of the performance model (GitHub issue #6, paper §3.2 and App. B).

``hardware`` measures a node type's H2D bandwidth under contention, the contention factor η and
the compute-bound tokens-per-expert threshold; ``model_fit`` fits a model's Δ(L, V) coefficients;
``nodeinfo`` reads the node's facts (DRAM, NUMA, PCIe links, GPUs). Importing this package is
cheap and torch-free; modules that need torch import it where they use it.
"""
