"""Settings: env prefix, validation with clear messages, masked secrets, `ocr-serve config`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from service.config import LEGACY_NAMES, Settings, _leaves, env_problems


def test_defaults_are_the_laptop_setup(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OCR_"):
            monkeypatch.delenv(key)
    s = Settings()
    assert s.engine.kind == "embedded"
    assert s.redis.url is None and s.auth.api_keys_file is None
    assert s.engine_deployment["ray_actor_options"]["num_gpus"] == 0
    assert s.engine.vllm.kwargs(on_cpu=False)["enable_prefix_caching"] is False


def test_every_setting_has_a_description_and_one_flat_name():
    leaves = list(_leaves(Settings))
    missing = [flat for flat, _, info in leaves if not info.description]
    assert missing == []
    flat = [name for name, _, _ in leaves]
    assert len(flat) == len(set(flat)), "two settings share a flat name"
    assert not set(flat) & set(LEGACY_NAMES), "an older name shadows a setting"


def test_env_prefix_and_types(monkeypatch, tmp_path):
    monkeypatch.setenv("OCR_PORT", "9001")
    monkeypatch.setenv("OCR_ENGINE", "vllm")
    monkeypatch.setenv("OCR_MODEL", str(tmp_path))
    monkeypatch.setenv("OCR_ENGINE_KWARGS", '{"max_num_batched_tokens": 8192}')
    monkeypatch.setenv("OCR_ALLOWED_FORMATS", '["png", "jpeg"]')
    s = Settings()
    assert s.server.port == 9001 and s.engine.kind == "vllm"
    assert s.engine_deployment["ray_actor_options"]["num_gpus"] == 1
    assert s.engine.vllm.engine_kwargs == {"max_num_batched_tokens": 8192}
    assert s.limits.allowed_formats == ["PNG", "JPEG"]


def test_nested_names_and_flat_names_are_one_setting(monkeypatch):
    monkeypatch.setenv("OCR_LIMITS__MAX_BODY_BYTES", "4096")
    monkeypatch.setenv("OCR_RATE_LIMIT__ENABLED", "false")
    s = Settings(max_fields=3)
    assert s.limits.max_body_bytes == 4096 and s.rate_limit.enabled is False and s.limits.max_fields == 3
    assert Settings(limits={"max_body_bytes": 2048}).limits.max_body_bytes == 2048
    # explicit values (CLI flags) win over the environment, also for the engine's kind (a flat name that is a section)
    monkeypatch.setenv("OCR_ENGINE", "mock")
    monkeypatch.setenv("OCR_EMBEDDED_THREADS", "2")
    s = Settings(engine="embedded")
    assert s.engine.kind == "embedded" and s.engine.embedded.threads == 2
    # what replicas get: the nested dump validates back to the same settings
    assert Settings.model_validate(s.model_dump()) == s


def test_a_flat_object_and_keys_inside_it_merge_beside_the_engine_kind(monkeypatch):
    """OCR_ENGINE (the kind) shares its name with the engine section; nested variables inside the section still
    apply, and keys set inside an object by nested names win over the object's own."""
    monkeypatch.setenv("OCR_ENGINE", "mock")
    monkeypatch.setenv("OCR_ENGINE_KWARGS", '{"dtype": "float16", "seed": 2}')
    monkeypatch.setenv("OCR_ENGINE__VLLM__ENGINE_KWARGS__SEED", "7")
    monkeypatch.setenv("OCR_ENGINE__EMBEDDED__THREADS", "3")
    s = Settings()
    assert s.engine.kind == "mock" and s.engine.embedded.threads == 3
    assert s.engine.vllm.engine_kwargs == {"dtype": "float16", "seed": 7}


def test_older_names_set_what_replaced_them(monkeypatch):
    monkeypatch.setenv("OCR_DTYPE", "bfloat16")
    monkeypatch.setenv("OCR_VLLM_EXTRA_ARGS", '{"seed": 3}')
    s = Settings(kv_cache_memory_gb=1.5, min_replicas=1, max_replicas=4, engine_num_cpus=2, ingress_replicas=2,
                 max_ongoing_requests=48)
    assert s.engine.vllm.engine_kwargs == {"dtype": "bfloat16", "seed": 3, "kv_cache_memory_bytes": int(1.5 * 2**30)}
    options = s.engine_deployment
    assert options["autoscaling_config"]["max_replicas"] == 4 and options["max_ongoing_requests"] == 48
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert s.serve.ingress_options()["num_replicas"] == 2


def test_equal_replica_bounds_are_a_fixed_count():
    assert Settings(min_replicas=2, max_replicas=2).engine_deployment["num_replicas"] == 2
    assert "autoscaling_config" not in Settings(engine_deployment={"num_replicas": 3}).engine_deployment


def test_serve_options_are_checked_by_serve():
    with pytest.raises(ValidationError, match="unknown or service-managed"):
        Settings(engine_deployment={"max_ongoing_request": 3})
    with pytest.raises(ValidationError, match="unknown or service-managed"):
        Settings(engine_deployment={"autoscaling_config": {"max_replica": 3}})
    with pytest.raises(ValidationError, match="ray_actor_options"):
        Settings(engine_deployment={"ray_actor_options": {"gpus": 1}})
    with pytest.raises(ValidationError, match="greater than 0"):
        Settings(engine_deployment={"max_ongoing_requests": 0})
    with pytest.raises(ValidationError, match="service-managed"):
        Settings(ingress_deployment={"graceful_shutdown_timeout_s": 5})  # a setting of its own
    options = Settings(engine_deployment={"max_replicas_per_node": 1}).engine_deployment
    assert options["max_replicas_per_node"] == 1 and options["max_ongoing_requests"] == 32


def test_engine_kwargs_may_not_set_what_the_service_sets():
    with pytest.raises(ValidationError, match="max_model_len"):
        Settings(engine_kwargs={"max_model_len": 4096})


def test_unknown_and_older_variables_are_reported():
    problems = env_problems({"OCR_MAX_BODDY_BYTES": "1", "OCR_DTYPE": "auto", "OCR_PORT": "1", "PATH": "/bin"})
    assert problems == ["OCR_MAX_BODDY_BYTES is not a setting (did you mean OCR_MAX_BODY_BYTES?)",
                        "OCR_DTYPE is an older name: it sets engine.vllm.engine_kwargs.dtype (docs/CONFIG.md)"]


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
    assert shown["server"]["port"] == 8111
    assert shown["redis"]["url"] == "**********"


def test_config_command_reports_invalid_settings():
    env = {**os.environ, "OCR_MAX_BODY_BYTES": "12", "OCR_MAX_FEILDS": "3"}
    proc = subprocess.run([sys.executable, "-m", "service.cli", "config"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "OCR_MAX_BODY_BYTES: Input should be greater than or equal to 1024" in proc.stderr
    assert "warning: OCR_MAX_FEILDS is not a setting (did you mean OCR_MAX_FIELDS?)" in proc.stderr


def test_config_reference_is_current():
    """docs/CONFIG.md is `ocr-serve config --markdown`: regenerate it when a setting changes."""
    from pathlib import Path

    from service.cli.config import reference_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    assert doc.read_text() == reference_markdown(), "stale docs/CONFIG.md: ocr-serve config --markdown > docs/CONFIG.md"
