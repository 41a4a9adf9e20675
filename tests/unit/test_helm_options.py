"""The chart's options for a GPU cluster (issue 49 items 4-8), rendered with Helm's Go SDK and validated against
Kubernetes' schemas and the vendored CRDs: scheduling knobs, the weight download, logs on stderr, GCS fault
tolerance and incremental upgrades, the HTTPRoute, several Ingress hosts, NOTES and the generated README."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.helm import (CHART_DIR, REPO, find, is_custom, render_chart, rendered_objects, validate_builtin,
                                 validate_custom_resource, validate_values)

OPTIONS = CHART_DIR / "ci" / "cluster-options-values.yaml"


def _objects(values=None) -> list[dict]:
    objects = rendered_objects(render_chart(values))
    for obj in objects:  # every render here is checked like the ci scenarios
        (validate_custom_resource if is_custom(obj) else validate_builtin)(obj)
    return objects


def _cluster(objects: list[dict]) -> dict:
    return find(objects, "RayService")[0]["spec"]["rayClusterConfig"]


def _pods(objects: list[dict]) -> dict[str, dict]:
    cluster = _cluster(objects)
    return {"head": cluster["headGroupSpec"]["template"], "engine": cluster["workerGroupSpecs"][0]["template"]}


def _args(objects: list[dict]) -> dict:
    return yaml.safe_load(find(objects, "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]


@pytest.fixture(scope="module")
def options() -> list[dict]:
    return _objects(OPTIONS)


@pytest.fixture(scope="module")
def default() -> list[dict]:
    return _objects()


# --- 4. scheduling and extension knobs ------------------------------------------------------------------------------

def test_engine_pods_spread_over_nodes_by_default(default):
    engine = _pods(default)["engine"]
    (constraint,) = engine["spec"]["topologySpreadConstraints"]
    assert constraint["topologyKey"] == "kubernetes.io/hostname" and constraint["whenUnsatisfiable"] == "ScheduleAnyway"
    selector = constraint["labelSelector"]["matchLabels"]
    assert selector.items() <= engine["metadata"]["labels"].items()  # it counts exactly the engine pods
    assert selector["app.kubernetes.io/component"] == "engine"
    assert "max_replicas_per_node" not in _args(default)["engine_deployment"]


def test_scheduling_knobs_reach_the_pods(options):
    pods = _pods(options)
    engine, head = pods["engine"], pods["head"]
    assert (engine["spec"]["priorityClassName"], engine["spec"]["runtimeClassName"]) == ("gpu-serving", "nvidia")
    assert head["spec"]["priorityClassName"] == "ocr-control" and "runtimeClassName" not in head["spec"]
    assert engine["spec"]["schedulerName"] == head["spec"]["schedulerName"] == "volcano"
    zone, host = engine["spec"]["topologySpreadConstraints"]
    assert (zone["topologyKey"], zone["whenUnsatisfiable"]) == ("topology.kubernetes.io/zone", "DoNotSchedule")
    assert zone["labelSelector"]["matchLabels"].items() <= engine["metadata"]["labels"].items()
    assert host["topologyKey"] == "kubernetes.io/hostname"
    assert _args(options)["engine_deployment"]["max_replicas_per_node"] == 1
    redis_pod = find(options, "StatefulSet")[0]["spec"]["template"]
    for pod in (engine, head, redis_pod):
        assert pod["metadata"]["labels"]["team"] == "document-ai"


def test_max_replicas_per_node_builds_into_serve():
    from ray.serve._private.build_app import build_app as serve_build_app

    from service.serve.app import ENGINE_DEPLOYMENT, app_builder

    objects = _objects({"apiKeys": {"enabled": False}, "engine": {"maxReplicasPerNode": 2, "replicasPerGpu": 2},
                        "settings": {"engine_kwargs": {"kv_cache_memory_bytes": 4 << 30}}})
    built = serve_build_app(app_builder(_args(objects)), name="ocr")
    engine = next(d for d in built.deployments if d.name == ENGINE_DEPLOYMENT)
    assert engine._replica_config.max_replicas_per_node == 2
    with pytest.raises(Exception, match="maxReplicasPerNode"):
        render_chart({"engine": {"maxReplicasPerNode": 1, "replicasPerGpu": 2},
                      "settings": {"engine_kwargs": {"kv_cache_memory_bytes": 4 << 30}}})


def test_extra_volumes_mounts_containers_and_env(options):
    for name, pod in _pods(options).items():
        spec = pod["spec"]
        ray, *sidecars = spec["containers"]
        assert [c["name"] for c in sidecars] == ["log-shipper"], name
        assert {"name": "ca-bundle", "configMap": {"name": "corporate-ca"}} in spec["volumes"]
        assert {"name": "ca-bundle", "mountPath": "/etc/ssl/corporate", "readOnly": True} in ray["volumeMounts"]
        assert {"name": "VLLM_LOGGING_LEVEL", "value": "WARNING"} in ray["env"]


def test_redis_pod_pull_secrets_and_annotations(options):
    pod = find(options, "StatefulSet")[0]["spec"]["template"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "dockerhub-mirror"}]
    assert pod["metadata"]["annotations"] == {"backup.velero.io/backup-volumes": "data"}
    fallback = find(_objects({"imagePullSecrets": [{"name": "registry-pull"}]}), "StatefulSet")[0]
    assert fallback["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry-pull"}]


def test_monitor_scrape_timeout_and_relabelings(options):
    pod_endpoint = find(options, "PodMonitor")[0]["spec"]["podMetricsEndpoints"][0]
    service_endpoint = find(options, "ServiceMonitor")[0]["spec"]["endpoints"][0]
    assert (pod_endpoint["interval"], pod_endpoint["scrapeTimeout"]) == ("30s", "20s")
    assert service_endpoint["scrapeTimeout"] == "10s"
    for endpoint in (pod_endpoint, service_endpoint):  # the chart's release label first, the values' rules after it
        assert endpoint["relabelings"][0]["targetLabel"] == "ocr_release"
        assert endpoint["relabelings"][-1] == {"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                               "targetLabel": "node"}
    # the chart's renames come first, the values' rules after them
    assert pod_endpoint["metricRelabelings"][-1] == {"sourceLabels": ["__name__"], "regex": "ray_node_network_.+",
                                                     "action": "drop"}
    assert pod_endpoint["metricRelabelings"][0]["regex"] == "ray_(ocr_.+)"


@pytest.mark.parametrize("bad, message", [
    ({"engine": {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway"}]}},
     "topologyKey"),
    ({"engine": {"priorityClassName": "GPU Serving"}}, "priorityClassName"),
    ({"engine": {"maxReplicasPerNode": 0}}, "maxReplicasPerNode"),
    ({"metrics": {"podMonitor": {"scrapeTimeout": "10"}}}, "scrapeTimeout"),
    ({"extraVolumeMounts": [{"name": "x"}]}, "mountPath"),
    ({"redis": {"podAnnotation": {}}}, "podAnnotation"),
    ({"logs": {"toStdout": True}}, "toStdout"),
    ({"model": {"download": {"enabled": True, "repo": "no-owner"}}}, "repo"),
    ({"model": {"pvc": {"accessMode": "ReadOnlyMany"}}}, "accessMode"),
    ({"upgradeStrategy": "Incremental"}, "upgradeStrategy"),
    ({"gcsFaultTolerance": {"redisAddress": "redis://r:6379"}}, "redisAddress"),
    ({"ingress": {"host": "ocr.example.com"}}, "host"),
    ({"ingress": {"hosts": [{"host": "a.example.com", "paths": [{"path": "v1"}]}]}}, "path"),
    ({"httpRoute": {"paths": []}}, "paths"),
])
def test_schema_refuses_bad_option_values(bad, message):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match=message):
        validate_values(bad)


# --- 5. model weights downloaded into a chart-made PVC ----------------------------------------------------------------

def test_offline_volume_stays_the_default(default):
    engine = _pods(default)["engine"]["spec"]
    assert "initContainers" not in engine and not find(default, "PersistentVolumeClaim")
    model = next(v for v in engine["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "hunyuan-ocr-weights", "readOnly": True}
    egress_ports = [p["port"] for rule in find(default, "NetworkPolicy", "-engine")[0]["spec"]["egress"]
                    for p in rule.get("ports", [])]
    assert 443 not in egress_ports


def test_download_fills_a_chart_made_claim(options):
    (claim,) = find(options, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "ocr-ocr-service-model"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs-client",
                             "resources": {"requests": {"storage": "10Gi"}}}
    engine = _pods(options)["engine"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "ocr-ocr-service-model"}} in engine["volumes"]
    (download,) = engine["initContainers"]
    assert download["name"] == "model-download"
    env = {e["name"]: e for e in download["env"]}
    assert env["MODEL_REPO"]["value"] == "tencent/HunyuanOCR" and env["MODEL_DIR"]["value"] == "/models/HunyuanOCR"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert {"name": "model", "mountPath": "/models"} in download["volumeMounts"]  # writable here only
    ray = engine["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in ray["volumeMounts"]
    assert _args(options)["model"] == "/models/HunyuanOCR"
    egress = find(options, "NetworkPolicy", "-engine")[0]["spec"]["egress"]
    assert {"ports": [{"port": 443, "protocol": "TCP"}]} in egress


def test_download_path_must_be_on_the_claim():
    with pytest.raises(Exception, match="model.path inside model.mountPath"):
        render_chart({"model": {"path": "/weights/x", "download": {"enabled": True}}})


def _download_script(tmp_path: Path, python_body: str) -> tuple[Path, dict]:
    """The rendered init container's script, with `python` on PATH replaced by a stub (no network here)."""
    engine = _pods(rendered_objects(render_chart(OPTIONS)))["engine"]["spec"]
    (container,) = engine["initContainers"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    stub = bin_dir / "python"
    stub.write_text("#!/bin/sh\n" + python_body)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {e["name"]: e.get("value", "") for e in container["env"] if "value" in e}
    env.update(MODEL_DIR=str(tmp_path / "models" / "HunyuanOCR"), PATH=f"{bin_dir}:{os.environ['PATH']}",
               CALLS=str(tmp_path / "calls"))
    return Path(container["command"][0]), {"script": container["command"][-1], "env": env}


def _run_download(shell: Path, job: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(shell), "-c", job["script"]], env=job["env"], capture_output=True, text=True,
                          timeout=30)


def test_download_runs_once_and_resumes_after_a_failure(tmp_path):
    fetch = 'echo fetch >> "$CALLS"; echo weights > "$MODEL_DIR/model.safetensors"\n'
    shell, job = _download_script(tmp_path, fetch)
    marker = Path(job["env"]["MODEL_DIR"]) / ".ocr-download-complete"
    wanted = f"{job['env']['MODEL_REPO']}@{job['env']['MODEL_REVISION']}"

    first = _run_download(shell, job)
    assert first.returncode == 0, first.stderr
    assert marker.read_text() == wanted and (tmp_path / "calls").read_text() == "fetch\n"
    again = _run_download(shell, job)  # a second engine pod, a restart: the weights are there
    assert again.returncode == 0 and "already in" in again.stdout
    assert (tmp_path / "calls").read_text() == "fetch\n"

    job["env"]["MODEL_REVISION"] = "fedcba9876543210fedcba9876543210fedcba98"  # a new revision is fetched
    assert _run_download(shell, job).returncode == 0
    assert (tmp_path / "calls").read_text() == "fetch\nfetch\n"

    shell, failing = _download_script(tmp_path / "f", 'echo fetch >> "$CALLS"; exit 3\n')
    broken = _run_download(shell, failing)  # the pod's init container fails and is retried; no marker meanwhile
    assert broken.returncode != 0 and not (Path(failing["env"]["MODEL_DIR"]) / ".ocr-download-complete").exists()


# --- 6. logs on the container's stderr ------------------------------------------------------------------------------

def test_logs_reach_stderr(default):
    for name, pod in _pods(default).items():
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["RAY_LOG_TO_STDERR"] == "1" and env["RAY_SERVE_LOG_TO_STDERR"] == "1", name
    for name, pod in _pods(_objects({"logs": {"toStderr": False}})).items():
        env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
        assert not env & {"RAY_LOG_TO_STDERR", "RAY_SERVE_LOG_TO_STDERR"}, name


# --- 7. Redis policy, GCS fault tolerance, incremental upgrades -------------------------------------------------------

def test_chart_redis_never_evicts(default):
    args = find(default, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_gcs_fault_tolerance(options):
    assert "gcsFaultToleranceOptions" not in _cluster(_objects())
    gcs = _cluster(options)["gcsFaultToleranceOptions"]
    assert gcs == {"redisAddress": "ocr-ocr-service-redis:6379", "externalStorageNamespace": "ocr-prod"}
    external = _cluster(_objects({"gcsFaultTolerance": {"enabled": True, "redisAddress": "gcs-redis.db:6379",
                                                        "redisPasswordSecret": {"name": "gcs-redis"}}}))
    assert external["gcsFaultToleranceOptions"] == {
        "redisAddress": "gcs-redis.db:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "gcs-redis", "key": "password"}}}}
    with pytest.raises(Exception, match="gcsFaultTolerance"):
        render_chart({"gcsFaultTolerance": {"enabled": True}, "redis": {"enabled": False}})


def test_incremental_upgrade(options):
    strategy = find(options, "RayService")[0]["spec"]["upgradeStrategy"]
    assert strategy == {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {
        "gatewayClassName": "istio", "stepSizePercent": 20, "intervalSeconds": 120, "maxSurgePercent": 50}}
    assert find(_objects(), "RayService")[0]["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    with pytest.raises(Exception, match="gatewayClassName"):
        render_chart({"upgradeStrategy": "NewClusterWithIncrementalUpgrade"})


# --- 8. HTTPRoute, Ingress hosts, NOTES, README ------------------------------------------------------------------------

def test_http_route(options):
    (route,) = find(options, "HTTPRoute")
    spec = route["spec"]
    assert spec["parentRefs"] == [{"name": "public-gateway", "namespace": "gateway-system", "sectionName": "https"}]
    assert spec["hostnames"] == ["ocr.internal.example.com"]
    (rule,) = spec["rules"]
    serve = find(options, "RayService")[0]["spec"]["serveService"]["metadata"]["name"]
    assert rule["backendRefs"] == [{"name": serve, "port": 8000}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"]["request"] == f"{_args(options).get('request_timeout_s', 300) + 10}s"
    assert not find(_objects(), "HTTPRoute")


def test_ingress_serves_several_hosts_and_paths(options):
    spec = find(options, "Ingress")[0]["spec"]
    rules = {r["host"]: [(p["path"], p["pathType"]) for p in r["http"]["paths"]] for r in spec["rules"]}
    assert rules == {"ocr.example.com": [("/", "Prefix")],
                     "api.example.com": [("/v1", "Prefix"), ("/readyz", "Exact")]}
    assert spec["tls"] == [{"hosts": ["ocr.example.com", "api.example.com"], "secretName": "ocr-example-com-tls"}]


def _notes(values=None) -> str:
    return next(text for path, text in render_chart(values).items() if path.endswith("NOTES.txt"))


def test_notes_say_where_state_and_logs_are():
    default = _notes()
    assert "kept in the release's Redis (ocr-ocr-service-redis, noeviction" in default
    assert "kubectl -n ocr-prod logs" in default
    no_redis = _notes(CHART_DIR / "ci" / "minimal-values.yaml")
    assert "none Redis" not in no_redis and "per ingress replica, in memory" in no_redis
    external = _notes(CHART_DIR / "ci" / "external-redis-values.yaml")
    assert "kept in the external Redis (Secret ocr-redis)" in external
    options = _notes(OPTIONS)
    assert "curl -s https://api.example.com/v1/readyz" in options
    assert "downloaded from tencent/HunyuanOCR@0123456789abcdef" in options
    assert "WARNING: the Ingress has no TLS" not in options
    assert "WARNING: the Ingress has no TLS" in _notes({"ingress": {"enabled": True}})


def test_chart_readme_is_generated_from_the_values_comments(tmp_path, monkeypatch):
    import helm_python as helm

    sys.path.insert(0, str(REPO / "deploy/helm"))
    import sync_chart

    shown = helm.show(str(CHART_DIR), output_format="readme")
    assert shown.strip() and shown.strip() == (CHART_DIR / "README.md").read_text().strip()
    documented = [key for key, _, _ in sync_chart.values_docs()]
    for key in ("engine.topologySpreadConstraints", "model.download.repo", "logs.toStderr", "httpRoute.parentRefs",
                "gcsFaultTolerance.redisAddress", "metrics.podMonitor.scrapeTimeout", "settings.max_body_bytes"):
        assert key in documented and f"| `{key}` |" in shown, key
    # a changed comment makes the README stale (sync_chart.py --check, test_chart_copies_and_schema_are_in_sync)
    values = tmp_path / "values.yaml"
    values.write_text((CHART_DIR / "values.yaml").read_text().replace(
        "# -- Image pull policy.", "# -- How the kubelet pulls the image."))
    monkeypatch.setattr(sync_chart, "VALUES", values)
    assert "How the kubelet pulls the image." in sync_chart.wanted_readme() != (CHART_DIR / "README.md").read_text()


def test_repo_readme_install_names_the_three_prerequisites():
    text = (REPO / "README.md").read_text()
    install = text[text.index("helm install ocr deploy/helm/ocr-service"):]
    install = install[:install.index("\n- ")]
    for needed in ("image.repository", "model.", "apiKeys.existingSecret"):
        assert needed in install, needed
