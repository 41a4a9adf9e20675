"""pyproject.toml: the license as an SPDX expression (PEP 639; the table form is deprecated), and every runtime
dependency used by the service (an unused one is installed in every image for nothing)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# distribution name → the module the service imports
IMPORT_NAMES = {"pillow": "PIL", "pyyaml": "yaml", "google-re2": "re2", "pydantic-settings": "pydantic_settings"}
# used without an import of ours: FastAPI parses forms with python-multipart, rapidocr runs on onnxruntime
USED_BY_ANOTHER = {"python-multipart": "fastapi", "onnxruntime": "rapidocr"}


def test_the_license_is_an_spdx_expression():
    assert PROJECT["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in PROJECT["project"].get("classifiers", []))
    backend = PROJECT["build-system"]["requires"]
    assert backend == ["setuptools>=77"]  # the first setuptools that reads license expressions


def imported_top_level_modules() -> set[str]:
    modules: set[str] = set()
    for path in (REPO / "service").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module.split(".")[0])
    return modules


def test_every_runtime_dependency_is_used():
    imported = imported_top_level_modules()
    unused = []
    for requirement in PROJECT["project"]["dependencies"]:
        name = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()
        module = IMPORT_NAMES.get(name, name.replace("-", "_"))
        if name in USED_BY_ANOTHER:
            assert USED_BY_ANOTHER[name] in imported, name
        elif module not in imported:
            unused.append(requirement)
    assert not unused, f"runtime dependencies the service never imports: {unused}"
