"""Kubernetes manifests under deploy/k8s: render every overlay, validate every object, check the pod specs.

- Rendering: there is no kustomize binary in CI, so ``render()`` below implements the subset of
  kustomize that the manifests use (resources, components, strategic-merge patches, namespace,
  images) and refuses anything else. Where a real kustomize exists (``kustomize`` or
  ``kubectl kustomize``), a test checks that both render the same objects.
- Core kinds are validated with ``kubernetes-validate`` against the Kubernetes JSON schemas it
  ships, in strict mode (unknown fields are errors), for Kubernetes 1.34 (the first release with
  DRA's ``resource.k8s.io/v1``) and for the newest version it ships.
- CRDs (LeaderWorkerSet, KEDA ScaledObject, Prometheus Operator PodMonitor) are not in those
  schemas: they are checked against the structural schemas written below (the fields these
  manifests use, from each project's API types), and the core types embedded in them (pod
  templates, HPA behavior) against the Kubernetes schemas.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
STANDALONE = sorted(p for d in ("storage", "jobs") for p in (K8S / d).glob("*.yaml"))
# resource.k8s.io/v1 (ResourceClaimTemplate) first appears in the 1.34 schemas; check the newest too.
K8S_VERSIONS = ("1.34.0", latest_version())

Obj = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# A small kustomize: exactly the features deploy/k8s uses, anything else is an error.
# ----------------------------------------------------------------------------------------------


class KustomizeError(ValueError):
    """A kustomization uses something this renderer does not implement, or is inconsistent."""


_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "patches", "images"}
_CLUSTER_SCOPED = {
    "Namespace",
    "PersistentVolume",
    "StorageClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "DeviceClass",
    "PriorityClass",
}
# API groups kustomize has schemas for; objects of other groups (CRDs) get atomic lists.
_BUILTIN_GROUPS = {
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "networking.k8s.io",
    "resource.k8s.io",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
}
# Strategic-merge keys of the pod-spec lists these patches touch (patchMergeKey in k8s.io/api).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "resourceClaims": "name",
    "imagePullSecrets": "name",
}


def _load_docs(path: Path) -> list[Obj]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= d.keys():
            raise KustomizeError(f"{path}: every document needs apiVersion, kind and metadata")
    return docs


def _load_kustomization(directory: Path, kind: str) -> Obj:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if k.get("kind") != kind:
        raise KustomizeError(f"{directory}: expected kind {kind}, found {k.get('kind')!r}")
    unknown = set(k) - _KUSTOMIZATION_KEYS
    if unknown:
        raise KustomizeError(f"{directory}/kustomization.yaml uses {sorted(unknown)}: not implemented here")
    return k


def _file_in(directory: Path, rel: str) -> Path:
    path = (directory / rel).resolve()
    if directory.resolve() not in path.parents:  # kustomize's load restrictor
        raise KustomizeError(f"{directory}: file {rel!r} is outside the kustomization root")
    return path


def _key(obj: Obj) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _smp(base: Any, patch: Any, field: str = "", atomic_lists: bool = False) -> Any:
    """Strategic merge: maps merge, keyed lists merge by key (new items first, as kustomize
    orders them), other lists and scalars are replaced, null deletes. For kinds kustomize has no
    schema for (CRDs), every list is atomic: replaced as a whole."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"patch directive in {field!r}: not implemented here")
        if not isinstance(base, dict):
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _smp(out[k], v, k, atomic_lists) if k in out else copy.deepcopy(v)
        return out
    if atomic_lists:
        return copy.deepcopy(patch)
    if isinstance(patch, list) and isinstance(base, list) and any(isinstance(i, dict) for i in patch + base):
        if any(isinstance(i, dict) and any(k.startswith("$") for k in i) for i in patch):
            raise KustomizeError(f"patch directive in {field!r}: not implemented here")
        mk = _MERGE_KEYS.get(field)
        if mk is None or not all(isinstance(i, dict) and mk in i for i in patch + base):
            raise KustomizeError(f"merging the list {field!r}: not implemented here")
        by_key = {i[mk]: i for i in patch}
        base_keys = {i[mk] for i in base}
        new = [copy.deepcopy(i) for i in patch if i[mk] not in base_keys]
        return new + [_smp(i, by_key[i[mk]], field) if i[mk] in by_key else copy.deepcopy(i) for i in base]
    return copy.deepcopy(patch)


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    head, sep, tag = name.rpartition(":")
    if sep and "/" not in tag:
        return head, tag, digest or None
    return name, None, digest or None


def _set_images(node: Any, images: list[Obj]) -> None:
    """kustomize's images transformer: every container list, wherever it is in the object."""
    if isinstance(node, list):
        for item in node:
            _set_images(item, images)
        return
    if not isinstance(node, dict):
        return
    for field, value in node.items():
        if field in ("containers", "initContainers") and isinstance(value, list):
            for c in value:
                name, tag, digest = _split_image(c["image"])
                for rule in images:
                    if rule["name"] == name:
                        if set(rule) - {"name", "newName", "newTag"}:
                            raise KustomizeError(f"images entry {rule}: only newName/newTag are implemented")
                        name, tag = rule.get("newName", name), rule.get("newTag", tag)
                        c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
        else:
            _set_images(value, images)


def _transform(k: Obj, objs: list[Obj], directory: Path) -> list[Obj]:
    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{directory}: patches entry {entry}: only `path:` patches are implemented")
        (patch,) = _load_docs(_file_in(directory, entry["path"]))
        targets = [
            o
            for o in objs
            if (o["apiVersion"], o["kind"], o["metadata"]["name"])
            == (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
        ]
        if len(targets) != 1:
            raise KustomizeError(f"{directory}/{entry['path']} matches {len(targets)} objects, expected 1")
        crd = patch["apiVersion"].rpartition("/")[0] not in _BUILTIN_GROUPS
        objs[objs.index(targets[0])] = _smp(targets[0], patch, atomic_lists=crd)
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in _CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    if "images" in k:
        for o in objs:
            _set_images(o, k["images"])
    return objs


def _accumulate(directory: Path, k: Obj, objs: list[Obj]) -> list[Obj]:
    for rel in k.get("resources", []):
        target = (directory / rel).resolve()
        objs = objs + (_build(target, "Kustomization") if target.is_dir() else _load_docs(_file_in(directory, rel)))
    for rel in k.get("components", []):
        objs = _build((directory / rel).resolve(), "Component", objs)
    keys = [_key(o) for o in objs]
    dupes = {key for key in keys if keys.count(key) > 1}
    if dupes:
        raise KustomizeError(f"{directory}: the same object more than once: {sorted(dupes)}")
    return _transform(k, objs, directory)


def _build(directory: Path, kind: str, objs: list[Obj] | None = None) -> list[Obj]:
    return _accumulate(directory, _load_kustomization(directory, kind), objs or [])


@functools.lru_cache(maxsize=None)
def _render_cached(directory: Path) -> str:
    return json.dumps(_build(directory, "Kustomization"))


def render(directory: Path) -> list[Obj]:
    """The objects `kustomize build directory` would print (for the features above)."""
    return json.loads(_render_cached(directory.resolve()))


def overlay(name: str) -> list[Obj]:
    return render(K8S / "overlays" / name)


# ----------------------------------------------------------------------------------------------
# Helpers on rendered objects
# ----------------------------------------------------------------------------------------------


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "Job", "StatefulSet"):
            yield where, o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            if "leaderTemplate" in lwt:
                yield f"{where}/leader", lwt["leaderTemplate"]
            yield f"{where}/worker", lwt["workerTemplate"]


def container(pod: Obj, name: str) -> Obj:
    spec = pod["spec"]
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name!r}: found {len(found)}"
    return found[0]


def env_spec(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def env_value(c: Obj, name: str, config: dict[str, str] | None = None) -> str:
    """An env var's value: literal, or from the gdsload-model ConfigMap when `config` is given."""
    e = env_spec(c)[name]
    if "value" in e:
        return e["value"]
    ref = e["valueFrom"]["configMapKeyRef"]
    assert config is not None and ref["name"] == "gdsload-model", e
    return config[ref["key"]]


def model_config(objs: list[Obj]) -> dict[str, str]:
    return one(objs, "ConfigMap", "gdsload-model")["data"]


def port_number(c: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (p,) = [p for p in c.get("ports", []) if p.get("name") == port]
    return p["containerPort"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def runtime_labels(where: str, pod: Obj) -> dict[str, str]:
    """A template's labels plus those its controller adds: LWS numbers the leader 0, workers 1.."""
    labels = dict(pod["metadata"]["labels"])
    if where.startswith("LeaderWorkerSet/"):
        labels["leaderworkerset.sigs.k8s.io/worker-index"] = "0" if where.endswith("/leader") else "1"
    return labels


_VAR = re.compile(r"\$\((\w+)\)")


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values (unknown names stay)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), s)


def sidecar_pods() -> list[tuple[str, str, Obj]]:
    return [
        (name, where, pod)
        for name in OVERLAYS
        for where, pod in pod_templates(overlay(name))
        if any(c["name"] == "gdsload" for c in pod["spec"].get("initContainers", []))
    ]


SIDECAR_PODS = sidecar_pods()
SIDECAR_IDS = [f"{name}:{where}" for name, where, _ in SIDECAR_PODS]
# Env vars the LeaderWorkerSet controller adds to every container of a group.
LWS_INJECTED = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
WORKER_INDEX_LABEL = "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"


# ----------------------------------------------------------------------------------------------
# Structural schemas of the CRDs (the fields these manifests may use; unknown fields are errors)
# ----------------------------------------------------------------------------------------------


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_INT_OR_STR = {"type": ["integer", "string"]}
_OBJ = {"type": "object"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = _strict({"name": _STR, "labels": _LABELS, "annotations": _LABELS, "namespace": _STR}, ("name",))
_SELECTOR = _strict({"matchLabels": _LABELS, "matchExpressions": {"type": "array"}})

CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    # sigs.k8s.io/lws api/leaderworkerset/v1/leaderworkerset_types.go
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": _strict(
                {
                    "replicas": {"type": "integer", "minimum": 0},
                    "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                    "rolloutStrategy": _strict(
                        {
                            "type": {"enum": ["RollingUpdate"]},
                            "rollingUpdateConfiguration": _strict(
                                {"partition": _INT, "maxUnavailable": _INT_OR_STR, "maxSurge": _INT_OR_STR}
                            ),
                        },
                        ("type",),
                    ),
                    "networkConfig": _strict({"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}),
                    "leaderWorkerTemplate": _strict(
                        {
                            "leaderTemplate": _OBJ,
                            "workerTemplate": _OBJ,  # PodTemplateSpec: core schema below
                            "size": {"type": "integer", "minimum": 1},
                            "restartPolicy": {
                                "enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
                            },
                            "subGroupPolicy": _OBJ,
                        },
                        ("workerTemplate",),
                    ),
                },
                ("leaderWorkerTemplate",),
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
    # kedacore/keda apis/keda/v1alpha1/scaledobject_types.go (trigger metadata is map[string]string)
    ("keda.sh/v1alpha1", "ScaledObject"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": _strict(
                {
                    "scaleTargetRef": _strict(
                        {"name": _STR, "apiVersion": _STR, "kind": _STR, "envSourceContainerName": _STR}, ("name",)
                    ),
                    "pollingInterval": _INT,
                    "cooldownPeriod": _INT,
                    "initialCooldownPeriod": _INT,
                    "idleReplicaCount": _INT,
                    "minReplicaCount": _INT,
                    "maxReplicaCount": _INT,
                    "fallback": _strict({"failureThreshold": _INT, "replicas": _INT}),
                    "advanced": _strict(
                        {
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            "horizontalPodAutoscalerConfig": _strict({"name": _STR, "behavior": _OBJ}),
                        }
                    ),
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": _strict(
                            {
                                "type": _STR,
                                "name": _STR,
                                "useCachedMetrics": {"type": "boolean"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                                "authenticationRef": _strict({"name": _STR, "kind": _STR}, ("name",)),
                            },
                            ("type", "metadata"),
                        ),
                    },
                },
                ("scaleTargetRef", "triggers"),
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
    # prometheus-operator pkg/apis/monitoring/v1/podmonitor_types.go
    ("monitoring.coreos.com/v1", "PodMonitor"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": _strict(
                {
                    "selector": _SELECTOR,
                    "jobLabel": _STR,
                    "namespaceSelector": _strict({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": _strict(
                            {
                                "port": _STR,
                                "portNumber": _INT,
                                "path": _STR,
                                "scheme": {"enum": ["http", "https"]},
                                "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                                "scrapeTimeout": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                            }
                        ),
                    },
                },
                ("selector", "podMetricsEndpoints"),
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
}


def validate_core(obj: Obj) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} against Kubernetes {version}: {where}: {e.message}")


def validate_object(obj: Obj) -> None:
    """Core kinds against the Kubernetes schemas; CRDs structurally, with their embedded core types."""
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is None:
        validate_core(obj)
        return
    jsonschema.validate(obj, crd, cls=jsonschema.Draft202012Validator)
    for where, template in pod_templates([obj]):
        validate_core(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": where.replace("/", "-").lower()},
                "template": template,
            }
        )
    behavior = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:
        validate_core(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "x"},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "maxReplicas": 1,
                    "behavior": behavior,
                },
            }
        )


# ----------------------------------------------------------------------------------------------
# The renderer itself
# ----------------------------------------------------------------------------------------------


def test_overlays_exist():
    assert OVERLAYS == ["multi-node", "plugin-fallback", "sidecar"]


def test_smp_merges_pod_lists_by_key_and_replaces_the_rest():
    base = {
        "containers": [{"name": "a", "args": ["1", "2"], "env": [{"name": "X", "value": "1"}]}],
        "volumes": [{"name": "v", "emptyDir": {}}],
    }
    patch = {
        "containers": [{"name": "a", "args": ["3"], "env": [{"name": "Y", "value": "2"}]}, {"name": "b", "image": "i"}],
        "volumes": [{"name": "v", "emptyDir": {"medium": "Memory"}}],
    }
    out = _smp(base, patch)
    assert [c["name"] for c in out["containers"]] == ["b", "a"]
    assert out["containers"][1]["args"] == ["3"]
    assert out["containers"][1]["env"] == [{"name": "Y", "value": "2"}, {"name": "X", "value": "1"}]
    assert out["volumes"] == [{"name": "v", "emptyDir": {"medium": "Memory"}}]
    assert _smp({"a": 1, "b": 2}, {"b": None}) == {"a": 1}


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path):
    with pytest.raises(KustomizeError, match=r"\$patch|directive"):
        _smp({"containers": []}, {"containers": [{"$patch": "delete"}]})
    with pytest.raises(KustomizeError, match="merging the list 'ports'"):
        _smp({"ports": [{"port": 1}]}, {"ports": [{"port": 2}]})
    (tmp_path / "kustomization.yaml").write_text("kind: Kustomization\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="commonLabels"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("kind: Kustomization\nresources: [../outside.yaml]\n")
    with pytest.raises(KustomizeError, match="outside the kustomization root"):
        render(tmp_path)


def test_images_and_namespace_transformers(tmp_path: Path):
    (tmp_path / "kustomization.yaml").write_text(
        "kind: Kustomization\nnamespace: ns\nresources: [objs.yaml]\n"
        "images: [{name: app, newName: reg.example/app, newTag: '2'}]\n"
    )
    (tmp_path / "objs.yaml").write_text(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: pv}\n---\n"
        "apiVersion: x/v1\nkind: Thing\nmetadata: {name: t}\n"
        "spec: {deep: {spec: {containers: [{name: c, image: 'app:1'}, {name: d, image: 'other:1'}]}}}\n"
    )
    pv, thing = render(tmp_path)
    assert "namespace" not in pv["metadata"] and thing["metadata"]["namespace"] == "ns"
    assert [c["image"] for c in thing["spec"]["deep"]["spec"]["containers"]] == ["reg.example/app:2", "other:1"]


def _real_kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("name", OVERLAYS)
def test_renderer_agrees_with_kustomize(name: str):
    cmd = _real_kustomize()
    if cmd is None:
        pytest.skip("no kustomize or kubectl binary here; the other tests use the renderer in this file")
    out = subprocess.run([*cmd, str(K8S / "overlays" / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {_key(o): o for o in overlay(name)}
    assert sorted(theirs) == sorted(ours)
    for key, obj in ours.items():
        assert obj == theirs[key], key


# ----------------------------------------------------------------------------------------------
# Every object validates; every file is used
# ----------------------------------------------------------------------------------------------


def test_resource_v1_needs_kubernetes_1_34():
    rct = one(overlay("sidecar"), "ResourceClaimTemplate")
    kubernetes_validate.validate(rct, "1.34.0", strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(rct, "1.33.0", strict=True)


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_objects_validate(name: str):
    objs = overlay(name)
    assert len(objs) >= 8
    for obj in objs:
        validate_object(obj)


@pytest.mark.parametrize("path", STANDALONE, ids=lambda p: str(p.relative_to(K8S)))
def test_standalone_manifests_validate(path: Path):
    for obj in _load_docs(path):
        validate_object(obj)


def test_strict_validation_catches_a_misspelt_field():
    deployment = copy.deepcopy(one(overlay("sidecar"), "Deployment"))
    container(deployment["spec"]["template"], "gdsload")["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    lws = copy.deepcopy(one(overlay("multi-node"), "LeaderWorkerSet"))
    lws["spec"]["startupPolicy"] = "LeaderReadyy"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(lws)


def _referenced_files() -> set[Path]:
    used: set[Path] = set()
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        used.add(kfile)
        for rel in k.get("resources", []) + [p["path"] for p in k.get("patches", [])]:
            target = (kfile.parent / rel).resolve()
            if target.is_file():
                used.add(target)
    return used


def test_every_manifest_file_is_used_or_standalone():
    files = {p.resolve() for p in K8S.rglob("*.yaml")}
    orphans = files - _referenced_files() - {p.resolve() for p in STANDALONE}
    assert not orphans, sorted(str(p.relative_to(K8S)) for p in orphans)


def test_every_kustomization_is_reachable_from_an_overlay():
    reached: set[Path] = set()

    def walk(d: Path) -> None:
        reached.add(d)
        k = yaml.safe_load((d / "kustomization.yaml").read_text())
        for rel in k.get("resources", []) + k.get("components", []):
            target = (d / rel).resolve()
            if target.is_dir():
                walk(target)

    for name in OVERLAYS:
        walk((K8S / "overlays" / name).resolve())
    every = {p.parent.resolve() for p in K8S.rglob("kustomization.yaml")}
    assert every <= reached, sorted(str(p.relative_to(K8S)) for p in every - reached)


# ----------------------------------------------------------------------------------------------
# The sidecar pod: every pod template that runs the gdsload sidecar
# ----------------------------------------------------------------------------------------------


def test_sidecar_pods_found():
    assert SIDECAR_IDS == [
        "multi-node:LeaderWorkerSet/gdsload-inference/leader",
        "multi-node:LeaderWorkerSet/gdsload-inference/worker",
        "sidecar:Deployment/gdsload-inference",
    ]


@pytest.mark.parametrize(("name", "where", "pod"), SIDECAR_PODS, ids=SIDECAR_IDS)
def test_engine_starts_only_after_the_sidecar_is_ready(name: str, where: str, pod: Obj):
    spec = pod["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "gdsload"]
    # Native sidecar: an init container with restartPolicy Always; the kubelet starts the
    # regular containers only after its startupProbe succeeded.
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    # The startup budget covers a slow cold load (at least 30 minutes).
    probe = sidecar["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800


@pytest.mark.parametrize(("name", "where", "pod"), SIDECAR_PODS, ids=SIDECAR_IDS)
def test_sidecar_probes_point_at_the_right_paths_and_port(name: str, where: str, pod: Obj):
    sidecar = container(pod, "gdsload")
    port = int(env_value(sidecar, "GDSLOAD_PORT"))
    assert port == 8471
    expected = {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe, path in expected.items():
        get = sidecar[probe]["httpGet"]
        assert get["path"] == path, probe
        assert port_number(sidecar, get["port"]) == port, probe
        assert get.get("scheme", "HTTP") == "HTTP" and "host" not in get, probe
    # Probes reach the pod IP, never loopback: the server must not bind 127.0.0.1.
    assert env_value(sidecar, "GDSLOAD_HOST") in ("0.0.0.0", "::")
    engine = container(pod, "vllm")
    assert "startupProbe" not in engine or engine["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize(("name", "where", "pod"), SIDECAR_PODS, ids=SIDECAR_IDS)
def test_one_resource_claim_is_shared_by_both_containers(name: str, where: str, pod: Obj):
    objs = overlay(name)
    spec = pod["spec"]
    (claim,) = spec["resourceClaims"]
    template = one(objs, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert request["exactly"]["count"] == int(model_config(objs)["GPUS_PER_POD"])
    for c in spec["initContainers"] + spec["containers"]:
        if c["name"] in ("gdsload", "vllm"):
            assert [x["name"] for x in c["resources"]["claims"]] == [claim["name"]], c["name"]
        # No device-plugin GPUs next to the claim: those would be different devices.
        assert not any(
            k.startswith("nvidia.com/") for part in ("requests", "limits") for k in c.get("resources", {}).get(part, {})
        ), c["name"]


@pytest.mark.parametrize(("name", "where", "pod"), SIDECAR_PODS, ids=SIDECAR_IDS)
def test_token_comes_from_the_secret(name: str, where: str, pod: Obj):
    spec = pod["spec"]
    (vol,) = [v for v in spec["volumes"] if "secret" in v]
    secret = vol["secret"]
    assert secret["secretName"] == "gdsload-token"
    assert secret["items"] == [{"key": "token", "path": "token"}]
    assert secret["defaultMode"] & 0o007 == 0, "the token must not be world-readable"
    sidecar, engine = container(pod, "gdsload"), container(pod, "vllm")
    paths = {}
    for c in (sidecar, engine):
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
        assert mount["readOnly"] is True
        paths[c["name"]] = f"{mount['mountPath']}/token"
        # Never a token value inline in the manifest.
        assert "GDSLOAD_TOKEN" not in env_spec(c), c["name"]
    assert env_value(sidecar, "GDSLOAD_TOKEN_FILE") == paths["gdsload"]
    loader = json.loads(env_value(engine, "LOADER_EXTRA_CONFIG"))
    assert loader["token_file"] == paths["vllm"]


@pytest.mark.parametrize(("name", "where", "pod"), SIDECAR_PODS, ids=SIDECAR_IDS)
def test_cuda_ipc_settings(name: str, where: str, pod: Obj):
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True  # legacy CUDA IPC handles need one PID namespace
    assert spec.get("hostIPC") is not True and spec.get("hostPID") is not True
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory" and "sizeLimit" in shm["emptyDir"]
    for name_ in ("gdsload", "vllm"):
        mounts = {m["mountPath"]: m["name"] for m in container(pod, name_)["volumeMounts"]}
        assert mounts.get("/dev/shm") == "dshm", name_
        assert env_value(container(pod, name_), "CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    # One user for both containers (torch's IPC reference counters in /dev/shm are 0600).
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001
    for c in spec["initContainers"] + spec["containers"]:
        sc = c.get("securityContext", {})
        assert sc.get("runAsUser", pod_sc["runAsUser"]) == pod_sc["runAsUser"], c["name"]
        assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged") is not True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]


@pytest.mark.parametrize(("name", "where", "pod"), SIDECAR_PODS, ids=SIDECAR_IDS)
def test_engine_maps_the_sidecars_tensors(name: str, where: str, pod: Obj):
    sidecar, engine = container(pod, "gdsload"), container(pod, "vllm")
    assert "--load-format=gdsload" in engine["args"]
    assert "--model-loader-extra-config=$(LOADER_EXTRA_CONFIG)" in engine["args"]
    loader = json.loads(env_value(engine, "LOADER_EXTRA_CONFIG"))
    assert loader["sidecar_url"] == f"http://127.0.0.1:{env_value(sidecar, 'GDSLOAD_PORT')}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_model_volume_is_the_shared_claim_mounted_read_only(name: str):
    objs = overlay(name)
    pvc = one(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] in (["ReadWriteMany"], ["ReadOnlyMany"])
    config = model_config(objs)
    for where, pod in pod_templates(objs):
        (vol,) = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert vol["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"], "readOnly": True}, where
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
            assert mount["readOnly"] is True, (where, c["name"])
            assert config["MODEL_DIR"].startswith(mount["mountPath"].rstrip("/") + "/"), (where, c["name"])
            if c["name"] == "gdsload":
                assert env_value(c, "GDSLOAD_ALLOW_ROOT") == mount["mountPath"]


def test_model_claim_binds_to_the_fsx_volume():
    (pv,) = _load_docs(K8S / "storage" / "fsx-lustre-pv.yaml")
    for name in OVERLAYS:
        pvc = one(overlay(name), "PersistentVolumeClaim")
        assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
        assert pvc["spec"]["storageClassName"] == pv["spec"]["storageClassName"] == ""
        assert pv["spec"]["claimRef"] == {"namespace": pvc["metadata"]["namespace"], "name": pvc["metadata"]["name"]}
        assert set(pvc["spec"]["accessModes"]) <= set(pv["spec"]["accessModes"])
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com"
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_variable_reference_resolves(name: str):
    for where, pod in pod_templates(overlay(name)):
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            defined = set(env_spec(c)) | (LWS_INJECTED if where.startswith("LeaderWorkerSet") else set())
            for s in c.get("command", []) + c.get("args", []):
                missing = set(_VAR.findall(s)) - defined
                assert not missing, (where, c["name"], s)


@pytest.mark.parametrize("name", OVERLAYS)
def test_images_are_pinned(name: str):
    for where, pod in pod_templates(overlay(name)):
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            repo, tag, digest = _split_image(c["image"])
            assert "/" in repo and (digest or (tag and tag != "latest")), (where, c["image"])


# ----------------------------------------------------------------------------------------------
# Without DRA: the vLLM plugin inside the engine
# ----------------------------------------------------------------------------------------------


def test_plugin_fallback_has_no_sidecar_and_no_dra():
    objs = overlay("plugin-fallback")
    assert not [o for o in objs if o["apiVersion"].startswith("resource.k8s.io/")]
    pod = one(objs, "Deployment")["spec"]["template"]
    spec = pod["spec"]
    assert "initContainers" not in spec and "resourceClaims" not in spec
    engine = container(pod, "vllm")
    assert "claims" not in engine["resources"]
    config = model_config(objs)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == config["GPUS_PER_POD"] == config["TP_SIZE"]
    assert "--load-format=gdsload" in engine["args"]
    assert json.loads(env_value(engine, "LOADER_EXTRA_CONFIG")) == {"backend": "auto"}
    # Readiness is vLLM's /health alone, which answers only once the plugin has loaded.
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"


# ----------------------------------------------------------------------------------------------
# Traffic, metrics, autoscaling
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_service_reaches_the_engine(name: str):
    objs = overlay(name)
    svc = one(objs, "Service")
    (port,) = svc["spec"]["ports"]
    targets = [(w, p) for w, p in pod_templates(objs) if selects(svc["spec"]["selector"], runtime_labels(w, p))]
    assert targets, "the Service selects no pod template"
    for where, pod in targets:
        assert port_number(container(pod, "vllm"), port["targetPort"]) == 8000, where
    if name == "multi-node":  # leaders only: workers run headless
        assert [w for w, _ in targets] == ["LeaderWorkerSet/gdsload-inference/leader"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_network_policy_keeps_the_sidecar_port_for_prometheus(name: str):
    objs = overlay(name)
    policy = one(objs, "NetworkPolicy", "gdsload-inference")
    for _, pod in pod_templates(objs):
        assert selects(policy["spec"]["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    open_rules = [r for r in policy["spec"]["ingress"] if r["from"] == [{"namespaceSelector": {}}]]
    assert [p["port"] for r in open_rules for p in r["ports"]] == [8000]
    monitoring = [
        r
        for r in policy["spec"]["ingress"]
        if r["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    ]
    assert 8471 in [p["port"] for r in monitoring for p in r["ports"]]


@pytest.mark.parametrize("name", OVERLAYS)
def test_podmonitor_scrapes_both_containers(name: str):
    objs = overlay(name)
    monitor = one(objs, "PodMonitor")
    pods = [
        (w, p)
        for w, p in pod_templates(objs)
        if selects(monitor["spec"]["selector"]["matchLabels"], p["metadata"]["labels"])
    ]
    assert pods
    named = {
        w: {
            port["name"]
            for c in p["spec"].get("initContainers", []) + p["spec"]["containers"]
            for port in c.get("ports", [])
        }
        for w, p in pods
    }
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics"
        assert any(endpoint["port"] in ports for ports in named.values()), endpoint
    if name != "plugin-fallback":
        assert all("gdsload" in ports for ports in named.values())


@pytest.mark.parametrize("name", [n for n in OVERLAYS if any(o["kind"] == "ScaledObject" for o in overlay(n))])
def test_keda_scales_the_deployment_on_total_demand(name: str):
    objs = overlay(name)
    scaled = one(objs, "ScaledObject")
    spec = scaled["spec"]
    target = one(objs, spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"])
    assert target["apiVersion"] == spec["scaleTargetRef"]["apiVersion"]
    assert spec["minReplicaCount"] >= 1  # never scale to zero: a cold start is a full load
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    assert set(re.findall(r'namespace="([^"]+)"', query)) == {target["metadata"]["namespace"]}
    assert "vllm:num_requests_waiting" in query and "vllm:num_requests_running" in query
    assert float(trigger["metadata"]["threshold"]) > 0
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 600
    # Scale-up readiness: a replica takes traffic only when Ready, and Ready includes /readyz.
    if name == "sidecar":
        pod = target["spec"]["template"]
        assert container(pod, "gdsload")["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The HPA owns the replica count: re-applying the manifests must not reset it.
    assert "replicas" not in target["spec"]
    # Rolling updates never drop a serving replica before its successor has loaded.
    assert target["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# ----------------------------------------------------------------------------------------------
# Multi-node: LeaderWorkerSet, every node loading its own ranks
# ----------------------------------------------------------------------------------------------


def test_multi_node_group_layout():
    objs = overlay("multi-node")
    lws = one(objs, "LeaderWorkerSet")
    config = model_config(objs)
    # One tensor-parallel engine across the group: every GPU of every node is one rank.
    assert int(config["TP_SIZE"]) == int(config["GPUS_PER_POD"]) * lws["spec"]["leaderWorkerTemplate"]["size"]
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady would deadlock
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] == 0
    templates = dict(pod_templates([lws]))
    leader = templates["LeaderWorkerSet/gdsload-inference/leader"]
    worker = templates["LeaderWorkerSet/gdsload-inference/worker"]
    assert "--headless" not in container(leader, "vllm")["args"]
    assert "--headless" in container(worker, "vllm")["args"]
    for pod in (leader, worker):
        engine, sidecar = container(pod, "vllm"), container(pod, "gdsload")
        assert "--node-rank=$(NODE_INDEX)" in engine["args"]
        assert "--nnodes=$(LWS_GROUP_SIZE)" in engine["args"]
        assert "--tensor-parallel-size=$(TP_SIZE)" in engine["args"]
        assert "--distributed-executor-backend=mp" in engine["args"]
        assert env_spec(engine)["NODE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == WORKER_INDEX_LABEL
        # The sidecar loads its node's ranks: no --tp/--ranks, the entrypoint derives them.
        assert not {"--tp", "--ranks"} & set(sidecar["args"])
        assert env_spec(sidecar)["GDSLOAD_NODE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == WORKER_INDEX_LABEL
        assert env_spec(sidecar)["GDSLOAD_GPUS_PER_NODE"]["valueFrom"]["configMapKeyRef"]["key"] == "GPUS_PER_POD"


def _run_entrypoint(c: Obj, config: dict[str, str], tmp_path: Path, labels: dict[str, str]) -> list[str]:
    """Start the sidecar container's entrypoint the way the kubelet would (env resolved from the
    rendered ConfigMap and the pod labels, $(VAR) expanded in args), with a fake gdsload."""
    env: dict[str, str] = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "configMapKeyRef" in e["valueFrom"]:
            env[e["name"]] = config[e["valueFrom"]["configMapKeyRef"]["key"]]
        else:
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", e["valueFrom"]["fieldRef"]["fieldPath"]).group(1)
            env[e["name"]] = labels[label]
    # The Secret's mount path does not exist here: the same token file, in a temporary directory.
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789")
    env["GDSLOAD_TOKEN_FILE"] = str(token)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gdsload"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_ARGV"\n')
    fake.chmod(0o755)
    argv_file = tmp_path / "argv"
    env |= {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_ARGV": str(argv_file)}
    args = [expand(a, env) for a in c["args"]]
    out = subprocess.run([str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return argv_file.read_text().splitlines()


def test_single_node_sidecar_starts_with_the_rendered_arguments(tmp_path: Path):
    objs = overlay("sidecar")
    config = model_config(objs)
    pod = one(objs, "Deployment")["spec"]["template"]
    argv = _run_entrypoint(container(pod, "gdsload"), config, tmp_path, pod["metadata"]["labels"])
    assert argv == ["serve", config["MODEL_DIR"], "--tp", config["TP_SIZE"]]
    assert config["TP_SIZE"] == config["GPUS_PER_POD"]  # one node: the sidecar serves every rank


@pytest.mark.parametrize(("role", "index", "ranks"), [("leader", "0", "0-7"), ("worker", "1", "8-15")])
def test_each_node_sidecar_loads_its_own_ranks(tmp_path: Path, role: str, index: str, ranks: str):
    objs = overlay("multi-node")
    config = model_config(objs)
    pod = dict(pod_templates(objs))[f"LeaderWorkerSet/gdsload-inference/{role}"]
    labels = pod["metadata"]["labels"] | {"leaderworkerset.sigs.k8s.io/worker-index": index}
    argv = _run_entrypoint(container(pod, "gdsload"), config, tmp_path, labels)
    assert argv == ["serve", config["MODEL_DIR"], "--ranks", ranks]


def test_doctor_job_runs_doctor_with_the_sidecar_image_and_model_volume():
    job = one(_load_docs(K8S / "jobs" / "doctor.yaml"), "Job")
    pod = job["spec"]["template"]
    doctor = container(pod, "doctor")
    assert doctor["args"] == ["doctor", "/models"]  # the model volume is what the doctor checks
    sidecar_image = container(one(overlay("sidecar"), "Deployment")["spec"]["template"], "gdsload")["image"]
    assert doctor["image"] == sidecar_image
    assert [
        v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v
    ] == ["gdsload-models"]
    assert [c["name"] for c in doctor["resources"]["claims"]] == [pod["spec"]["resourceClaims"][0]["name"]]
