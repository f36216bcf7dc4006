"""CRDs generated from the models (and up to date), examples valid against them, `vexpert render`
output valid against the official Kubernetes schemas (kubernetes-validate --strict, offline)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from operator_support.emulator import apply_defaults, openapi_to_jsonschema
from vexpert_operator.crdgen import all_crds, openapi_schema, render_crd
from vexpert_operator.crdgen import main as crdgen_main
from vexpert_operator.render import render_file
from vexpert_runtime.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
CRDS = REPO / "crds"
EXAMPLES = REPO / "examples"
K8S_VERSIONS = ["1.29", "1.32"]


def crd_validator(kind: str) -> tuple[jsonschema.Draft4Validator, dict[str, Any]]:
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            raw = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            return jsonschema.Draft4Validator(openapi_to_jsonschema(raw)), raw
    raise AssertionError(f"no CRD for {kind}")


def test_crds_are_up_to_date_with_the_models(tmp_path: Path) -> None:
    for name, crd in all_crds().items():
        assert (CRDS / name).read_text() == render_crd(crd), f"run `python -m vexpert_operator.crdgen` ({name})"
    assert crdgen_main(["--check"]) == 0
    stale = tmp_path / "crds"
    stale.mkdir()
    (stale / "vexpertdeployments.vexpert.io.yaml").write_text("stale")
    assert crdgen_main(["--check", "--out", str(stale)]) == 1


def test_crd_schemas_are_structural() -> None:
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert "anyOf" not in node and "$ref" not in node and "title" not in node, path
            if "properties" in node or node.get("type") == "object":
                assert node.get("type") == "object", path
            if path.endswith("properties") is False and isinstance(node.get("type"), list):
                raise AssertionError(f"type must be a string at {path}")
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")

    for crd in all_crds().values():
        walk(crd["spec"]["versions"][0]["schema"], crd["metadata"]["name"])
    spec = openapi_schema(__import__("vexpert_operator.api", fromlist=["x"]).VExpertDeploymentSpec)
    assert spec["properties"]["model"]["properties"]["shape"]["nullable"] is True
    rules = spec["properties"]["parallelism"]["x-kubernetes-validations"]
    assert rules[0]["rule"] == "self.expertParallelSize % self.gpusPerNode == 0"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crds_validate_as_kubernetes_objects(version: str) -> None:
    for path in sorted(CRDS.glob("*.yaml")):
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), version, strict=True)


def test_printer_columns_and_short_names() -> None:
    crd = yaml.safe_load((CRDS / "vexpertdeployments.vexpert.io.yaml").read_text())
    assert crd["spec"]["names"]["shortNames"] == ["vxd"]
    assert crd["spec"]["scope"] == "Namespaced"
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Ready"] == ".status.readyNodes"
    assert columns["K"] == ".status.tuning.allocationInterval" and columns["Np"] == ".status.tuning.pooledExperts"
    node = yaml.safe_load((CRDS / "vexpertnodeprofiles.vexpert.io.yaml").read_text())
    assert node["spec"]["scope"] == "Cluster"


def example_docs(custom: bool = True) -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["apiVersion"].startswith("vexpert.io/") == custom:
                docs.append((path.name, doc))
    return docs


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_in_examples_validate_strictly(version: str) -> None:
    """The examples' built-in objects and the install manifest (deploy/vexpert-operator.yaml)."""
    install = REPO / "deploy" / "vexpert-operator.yaml"
    docs = example_docs(custom=False) + [(install.name, d) for d in yaml.safe_load_all(install.read_text()) if d]
    assert {d["kind"] for _, d in docs} >= {"Deployment", "ClusterRole", "ServiceAccount", "PersistentVolumeClaim"}
    for _, doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(("name", "doc"), example_docs(),
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in example_docs()])
def test_examples_validate_against_the_crd_schema(name: str, doc: dict[str, Any]) -> None:
    validator, raw = crd_validator(doc["kind"])
    obj = apply_defaults(raw, copy.deepcopy(doc))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
    assert errors == []


def test_crd_runtime_has_kv_cache_dtype_with_vllms_names() -> None:
    validator, raw = crd_validator("VExpertDeployment")
    field = raw["properties"]["spec"]["properties"]["runtime"]["properties"]["kvCacheDtype"]
    assert field["default"] == "auto" and field["enum"] == ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    doc = yaml.safe_load((EXAMPLES / "qwen-moe-small.yaml").read_text())
    doc["spec"]["runtime"]["kvCacheDtype"] = "int8"
    assert [e.path[-1] for e in validator.iter_errors(doc)] == ["kvCacheDtype"]


def test_crd_runtime_has_gpu_memory_utilization_with_bounds_and_default() -> None:
    validator, raw = crd_validator("VExpertDeployment")
    field = raw["properties"]["spec"]["properties"]["runtime"]["properties"]["gpuMemoryUtilization"]
    assert field["type"] == "number" and field["default"] == 0.9
    assert field["minimum"] == 0 and field["exclusiveMinimum"] is True  # OpenAPI 3.0: 0 < x
    assert field["maximum"] == 1 and field.get("exclusiveMaximum") is not True  # x ≤ 1
    assert "KV cache" in field["description"]
    doc = yaml.safe_load((EXAMPLES / "qwen-moe-small.yaml").read_text())
    assert apply_defaults(raw, copy.deepcopy(doc))["spec"]["runtime"]["gpuMemoryUtilization"] == 0.9
    for good in (0.5, 1):
        doc["spec"]["runtime"]["gpuMemoryUtilization"] = good
        assert list(validator.iter_errors(doc)) == []
    for bad in (0, -0.1, 1.5, "0.9"):
        doc["spec"]["runtime"]["gpuMemoryUtilization"] = bad
        assert [e.path[-1] for e in validator.iter_errors(doc)] == ["gpuMemoryUtilization"], bad


def test_crd_runtime_has_api_key_secret() -> None:
    validator, raw = crd_validator("VExpertDeployment")
    field = raw["properties"]["spec"]["properties"]["runtime"]["properties"]["apiKeySecret"]
    assert field["type"] == "object" and field["required"] == ["name"]
    assert field["properties"]["key"]["default"] == "api-key"
    assert "VEXPERT_API_KEY" in field["description"]
    doc = yaml.safe_load((EXAMPLES / "qwen-moe-small.yaml").read_text())
    assert "apiKeySecret" not in apply_defaults(raw, copy.deepcopy(doc))["spec"]["runtime"]
    doc["spec"]["runtime"]["apiKeySecret"] = {"name": "vexpert-api-key"}
    assert list(validator.iter_errors(doc)) == []
    assert apply_defaults(raw, copy.deepcopy(doc))["spec"]["runtime"]["apiKeySecret"]["key"] == "api-key"
    for bad in ({"name": "Bad_Name"}, {"key": "api-key"}, {"name": "ok", "key": "a/b"}, {"name": "ok", "other": 1}):
        doc["spec"]["runtime"]["apiKeySecret"] = bad
        assert list(validator.iter_errors(doc)), bad


def test_crd_schema_rejects_unknown_and_wrong_fields() -> None:
    validator, _ = crd_validator("VExpertDeployment")
    doc = yaml.safe_load((EXAMPLES / "qwen-moe-small.yaml").read_text())
    doc["spec"]["runtime"]["replicas"] = 3
    doc["spec"]["parallelism"]["gpusPerNode"] = "eight"
    messages = [e.message for e in validator.iter_errors(doc)]
    assert any("replicas" in m for m in messages) and any("eight" in m for m in messages)


RENDER_CASES = [
    ("deepseek-v3-ep64.yaml", []),
    ("deepseek-v3-ep64.yaml", ["--node-profile", str(EXAMPLES / "profiles" / "h200-node-profile.yaml")]),
    ("qwen-moe-small.yaml", []),
    ("manual-calibration.yaml", []),
    ("manual-calibration.yaml", ["--node-profile", str(EXAMPLES / "profiles" / "h100-p5.json")]),
]


@pytest.mark.parametrize(("example", "extra"), RENDER_CASES)
def test_render_output_validates_strictly_offline(example: str, extra: list[str], capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    assert cli_main(["render", "-f", str(EXAMPLES / example), *extra]) == 0
    out = capsys.readouterr().out
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"}
    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    # The same through the kubernetes-validate command line, as CI would run it.
    path = tmp_path / "rendered.yaml"
    path.write_text(out)
    result = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.32.0", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_uses_the_node_profile_and_same_code_path() -> None:
    plain = render_file(EXAMPLES / "deepseek-v3-ep64.yaml")
    pinned = render_file(EXAMPLES / "deepseek-v3-ep64.yaml",
                         node_profile_file=str(EXAMPLES / "profiles" / "h200-node-profile.yaml"))
    sts = next(m for m in pinned.manifests if m["kind"] == "StatefulSet")
    affinity = sts["spec"]["template"]["spec"]["affinity"]
    assert "nodeAffinity" in affinity
    assert "nodeAffinity" not in next(m for m in plain.manifests if m["kind"] == "StatefulSet")["spec"]["template"][
        "spec"]["affinity"]
    config = yaml.safe_load(next(m for m in pinned.manifests if m["kind"] == "ConfigMap")["data"]["runtime.yaml"])
    assert config["profile"]["hardware"]["h2d_bandwidth_gb_per_s"] == 54.7
    assert any(m["kind"] == "Job" for m in pinned.manifests)  # the model would be calibrated first
    manual = render_file(EXAMPLES / "manual-calibration.yaml")
    config = yaml.safe_load(next(m for m in manual.manifests if m["kind"] == "ConfigMap")["data"]["runtime.yaml"])
    assert config["profile"]["load_balance"]["alpha"] == -0.72
    assert config["tuning"]["pooled_experts"] == 128
    assert not any(m["kind"] == "Job" for m in manual.manifests)


def test_render_errors_are_one_line_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((EXAMPLES / "qwen-moe-small.yaml").read_text())
    doc["spec"]["parallelism"]["expertParallelSize"] = 6
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli_main(["render", "-f", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "spec.parallelism.expertParallelSize" in err
    assert cli_main(["render", "-f", str(tmp_path / "missing.yaml")]) == 2


def test_render_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["render", "-f", str(EXAMPLES / "qwen-moe-small.yaml"), "-o", "json"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["kind"] == "List" and len(out["items"]) >= 4
