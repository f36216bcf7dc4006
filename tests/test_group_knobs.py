"""vExpert's group knobs are defined once (``vexpert_runtime.config.GroupKnobs``): the operator's
``spec.vexpert`` takes them camelCase with the runtime's bounds, and renders them into the runtime
config unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from operator_support.samples import spec
from vexpert_operator.api import VExpertSpec
from vexpert_operator.manifests import build_runtime_config
from vexpert_operator.sizing import KNOWN_SHAPES, size_pod
from vexpert_runtime.config import GroupKnobs, VExpertKnobs, parse_runtime_config
from vexpert_runtime.policy.profile import PerformanceProfile

# A value other than the default for every group knob (a new knob adds one here).
CHANGED: dict[str, Any] = {"group_size": 3, "vmax": 2, "balance_threshold": 0.55, "dispatch": "global",
                           "placement_policy": "eplb-redundant"}


def test_the_deployment_and_the_runtime_share_the_knob_definitions() -> None:
    assert set(CHANGED) == set(GroupKnobs.model_fields), "give the new knob a value in CHANGED"
    for name, knob in GroupKnobs.model_fields.items():
        for user in (VExpertSpec, VExpertKnobs):
            field = user.model_fields[name]
            assert (field.annotation, field.default, field.metadata) == (knob.annotation, knob.default, knob.metadata)
        assert VExpertSpec.model_fields[name].alias == to_camel(name)
        assert GroupKnobs.model_fields[name].alias is None  # the runtime's YAML stays snake_case


@pytest.mark.parametrize(("name", "bad"), [("groupSize", 9), ("vmax", -1), ("balanceThreshold", 1.5),
                                           ("dispatch", "round-robin"), ("placementPolicy", "eplb")])
def test_the_deployment_refuses_what_the_runtime_would(name: str, bad: Any) -> None:
    with pytest.raises(ValidationError):
        VExpertSpec.model_validate({name: bad})
    with pytest.raises(ValidationError):
        VExpertKnobs.model_validate({_snake(name): bad})


def test_every_group_knob_reaches_the_runtime_config() -> None:
    deployment = spec(**{f"vexpert__{to_camel(name)}": value for name, value in CHANGED.items()})
    sizing = size_pod(deployment, KNOWN_SHAPES["deepseek_v3"], None)
    rendered = build_runtime_config(deployment, "dsv3", "inference", PerformanceProfile(), 10, None, sizing)
    config = parse_runtime_config(yaml.safe_load(rendered.to_yaml()))  # through the ConfigMap's text
    assert config.vexpert.group_knobs() == CHANGED


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)
