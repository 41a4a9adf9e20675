"""The chart's Ray environment must give every pod that holds replicas an HTTP front end on port 8000: the engine pods'
probes (/readyz on 8000) and KubeRay's Serve service go there. Ray decides where front ends run from environment
variables every Ray process reads, so this runs a real two-node Ray cluster (ray.cluster_utils, one host) under the
environment the rendered chart gives its worker pods, serves a deployment with a replica on each node, and counts
the nodes Serve put a front end on (a proxy actor, or with HAProxy an HAProxy manager)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import yaml

from loadtest.common import free_port
from tests.fixtures.helm import find, render_chart, rendered_objects

pytestmark = pytest.mark.ray

# Runs in a fresh process: Serve reads its mode when it is imported. argv: proxy location, HTTP port, and
# "healthy" to wait for every front end to report healthy too.
PROBE = r"""
import json, sys, time
import ray
from ray import serve
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
cluster.wait_for_nodes()

@serve.deployment(num_replicas=2, max_replicas_per_node=1, ray_actor_options={"num_cpus": 0.5})
class Echo:
    async def __call__(self, request):
        return "ok"

try:
    serve.start(proxy_location=sys.argv[1], http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
    serve.run(Echo.bind(), name="probe", route_prefix="/")  # returns once both replicas (one per node) run
    started = time.monotonic()
    while True:  # Serve's controller places front ends within a few of its loops once replicas run
        proxies = {node: str(status).rsplit(".", 1)[-1] for node, status in serve.status().proxies.items()}
        if len(proxies) == len(ray.nodes()) or time.monotonic() - started > 15:
            break
        time.sleep(0.5)
    placed_s = time.monotonic() - started
    while sys.argv[3] == "healthy" and any(s != "HEALTHY" for s in proxies.values()) and \
            time.monotonic() - started < 30:
        time.sleep(0.5)
        proxies = {node: str(status).rsplit(".", 1)[-1] for node, status in serve.status().proxies.items()}
    print("PROBE " + json.dumps({"nodes": len(ray.nodes()), "front_ends": proxies, "placed_s": placed_s}))
finally:  # no serve.shutdown(): its controller waits 30 s for the second HAProxy; the cluster's end stops all
    ray.shutdown()
    cluster.shutdown()
"""


def _chart_ray_env(values: dict) -> tuple[dict[str, str], str]:
    """The RAY_SERVE_* variables of the rendered chart's engine (worker) pods, and the Serve config's proxy location."""
    objects = rendered_objects(render_chart(values))
    service = find(objects, "RayService")[0]["spec"]
    worker = service["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in worker["env"] if e["name"].startswith("RAY_SERVE_")}
    head = service["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert env == {e["name"]: e["value"] for e in head["env"] if e["name"].startswith("RAY_SERVE_")}  # all agree
    return env, yaml.safe_load(service["serveConfigV2"])["proxy_location"]


def _front_ends(ray_env: dict[str, str], proxy_location: str, *, healthy: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env.update(ray_env)
    if "RAY_SERVE_HAPROXY_BINARY_PATH" in env:  # the image's ocr-haproxy: here, the same program through a shim
        from service.serve.local import haproxy_shim

        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = haproxy_shim()
    # HAProxy's stats and exporter ports are fixed (8404, 9101) unless named; free ones keep this test off them
    # and its files go to a short directory of this test (its admin socket's path must stay under 108 bytes)
    with tempfile.TemporaryDirectory(prefix="hap-", dir="/tmp") as files:
        env.update(RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()), RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()),
                   RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=f"{files}/haproxy.cfg",
                   RAY_SERVE_HAPROXY_SOCKET_PATH=f"{files}/admin.sock", RAY_USAGE_STATS_ENABLED="0")
        done = subprocess.run([sys.executable, "-c", PROBE, proxy_location, str(free_port()),
                               "healthy" if healthy else "placed"], env=env,
                              capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    return json.loads(lines[-1][len("PROBE "):])


@pytest.mark.parametrize("values, front_end", [({}, "haproxy"), ({"rayServeHaProxy": False}, "proxy actor")],
                         ids=["default_haproxy", "proxy_actor"])
def test_every_node_with_replicas_gets_a_front_end(values, front_end):
    ray_env, location = _chart_ray_env(values)
    assert ray_env.get("RAY_SERVE_ENABLE_HA_PROXY") == ("1" if front_end == "haproxy" else "0")
    probe = _front_ends(ray_env, location, healthy=front_end == "proxy actor")
    assert probe["nodes"] == 2 and len(probe["front_ends"]) == 2, probe
    if front_end == "proxy actor":
        # both proxy actors bind the one host's port (SO_REUSEPORT) and report healthy; two HAProxies cannot share
        # it on one host (on the cluster each pod has its own), so for them the placement is what is checked
        assert set(probe["front_ends"].values()) == {"HEALTHY"}, probe


def test_the_check_sees_a_head_only_front_end():
    """The environment the chart had before HAProxy became its default (the throughput-optimized mode alone, whose
    direct ingress makes Serve run its proxy on the head node only): one front end for two nodes with replicas. The
    engine pods' probes on port 8000 would have found nothing."""
    ray_env, location = _chart_ray_env({"rayServeHaProxy": False})
    ray_env = {k: v for k, v in ray_env.items() if k != "RAY_SERVE_ENABLE_DIRECT_INGRESS"}
    probe = _front_ends(ray_env, location)
    assert probe["nodes"] == 2 and len(probe["front_ends"]) == 1, probe
