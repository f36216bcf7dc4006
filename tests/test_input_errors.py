"""Bad input is one ``error: <field>: <problem> (fix: …)`` line and exit code 2 (README "Command line").

Issue 24 found two that were not: ``--cpu-workers 0`` had no fix, and a YAML indentation typo in a
config file printed PyYAML's six lines naming ``"<unicode string>"`` instead of the file and line.
The file-loading checks live once, in :mod:`vexpert_runtime.documents`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vexpert_runtime.cli import main
from vexpert_runtime.config import load_runtime_config
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.profile import load_profile

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime" / "vexpert_runtime"
ONE_LINE = re.compile(r"^error: (?P<field>[^\n]+?): (?P<problem>[^\n]+) \(fix: (?P<fix>[^\n]+)\)$")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> re.Match[str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"not one line:\n{err}"
    match = ONE_LINE.match(lines[0])
    assert match, f"not `error: <field>: <problem> (fix: …)`: {lines[0]}"
    return match


@pytest.mark.parametrize("argv", [
    ["serve", "--cpu-workers", "0"],
    ["node", "--config", "runtime.yaml", "--cpu-workers", "0"],
    ["node", "--config", "runtime.yaml", "--cpu-workers", "-3"],
])
def test_cpu_workers_below_one_says_how_to_fix_it(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    match = run_cli(argv, capsys)
    assert match["field"] == "--cpu-workers"
    assert "pass --cpu-workers 1 or more" in match["fix"] and "GPU" in match["fix"]


def test_demo_and_simulate_bounds_say_how_to_fix_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["demo", "--workers", "0"], capsys)["fix"].startswith("pass --workers 1 or more")
    assert run_cli(["serve", "--port", "70000"], capsys)["field"] == "--port"
    shared = run_cli(["serve", "--api-servers", "2", "--port", "0"], capsys)
    assert shared["field"] == "--port" and "--api-servers 1" in shared["fix"]
    assert run_cli(["serve", "--api-servers", "0"], capsys)["field"] == "--api-servers"
    assert run_cli(["serve", "--drain-timeout", "-1"], capsys)["field"] == "--drain-timeout"  # was "up to -1 s"
    assert run_cli(["serve", "--served-model-name", "tiny", " "], capsys)["field"] == "--served-model-name"
    interval = run_cli(["serve", "--stream-interval", "0"], capsys)
    assert interval["field"] == "--stream-interval" and interval["fix"].startswith("pass --stream-interval 1 or more")


def test_a_max_model_len_beyond_the_checkpoint_says_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from vexpert_runtime.serve.demo_model import ensure_demo_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the embedded demo model: 4096 positions
    ensure_demo_model(tmp_path / "vexpert" / "demo-model")  # written now: its progress bar is not the CLI's
    capsys.readouterr()
    match = run_cli(["serve", "--cpu-workers", "1", "--max-model-len", "5000"], capsys)
    assert match["field"] == "--max-model-len" and "[2, 4096]" in match["problem"]
    assert match["fix"].startswith("pass at most 4096")
    # the scheduler's limits, one field each, each with its flag (max_waiting was reported as max_running)
    for flag, field in (("--max-running", "max_running"), ("--max-waiting", "max_waiting")):
        limit = run_cli(["serve", "--cpu-workers", "1", flag, "-1"], capsys)
        assert limit["field"] == field and flag in limit["fix"], limit[0]
    budget = run_cli(["serve", "--cpu-workers", "1", "--max-running", "8", "--max-batch-tokens", "4"], capsys)
    assert budget["field"] == "max_batch_tokens" and "--max-batch-tokens" in budget["fix"]


def test_the_checkpoint_named_wrongly_names_where_it_came_from(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``vexpert serve PATH`` (vLLM's positional form; ``tests/serve_process.py`` serves through it), ``--model``
    and the config's ``model.checkpoint_path``: a directory without config.json is refused naming the one given
    (the config's was reported as --model), and two different checkpoints are refused, not one silently taken."""
    missing = tmp_path / "missing"
    assert run_cli(["serve", str(missing)], capsys)["field"] == "MODEL"
    assert run_cli(["serve", "--model", str(missing)], capsys)["field"] == "--model"
    config = tmp_path / "runtime.yaml"
    config.write_text(json.dumps({"model": {"checkpoint_path": str(missing)}, "runtime": {"device": "cpu"}}))
    assert run_cli(["serve", "--config", str(config)], capsys)["field"] == "model.checkpoint_path"
    both = run_cli(["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b")], capsys)
    assert both["field"] == "MODEL" and "once" in both["fix"]
    # the same directory twice is one checkpoint: refused only for lacking config.json
    assert "no config.json" in run_cli(["serve", str(missing), "--model", str(missing) + "/"], capsys)["problem"]
    # a config.json that is not JSON: its line and column (it was json.decoder's traceback), or not an object
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "deepseek_v3"\n')
    not_json = run_cli(["serve", str(broken)], capsys)
    assert not_json["field"] == "model.checkpoint_path" and "config.json line 2, column 1: not JSON" in not_json["problem"]
    (broken / "config.json").write_text("[1]")
    assert "config.json is a JSON list, not an object" in run_cli(["serve", str(broken)], capsys)["problem"]


def test_a_hugging_face_repo_id_is_served_from_the_local_cache_or_says_how_to_get_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``vexpert serve org/name`` as vLLM users write it: a checkpoint in the local Hugging Face cache is served
    from its snapshot under the repo id; one not there is refused with the download command (nothing is
    downloaded); a local directory of that relative name wins over the cache."""
    from huggingface_hub import constants

    from vexpert_runtime.commands.serve import checkpoint_dir

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0123abc")
    assert checkpoint_dir("org/tiny", "MODEL") == (snapshot, "org/tiny")
    missing = run_cli(["serve", "org/missing"], capsys)
    assert missing["field"] == "MODEL" and "not in the Hugging Face cache" in missing["problem"]
    assert "hf download org/missing" in missing["fix"]
    assert "no config.json" in run_cli(["serve", "./org-missing/x"], capsys)["problem"]  # a local path, not an id
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert checkpoint_dir("org/tiny", "MODEL") == (Path("org/tiny"), "tiny")


def test_dtype_takes_vllms_names_over_the_config(tmp_path: Path) -> None:
    """``vexpert serve --dtype`` (vLLM's flag and names: half, float, …) sets the compute dtype over the config's
    model.dtype; auto keeps the config's, else the machine's default (float32 on CPU ranks)."""
    from vexpert_runtime.cli import build_parser
    from vexpert_runtime.commands.serve import _runtime_config

    config = tmp_path / "runtime.yaml"
    config.write_text(json.dumps({"model": {"dtype": "bfloat16"}, "runtime": {"device": "cpu"}}))
    parser = build_parser()
    for flags, want in ((["--dtype", "half"], "float16"), (["--dtype", "float"], "float32"),
                        (["--config", str(config)], "bfloat16"), (["--config", str(config), "--dtype", "float32"], "float32"),
                        (["--cpu-workers", "1"], "float32")):
        args = parser.parse_args(["serve", *flags])
        assert _runtime_config(args).model.dtype == want, flags
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dtype", "fp8"])


INDENT_TYPO = "runtime:\n  device: cpu\n   metrics_port: 0\n"  # line 3 indented one space too far


def test_yaml_indentation_typo_names_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "runtime.yaml"
    config.write_text(INDENT_TYPO)
    match = run_cli(["node", "--config", str(config), "--cpu-workers", "1"], capsys)
    assert match["field"] == "--config"
    assert f"{config} line 3, column" in match["problem"]
    assert "<unicode string>" not in match.group(0)
    assert "line 3" in match["fix"] and "indentation" in match["fix"]


def test_yaml_tab_indentation_says_spaces(tmp_path: Path) -> None:
    config = tmp_path / "runtime.yaml"
    config.write_text("runtime:\n\tdevice: cpu\n")
    with pytest.raises(VExpertInputError) as err:
        load_runtime_config(config)
    assert f"{config} line 2" in err.value.problem and "spaces, not tabs" in err.value.fix


def test_a_refused_value_names_its_line(tmp_path: Path) -> None:
    config = tmp_path / "runtime.yaml"
    config.write_text("vexpert:\n  vmax: 1\nruntime:\n  metrics_port: 0\n  device: gpu\n")
    with pytest.raises(VExpertInputError) as err:
        load_runtime_config(config)
    assert err.value.field == f"{config} line 5: runtime.device"
    assert "cpu" in err.value.problem and err.value.fix
    config.write_text("runtime:\n  device: cpu\n  devise: cpu\n")
    with pytest.raises(VExpertInputError) as err:
        load_runtime_config(config)
    assert err.value.field == f"{config} line 3: runtime.devise"
    assert "spelling" in err.value.fix


def test_config_top_level_and_missing_file(tmp_path: Path) -> None:
    config = tmp_path / "runtime.yaml"
    config.write_text("- a\n- b\n")
    with pytest.raises(VExpertInputError, match=r"holds a YAML list, not a mapping") as err:
        load_runtime_config(config)
    assert err.value.fix
    with pytest.raises(VExpertInputError, match="no such file") as err:
        load_runtime_config(tmp_path / "absent.yaml")
    assert "vexpert render" in err.value.fix
    config.write_text("")
    assert load_runtime_config(config).runtime.device  # empty file: every default


def test_profile_json_errors_name_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text('{"hardware":\n  {"bw_h2d_gbps": 50,}\n}\n')
    with pytest.raises(VExpertInputError) as err:
        load_profile(profile)
    assert err.value.field == "--profile"
    assert f"{profile} line 2, column" in err.value.problem and "line 2" in err.value.fix
    profile.write_text(json.dumps({"hardware": {"no_such_figure": 1}}, indent=2))
    with pytest.raises(VExpertInputError) as err:
        load_profile(profile)
    assert err.value.field == f"{profile} line 3: hardware.no_such_figure"


def test_render_manifest_typo_names_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "deployment.yaml"
    manifest.write_text("apiVersion: vexpert.io/v1alpha1\nkind: VExpertDeployment\nmetadata:\n  name: x\n"
                        "spec:\n  model:\n    name: m\n     revision: main\n")
    match = run_cli(["render", "-f", str(manifest)], capsys)
    assert match["field"] == "-f" and f"{manifest} line 8, column" in match["problem"]


def _input_errors(path: Path) -> list[tuple[int, int]]:
    """(line, argument count) of every ``VExpertInputError(...)`` call in ``path``."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VExpertInputError":
            calls.append((node.lineno, len(node.args) + len(node.keywords)))
    return calls


def test_every_command_and_file_error_carries_a_fix() -> None:
    """The command modules' flag checks and the file loaders give every error a fix (the third argument)."""
    files = [*sorted((RUNTIME / "commands").glob("*.py")), RUNTIME / "documents.py", RUNTIME / "config.py",
             RUNTIME / "policy" / "profile.py", RUNTIME / "errors.py"]
    missing = [f"{p.relative_to(REPO)}:{line}" for p in files for line, n in _input_errors(p) if n < 3]
    assert not missing, f"VExpertInputError without a fix: {missing}"


def test_one_file_loading_ladder() -> None:
    """Parse errors of user files are handled in documents.py only (config.py and policy/profile.py
    each had their own copy of the ladder, operator/render.py a third)."""
    for path in [RUNTIME / "config.py", RUNTIME / "policy" / "profile.py", REPO / "operator" / "vexpert_operator" / "render.py"]:
        text = path.read_text()
        for handler in ("yaml.YAMLError", "json.JSONDecodeError", "UnicodeDecodeError", "yaml.safe_load(", "json.loads("):
            assert handler not in text, f"{path.relative_to(REPO)} handles {handler} itself: use vexpert_runtime.documents"


def _listening_socket() -> Any:
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_an_address_the_api_cannot_listen_on_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """A port in use (or a host that is no address here) ends ``vexpert serve`` in its first seconds with one line
    naming the flag, before the node starts — as vLLM binds before it builds the engine. Until 2026-12-07 it came as
    aiohttp's OSError traceback once the workers had loaded the model."""
    from serve_support import build_tiny_checkpoint

    build_tiny_checkpoint(tmp_path / "tiny", family="qwen3_moe")
    with _listening_socket() as held:
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "vexpert_runtime", "serve", "--model", str(tmp_path / "tiny"), "--cpu-workers", "1",
             "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    match = ONE_LINE.match(lines[-1])
    assert match and match["field"] == "--port" and f"127.0.0.1:{port} is in use" in match["problem"], lines
    assert not any("coordinator process" in line or "Traceback" in line for line in lines), lines  # nothing started


def test_check_listen_address_names_the_flag_to_change() -> None:
    import errno

    from vexpert_runtime.ports import check_listen_address, free_port, listen_error

    with _listening_socket() as held:
        with pytest.raises(VExpertInputError) as in_use:
            check_listen_address("127.0.0.1", held.getsockname()[1])
        assert in_use.value.field == "--port" and "in use" in in_use.value.problem
    with pytest.raises(VExpertInputError) as unresolved:
        check_listen_address("999.1.1.1", 8000)  # no such IPv4 address
    assert unresolved.value.field == "--host"
    with pytest.raises(VExpertInputError) as foreign:
        check_listen_address("192.0.2.1", 8000)  # TEST-NET-1 (RFC 5737): never a local address
    assert foreign.value.field == "--host" and "cannot listen" in foreign.value.problem
    check_listen_address("127.0.0.1", free_port())  # a free port passes (and is left free)
    check_listen_address("127.0.0.1", 0)
    # the late bind (the port taken between the check and the server's start) maps alike
    assert listen_error("h", 1, OSError(errno.EACCES, "Permission denied")).field == "--port"
    assert listen_error("h", 1, OSError(errno.EADDRINUSE, "Address already in use")).field == "--port"


def test_every_commands_help_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of ``vexpert`` and of every sub-command (nested ones too) prints its flags and exits 0 — help
    text shared with the config's field descriptions once held a literal ``%`` ("13-18% shorter"), and
    ``vexpert serve --help`` died in argparse's formatting with a TypeError."""
    import argparse

    from vexpert_runtime.cli import build_parser

    def commands(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += commands(sub, (*path, name))
        return found

    every = commands(build_parser(), ())
    assert ("serve",) in every and len(every) > 8
    for path in every:
        with pytest.raises(SystemExit) as exit_info:
            main([*path, "--help"])
        assert exit_info.value.code == 0, path
        out = capsys.readouterr().out
        assert out.startswith("usage: vexpert") and "--help" in out, path
