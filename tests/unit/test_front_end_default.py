"""The HTTP front end `ocr-serve serve` picks: HAProxy with the vLLM engine (a GPU engine's latency shows the proxy
actor's milliseconds), Serve's proxy actor otherwise; RAY_SERVE_ENABLE_HA_PROXY in the environment wins either way.
docs/design/http-front-end.md."""

from __future__ import annotations

import argparse

import pytest

from service.cli import serve as serve_cli
from service.serve import local


class Started(Exception):
    """Raised by the stand-in for start_ray: the command got as far as starting Ray."""


@pytest.fixture
def start_ray_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []

    def record(**kwargs):
        calls.append(kwargs)
        raise Started

    monkeypatch.setattr(local, "start_ray", record)
    return calls


@pytest.mark.parametrize(("engine", "haproxy"), [("vllm", True), ("embedded", False), ("mock", False)])
def test_serve_asks_for_haproxy_with_the_vllm_engine_only(engine, haproxy, start_ray_calls, monkeypatch, tmp_path):
    monkeypatch.delenv("OCR_ENGINE", raising=False)
    args = argparse.Namespace(engine=engine, port=None, host=None, model=str(tmp_path) if engine == "vllm" else None)
    with pytest.raises(Started):
        serve_cli.cmd_serve(args)
    assert start_ray_calls[0]["haproxy"] is haproxy


@pytest.fixture
def ray_stub(monkeypatch):
    """start_ray up to ray.init: the environment it sets, with no cluster started (and this process's environment
    as it was afterwards)."""
    import os

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    saved = dict(os.environ)
    for key in ("RAY_SERVE_ENABLE_HA_PROXY", *local.HAPROXY_PORT_ENV, local.HAPROXY_BINARY_ENV):
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_haproxy_gets_its_ports_and_binary_when_asked_for(ray_stub):
    local.start_ray(haproxy=True)
    import os

    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert all(os.environ[key].isdigit() for key in local.HAPROXY_PORT_ENV)
    assert os.access(os.environ[local.HAPROXY_BINARY_ENV], os.X_OK)


def test_the_environment_keeps_the_proxy_actor(ray_stub, monkeypatch):
    import os

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    local.start_ray(haproxy=True)
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert local.HAPROXY_BINARY_ENV not in os.environ


def test_no_haproxy_unless_asked(ray_stub):
    import os

    local.start_ray(haproxy=False)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
