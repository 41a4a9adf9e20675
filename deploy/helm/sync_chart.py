"""Keep the Helm chart in step with its two sources outside the chart directory (Helm cannot read files there).

1. Alert rules and Grafana dashboards: deploy/grafana/ is canonical (the metrics work owns it); copies live in
   deploy/helm/ocr-service/files/grafana/ for `.Files` (PrometheusRule, dashboard ConfigMaps).
2. `values.schema.json` → `properties.settings`: generated from service/config.py (every setting by its flat name,
   older names marked deprecated), so `helm install` rejects a misspelled or mistyped setting before Serve ever sees
   it. Settings the chart sets itself are left out; `testing` is never offered.
3. The chart's README.md (what `helm show readme` prints): its values table is generated from the `# --` comments of
   values.yaml (helm-docs' convention), under a fixed introduction.

    python deploy/helm/sync_chart.py           # rewrite the copies and the schema
    python deploy/helm/sync_chart.py --check   # exit 1 and list what is stale (tests/test_helm_chart.py runs this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "ocr-service"
GRAFANA = REPO / "deploy" / "grafana"
SCHEMA = CHART / "values.schema.json"
VALUES = CHART / "values.yaml"
README = CHART / "README.md"

# Settings the chart derives from its own values (model, adapters, apiKeys, redis, autoscaling.latency*); the engine
# deployment's replicas and resources come from `autoscaling` and `engine` (merged into `engine_deployment`)
CHART_MANAGED_SETTINGS = frozenset({"host", "port", "model", "adapters_dir", "api_keys_file", "redis_url",
                                    "latency_target_ms", "latency_downscale_ratio"})


def grafana_copies() -> dict[Path, bytes]:
    """Chart path → wanted content of every synced Grafana file."""
    wanted: dict[Path, bytes] = {}
    alerts = GRAFANA / "alerts.yaml"
    if alerts.exists():
        wanted[CHART / "files" / "grafana" / "alerts.yaml"] = alerts.read_bytes()
    for dashboard in sorted((GRAFANA / "dashboards").glob("*.json")):
        wanted[CHART / "files" / "grafana" / "dashboards" / dashboard.name] = dashboard.read_bytes()
    return wanted


def _clean(node):
    """Pydantic's JSON Schema without titles and formats Helm's validator does not know (`path`, `password`)."""
    if isinstance(node, dict):
        return {k: _clean(v) for k, v in node.items()
                if k not in ("title", "writeOnly") and not (k == "format" and v in ("path", "password"))}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def settings_schema() -> dict:
    """Every setting by its flat name with its field's JSON Schema, and the older names (deprecated)."""
    sys.path.insert(0, str(REPO))
    from service.config import LEGACY_MERGED, LEGACY_NAMES, Settings, flat_names

    full = Settings.model_json_schema(by_alias=True)
    defs = full.get("$defs", {})

    def section_schema(path: tuple[str, ...]) -> dict:
        node = full
        for key in path:
            prop = node["properties"][key]
            ref = prop.get("$ref") or next((item["$ref"] for item in prop.get("allOf", []) if "$ref" in item), None)
            node = defs[ref.rsplit("/", 1)[1]]
        return node

    props: dict = {}
    for flat, (path, info) in flat_names().items():
        if path[0] == "testing" or flat in CHART_MANAGED_SETTINGS:
            continue
        leaf = section_schema(path[:-1])["properties"][info.alias or path[-1]]
        props[flat] = _inline(leaf, defs)
    for name, (path, _, schema) in LEGACY_NAMES.items():
        if path[:3] == ("serve", "engine_deployment", "autoscaling_config") or path[-1] in ("num_gpus", "num_cpus") \
                and path[1] == "engine_deployment":
            continue  # the chart sets these from `autoscaling` and `engine`
        props[name] = {**schema, "deprecated": True,
                       "description": f"Older name of `{'.'.join(path)}` (docs/CONFIG.md)."}
    for name, path in LEGACY_MERGED.items():
        props[name] = {"type": "object", "deprecated": True,
                       "description": f"Older name: merged into `{'.'.join(path)}` (docs/CONFIG.md)."}
    return {
        "type": "object",
        "description": "Service settings by flat name (docs/CONFIG.md), passed as the Serve application's args.",
        "additionalProperties": False,
        "properties": {name: _clean(spec) for name, spec in props.items()},
    }


def _inline(node, defs: dict):
    """A field's schema with its `$ref`s to leaf types (enums, SecretStr) replaced by their definitions."""
    if isinstance(node, dict):
        if "$ref" in node and len(node) == 1:
            return _inline(defs[node["$ref"].rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def wanted_schema() -> str:
    schema = json.loads(SCHEMA.read_text())
    schema["properties"]["settings"] = settings_schema()
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


README_INTRO = """\
# ocr-service

Horizontally scalable OCR API: HunyuanOCR on vLLM inside Ray Serve, installed as one KubeRay **RayService** (a CPU
head pod with the API's ingress replicas, a GPU worker group with one engine replica and one GPU per pod), with Redis
rate limiting, autoscaling on queue depth and latency, a PodMonitor, alert rules and Grafana dashboards.

This file is generated by `python deploy/helm/sync_chart.py` from the `# --` comments of values.yaml; edit those.
The full guide is docs/DEPLOY.md of the repository.

## Prerequisites

- The KubeRay operator (>= 1.4; `ray.io/v1` RayService), and the Prometheus operator for the monitoring objects
  (or `metrics.podMonitor.enabled=false metrics.prometheusRule.enabled=false`).
- Three things the chart does not make:
  1. **the image**, built from the repository's Dockerfile (`--target gpu`) and pushed to your registry
     (`image.repository`, `image.tag`);
  2. **the model weights**, on a volume (`model.volume`, e.g. a ReadOnlyMany PVC) or downloaded once by the chart
     (`model.download.enabled=true`);
  3. **the API-key Secret**, made from a hashed key file (`ocr-serve keys add --file keys.yaml --tenant acme`, then
     `kubectl create secret generic ocr-api-keys --from-file=keys.yaml=keys.yaml`; `apiKeys.existingSecret`).

## Install

    helm install ocr deploy/helm/ocr-service -n ocr \\
      --set image.repository=REGISTRY/ocr-service --set image.tag=0.1.0-gpu \\
      --set model.volume.persistentVolumeClaim.claimName=hunyuan-ocr-weights \\
      --set apiKeys.existingSecret=ocr-api-keys

`ci/*-values.yaml` hold other scenarios (CPU-only, external Redis, fixed replicas, two engines per GPU).

## Values

| Key | Type | Default | Description |
|-----|------|---------|-------------|
"""


def _value_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}[type(value)]


def _default_cell(value) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return "`" + text.replace("|", "\\|") + "`"


def values_docs() -> list[tuple[str, object, str]]:
    """(dotted key, default, description) of every value preceded by a `# --` comment, in file order. A comment
    continues on the `#` lines below its `# --` line."""
    import yaml

    defaults = yaml.safe_load(VALUES.read_text())
    rows: list[tuple[str, object, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in VALUES.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        if not stripped or stripped.startswith("- ") or ":" not in stripped:
            comment = []
            continue
        indent = len(line) - len(line.lstrip())
        key = stripped.split(":", 1)[0].strip().strip('"')
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        stack.append((indent, key))
        start = next((i for i, c in enumerate(comment) if c.startswith("# --")), None)
        if start is not None:
            text = " ".join(c.lstrip("#").strip() for c in comment[start:]).removeprefix("-- ").strip()
            node = defaults
            for part in path:
                node = node[part]
            rows.append((".".join(path), node, text))
        comment = []
    return rows


def _row(key: str, default, text: str) -> str:
    escaped = text.replace("|", "\\|")
    return f"| `{key}` | {_value_type(default)} | {_default_cell(default)} | {escaped} |"


def wanted_readme() -> str:
    lines = [README_INTRO.rstrip("\n")]
    for key, default, text in values_docs():
        if key == "settings" or (key.startswith("settings.")):
            continue
        lines.append(_row(key, default, text))
    lines.append("")
    lines.append("### Service settings (`settings`)")
    lines.append("")
    lines.append("Every setting of the service by its flat name (docs/CONFIG.md lists them all; the values schema "
                 "rejects unknown names). Those values.yaml sets:")
    lines.append("")
    lines.append("| Key | Type | Default | Description |")
    lines.append("|-----|------|---------|-------------|")
    for key, default, text in values_docs():
        if key.startswith("settings."):
            lines.append(_row(key, default, text))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)

    wanted = {path: content for path, content in grafana_copies().items()}
    wanted[SCHEMA] = wanted_schema().encode()
    wanted[README] = wanted_readme().encode()
    synced_dir = CHART / "files" / "grafana"
    extra = [p for p in synced_dir.rglob("*") if p.is_file() and p not in wanted] if synced_dir.exists() else []

    stale = [p for p, content in wanted.items() if not p.exists() or p.read_bytes() != content]
    if args.check:
        for path in stale + extra:
            print(f"stale: {path.relative_to(REPO)}")
        if stale or extra:
            print("run: python deploy/helm/sync_chart.py")
        return 1 if stale or extra else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(wanted[path])
        print(f"wrote {path.relative_to(REPO)}")
    for path in extra:
        path.unlink()
        print(f"removed {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
