"""Unit tests of the ingress's retry-once policy (ServeEngineClient) and the Ray/Serve error mapping, with a scripted
stand-in for the deployment handle (the real replica kill is tests/integration/test_reliability_replicas.py)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

from service.engine.protocol import EngineDelta, EngineRequest, EngineResult
from service.errors import OCRError
from service.serve.client import ServeEngineClient, replica_died, translate_engine_error


class ScriptedHandle:
    """Answers `.generate.remote()` / `.options(stream=True).stream.remote()` from a script of outcomes: an
    exception is raised, anything else returned (streams yield deltas, and may fail after `fail_after` deltas)."""

    def __init__(self, script: list, fail_after: int | None = None):
        self.script = list(script)
        self.calls = 0
        self.fail_after = fail_after

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    @property
    def stream(self):
        return self

    def remote(self, request):
        self.calls += 1
        outcome = self.script.pop(0)
        return _Response(outcome, self.fail_after)


class _Response:
    def __init__(self, outcome, fail_after):
        self.outcome = outcome
        self.fail_after = fail_after

    def __await__(self):
        async def run():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return run().__await__()

    def __aiter__(self):
        async def gen():
            if isinstance(self.outcome, BaseException) and self.fail_after is None:
                raise self.outcome
            yield EngineDelta(text="partial ")
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            yield EngineDelta(final=EngineResult(text="partial done"))
        return gen()


REQUEST = EngineRequest(request_id="r1", task="text", image_png=b"\x89PNG", width=1, height=1, max_tokens=8)
RESULT = EngineResult(text="ok")


@pytest.mark.parametrize("died", [ActorDiedError(), ActorUnavailableError("gone", None),
                                  ReplicaUnavailableError("gone")])
async def test_generate_retries_once_when_the_replica_died(died):
    handle = ScriptedHandle([died, RESULT])
    assert (await ServeEngineClient(handle).generate(REQUEST)).text == "ok"
    assert handle.calls == 2


async def test_generate_gives_up_after_one_retry():
    handle = ScriptedHandle([ActorDiedError(), ActorDiedError(), RESULT])
    with pytest.raises(OCRError) as err:
        await ServeEngineClient(handle).generate(REQUEST)
    assert err.value.code == "engine_unavailable" and err.value.status == 503
    assert handle.calls == 2


@pytest.mark.parametrize("error", [RuntimeError("engine bug"), OCRError("unsupported_task", "no")])
async def test_generate_does_not_retry_other_failures(error):
    handle = ScriptedHandle([error, RESULT])
    with pytest.raises(type(error)):
        await ServeEngineClient(handle).generate(REQUEST)
    assert handle.calls == 1


async def test_backpressure_is_a_fast_503_with_retry_after():
    handle = ScriptedHandle([BackPressureError(num_queued_requests=5, max_queued_requests=4)])
    with pytest.raises(OCRError) as err:
        await ServeEngineClient(handle).generate(REQUEST)
    assert err.value.code == "overloaded" and err.value.status == 503
    assert int(err.value.headers["Retry-After"]) >= 1
    assert handle.calls == 1  # never retried: retrying is how overload gets worse


async def test_stream_retries_only_before_the_first_delta():
    handle = ScriptedHandle([ActorDiedError(), RESULT])
    deltas = [d async for d in ServeEngineClient(handle).stream(REQUEST)]
    assert deltas[-1].final is not None and handle.calls == 2

    handle = ScriptedHandle([ActorDiedError(), RESULT], fail_after=1)  # dies after text went out: no retry
    with pytest.raises(OCRError) as err:
        _ = [d async for d in ServeEngineClient(handle).stream(REQUEST)]
    assert err.value.code == "engine_unavailable" and handle.calls == 1


def test_error_mapping():
    assert replica_died(ActorDiedError()) and replica_died(ActorUnavailableError("x", None))
    assert not replica_died(RuntimeError()) and not replica_died(BackPressureError(num_queued_requests=1,
                                                                                  max_queued_requests=1))
    assert translate_engine_error(RuntimeError()) is None
