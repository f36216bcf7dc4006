"""``gpu_memory_utilization``: the share of each GPU's memory a serving rank may fill.

RuntimeConfig's ``runtime.gpu_memory_utilization`` (what the operator renders into runtime.yaml)
is validated with a message naming the field and the fix; ``vexpert serve`` takes
``--gpu-memory-utilization`` over the config's value over 0.9.
(The CRD field and the operator's rendering: tests/test_operator_crds.py, test_operator_builders.py.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from vexpert_runtime.cli import build_parser
from vexpert_runtime.cli import main as cli_main
from vexpert_runtime.commands.serve import resolve_gpu_memory_utilization
from vexpert_runtime.config import RuntimeConfig, load_runtime_config, parse_runtime_config
from vexpert_runtime.errors import VExpertInputError


def _config(value: Any) -> dict[str, Any]:
    return {"runtime": {"gpu_memory_utilization": value}}


def test_the_config_defaults_to_0_9_and_takes_a_share_up_to_1() -> None:
    assert RuntimeConfig().runtime.gpu_memory_utilization == 0.9
    assert parse_runtime_config({}).runtime.gpu_memory_utilization == 0.9
    for value in (0.5, 1, 1.0, 0.01, "0.75"):
        assert parse_runtime_config(_config(value)).runtime.gpu_memory_utilization == float(value)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, 2, math.nan, math.inf, "lots", None, True, [0.9]])
def test_a_bad_config_value_is_refused_naming_the_field_and_the_fix(value: Any) -> None:
    with pytest.raises(VExpertInputError) as caught:
        parse_runtime_config(_config(value), origin="runtime.yaml")
    message = str(caught.value)
    assert caught.value.field == "runtime.yaml: runtime.gpu_memory_utilization"
    assert "is not a share in (0, 1]" in message and "each GPU's memory a rank may fill" in message
    assert "e.g. 0.9 (the default)" in message and "Value error" not in message


def test_a_bad_value_in_a_config_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text(yaml.safe_dump(_config(1.5)))
    with pytest.raises(VExpertInputError, match=r"runtime\.gpu_memory_utilization: 1\.5 is not a share in \(0, 1\]"):
        load_runtime_config(path)
    assert cli_main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # one line naming the file, the value's line and the field
    assert len(err) == 1 and err[0].startswith(f"error: {path} line 2: runtime.gpu_memory_utilization: 1.5 ")


def test_the_config_round_trips_through_yaml() -> None:
    config = parse_runtime_config(_config(0.6))
    assert parse_runtime_config(yaml.safe_load(config.to_yaml())).runtime.gpu_memory_utilization == 0.6


# ------------------------------------------------------------------------------------ vexpert serve


def test_the_cli_flag_defaults_to_unset_so_the_config_decides() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.gpu_memory_utilization is None
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.5"])
    assert args.gpu_memory_utilization == 0.5


@pytest.mark.parametrize(("cli", "configured", "expected"), [
    (None, None, 0.9),   # neither: the default
    (None, 0.7, 0.7),    # the config's value
    (0.5, 0.7, 0.5),     # the command line wins
    (0.5, None, 0.5),
    (1.0, 0.7, 1.0),
])
def test_serve_resolves_cli_over_config_over_default(cli: float | None, configured: float | None,
                                                     expected: float) -> None:
    assert resolve_gpu_memory_utilization(cli, configured) == expected


def test_serve_takes_the_rendered_config_value(tmp_path: Path) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text(parse_runtime_config(_config(0.8)).to_yaml())
    configured = load_runtime_config(path).runtime.gpu_memory_utilization
    assert resolve_gpu_memory_utilization(None, configured) == 0.8
    assert resolve_gpu_memory_utilization(0.6, configured) == 0.6


@pytest.mark.parametrize("cli", [0.0, -0.5, 1.5, math.nan])
def test_a_bad_cli_value_is_refused_naming_the_flag_and_the_fix(cli: float) -> None:
    with pytest.raises(VExpertInputError) as caught:
        resolve_gpu_memory_utilization(cli, 0.9)
    assert caught.value.field == "--gpu-memory-utilization"
    assert "(0, 1]" in caught.value.problem and "e.g. 0.9" in caught.value.fix
