"""deploy/kubernetes/ can't be applied here (no cluster), so render each overlay as kustomize
would and check what comes out: every object against the Kubernetes API schemas bundled with
kubernetes-validate (strict: an unknown field is an error), then the references between the
objects and the settings the pods will read.

kustomize itself is not installed everywhere the suite runs, so `render` implements the part
of it these manifests use, and refuses any other kustomization field rather than ignore it.
Where a kubectl with kustomize v5 is on PATH, the render is compared with kubectl's own.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from reach.config import ReachSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("dev", "production")
# The oldest Kubernetes the manifests are written for (nothing in them is newer), and the
# newest the installed kubernetes-validate bundles.
K8S_VERSIONS = ("1.29", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
GATEWAY, WORKER = "reach-gateway", "reach-worker"

Obj = dict[str, Any]

# ---------------------------------------------------------------------------------------------
# the kustomize subset

SUPPORTED = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "images",
    "patches",
    "configMapGenerator",
    "generatorOptions",
}
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Strategic merge: the lists Kubernetes merges item by item, and on which field.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


def render(directory: Path) -> list[Obj]:
    """What `kustomize build directory` prints, for the fields in SUPPORTED."""
    k: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= SUPPORTED, f"{directory}: the test's renderer lacks {set(k) - SUPPORTED}"
    objects: list[Obj] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    hashless = k.get("generatorOptions", {}) == {"disableNameSuffixHash": True}
    assert hashless or "generatorOptions" not in k, k["generatorOptions"]
    for generator in k.get("configMapGenerator", []):
        # The content hash kustomize appends to a new generated name is not implemented (a
        # replacement keeps the name it replaces).
        assert hashless or generator.get("behavior") in ("replace", "merge"), generator
        _generate(directory, generator, objects)
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, "only strategic-merge patches from a file, by name"
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = find(objects, body["kind"], body["metadata"]["name"])
        _merge(target, body)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        assert set(entry) <= {"pairs", "includeSelectors", "includeTemplates"}, entry
        for obj in objects:
            _label(obj, entry["pairs"], entry.get("includeSelectors", False), entry)
    for image in k.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                container["image"] = _retag(container["image"], image)
    return objects


def _generate(directory: Path, generator: dict[str, Any], objects: list[Obj]) -> None:
    assert set(generator) <= {"name", "behavior", "files"}, generator
    data = {Path(f).name: (directory / f).read_text() for f in generator.get("files", [])}
    behavior = generator.get("behavior", "create")
    if behavior == "create":
        assert not [o for o in objects if o["metadata"]["name"] == generator["name"]]
        meta = {"name": generator["name"]}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    else:
        existing = find(objects, "ConfigMap", generator["name"])
        assert behavior in ("replace", "merge"), behavior
        existing["data"] = data if behavior == "replace" else {**existing["data"], **data}


def _merge(base: Obj, patch: Obj) -> None:
    for key, value in patch.items():
        assert not key.startswith("$"), f"patch directive {key} is not implemented"
        mine = base.get(key)
        if isinstance(value, dict) and isinstance(mine, dict):
            _merge(mine, value)
        elif isinstance(value, list) and isinstance(mine, list) and key in MERGE_KEYS:
            on = MERGE_KEYS[key]
            for item in value:
                match = next((m for m in mine if m.get(on) == item[on]), None)
                if match is None:
                    mine.append(copy.deepcopy(item))
                else:
                    _merge(match, item)
        else:
            base[key] = copy.deepcopy(value)


def _label(obj: Obj, pairs: dict[str, str], selectors: bool, entry: dict[str, Any]) -> None:
    obj["metadata"].setdefault("labels", {}).update(pairs)
    spec = obj.get("spec", {})
    if obj["kind"] in WORKLOADS and (selectors or entry.get("includeTemplates")):
        spec["template"]["metadata"].setdefault("labels", {}).update(pairs)
    if selectors:
        if obj["kind"] == "Service":
            spec.setdefault("selector", {}).update(pairs)
        elif obj["kind"] in WORKLOADS or obj["kind"] == "PodDisruptionBudget":
            spec["selector"].setdefault("matchLabels", {}).update(pairs)


def _retag(image: str, change: dict[str, str]) -> str:
    assert set(change) <= {"name", "newName", "newTag", "digest"}, change
    name, at, digest = image.partition("@")
    tag = ""
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != change["name"]:
        return image
    name = change.get("newName", name)
    if "digest" in change:
        return f"{name}@{change['digest']}"
    if "newTag" in change:
        return f"{name}:{change['newTag']}"
    return f"{name}:{tag}" if tag else f"{name}@{digest}" if at else name


# ---------------------------------------------------------------------------------------------
# reading the render


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def _containers(obj: Obj) -> list[Obj]:
    if obj["kind"] not in WORKLOADS:
        return []
    pod = obj["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def workers(objects: list[Obj]) -> list[Obj]:
    return [
        d
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/name") == WORKER
    ]


def capability_of(worker: Obj) -> str:
    command: list[str] = worker["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "worker.py", "--capability"], command
    assert len(command) == 4, "one capability per Deployment: each scales on its own"
    return command[3]


def secret_values(overlay: str, objects: list[Obj]) -> dict[str, str]:
    """reach-secrets as the pods will see it: the rendered one, or for an overlay whose Secret
    is made by hand, its secret.example.yaml with each placeholder filled as documented."""
    rendered = [o for o in of_kind(objects, "Secret") if o["metadata"]["name"] == "reach-secrets"]
    if rendered:
        values: dict[str, str] = rendered[0]["stringData"]
        return values
    example = yaml.safe_load((KUBE / "overlays" / overlay / "secret.example.yaml").read_text())
    key = base64.b64encode(os.urandom(32)).decode()  # what `openssl rand -base64 32` prints
    filled = {
        k: v.replace("REPLACE-WITH-openssl-rand-base64-32", key)
        for k, v in example["stringData"].items()
    }
    return {k: v.replace("REPLACE-WITH-THE-REDIS-PASSWORD", "pw") for k, v in filled.items()}


def pod_settings(
    overlay: str,
    objects: list[Obj],
    deployment: Obj,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> ReachSettings:
    """The settings a pod of `deployment` loads: its mounted reach.yaml and its environment."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    config_path = Path(env["REACH_CONFIG"]["value"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = find(objects, "ConfigMap", volume["configMap"]["name"])
    local = tmp_path / deployment["metadata"]["name"] / config_path.name
    local.parent.mkdir(parents=True)
    local.write_text(config_map["data"][config_path.name])
    for name in [n for n in os.environ if n.startswith(("REACH_", "TEMPORAL_"))]:
        monkeypatch.delenv(name)
    secrets = secret_values(overlay, objects)
    for name, spec in env.items():
        if name == "REACH_CONFIG":
            continue
        ref = spec["valueFrom"]["secretKeyRef"] if "valueFrom" in spec else None
        if ref is None:
            monkeypatch.setenv(name, spec["value"])
        elif ref["key"] in secrets:
            monkeypatch.setenv(name, secrets[ref["key"]])
    return load_settings(local)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def objects(overlay: str) -> list[Obj]:
    return render(KUBE / "overlays" / overlay)


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_kubernetes(objects: list[Obj], version: str) -> None:
    example = KUBE / "overlays" / "production" / "secret.example.yaml"
    for obj in [*objects, yaml.safe_load(example.read_text())]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")


def test_the_render_is_what_kubectl_kustomize_makes(overlay: str, objects: list[Obj]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl on PATH: the renderer is checked against it where there is one")
    run = [kubectl, "version", "--client", "--output=json"]
    version = json.loads(subprocess.run(run, capture_output=True, check=True, timeout=60).stdout)
    if int(re.sub(r"\D", "", version.get("kustomizeVersion", "v0").split(".")[0]) or 0) < 5:
        pytest.skip(f"kubectl's kustomize is {version.get('kustomizeVersion')}, before v5")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert sorted(ours) == sorted(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], key


def test_names_are_unique_and_namespaced(overlay: str, objects: list[Obj]) -> None:
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))
    (namespace,) = of_kind(objects, "Namespace")
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace["metadata"]["name"], obj["kind"]
        # The overlay's own label, on everything it makes (the base's only on the base's).
        assert "app.kubernetes.io/instance" in obj["metadata"]["labels"], obj["kind"]


def test_selectors_find_their_pods_and_ports(objects: list[Obj]) -> None:
    deployments = of_kind(objects, "Deployment")
    for d in deployments:
        selector = d["spec"]["selector"]["matchLabels"]
        assert selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for service in of_kind(objects, "Service"):
        selected = [
            d
            for d in deployments
            if service["spec"]["selector"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, service["metadata"]["name"]
        names = {
            p["name"]: p["containerPort"] for c in _containers(selected[0]) for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)
            assert port["port"] == names[port["targetPort"]]  # one number inside and out
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        labels = pdb["spec"]["selector"]["matchLabels"].items()
        assert [
            d for d in deployments if labels <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["apiVersion"] == "apps/v1"
        find(objects, ref["kind"], ref["name"])
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_every_config_map_secret_and_account_named_exists(overlay: str, objects: list[Obj]) -> None:
    secrets = secret_values(overlay, objects)
    by_hand = not [
        s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == "reach-secrets"
    ]
    for d in of_kind(objects, "Deployment"):
        pod = d["spec"]["template"]["spec"]
        if "serviceAccountName" in pod:
            find(objects, "ServiceAccount", pod["serviceAccountName"])
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                find(objects, "ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                find(objects, "Secret", volume["secret"]["secretName"])
        for container in _containers(d):
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod.get("volumes", [])}
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] == "reach-secrets", env
                    assert ref.get("optional") or ref["key"] in secrets, env
                    # A Secret made by hand: its example documents every key pods read.
                    assert ref["key"] in secrets or not by_hand, env


def test_probes_and_drain(objects: list[Obj]) -> None:
    gateway = find(objects, "Deployment", GATEWAY)
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    for worker in workers(objects):
        (c,) = worker["spec"]["template"]["spec"]["containers"]
        for probe in ("livenessProbe", "startupProbe"):
            assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert 0 < int(pause[1]) < pod["terminationGracePeriodSeconds"]


def test_pods_read_valid_settings_that_match_their_ports(
    overlay: str, objects: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = find(objects, "Deployment", GATEWAY)
    settings = pod_settings(overlay, objects, gateway, tmp_path, monkeypatch)
    assert settings.registry.type == "redis"  # several pods share one registry
    assert settings.registry.redis_url.startswith(("redis://", "rediss://"))
    assert settings.listen_host == "0.0.0.0"
    assert settings.auth.mode == "tokens"
    assert settings.temporal.address == "temporal-frontend.temporal:7233"
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["reach", "gateway"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.listen_port, "grpc": settings.transport.ports["grpc"]}
    service = find(objects, "Service", GATEWAY)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    # The drain outlasts the pause plus the longest synchronous deadline a caller can be held.
    deadlines = [settings.policy.default_timeout_ms] + [
        op.timeout_ms for op in settings.policy.operations.values() if op.timeout_ms
    ]
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pause + max(deadlines) / 1000 + 10
    # And the gateway's own bound on what it lets finish (transport.drain_s, plus uvicorn's 5 s).
    assert grace >= pause + settings.transport.drain_s + 5 + 10
    for worker in workers(objects):
        worker_settings = pod_settings(overlay, objects, worker, tmp_path, monkeypatch)
        assert worker_settings.registry.type == "redis"
        assert worker_settings.metrics.worker_host == "0.0.0.0"  # the kubelet probes the pod
        (c,) = worker["spec"]["template"]["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "metrics": worker_settings.metrics.worker_port
        }


def test_a_worker_and_an_autoscaler_per_queue_capability(
    overlay: str, objects: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = pod_settings(
        overlay, objects, find(objects, "Deployment", GATEWAY), tmp_path, monkeypatch
    )
    queued = {name for name, cap in settings.capabilities.items() if cap.mode == "queue"}
    served = {capability_of(w): w for w in workers(objects)}
    # With the redis registry the gateway serves no queue capability itself: each needs its
    # own workers, and a worker for an inline one would poll a queue nobody sends to.
    assert set(served) == queued
    scaled = {
        h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objects, "HorizontalPodAutoscaler")
    }
    assert {GATEWAY} | {w["metadata"]["name"] for w in served.values()} == scaled
    for name, w in served.items():
        assert w["metadata"]["name"] == f"{WORKER}-{name}"
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert labels["agent-reach.io/capability"] == name


def test_reach_images_are_the_overlays_own(objects: list[Obj]) -> None:
    images = {
        c["image"]
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["name"] == GATEWAY or d in workers(objects)
        for c in _containers(d)
    }
    (image,) = images  # gateway and workers run one build
    assert re.fullmatch(r"[a-z0-9./-]+(:[\w.-]+|@sha256:[0-9a-f]{64})", image), image
    assert image != "agent-reach", "the overlay names the built image (images:)"


def test_the_temporal_chart_values_match_reach() -> None:
    """Temporal comes from its own Helm chart: the values Reach needs of it."""
    from reach.limits import UPDATE_PAYLOADS_LIMIT_BYTES

    values = yaml.safe_load((KUBE / "temporal-values.yaml").read_text())
    dynamic = values["server"]["dynamicConfig"]
    assert dynamic["history.maxInFlightUpdatePayloads"] == [{"value": UPDATE_PAYLOADS_LIMIT_BYTES}]
    compose_cluster = yaml.safe_load((ROOT / "deploy" / "temporal-dynamicconfig.yaml").read_text())
    assert dynamic == compose_cluster  # the same server settings on both clusters
    namespaces = values["server"]["config"]["namespaces"]
    assert namespaces["create"] is True
    for overlay in OVERLAYS:
        data = find(render(KUBE / "overlays" / overlay), "ConfigMap", "reach-config")["data"]
        namespace = yaml.safe_load(data["reach.yaml"])["reach"]["temporal"]["namespace"]
        assert namespace in [n["name"] for n in namespaces["namespace"]]
