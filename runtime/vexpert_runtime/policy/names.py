"""The placement policies' names, torch-free: the runtime config and the operator's CRD type their
``placement_policy`` option with :data:`PlacementPolicyName`, and :mod:`.registry` (which needs
torch) maps each name to its policy; a test keeps the two equal."""

from __future__ import annotations

from typing import Literal, get_args

PlacementPolicyName = Literal["vexpert", "eplb-redundant", "static"]
PLACEMENT_POLICY_NAMES: tuple[PlacementPolicyName, ...] = get_args(PlacementPolicyName)
DEFAULT_PLACEMENT_POLICY: PlacementPolicyName = "vexpert"
PLACEMENT_POLICY_HELP = (
    "Placement policy the node runs every k iterations: vexpert = the vExpert allocator; eplb-redundant = "
    "DeepSeek EPLB's redundant experts (the same number in every layer, hottest per copy first, tokens split "
    "evenly) streamed into the same slots, a live baseline; static = no copies"
)
