"""`ocr-serve`: run the service, call it, OCR folders and buckets in bulk, manage keys, inspect settings and
metrics, replay model output, write a model kit, measure quality. Each subcommand lives in its own module of this package (eval in service/eval/); this
module lists them. `python -m service.cli` runs it too."""

from __future__ import annotations

import argparse

from service.cli import batch, client, config, keys, metrics, modelkit, parse, serve, ui
from service.eval import cli as eval_cli

# each adds its subcommand to the parser, in the order `ocr-serve --help` lists them
COMMANDS = (serve.add_serve, serve.add_drain, client.add_cli, batch.add_cli, config.add_cli, keys.add_cli,
            metrics.add_cli, ui.add_cli, parse.add_cli, modelkit.add_cli, eval_cli.add_cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ocr-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    raise SystemExit(main())
