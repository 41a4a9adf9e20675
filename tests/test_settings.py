"""Settings: env prefix, validation with clear messages, masked secrets, `ocr-serve config`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from service.config import Settings


def test_defaults_are_the_laptop_setup(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OCR_"):
            monkeypatch.delenv(key)
    s = Settings()
    assert s.engine == "embedded"
    assert s.redis_url is None and s.api_keys_file is None
    assert s.resolved_engine_num_gpus == 0
    assert s.enable_prefix_caching is False


def test_every_field_has_a_description():
    missing = [name for name, f in Settings.model_fields.items() if not f.description]
    assert missing == []


def test_env_prefix_and_types(monkeypatch, tmp_path):
    monkeypatch.setenv("OCR_PORT", "9001")
    monkeypatch.setenv("OCR_ENGINE", "vllm")
    monkeypatch.setenv("OCR_MODEL", str(tmp_path))
    monkeypatch.setenv("OCR_VLLM_EXTRA_ARGS", '{"max_num_batched_tokens": 8192}')
    s = Settings()
    assert s.port == 9001 and s.engine == "vllm"
    assert s.resolved_engine_num_gpus == 1
    assert s.vllm_extra_args == {"max_num_batched_tokens": 8192}


@pytest.mark.parametrize("env, fragment", [
    ({"OCR_ENGINE": "vllm"}, "OCR_MODEL must name a model directory"),
    ({"OCR_MIN_REPLICAS": "3", "OCR_MAX_REPLICAS": "2"}, "min_replicas (3) > max_replicas (2)"),
    ({"OCR_PORT": "70000"}, "less than or equal to 65535"),
    ({"OCR_ENGINE": "tesseract"}, "'embedded', 'vllm' or 'mock'"),
    ({"OCR_API_KEYS_FILE": "/nonexistent/keys.yaml"}, "does not exist"),
])
def test_invalid_settings_fail_with_clear_messages(monkeypatch, env, fragment):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert fragment in str(info.value)


def test_unknown_field_rejected():
    with pytest.raises(ValidationError):
        Settings(not_a_setting=1)


def test_config_command_masks_secrets():
    env = {**os.environ, "OCR_REDIS_URL": "redis://:hunter2-secret@127.0.0.1:6379/0", "OCR_PORT": "8111"}
    out = subprocess.run([sys.executable, "-m", "service.cli", "config"], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "hunter2-secret" not in out
    shown = json.loads(out)
    assert shown["port"] == 8111
    assert shown["redis_url"] == "**********"


def test_config_command_reports_invalid_settings():
    env = {**os.environ, "OCR_MAX_BODY_BYTES": "12"}
    proc = subprocess.run([sys.executable, "-m", "service.cli", "config"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "OCR_MAX_BODY_BYTES" in proc.stderr
