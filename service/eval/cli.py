"""`ocr-serve eval`: four forms, dispatched on the first word (docs/EVAL.md).

    ocr-serve eval MANIFEST --url URL [--api-key KEY] [--task TASK] [--adapter NAME] [--concurrency N] [--out DIR]
    ocr-serve eval compare A/summary.json B/summary.json [--out DIR]
    ocr-serve eval import {funsd,icdar} SRC OUT.jsonl [--images DIR]
    ocr-serve eval sample DIR [--n N] [--seed S]

The `eval` subcommand hands its arguments over untouched (a manifest may come first or after its options), and each
form has its own parser and `--help`. Every mistake the user can fix prints one line, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from service.eval import EvalError

FORMS = ("compare", "import", "sample")
EPILOG = """other forms:
  ocr-serve eval compare A/summary.json B/summary.json [--out DIR]   differences with bootstrap intervals
  ocr-serve eval import {funsd,icdar} SRC OUT.jsonl [--images DIR]   annotations to a manifest
  ocr-serve eval sample DIR [--n N] [--seed S]                       a labelled sample set
each has its own --help; docs/EVAL.md explains manifests and metrics"""


def add_cli(sub) -> None:
    # prefix_chars nobody types: every argument (options included) reaches `main` as it was given
    p = sub.add_parser("eval", help="OCR quality of a running service on labelled documents; compare runs "
                       "(docs/EVAL.md)", add_help=False, prefix_chars="\0")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.argv))


def main(argv: list[str]) -> int:
    form = argv[0] if argv and argv[0] in FORMS else "run"
    parser = PARSERS[form]()
    args = parser.parse_args(argv[1:] if form != "run" else argv)
    try:
        return args.handler(args)
    except EvalError as exc:
        print(f"ocr-serve eval: error: {exc}", file=sys.stderr)
        return 2 if form != "run" or _is_manifest_error(exc) else 1
    except KeyboardInterrupt:
        print("ocr-serve eval: interrupted", file=sys.stderr)
        return 130


def _is_manifest_error(exc: EvalError) -> bool:
    from service.eval.manifest import ManifestError

    return isinstance(exc, ManifestError)


# --- run ----------------------------------------------------------------------------------------------------------

def _run_parser() -> argparse.ArgumentParser:
    from service.config import DEFAULT_SERVICE_URL
    from service.eval import metrics
    from service.tasks import TASKS

    p = argparse.ArgumentParser(prog="ocr-serve eval", epilog=EPILOG, formatter_class=argparse.RawTextHelpFormatter,
                                description="Run every document of MANIFEST through the service at --url and "
                                "measure OCR quality and speed;\nwrites summary.json, documents.csv, report.md and "
                                "plots to --out.")
    p.add_argument("manifest", type=Path, help="JSON Lines manifest (docs/EVAL.md)")
    p.add_argument("--url", default=os.environ.get("OCR_URL", DEFAULT_SERVICE_URL),
                   help=f"the service (default: $OCR_URL, else {DEFAULT_SERVICE_URL})")
    p.add_argument("--api-key", default=os.environ.get("OCR_API_KEY"), help="API key (default: $OCR_API_KEY)")
    p.add_argument("--task", default="spotting", choices=sorted(TASKS), help="task of every request (default "
                   "%(default)s)")
    p.add_argument("--adapter", help="LoRA adapter name")
    p.add_argument("--target-language", help="task translate: the target language")
    p.add_argument("--concurrency", type=_positive_int, default=4, help="documents in flight (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("eval-out"), help="output folder (default %(default)s)")
    p.add_argument("--iou-threshold", type=_unit_interval, default=metrics.DEFAULT_IOU_THRESHOLD,
                   help="IoU at which a predicted line matches a truth line (default %(default)s)")
    p.add_argument("--ignore-case", action="store_true", help="case-fold text on both sides before comparing")
    p.add_argument("--ece-bins", type=_positive_int, default=metrics.DEFAULT_ECE_BINS,
                   help="equal-width confidence bins for ECE (default %(default)s)")
    p.add_argument("--timeout", type=_positive_float, default=300.0, help="seconds per request (default %(default)s)")
    p.add_argument("--retries", type=_non_negative_int, default=8, help="retries of 429/503 with Retry-After and "
                   "refused connections (default %(default)s)")
    p.add_argument("--max-wait", type=_positive_float, default=60.0, help="longest Retry-After honoured, seconds "
                   "(default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(handler=cmd_run)
    return p


def cmd_run(args: argparse.Namespace) -> int:
    from service.eval.runner import RunConfig, run_eval

    config = RunConfig(manifest=args.manifest, url=args.url, out=args.out, task=args.task, adapter=args.adapter,
                       target_language=args.target_language, api_key=args.api_key, concurrency=args.concurrency,
                       iou_threshold=args.iou_threshold, ignore_case=args.ignore_case, ece_bins=args.ece_bins,
                       timeout_s=args.timeout, retries=args.retries, max_wait_s=args.max_wait)
    summary = run_eval(config, progress=None if args.no_progress else sys.stderr)
    shown = {k: v for k, v in summary["metrics"].items() if v is not None}
    print(f"{summary['documents']} documents, {summary['errors']} errors, task {summary['settings']['task']}")
    for name, value in shown.items():
        print(f"  {name:<17} {value}")
    print(f"wrote {args.out}/summary.json, documents.csv, report.md")
    if summary["errors"]:
        print(f"ocr-serve eval: {summary['errors']} document(s) failed: see the error column of "
              f"{args.out}/documents.csv", file=sys.stderr)
    return 1 if summary["errors"] == summary["documents"] else 0


# --- compare ------------------------------------------------------------------------------------------------------

def _compare_parser() -> argparse.ArgumentParser:
    from service.eval.compare import DEFAULT_RESAMPLES, DEFAULT_SEED, DEFAULT_TOP

    p = argparse.ArgumentParser(prog="ocr-serve eval compare", description="Compare two runs of the same manifest: "
                                "B − A per metric with paired bootstrap 95 % intervals, and the documents that "
                                "regressed most.")
    p.add_argument("a", type=Path, help="run A's summary.json (or its folder)")
    p.add_argument("b", type=Path, help="run B's summary.json (or its folder)")
    p.add_argument("--out", type=Path, default=Path("eval-compare"), help="output folder (default %(default)s)")
    p.add_argument("--resamples", type=_positive_int, default=DEFAULT_RESAMPLES, help="bootstrap resamples "
                   "(default %(default)s)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="bootstrap seed (default %(default)s)")
    p.add_argument("--top", type=_positive_int, default=DEFAULT_TOP, help="regressed documents listed per metric "
                   "(default %(default)s)")
    p.set_defaults(handler=cmd_compare)
    return p


def cmd_compare(args: argparse.Namespace) -> int:
    from service.eval.compare import compare_runs, render_compare, write_compare

    result = compare_runs(args.a, args.b, resamples=args.resamples, seed=args.seed, top=args.top)
    write_compare(args.out, result)
    print(render_compare(result), end="")
    print(f"wrote {args.out}/compare.json, compare.md")
    return 0


# --- import -------------------------------------------------------------------------------------------------------

def _import_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ocr-serve eval import", description="Convert annotations to an eval manifest "
                                "(image paths relative to the manifest).")
    p.add_argument("format", choices=["funsd", "icdar"])
    p.add_argument("src", type=Path, help="funsd: the folder holding annotations/ and images/ (or one JSON file); "
                   "icdar: the folder of gt_*.txt files (or one file)")
    p.add_argument("out", type=Path, help="the manifest to write (.jsonl)")
    p.add_argument("--images", type=Path, help="folder of the images (default: funsd images/ beside annotations/, "
                   "icdar the text files' folder)")
    p.set_defaults(handler=cmd_import)
    return p


def cmd_import(args: argparse.Namespace) -> int:
    from service.eval.importers import import_dataset
    from service.eval.manifest import load_manifest

    counts = import_dataset(args.format, args.src, args.out, args.images)
    load_manifest(args.out)  # what was written loads
    print(f"wrote {args.out}: {counts['documents']} documents, {counts['lines']} lines"
          + (f" ({counts['skipped']} without text or area skipped)" if counts["skipped"] else ""))
    return 0


# --- sample -------------------------------------------------------------------------------------------------------

def _sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ocr-serve eval sample", description="Write a deterministic labelled sample set "
                                "(receipts, ID cards, letters; English and Chinese) with exact line boxes.")
    p.add_argument("dir", type=Path)
    p.add_argument("--n", type=_positive_int, default=12, help="documents (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default %(default)s)")
    p.add_argument("--lang", choices=["both", "en", "zh"], default="both", help="languages (default %(default)s)")
    p.set_defaults(handler=cmd_sample)
    return p


def cmd_sample(args: argparse.Namespace) -> int:
    from service.eval.sample import write_sample

    manifest = write_sample(args.dir, args.n, args.seed, args.lang)
    print(f"wrote {manifest} ({args.n} documents, seed {args.seed})")
    return 0


PARSERS = {"run": _run_parser, "compare": _compare_parser, "import": _import_parser, "sample": _sample_parser}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _unit_interval(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text}")
    return value
