"""API keys: the hashed key file, `ocr-serve keys`, the auth matrix through the HTTP API (missing, invalid, revoked,
wrong role, adapter not allowed), reload on change, open mode, and proof that no key is ever logged."""

from __future__ import annotations

import base64
import io
import json
import logging

import httpx
import pytest
from fastapi import APIRouter, Depends
from PIL import Image

from service.admission.auth import (
    ANONYMOUS,
    Principal,
    KeyFileAuthenticator,
    hash_key,
    key_from_headers,
    load_key_file,
    make_authenticator,
    require_admin,
)
from service.cli.keys import add_key, revoke_key, write_key_file
from service.http.app import create_app
from service.http.deps import admin
from service.cli.main import main as cli_main
from service.engine.mock import MockEngine
from service.errors import OCRError
from service.config import Settings


def png_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 32), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


BODY = {"image": png_b64(), "task": "text"}


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys.yaml"
    keys = {
        "user": add_key(path, tenant="acme", role="user", adapters=["invoices"])[0],
        "admin": add_key(path, tenant="ops", role="admin")[0],
        "revoked": add_key(path, tenant="acme", role="admin")[0],
    }
    revoke_key(path, "k_" + hash_key(keys["revoked"])[:12])
    return path, keys


admin_router = APIRouter()


@admin_router.get("/v1/admin/ping")
async def ping(caller: Principal = Depends(admin)):
    """An admin endpoint guarded as the adapter admin API is: the `admin` dependency."""
    return {"tenant": caller.tenant}


def app_client(key_path, engine=None) -> httpx.AsyncClient:
    from service.pipeline.context import build_context

    ctx = build_context(Settings(engine="mock", api_keys_file=key_path, api_keys_reload_interval_s=0),
                        engine or MockEngine(adapters=["invoices", "contracts"]))
    app = create_app(ctx)
    app.include_router(admin_router)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code


async def test_auth_matrix_through_the_api(key_file, caplog):
    path, keys = key_file
    caplog.set_level(logging.DEBUG)
    engine = MockEngine(adapters=["invoices", "contracts"])
    async with app_client(path, engine) as client:
        def post(headers=None, **extra):
            return client.post("/v1/ocr", json={**BODY, **extra}, headers=headers or {})

        # missing, malformed, invalid, revoked → 401 (with a Bearer challenge), before any work is done
        resp = await post()
        assert_error(resp, 401, "unauthorized")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert_error(await post({"Authorization": "Basic dXNlcjpwYXNz"}), 401, "unauthorized")
        assert_error(await post({"Authorization": "Bearer " + keys["user"] + "x"}), 401, "unauthorized")
        assert_error(await post({"X-API-Key": "ocr_not-a-key"}), 401, "unauthorized")
        revoked = await post({"Authorization": "Bearer " + keys["revoked"]})
        assert_error(revoked, 401, "unauthorized")
        assert "revoked" in revoked.json()["error"]["message"]
        assert engine.requests == []

        # valid keys, both header forms
        assert (await post({"Authorization": "Bearer " + keys["user"]})).status_code == 200
        assert (await post({"authorization": "bearer " + keys["user"]})).status_code == 200
        assert (await post({"X-API-Key": keys["admin"]})).status_code == 200

        # adapters: allowed → engine, not allowed → 403 forbidden (engine untouched); admin keys may use any
        served = len(engine.requests)
        assert (await post({"X-API-Key": keys["user"]}, adapter="invoices")).status_code == 200
        assert_error(await post({"X-API-Key": keys["user"]}, adapter="contracts"), 403, "forbidden")
        assert len(engine.requests) == served + 1
        assert (await post({"X-API-Key": keys["admin"]}, adapter="contracts")).status_code == 200

        # roles: the admin endpoint needs the admin role
        assert_error(await client.get("/v1/admin/ping", headers={"X-API-Key": keys["user"]}), 403, "forbidden")
        assert_error(await client.get("/v1/admin/ping"), 401, "unauthorized")
        ok = await client.get("/v1/admin/ping", headers={"Authorization": "Bearer " + keys["admin"]})
        assert ok.status_code == 200 and ok.json() == {"tenant": "ops"}

        # no response echoes a key
        for key in keys.values():
            assert key not in resp.text and key not in revoked.text

    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "auth: unknown API key refused" in logged  # the failures were logged...
    for key in keys.values():  # ...but no key (nor its full hash) ever was
        assert key not in logged and hash_key(key) not in logged
        assert key[4:20] not in logged


async def test_key_file_changes_apply_without_restart(key_file, caplog):
    path, keys = key_file
    async with app_client(path) as client:
        new_key, record = add_key(path, tenant="newco")  # the CLI's write path: atomic replace
        assert (await client.post("/v1/ocr", json=BODY, headers={"X-API-Key": new_key})).status_code == 200
        revoke_key(path, record.id)
        assert_error(await client.post("/v1/ocr", json=BODY, headers={"X-API-Key": new_key}), 401, "unauthorized")

        # a broken file (half-written by hand) keeps the previous keys in force and is reported once
        caplog.set_level(logging.ERROR, logger="service.admission.auth")
        path.write_text("keys: [ {broken")
        for _ in range(3):
            resp = await client.post("/v1/ocr", json=BODY, headers={"X-API-Key": keys["user"]})
            assert resp.status_code == 200
        assert sum("reload failed" in r.getMessage() for r in caplog.records) == 1


def test_key_file_holds_hashes_only_and_reads_json_and_yaml(tmp_path):
    yaml_path = tmp_path / "keys.yaml"
    key, record = add_key(yaml_path, tenant="acme", rate=2.5, burst=7, adapters=[])
    text = yaml_path.read_text()
    assert key not in text and record.sha256 in text
    assert oct(yaml_path.stat().st_mode & 0o777) == "0o600"

    json_path = tmp_path / "keys.json"
    write_key_file(json_path, load_key_file(yaml_path))
    assert json.loads(json_path.read_text())["keys"][0]["id"] == record.id

    principal = KeyFileAuthenticator(json_path).authenticate({"X-API-Key": key})
    assert (principal.tenant, principal.role, principal.rate, principal.burst) == ("acme", "user", 2.5, 7)
    assert principal.adapters == frozenset() and not principal.may_use_adapter("anything")
    assert principal.may_use_adapter(None) and principal.key_id == record.id
    assert key not in repr(principal)


@pytest.mark.parametrize("content, fragment", [
    ("keys: [ {broken", "not valid YAML"),
    ('{"keys": [{"id": "k_x", "sha256": "nothex", "tenant": "a"}]}', "sha256"),
    ('{"keys": [{"id": "k_x", "sha256": "' + "a" * 64 + '", "tenant": "a", "role": "root"}]}', "role"),
    ('{"version": 2, "keys": []}', "unsupported version"),
    ('{"keys": [], "extra": 1}', "extra"),
])
def test_invalid_key_file_fails_at_start_with_a_clear_message(tmp_path, content, fragment):
    path = tmp_path / "keys.yaml"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        KeyFileAuthenticator(path)
    assert fragment in str(info.value)


def test_duplicate_keys_are_rejected(tmp_path):
    path = tmp_path / "keys.yaml"
    add_key(path, tenant="a")
    data = load_key_file(path)
    data.keys.append(data.keys[0])
    write_key_file(path, data)
    with pytest.raises(ValueError, match="appears twice"):
        load_key_file(path)


def test_header_forms():
    assert key_from_headers({"Authorization": "Bearer abc"}) == "abc"
    assert key_from_headers({"AUTHORIZATION": "bearer   abc  "}) == "abc"
    assert key_from_headers({"x-api-key": "abc"}) == "abc"
    assert key_from_headers({"Authorization": "Basic abc"}) is None
    assert key_from_headers({"Authorization": "Bearer "}) is None
    assert key_from_headers({}) is None


def test_require_admin():
    assert require_admin(ANONYMOUS) is ANONYMOUS
    with pytest.raises(OCRError) as info:
        require_admin(ANONYMOUS.__class__(tenant="acme", role="user"))
    assert info.value.code == "forbidden" and info.value.status == 403


def test_open_mode_says_so_loudly(caplog):
    caplog.set_level(logging.WARNING, logger="service.admission.auth")
    authenticator = make_authenticator(Settings())
    assert authenticator.authenticate({}) == ANONYMOUS
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("OPEN" in r.getMessage() and "OCR_API_KEYS_FILE" in r.getMessage() for r in warnings)


def test_keys_cli_add_list_revoke(tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "keys.yaml"
    assert cli_main(["keys", "add", "--file", str(path), "--tenant", "acme", "--rate", "3", "--burst", "9",
                     "--adapters", "invoices,contracts", "--note", "test key"]) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert key.startswith("ocr_") and "\n" not in key  # stdout is the key alone, printed once
    assert "shown once" in out.err and key not in out.err
    principal = KeyFileAuthenticator(path).authenticate({"Authorization": f"Bearer {key}"})
    assert principal.tenant == "acme" and principal.rate == 3 and principal.adapters == {"invoices", "contracts"}

    assert cli_main(["keys", "list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    key_id = "k_" + hash_key(key)[:12]
    assert key_id in listing and "acme" in listing and "active" in listing
    assert key not in listing and hash_key(key) not in listing

    assert cli_main(["keys", "list", "--file", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["id"] == key_id and "sha256" not in rows[0]

    assert cli_main(["keys", "revoke", "--file", str(path), key_id]) == 0
    assert cli_main(["keys", "revoke", "--file", str(path), "k_unknown"]) == 1
    assert cli_main(["keys", "add", "--file", str(path), "--tenant", "bad tenant!"]) == 2
    assert cli_main(["keys", "list", "--file", str(path)]) == 0
    assert "revoked" in capsys.readouterr().out
    with pytest.raises(OCRError) as info:
        KeyFileAuthenticator(path).authenticate({"X-API-Key": key})
    assert info.value.code == "unauthorized"
    assert key not in caplog.text
