"""`ocr-serve metrics`: the metric reference (docs/METRICS.md's table) and a prometheus.yml that scrapes Ray's
metrics ports with the product's relabel rules."""

from __future__ import annotations

import sys

from service.observability.metrics import LOCAL_NAMESPACE, LOCAL_RELEASE, prometheus_config, reference_table


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("metrics", help="metrics reference and a prometheus.yml for Ray metrics ports")
    p.add_argument("what", choices=["table", "prometheus-config"])
    p.add_argument("--target", action="append", default=[],
                   help="host:port of a Ray metrics port (repeatable; default: 127.0.0.1 and the port `ocr-serve "
                        "serve` exports on, OCR_METRICS_EXPORT_PORT, 8080 unless set)")
    p.add_argument("--scrape-interval", default="15s", help="scrape and rule evaluation interval (default 15s)")
    p.add_argument("--namespace", default=LOCAL_NAMESPACE,
                   help=f"`namespace` label of the targets, as dashboards and alerts group by it (default "
                        f"{LOCAL_NAMESPACE})")
    p.add_argument("--release", default=LOCAL_RELEASE,
                   help=f"`ocr_release` label of the targets (default {LOCAL_RELEASE})")
    p.set_defaults(func=_cmd_metrics)


def _cmd_metrics(args) -> int:
    import yaml

    if args.what == "table":
        print(reference_table())
        return 0
    targets = args.target
    if not targets:
        from service.cli.config import settings_or_exit

        port = settings_or_exit().observability.metrics_export_port
        if port is None:
            print("ocr-serve metrics: OCR_METRICS_EXPORT_PORT is empty (a free port each start): pass --target "
                  "127.0.0.1:<the port `ocr-serve serve` printed>", file=sys.stderr, flush=True)
            return 2
        targets = [f"127.0.0.1:{port}"]
    print(yaml.safe_dump(prometheus_config(targets, scrape_interval=args.scrape_interval, namespace=args.namespace,
                                           release=args.release), sort_keys=False))
    return 0
