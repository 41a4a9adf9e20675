"""`ocr-serve metrics`: the metric reference (docs/METRICS.md's table) and a prometheus.yml that scrapes Ray's
metrics ports with the product's relabel rules."""

from __future__ import annotations

from service.observability.metrics import prometheus_config, reference_table


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("metrics", help="metrics reference and a prometheus.yml for Ray metrics ports")
    p.add_argument("what", choices=["table", "prometheus-config"])
    p.add_argument("--target", action="append", default=[], help="host:port of a Ray metrics port (repeatable)")
    p.add_argument("--scrape-interval", default="15s")
    p.set_defaults(func=_cmd_metrics)


def _cmd_metrics(args) -> int:
    import yaml

    if args.what == "table":
        print(reference_table())
    else:
        print(yaml.safe_dump(prometheus_config(args.target or ["127.0.0.1:8080"],
                                               scrape_interval=args.scrape_interval), sort_keys=False))
    return 0
