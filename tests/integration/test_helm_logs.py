"""`kubectl logs` shows a container's stdout/stderr only. Under the environment the rendered chart gives its Ray
containers, a Serve replica's records (Serve's own and the service's `service.*` loggers, routed as every replica of
the app routes them) must reach the stderr of the process that started Ray, which in a pod is the container's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures.helm import find, render_chart, rendered_objects

pytestmark = pytest.mark.ray

PROBE = r"""
import logging
import ray
from ray import serve

# no log streaming to the driver: in a pod nothing streams worker output to `ray start`
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Echo:
    def __init__(self):
        from service.serve.replica_logs import route_to_replica_log
        route_to_replica_log("INFO")
        logging.getLogger("service.probe").warning("probe-marker from the replica")

    async def __call__(self, request):
        return "ok"

try:
    serve.run(Echo.bind(), name="probe", route_prefix=None)
finally:
    ray.shutdown()
"""


def _chart_log_env(values: dict) -> dict[str, str]:
    cluster = find(rendered_objects(render_chart(values)), "RayService")[0]["spec"]["rayClusterConfig"]
    env = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e and e["name"].startswith(("RAY_", "OCR_"))
            and "HAPROXY" not in e["name"] and "CALLBACK" not in e["name"]}


@pytest.mark.parametrize("to_stderr", [True, False], ids=["logs_to_stderr", "files_only"])
def test_replica_logs_reach_the_container_stderr(to_stderr):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(_chart_log_env({"logs": {"toStderr": to_stderr}}), RAY_SERVE_ENABLE_HA_PROXY="0",
               RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert ("probe-marker from the replica" in output) == to_stderr, output[-4000:]
