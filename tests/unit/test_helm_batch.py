"""The chart's optional batch RayJob: rendered only when enabled, valid against KubeRay's RayJob CRD, its entrypoint
an `ocr-serve batch` command line the CLI accepts, the chart's settings reaching the driver as the same Settings, and
the store credentials taken from the Secret on every pod."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from tests.fixtures.helm import CHART_DIR, find, render_chart, rendered_objects, validate_custom_resource, \
    validate_values

BATCH_VALUES = CHART_DIR / "ci" / "batch-values.yaml"


@pytest.fixture(scope="module")
def rayjob() -> dict:
    jobs = find(rendered_objects(render_chart(BATCH_VALUES)), "RayJob")
    assert len(jobs) == 1
    return jobs[0]


def containers(job: dict) -> dict[str, dict]:
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    return {"head": head, "worker": worker}


def test_no_rayjob_unless_enabled(chart_renders):
    assert {name for name, objects in chart_renders.items() if find(objects, "RayJob")} == {"batch"}


def test_rayjob_matches_the_crd(rayjob):
    validate_custom_resource(rayjob)
    bad = json.loads(json.dumps(rayjob))
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(AssertionError, match="replica"):
        validate_custom_resource(bad)


def test_entrypoint_is_a_batch_command_the_cli_accepts(rayjob):
    from service.cli.main import build_parser

    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:2] == ["ocr-serve", "batch"]
    args = build_parser().parse_args(argv[1:])
    assert args.inputs == ["s3://scans/archive/**/*.pdf", "@s3://scans/lists/extra.txt"]
    assert (args.out, args.address, args.task, args.format, args.markdown, args.commit_every) == (
        "s3://ocr-results/archive-2026", "auto", "document", "parquet", True, 512)
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True and rayjob["spec"]["backoffLimit"] == 2
    assert rayjob["spec"]["activeDeadlineSeconds"] == 172800


def test_settings_reach_the_driver_and_credentials_every_pod(rayjob, monkeypatch):
    from service.config import Settings

    pods = containers(rayjob)
    for container in pods.values():
        assert container["envFrom"] == [{"secretRef": {"name": "batch-s3-credentials"}}]
        assert not any("AWS_" in e["name"] for e in container["env"])  # no credential in the object itself
    assert pods["worker"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 2
    env = {e["name"]: e["value"] for e in pods["head"]["env"] if "value" in e}
    for name in [n for n in os.environ if n.startswith("OCR_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("OCR_"):
            monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.engine.kind == "vllm" and str(settings.engine.model) == "/models/hunyuan-ocr"
    assert settings.engine.max_output_tokens == 1024
    assert settings.engine.vllm.engine_kwargs["max_num_seqs"] == 128
    mounts = {m["name"] for m in pods["worker"]["volumeMounts"]} & {m["name"] for m in pods["head"]["volumeMounts"]}
    assert "model" in mounts


@pytest.mark.parametrize("bad, message", [
    ({"batch": {"enabled": True, "output": "s3://b/o"}}, "batch.inputs"),
    ({"batch": {"enabled": True, "inputs": ["s3://b/i"]}}, "batch.output"),
])
def test_enabled_without_inputs_or_output_fails_to_render(bad, message):
    with pytest.raises(Exception, match=message):
        render_chart(bad)


@pytest.mark.parametrize("bad", [{"batch": {"format": "csv"}}, {"batch": {"workers": 0}},
                                 {"batch": {"inputz": []}}, {"batch": {"task": "poetry"}}])
def test_schema_rejects_bad_batch_values(bad):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError):
        validate_values(bad)
