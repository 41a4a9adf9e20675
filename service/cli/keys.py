"""`ocr-serve keys add|list|revoke`: manage the hashed API key file (OCR_API_KEYS_FILE or `--file`).

`add` prints the new key exactly once (stdout, nothing else on it); the file keeps only its SHA-256. Writes are
atomic (temp file + rename, mode 0600) and serialised with a lock file, so a running service that re-reads the file
never sees half of it. Put the file into the Kubernetes Secret the chart mounts (see the Helm chart's values).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import yaml
from pydantic import ValidationError

from service.admission.auth import KeyFile, KeyRecord, hash_key, key_id_for, load_key_file

KEY_PREFIX = "ocr_"


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)  # 256 bits: a plain SHA-256 is then a safe verifier


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialise read-modify-write of the key file between CLI invocations."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_or_empty(path: Path) -> KeyFile:
    return load_key_file(path) if path.exists() else KeyFile()


def write_key_file(path: Path, key_file: KeyFile) -> None:
    """Atomic replace; JSON for `.json` files, YAML otherwise."""
    data = key_file.model_dump(mode="json")
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = "# API keys (hashes only), managed by `ocr-serve keys`\n" + yaml.safe_dump(data, sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def add_key(path: Path, *, tenant: str, role: str = "user", rate: float | None = None, burst: float | None = None,
            adapters: list[str] | None = None, note: str | None = None) -> tuple[str, KeyRecord]:
    """Create a key, store its hash; returns (the key, its record). The key is not stored anywhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = generate_key()
    digest = hash_key(key)
    record = KeyRecord(id=key_id_for(digest), sha256=digest, tenant=tenant, role=role, rate=rate, burst=burst,
                       adapters=adapters, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       note=note)
    with locked(path):
        key_file = read_or_empty(path)
        key_file.keys.append(record)
        write_key_file(path, KeyFile.model_validate(key_file.model_dump()))  # re-validate the whole file
    return key, record


def revoke_key(path: Path, key_id: str) -> KeyRecord:
    with locked(path):
        key_file = read_or_empty(path)
        for record in key_file.keys:
            if record.id == key_id:
                record.revoked = True
                write_key_file(path, key_file)
                return record
    raise KeyError(key_id)


def _file_arg(args: argparse.Namespace) -> Path:
    chosen = args.file or os.environ.get("OCR_API_KEYS_FILE")
    if not chosen:
        print("no key file: pass --file or set OCR_API_KEYS_FILE", file=sys.stderr)
        raise SystemExit(2)
    return Path(chosen)


def cmd_add(args: argparse.Namespace) -> int:
    path = _file_arg(args)
    adapters = None
    if args.adapters is not None:
        adapters = [a.strip() for a in args.adapters.split(",") if a.strip()]
    try:
        key, record = add_key(path, tenant=args.tenant, role=args.role, rate=args.rate, burst=args.burst,
                              adapters=adapters, note=args.note)
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"keys add: {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"keys add: {exc}", file=sys.stderr)
        return 2
    print(f"added key {record.id} for tenant {record.tenant} (role {record.role}) to {path}; "
          "the key is shown once below, store it now:", file=sys.stderr)
    print(key, flush=True)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    path = _file_arg(args)
    try:
        key_file = read_or_empty(path)
    except ValueError as exc:
        print(f"keys list: {exc}", file=sys.stderr)
        return 2
    rows = [r.model_dump(exclude={"sha256"}) for r in key_file.keys]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["ID", "TENANT", "ROLE", "RATE", "BURST", "ADAPTERS", "STATUS", "CREATED", "NOTE"]
    table = [header] + [[r["id"], r["tenant"], r["role"], _num(r["rate"]), _num(r["burst"]),
                         "*" if r["adapters"] is None else ",".join(r["adapters"]) or "-",
                         "revoked" if r["revoked"] else "active", r["created"] or "-", r["note"] or ""]
                        for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _num(value: float | None) -> str:
    return "default" if value is None else f"{value:g}"


def cmd_revoke(args: argparse.Namespace) -> int:
    path = _file_arg(args)
    try:
        record = revoke_key(path, args.key_id)
    except KeyError:
        print(f"keys revoke: no key with id {args.key_id!r} in {path}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"keys revoke: {exc}", file=sys.stderr)
        return 2
    print(f"revoked key {record.id} (tenant {record.tenant}); running services refuse it within "
          "OCR_API_KEYS_RELOAD_INTERVAL_S of the file reaching them", file=sys.stderr)
    return 0


def add_cli(subparsers) -> None:
    keys = subparsers.add_parser("keys", help="manage API keys (hashed key file)")
    verbs = keys.add_subparsers(dest="keys_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--file", help="key file (default: OCR_API_KEYS_FILE); .json → JSON, else YAML")

    add = verbs.add_parser("add", parents=[common], help="create a key; prints it once")
    add.add_argument("--tenant", required=True, help="tenant name (rate-limit bucket)")
    add.add_argument("--role", choices=["user", "admin"], default="user")
    add.add_argument("--rate", type=float, help="refill rate in tokens/s (default: OCR_DEFAULT_RATE)")
    add.add_argument("--burst", type=float, help="bucket size (default: OCR_DEFAULT_BURST)")
    add.add_argument("--adapters", help="comma-separated LoRA adapters the key may use (default: any; '' = none)")
    add.add_argument("--note", help="free text for operators")
    add.set_defaults(func=cmd_add)

    lst = verbs.add_parser("list", parents=[common], help="list keys (ids and metadata, never keys or hashes)")
    lst.add_argument("--json", action="store_true", help="JSON output")
    lst.set_defaults(func=cmd_list)

    revoke = verbs.add_parser("revoke", parents=[common], help="revoke a key by id (see `keys list`)")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_revoke)
