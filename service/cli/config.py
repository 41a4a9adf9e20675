"""`ocr-serve config`: the effective settings (environment and defaults), secrets masked; and the one way every
command reads settings (invalid ones: one line each, exit 2)."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError


def settings_or_exit(**overrides):
    from service.config import load_settings

    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        print("invalid settings:", file=sys.stderr)
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "settings"
            print(f"  OCR_{where.upper()}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2)


def cmd_config(args: argparse.Namespace) -> int:
    settings = settings_or_exit()
    print(json.dumps(settings.masked(), indent=2, default=str))
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("config", help="print the effective settings (secrets masked)")
    p.set_defaults(func=cmd_config)
