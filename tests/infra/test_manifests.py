"""infra/: what can be checked without a Kubernetes cluster or other machines.

Every manifest parses; every ``python -m jobs.X ...`` entrypoint names a module whose own parser accepts the
arguments; every Serve import path resolves and its ``args`` are valid ServeSettings; the RayService's serve
config is infra/serve.yaml up to the listed cluster settings; the launcher installs specray with the README's line.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

from jobs.common import UsageError
from serving.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
MANIFESTS = sorted(p for p in INFRA.rglob("*.yaml"))
# the RayService's serve config differs from infra/serve.yaml in these settings only (see rayservice.yaml's header)
CLUSTER_OVERRIDES = {("http_options", "host"): "0.0.0.0", ("applications", 0, "args", "model_num_gpus"): 1}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kube(kind: str) -> list[dict]:
    return [d for p in (INFRA / "kuberay").glob("*.yaml") for d in docs(p) if d.get("kind") == kind]


def walk(node, path=()):
    """(path, value) of every leaf."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, (*path, i))
    else:
        yield path, node


def serve_configs() -> list[tuple[str, dict]]:
    out = [("infra/serve.yaml", docs(INFRA / "serve.yaml")[0])]
    out += [(f"RayService {s['metadata']['name']}", yaml.safe_load(s["spec"]["serveConfigV2"])) for s in kube("RayService")]
    return out


def entrypoints() -> list[str]:
    return [j["spec"]["entrypoint"] for j in kube("RayJob")]


def readme_install_line() -> str:
    """The install part of the README's one-line set-up (`pip install ... && specray pipeline`)."""
    lines = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip().endswith("&& specray pipeline")]
    assert len(lines) == 1, lines
    return lines[0].removesuffix("&& specray pipeline").strip().removesuffix("&&").strip()


def test_there_is_everything_the_issue_asks_for():
    kinds = {d.get("kind") for p in (INFRA / "kuberay").glob("*.yaml") for d in docs(p)}
    assert {"RayCluster", "RayJob", "RayService", "Deployment", "Service"} <= kinds
    assert docs(INFRA / "cluster.yaml")[0]["provider"]["type"] == "local"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_manifest_parses(path):
    parsed = docs(path)
    assert parsed and all(isinstance(d, dict) for d in parsed)
    for d in parsed:
        if "kind" in d:  # Kubernetes objects
            assert d.get("apiVersion") and d.get("metadata", {}).get("name"), f"{path.name}: {d.get('kind')} lacks apiVersion/name"


def test_launcher_has_head_and_workers():
    cfg = docs(INFRA / "cluster.yaml")[0]
    ips = [cfg["provider"]["head_ip"], *cfg["provider"]["worker_ips"]]
    assert all(re.fullmatch(r"[\w.-]+", ip) for ip in ips) and len(set(ips)) == len(ips) >= 2
    assert cfg["max_workers"] >= len(cfg["provider"]["worker_ips"])
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])
    assert cfg["file_mounts"] == {"~/specray": "."}


def test_launcher_setup_is_the_readme_install_line():
    cfg = docs(INFRA / "cluster.yaml")[0]
    (cmd,) = cfg["setup_commands"]
    assert cmd.startswith("cd ~/specray && ")
    assert cmd.removeprefix("cd ~/specray && ") == readme_install_line()
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert f"RUN {readme_install_line()}\n" in dockerfile  # the KubeRay image installs the same way


@pytest.mark.parametrize("entrypoint", entrypoints())
def test_job_entrypoint_exists_and_parses(entrypoint):
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["python", "-m"], entrypoint
    module = importlib.import_module(argv[2])
    try:
        module.build_parser().parse_args(argv[3:])
    except (SystemExit, UsageError) as e:
        pytest.fail(f"{argv[2]} rejects {argv[3:]}: {e}")


def test_job_entrypoint_check_can_fail():
    module = importlib.import_module("jobs.tune")
    with pytest.raises((SystemExit, UsageError)):
        module.build_parser().parse_args(["--no-such-flag"])


@pytest.mark.parametrize("name,config", serve_configs(), ids=lambda x: x if isinstance(x, str) else "")
def test_serve_import_paths_resolve_and_args_are_settings(name, config):
    for app in config["applications"]:
        module, _, attr = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), f"{name}: {app['import_path']}"
        ServeSettings.from_dict(app.get("args"))  # raises ConfigError naming a bad field


def test_rayservice_serves_infra_serve_yaml():
    serve = docs(INFRA / "serve.yaml")[0]
    (service,) = kube("RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ours, theirs = dict(walk(serve)), dict(walk(config))
    differ = {p for p in set(ours) | set(theirs) if ours.get(p, "<absent>") != theirs.get(p, "<absent>")}
    assert differ == set(CLUSTER_OVERRIDES), f"RayService serve config drifted from infra/serve.yaml at {sorted(map(str, differ))}"
    assert {p: theirs[p] for p in differ} == CLUSTER_OVERRIDES


def test_redis_backs_the_registry_and_gcs_fault_tolerance():
    (redis_svc,) = [d for d in docs(INFRA / "kuberay" / "redis.yaml") if d["kind"] == "Service"]
    host = f"{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}"
    clusters = [*kube("RayCluster"), *[{"spec": s["spec"]["rayClusterConfig"]} for s in kube("RayService")]]
    assert len(clusters) == 2
    for c in clusters:
        spec = c["spec"]
        assert spec["gcsFaultToleranceOptions"]["redisAddress"] == f"redis://{host}"
        assert spec["authOptions"] == {"mode": "token"}
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for g in groups:
            (container,) = g["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["SPECRAY_REDIS_URL"].endswith(f"@{host}/1"), env
        gpus = [g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for g in spec["workerGroupSpecs"]]
        assert spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") is None
        assert any(gpus), "a GPU worker group"


def test_rayjobs_target_the_raycluster():
    (cluster,) = kube("RayCluster")
    for job in kube("RayJob"):
        assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
