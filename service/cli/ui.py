"""`ocr-serve ui`: print (or open) the URL of the web UI a running service serves at `/ui`."""

from __future__ import annotations

import argparse


def cmd_ui(args: argparse.Namespace) -> int:
    from service.cli.client import service_url

    url = service_url(args.url) + "/ui"
    print(f"OCR web UI: {url}  (start the service with `ocr-serve serve` if it is not running)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("ui", help="print (or --open) the URL of the web UI served by a running service")
    p.add_argument("--url", help="base URL of the service (default: $OCR_URL, else http://127.0.0.1:8000)")
    p.add_argument("--open", action="store_true", help="open it in the default browser")
    p.set_defaults(func=cmd_ui)
