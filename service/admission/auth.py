"""Who is calling: API keys → principal (tenant, role, limits, allowed adapters).

Keys live in a YAML/JSON file (mounted from a Kubernetes Secret) that holds only their SHA-256 hashes:

    version: 1
    keys:
      - id: k_3f9a1c2b7d4e          # first 12 hex digits of the hash: names the key in logs and `keys revoke`
        sha256: 3f9a1c2b7d4e...     # hex SHA-256 of the key
        tenant: acme
        role: user                  # user | admin (admin endpoints need admin)
        rate: 5.0                   # tokens/s (null = settings default)
        burst: 20                   # bucket size (null = settings default)
        adapters: [invoice-v2]      # LoRA adapters this key may use (null = any)
        revoked: false

Callers send `Authorization: Bearer <key>` or `X-API-Key: <key>` (one key per request: repeated headers, or two
different keys, are refused with 400 `ambiguous_credentials`). The file is re-read when it changes (Secret
rotation swaps it atomically). `ocr-serve keys add|list|revoke` (service/cli/keys.py) manages it.

With no key file configured the service runs open: every caller is the `anonymous` tenant with the `admin` role.
Keys are never logged, only their `id`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.errors import OCRError

log = logging.getLogger(__name__)

KEY_FILE_VERSION = 1


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str = "user"  # user | admin
    rate: float | None = None  # tokens/s; None = settings default
    burst: float | None = None
    adapters: frozenset[str] | None = None  # None = any adapter
    key_id: str | None = field(default=None, repr=False)  # short hash prefix for audit, never the key

    def may_use_adapter(self, adapter: str | None) -> bool:
        return adapter is None or self.adapters is None or adapter in self.adapters


ANONYMOUS = Principal(tenant="anonymous", role="admin")


class KeyRecord(BaseModel):
    """One API key in the key file (the key itself is never stored)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="`k_` + the first 12 hex digits of sha256; names the key in logs and the CLI.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex SHA-256 of the key.")
    tenant: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                        description="Tenant the key belongs to (its rate-limit bucket).")
    role: Literal["user", "admin"] = Field("user", description="`admin` may call the admin endpoints.")
    rate: float | None = Field(None, gt=0, description="Refill rate in tokens/s (null = settings default).")
    burst: float | None = Field(None, gt=0, description="Bucket size (null = settings default).")
    adapters: list[str] | None = Field(None, description="LoRA adapters the key may use (null = any).")
    revoked: bool = Field(False, description="A revoked key is refused with 401.")
    created: str | None = Field(None, description="Creation time (ISO 8601, UTC).")
    note: str | None = Field(None, max_length=200, description="Free text for operators (who, why).")

    def principal(self) -> Principal:
        return Principal(tenant=self.tenant, role=self.role, rate=self.rate, burst=self.burst,
                         adapters=None if self.adapters is None else frozenset(self.adapters), key_id=self.id)


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(KEY_FILE_VERSION, description="Format version of the key file.")
    keys: list[KeyRecord] = Field(default_factory=list, description="The API keys.")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id_for(digest: str) -> str:
    return "k_" + digest[:12]


def load_key_file(path: Path) -> KeyFile:
    """Parse and validate a key file (YAML, or JSON which is YAML too). Raises ValueError with a clear message."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        raw = json.loads(text) if Path(path).suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"key file {path} is not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                         f"{type(exc).__name__}") from None
    try:
        parsed = KeyFile.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"key file {path}: {where}: {err['msg']}") from None  # no input echo: it may be a key
    if parsed.version != KEY_FILE_VERSION:
        raise ValueError(f"key file {path}: unsupported version {parsed.version}")
    seen: set[str] = set()
    for record in parsed.keys:
        if record.sha256 in seen:
            raise ValueError(f"key file {path}: key {record.id} appears twice")
        seen.add(record.sha256)
    return parsed


def _header_values(headers: Any, name: str) -> list[str]:
    """Every value of header `name` (lower-case), repeated headers included: Starlette's request headers
    (`getlist`), httpx's (`multi_items`), or a plain mapping that may hold one name in several spellings."""
    if hasattr(headers, "getlist"):
        return list(headers.getlist(name))
    pairs = headers.multi_items() if hasattr(headers, "multi_items") else headers.items()
    return [value for key, value in pairs if key.lower() == name]


def key_from_headers(headers: Any) -> str | None:
    """The key from `Authorization: Bearer <key>` or `X-API-Key: <key>` (header names case-insensitive).

    A request with more than one key is refused with 400 `ambiguous_credentials` instead of picking one: a repeated
    `Authorization` or `X-API-Key` header (proxies and frameworks disagree on which copy wins, so a key smuggled in
    a second copy could be checked by one layer and used by another), or a bearer key and an `X-API-Key` that differ.
    """
    authorizations = _header_values(headers, "authorization")
    api_keys = _header_values(headers, "x-api-key")
    if len(authorizations) > 1 or len(api_keys) > 1:
        raise OCRError("ambiguous_credentials", "send one API key, in one `Authorization` or `X-API-Key` header")
    bearer = None
    if authorizations:
        scheme, _, value = authorizations[0].strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            bearer = value.strip()
    api_key = api_keys[0].strip() if api_keys else ""
    if bearer and api_key and api_key != bearer:
        raise OCRError("ambiguous_credentials", "the `Authorization` and `X-API-Key` headers carry different keys; "
                       "send one")
    return bearer or api_key or None


def unauthorized(message: str) -> OCRError:
    return OCRError("unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def require_admin(principal: Principal) -> Principal:
    """For admin endpoints: 403 `forbidden` unless the key has the admin role."""
    if principal.role != "admin":
        raise OCRError("forbidden", "this endpoint needs an API key with the admin role")
    return principal


class Authenticator(Protocol):
    def authenticate(self, headers: Any) -> Principal: ...


class OpenAuthenticator:
    """No key file: everyone is the anonymous admin (development mode)."""

    open_mode = True

    def authenticate(self, headers: Any) -> Principal:
        return ANONYMOUS


class KeyFileAuthenticator:
    """Authenticates against the hashed keys of a key file; re-reads the file when it changes.

    A file that fails to parse after a change is reported once and the previous keys stay in force (a half-written
    file must not lock everyone out); at start an invalid file is an error. `on_tenants(tenants)` is called with the
    file's tenants at start and after each reload (the metrics start their label sets at 0 with it).
    """

    open_mode = False

    def __init__(self, path: Path, *, reload_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 on_tenants: Callable[[set[str]], None] | None = None):
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self._clock = clock
        self._on_tenants = on_tenants
        self._by_hash: dict[str, KeyRecord] = {}
        self._signature: str | None = None
        self._next_check = 0.0
        self._load(self._fingerprint())
        active = sum(not r.revoked for r in self._by_hash.values())
        log.info("API keys: %d active, %d revoked, from %s", active, len(self._by_hash) - active, self.path)

    def _fingerprint(self) -> str | None:
        """Digest of the file's bytes (a few KB, read at most once per reload interval): unlike mtime/inode it
        cannot miss a change, and it follows the Secret volume's `..data` symlink swap."""
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def _load(self, signature: str | None) -> None:
        parsed = load_key_file(self.path)
        self._by_hash = {r.sha256: r for r in parsed.keys}
        self._signature = signature
        if self._on_tenants is not None:
            try:
                self._on_tenants({record.tenant for record in parsed.keys})
            except Exception:  # a metrics hook must never fail authentication
                log.exception("API keys: on_tenants hook failed")

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self.reload_interval_s
        signature = self._fingerprint()
        if signature == self._signature:
            return
        if signature is None:
            log.error("API keys: %s disappeared; keeping the %d keys loaded before", self.path, len(self._by_hash))
            self._signature = None
            return
        try:
            self._load(signature)
        except (OSError, ValueError) as exc:
            log.error("API keys: reload failed, keeping the previous keys: %s", exc)
            self._signature = signature  # report each bad version once
            return
        log.info("API keys: reloaded %s (%d keys)", self.path, len(self._by_hash))

    def authenticate(self, headers: Any) -> Principal:
        self._maybe_reload()
        key = key_from_headers(headers)
        if key is None:
            raise unauthorized("missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
        record = self._by_hash.get(hash_key(key))
        if record is None:
            log.info("auth: unknown API key refused")
            raise unauthorized("invalid API key")
        if record.revoked:
            log.info("auth: revoked API key %s (tenant %s) refused", record.id, record.tenant)
            raise unauthorized("this API key has been revoked")
        return record.principal()


def make_authenticator(settings, on_tenants: Callable[[set[str]], None] | None = None):
    """The authenticator the settings ask for; without a key file the open (development) one, announced loudly.
    `on_tenants`: see KeyFileAuthenticator."""
    if settings.auth.api_keys_file is not None:
        return KeyFileAuthenticator(settings.auth.api_keys_file, reload_interval_s=settings.auth.api_keys_reload_interval_s,
                                    on_tenants=on_tenants)
    announce_open_service()
    return OpenAuthenticator()


def announce_open_service() -> None:
    """Said by every ingress replica (into its log) and by `ocr-serve serve` (on its terminal, where a replica's
    log does not reach in Serve's throughput-optimized mode)."""
    log.warning("=" * 78)
    log.warning("NO API KEY FILE CONFIGURED (OCR_API_KEYS_FILE): the service is OPEN. Every caller is the admin "
                "tenant 'anonymous'. Development only: never expose this instance.")
    log.warning("=" * 78)
