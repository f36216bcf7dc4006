"""Placement policy: the vExpert allocator, EPLB baselines, the performance model and its profile."""
