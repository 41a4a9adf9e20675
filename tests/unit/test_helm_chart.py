"""The Helm chart, verified without a cluster: renders for every ci/ scenario, lints strictly, rejects bad values by
schema, produces valid built-in objects (kubernetes-validate --strict) and valid custom resources (real CRD schemas,
unknown fields included), and its serveConfigV2 builds the real Serve application with the rendered settings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.helm import (CHART_DIR, CRD_DIR, CRD_FILES, REPO, ci_values_files, find, is_custom, lint_chart,
                                 load_values, render_chart, rendered_objects, validate_builtin,
                                 validate_custom_resource, validate_values)

SCENARIOS = ["default"] + [p.name.removesuffix("-values.yaml") for p in ci_values_files()]


def test_ci_scenarios_exist():
    assert {"minimal", "gpu-production", "external-redis", "autoscaling-off", "colocated"} <= set(SCENARIOS)


def test_chart_copies_and_schema_are_in_sync():
    """deploy/grafana (canonical) → files/grafana copies, service/config.py → values.schema.json `settings`."""
    proc = subprocess.run([sys.executable, str(REPO / "deploy/helm/sync_chart.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (CHART_DIR / "files/grafana/alerts.yaml").read_bytes() == (REPO / "deploy/grafana/alerts.yaml").read_bytes()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_strict(scenario):
    values = None if scenario == "default" else CHART_DIR / "ci" / f"{scenario}-values.yaml"
    report = lint_chart(values)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not problems, problems


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_builtin_kinds_are_valid(chart_renders, scenario):
    builtin = [o for o in chart_renders[scenario] if not is_custom(o)]
    assert builtin
    for obj in builtin:
        validate_builtin(obj)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_custom_resources_match_crds(chart_renders, scenario):
    custom = [o for o in chart_renders[scenario] if is_custom(o)]
    assert find(custom, "RayService")
    for obj in custom:
        validate_custom_resource(obj)


def test_every_kind_is_rendered_somewhere(chart_renders):
    kinds = {o["kind"] for objs in chart_renders.values() for o in objs}
    assert kinds >= {"RayService", "StatefulSet", "Service", "Secret", "Ingress", "ServiceMonitor", "PodMonitor",
                     "PrometheusRule", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount"}


def test_crd_check_catches_unknown_and_mistyped_fields(chart_renders):
    """The CRD validation is not vacuous: a misplaced field and a wrong type are caught."""
    rayservice = find(chart_renders["default"], "RayService")[0]
    bad = json.loads(json.dumps(rayservice))
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError, match="maxReplica"):
        validate_custom_resource(bad)
    bad = json.loads(json.dumps(rayservice))
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(AssertionError, match="resourcez"):
        validate_custom_resource(bad)
    bad = json.loads(json.dumps(rayservice))
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "one"
    with pytest.raises(Exception, match="one"):
        validate_custom_resource(bad)
    rule = find(chart_renders["default"], "PrometheusRule")[0]
    bad = json.loads(json.dumps(rule))
    bad["spec"]["groups"][0]["rules"][0]["severity"] = "warning"  # belongs under labels
    with pytest.raises(AssertionError, match="severity"):
        validate_custom_resource(bad)


def test_builtin_check_catches_unknown_fields(chart_renders):
    import kubernetes_validate

    sts = find(chart_renders["default"], "StatefulSet")[0]
    bad = json.loads(json.dumps(sts))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(bad)


@pytest.mark.parametrize("bad, message", [
    ({"settings": {"max_body_byte": 10}}, "max_body_byte"),                   # misspelled setting
    ({"settings": {"engine": "tensorrt"}}, "engine"),                         # not an engine
    ({"settings": {"gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
    ({"settings": {"min_replicas": 3}}, "min_replicas"),                      # chart-managed: use autoscaling.*
    ({"autoscaling": {"maxReplicas": 0}}, "maxReplicas"),
    ({"autoscaling": {"latencyDownscaleRatio": 2}}, "latencyDownscaleRatio"),
    ({"engine": {"gpusPerReplica": "one"}}, "gpusPerReplica"),
    ({"engine": {"replicasPerGpu": 0}}, "replicasPerGpu"),
    ({"redis": {"external": {"url": "http://not-redis"}}}, "url"),
    ({"ingress": {"enable": True}}, "enable"),                                # unknown key
    ({"upgradeStrategy": "Rolling"}, "upgradeStrategy"),
])
def test_schema_rejects_bad_values(bad, message):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match=message):
        validate_values(bad)


@pytest.mark.parametrize("path", ci_values_files(), ids=lambda p: p.name)
def test_schema_accepts_ci_values(path):
    validate_values(path)


def test_settings_schema_covers_every_setting():
    """Every setting (by its flat name) is either settable under `settings` or set by the chart (never silently
    unsettable); the test switches are never offered; older names are offered, marked deprecated, except those the
    chart sets itself from `autoscaling` and `engine`."""
    sys.path.insert(0, str(REPO / "deploy/helm"))
    from sync_chart import CHART_MANAGED_SETTINGS

    from service.config import LEGACY_MERGED, LEGACY_NAMES, flat_names

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    properties = schema["properties"]["settings"]["properties"]
    settable = {name for name, spec in properties.items() if not spec.get("deprecated")}
    product = {flat for flat, (path, _) in flat_names().items() if path[0] != "testing"}
    assert settable | CHART_MANAGED_SETTINGS == product
    assert not settable & CHART_MANAGED_SETTINGS
    older = {name for name, spec in properties.items() if spec.get("deprecated")}
    assert older <= set(LEGACY_NAMES) | set(LEGACY_MERGED)
    assert {"dtype", "kv_cache_memory_gb", "max_ongoing_requests", "vllm_extra_args"} <= older
    assert not older & {"min_replicas", "max_replicas", "engine_num_gpus", "engine_num_cpus"}


def _serve_config(objects: list[dict]) -> dict:
    return yaml.safe_load(find(objects, "RayService")[0]["spec"]["serveConfigV2"])


def test_serve_config_is_valid_for_ray_serve(chart_renders):
    from ray.serve.schema import ServeDeploySchema

    for scenario, objects in chart_renders.items():
        config = ServeDeploySchema.model_validate(_serve_config(objects))
        (app,) = config.applications
        assert app.import_path == "service.serve.app:app_builder", scenario
        assert config.proxy_location.value == "EveryNode"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_serve_config_builds_the_app(chart_renders, scenario, tmp_path, monkeypatch):
    """`import_path` + rendered `args` → Settings → build_app → the engine deployment carries the chart's knobs."""
    from ray.serve._private.build_app import build_app as serve_build_app

    from service.serve.app import COLOCATED_DEPLOYMENT, ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, app_builder

    for var in [v for v in __import__("os").environ if v.startswith("OCR_")]:
        monkeypatch.delenv(var)
    objects = chart_renders[scenario]
    args = dict(_serve_config(objects)["applications"][0]["args"])
    if "api_keys_file" in args:  # the Secret mount, simulated: the key file at the rendered path's name
        keys = tmp_path / Path(args["api_keys_file"]).name
        secret = find(objects, "Secret", "-api-keys")
        content = next(iter(secret[0]["stringData"].values())) if secret else "version: 1\nkeys: []\n"
        keys.write_text(content)
        args["api_keys_file"] = str(keys)
    built = serve_build_app(app_builder(args), name="ocr")
    deployments = {d.name: d for d in built.deployments}
    if args.get("serve_topology") == "colocated":  # one deployment answers HTTP and holds the engine
        assert set(deployments) == {COLOCATED_DEPLOYMENT}
        engine = deployments[COLOCATED_DEPLOYMENT]
    else:
        assert set(deployments) == {ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT}
        engine = deployments[ENGINE_DEPLOYMENT]

    rayservice = find(objects, "RayService")[0]
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(workers["rayStartParams"]["num-gpus"])
    values = load_values(None if scenario == "default" else CHART_DIR / "ci" / f"{scenario}-values.yaml")
    per_gpu = (values.get("engine") or {}).get("replicasPerGpu", 1)
    # a worker pod holds exactly per_gpu engine replicas: they take all its GPU and all the CPUs it advertises
    assert engine.ray_actor_options["num_gpus"] * per_gpu == pytest.approx(gpus)
    assert float(workers["rayStartParams"]["num-cpus"]) == engine.ray_actor_options["num_cpus"] * per_gpu
    if gpus:
        limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == gpus == 1
    autoscaling = engine._deployment_config.autoscaling_config
    if rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]:
        assert autoscaling is not None
        assert (autoscaling.min_replicas, autoscaling.max_replicas) == \
            (workers["minReplicas"] * per_gpu, workers["maxReplicas"] * per_gpu)
        if args.get("latency_target_ms"):
            assert autoscaling.policy.policy_function == "service.serve.autoscaling:QueueLatencyPolicy"
            assert autoscaling.policy.policy_kwargs["latency_target_ms"] == args["latency_target_ms"]
        else:
            assert autoscaling.policy.is_default_policy_function()
    else:
        assert autoscaling is None
        assert engine.num_replicas == workers["replicas"] * per_gpu
        assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"]


@pytest.mark.parametrize("values, message", [
    ({"engine": {"replicasPerGpu": 2}}, "kv_cache_memory_bytes"),
    ({"engine": {"replicasPerGpu": 2, "gpusPerReplica": 2}, "settings": {"kv_cache_memory_gb": 8}}, "gpusPerReplica=1"),
    ({"engine": {"replicasPerGpu": 2, "gpusPerReplica": 0}, "settings": {"engine": "embedded"}}, "engine=vllm"),
])
def test_engines_share_a_gpu_only_where_that_works(values, message):
    """Two vLLM engines per GPU need fixed KV caches (each would count the other's memory while sizing its own from
    gpu_memory_utilization) and exactly one GPU per pod; the embedded engine has no GPU to share."""
    with pytest.raises(Exception, match=message):
        render_chart(values)


def test_ingress_body_size_and_timeouts_follow_settings():
    objects = rendered_objects(render_chart(CHART_DIR / "ci" / "gpu-production-values.yaml"))
    ingress = find(objects, "Ingress")[0]
    args = _serve_config(objects)["applications"][0]["args"]
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == str(args["max_body_bytes"]) == "31457280"
    assert annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"] == str(args["request_timeout_s"])
    assert ingress["spec"]["tls"][0]["secretName"] == "ocr-example-com-tls"
    assert ingress["spec"]["ingressClassName"] == "nginx"
    rayservice = find(objects, "RayService")[0]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == \
        rayservice["spec"]["serveService"]["metadata"]["name"]


def test_gpu_workers_probes_draining_and_security(chart_renders):
    objects = chart_renders["gpu-production"]
    cluster = find(objects, "RayService")[0]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    workers = cluster["workerGroupSpecs"][0]
    pod = workers["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"  # merged with the default selector
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load + compile + CUDA graphs
    assert "ray drain-node" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert pod["terminationGracePeriodSeconds"] > 90
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] and mounts["adapters"]["readOnly"] and mounts["api-keys"]["readOnly"]
    args = _serve_config(objects)["applications"][0]["args"]
    assert args["model"] == "/models/HunyuanOCR-1.5" and args["adapters_dir"] == "/adapters"
    assert args["api_keys_file"].startswith(mounts["api-keys"]["mountPath"])


def test_redis_modes(chart_renders):
    def redis_env(objects):
        head = find(objects, "RayService")[0]["spec"]["rayClusterConfig"]["headGroupSpec"]
        return {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}.get("OCR_REDIS_URL")

    internal = chart_renders["default"]
    assert find(internal, "StatefulSet")[0]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]
    assert redis_env(internal)["value"] == "redis://ocr-ocr-service-redis:6379/0"
    external = chart_renders["external-redis"]
    assert not find(external, "StatefulSet")
    assert redis_env(external)["valueFrom"]["secretKeyRef"] == {"name": "ocr-redis", "key": "url"}
    from_values = chart_renders["autoscaling-off"]
    secret = find(from_values, "Secret", "-redis-url")[0]
    assert redis_env(from_values)["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert "redis_url" not in _serve_config(from_values)["applications"][0]["args"]  # never in the CR
    assert redis_env(chart_renders["minimal"]) is None


def test_serve_mode_and_front_end_are_set_on_every_ray_container():
    """Every Ray process reads the Serve mode and front-end variables when it starts: head and workers must agree.
    Where the front ends then run is checked against a real Ray cluster in tests/integration/test_helm_front_end.py."""
    def modes(objects):
        cluster = find(objects, "RayService")[0]["spec"]["rayClusterConfig"]
        pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"]
                                                                 for g in cluster["workerGroupSpecs"]]
        return [{e["name"]: e["value"] for e in pod["containers"][0]["env"] if e["name"].startswith("RAY_SERVE_")
                 and e["name"] != "RAY_SERVE_LOG_TO_STDERR"}  # logs.toStderr: test_logs_reach_stderr
                for pod in pods]

    from service.serve.edge import PROXY_CALLBACK_ENV
    from service.serve.local import SERVE_MODE_ENV

    # the default: the throughput-optimized mode as `ocr-serve serve` has it, with HAProxy as the front end, which
    # keeps Ray's hold on a stopping ingress replica (HAProxy is the balancer that hold is for); HAProxy runs through
    # the image's ocr-haproxy and Serve's HTTP servers call the edge's callback, as `ocr-serve serve` has them
    haproxy = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": SERVE_MODE_ENV["RAY_SERVE_THROUGHPUT_OPTIMIZED"],
               "RAY_SERVE_ENABLE_HA_PROXY": "1",
               # bodies and pages over gRPC's 4 MiB reach the replicas, in every mode and front end
               "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": SERVE_MODE_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"],
               "RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/venv/bin/ocr-haproxy", **PROXY_CALLBACK_ENV}
    assert modes(rendered_objects(render_chart())) == [haproxy] * 2
    # the proxy actor: `ocr-serve serve`'s variables, and direct ingress off so that the proxy runs on every pod
    assert modes(rendered_objects(render_chart({"rayServeHaProxy": False}))) == [
        {**SERVE_MODE_ENV, **PROXY_CALLBACK_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0",
         "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}] * 2
    assert modes(rendered_objects(render_chart({"rayServeHaProxy": False, "rayServeThroughputOptimized": False}))) \
        == [{**SERVE_MODE_ENV, **PROXY_CALLBACK_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0",
             "RAY_SERVE_ENABLE_HA_PROXY": "0"}] * 2
    assert modes(rendered_objects(render_chart({"rayServeThroughputOptimized": False}))) == [
        {**haproxy, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}] * 2  # HAProxy turns direct ingress on by itself


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_termination_grace_covers_the_drain(chart_renders, scenario):
    """The head pod holds the ingress replicas: its preStop drains them (graceful_shutdown_timeout_s, then 503s
    within CUT_WAIT_S, after joining the cluster) before `ray stop`, all inside the grace period. Engine pods are
    drained by Ray for engine.drainSeconds, which must leave their replicas the graceful timeout."""
    from service.serve.local import CUT_WAIT_S

    objects = chart_renders[scenario]
    cluster = find(objects, "RayService")[0]["spec"]["rayClusterConfig"]
    args = _serve_config(objects)["applications"][0]["args"]
    graceful = args.get("graceful_shutdown_timeout_s", 30)
    head = cluster["headGroupSpec"]["template"]["spec"]
    command = " ".join(head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
    drain = re.search(r"ocr-serve drain --timeout-s (\d+)", command)
    stop = re.search(r"ray stop --grace-period (\d+)", command)
    assert drain and stop and drain.start() < stop.start(), command
    assert int(drain.group(1)) == graceful
    join_s, spare_s = 10, 5
    assert head["terminationGracePeriodSeconds"] >= graceful + CUT_WAIT_S + join_s + int(stop.group(1)) + spare_s
    engine = cluster["workerGroupSpecs"][0]["template"]["spec"]
    engine_command = " ".join(engine["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
    drain_seconds = int(re.search(r"sleep (\d+)", engine_command).group(1))
    assert drain_seconds >= graceful + 10
    assert engine["terminationGracePeriodSeconds"] > drain_seconds


def test_drain_seconds_below_the_graceful_timeout_are_refused():
    with pytest.raises(Exception, match="drainSeconds"):
        render_chart({"engine": {"drainSeconds": 30}, "settings": {"graceful_shutdown_timeout_s": 60}})


def test_edge_limits_reach_the_edge_and_the_app():
    """The header cap and deadline are read by HAProxy / Serve's proxy from the environment and by the app from its
    args: both get the value from settings."""
    objects = rendered_objects(render_chart({"settings": {"max_header_bytes": 32768, "header_timeout_s": 7}}))
    cluster = find(objects, "RayService")[0]["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        env = {e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert env["OCR_MAX_HEADER_BYTES"] == "32768" and env["OCR_HEADER_TIMEOUT_S"] == "7"
    args = _serve_config(objects)["applications"][0]["args"]
    assert args["max_header_bytes"] == 32768 and args["header_timeout_s"] == 7


def test_monitoring_objects(chart_renders):
    from service.observability.metrics import METRIC_RELABEL_CONFIGS

    objects = chart_renders["gpu-production"]
    rule = find(objects, "PrometheusRule")[0]
    alerts = yaml.safe_load((REPO / "deploy/grafana/alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    dashboards = find(objects, "ConfigMap")
    assert sorted(next(iter(c["data"])) for c in dashboards) == \
        sorted(p.name for p in (REPO / "deploy/grafana/dashboards").glob("*.json"))
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        json.loads(next(iter(cm["data"].values())))
    camel = [{{"source_labels": "sourceLabels", "target_label": "targetLabel"}.get(k, k): v for k, v in r.items()}
             for r in METRIC_RELABEL_CONFIGS]
    pod_monitor = find(objects, "PodMonitor")[0]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["metricRelabelings"] == camel
    assert find(objects, "ServiceMonitor")[0]["spec"]["endpoints"][0]["metricRelabelings"] == camel
    # targets carry the release; the operator adds `namespace` (alerts and dashboards group by both)
    scope = [{"action": "replace", "targetLabel": "ocr_release", "replacement": "ocr"}]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] == scope
    assert find(objects, "ServiceMonitor")[0]["spec"]["endpoints"][0]["relabelings"] == scope


def test_dashboards_get_a_uid_and_title_per_release():
    """Two releases (or one name in two namespaces) ship dashboards that do not overwrite each other in Grafana."""
    def dashboards(name: str, namespace: str) -> dict[str, dict]:
        objects = rendered_objects(render_chart({"metrics": {"dashboards": {"enabled": True}}}, name=name,
                                                namespace=namespace))
        return {next(iter(cm["data"])): json.loads(next(iter(cm["data"].values())))
                for cm in find(objects, "ConfigMap") if cm["metadata"]["labels"].get("grafana_dashboard")}

    first, second, other_ns = dashboards("ocr", "team-a"), dashboards("ocr-canary", "team-a"), dashboards("ocr", "b")
    assert first.keys() == second.keys() == other_ns.keys() and len(first) == 4
    uids = [d["uid"] for d in (*first.values(), *second.values(), *other_ns.values())]
    assert len(set(uids)) == len(uids) and all(len(uid) <= 40 for uid in uids), uids
    canonical = json.loads((REPO / "deploy/grafana/dashboards/overview.json").read_text())
    assert first["overview.json"]["uid"].startswith(canonical["uid"] + "-")
    assert first["overview.json"]["title"] == canonical["title"] + " (team-a/ocr)"
    # only uid and title differ from the canonical file
    assert {k: v for k, v in first["overview.json"].items() if k not in ("uid", "title")} == \
        {k: v for k, v in canonical.items() if k not in ("uid", "title")}


def test_network_policy_limits_engine_egress(chart_renders):
    policy = find(chart_renders["default"], "NetworkPolicy", "-engine")[0]["spec"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    destinations = [to for rule in policy["egress"] for to in rule["to"]]
    assert all("ipBlock" not in d for d in destinations)  # no internet, no model hubs
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "ocr-service",
                                            "app.kubernetes.io/instance": "ocr"}}} in destinations
    # the Serve port from outside the release: the API side, and the KubeRay operator, which checks each pod's front end
    sources = [(source, [p["port"] for p in rule.get("ports", [])]) for rule in policy["ingress"]
               for source in rule["from"]]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}
    assert (operator, [8000]) in sources
    narrowed = find(rendered_objects(render_chart({"networkPolicy": {"apiNamespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}})), "NetworkPolicy", "-engine")[0]["spec"]
    assert (operator, [8000]) in [(source, [p["port"] for p in rule.get("ports", [])])
                                  for rule in narrowed["ingress"] for source in rule["from"]]


def test_names_come_from_the_release():
    one = rendered_objects(render_chart(name="alpha"))
    two = rendered_objects(render_chart(name="beta"))
    names_one = {(o["kind"], o["metadata"]["name"]) for o in one}
    names_two = {(o["kind"], o["metadata"]["name"]) for o in two}
    assert not names_one & names_two  # two releases can share a namespace


def test_the_vendored_crds_are_in_the_repository_with_their_source():
    """The chart is validated against CRDs inside the clone (nothing beside it), each named in the README with the
    project it comes from and its version."""
    assert CRD_DIR.resolve().is_relative_to(REPO.resolve())
    readme = (CRD_DIR / "README.md").read_text()
    for name in CRD_FILES.values():
        assert (CRD_DIR / name).is_file(), name
        row = next(line for line in readme.splitlines() if line.startswith(f"| {name} |"))
        assert any(project in row for project in ("ray-project/kuberay", "prometheus-operator/prometheus-operator",
                                                  "kubernetes-sigs/gateway-api")) and "commit" in row


def test_every_value_has_a_helm_docs_comment():
    """helm-docs: each value (or the map/list above it) carries a `# --` comment."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- "):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        comment = []
        while j >= 0 and lines[j].strip().startswith("#"):
            comment.append(lines[j].strip())
            j -= 1
        documented = any(c.startswith("# --") for c in comment)
        rest = [ln for ln in lines[i + 1:] if ln.strip() and not ln.strip().startswith("#")]
        has_children = bool(rest) and (len(rest[0]) - len(rest[0].lstrip())) > indent \
            and not rest[0].strip().startswith("- ") and stripped.endswith(":")
        if not documented and not any(d for _, d in stack) and not has_children:
            undocumented.append(stripped)
        stack.append((indent, documented))
    assert not undocumented, undocumented
