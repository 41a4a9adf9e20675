"""`ocr-serve batch`: OCR of folders, globs, list files and buckets on Ray Data, resumable, written once per page
(service/batch/, docs/BATCH.md)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from service.cli.config import settings_or_exit


def cmd_batch(args: argparse.Namespace) -> int:
    from service.batch.inputs import StoreOptions
    from service.batch.run import BatchOptions, run_batch

    # pages cross from the CPU tasks to the engine actors as pixels: the actors decode nothing
    settings = settings_or_exit(engine=args.engine, model=args.model, engine_image_transport="pixels")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request = {"task": args.task, "max_tokens": args.max_tokens, "target_language": args.target_language,
               "adapter": args.adapter, "confidence": not args.no_confidence}
    if args.fields:
        request["fields"] = [f.strip() for f in args.fields.split(",") if f.strip()]
    if args.schema:
        try:
            request["schema"] = json.loads(Path(args.schema).read_text())
        except (OSError, ValueError) as exc:
            print(f"ocr-serve batch: --schema {args.schema}: {exc}", file=sys.stderr)
            return 2
    options = BatchOptions(
        inputs=args.inputs, out=args.out, request={k: v for k, v in request.items() if v is not None},
        format=args.format, markdown=args.markdown, address=args.address, engine_actors=args.engine_actors,
        engine_gpus=args.engine_gpus, in_flight=args.in_flight, rows_per_call=args.rows_per_call,
        commit_every=args.commit_every, commit_interval_s=args.commit_interval_s, progress=not args.no_progress,
        store=StoreOptions.from_environment(args.s3_endpoint, args.s3_region))
    return run_batch(options, settings)


def add_cli(sub) -> None:
    p = sub.add_parser(
        "batch", help="OCR every page of folders, globs, list files or buckets on Ray Data into OUT (resumable)",
        description="Every page of every document the inputs name, through the service's own admission, engine and "
        "parsing on Ray Data, one record per page in OUT. Run it again with the same OUT to go on where it stopped. "
        "Exit status: 0 every page has a result, 1 some page failed (its record says why) or is not written yet, "
        "2 the run could not start, 130 interrupted. Settings (limits, the engine's) are the service's OCR_* "
        "variables (`ocr-serve config`); docs/BATCH.md.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a file, a folder (scanned recursively for images and PDFs), a glob ('scans/**/*.pdf'), "
                   "@FILE (inputs listed one per line), or a URI (s3://bucket/prefix, gs://…)")
    p.add_argument("--out", required=True, help="output folder or URI (s3://bucket/prefix): parts/ (the records), "
                   "_manifest/, _summary.json, markdown/")
    p.add_argument("--task", default="text", help="spotting | text | document | table | formula | chart | extract | "
                   "translate | subtitles | layout (default text; the embedded engine does spotting and text)")
    p.add_argument("--engine", choices=["embedded", "vllm", "mock"], help="engine (default: OCR_ENGINE or embedded)")
    p.add_argument("--model", help="model directory (vllm engine)")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="record format (default jsonl)")
    p.add_argument("--markdown", action="store_true", help="also write OUT/markdown/NAME.md per document")
    p.add_argument("--address", help="run on this Ray cluster (`auto`: the one on this machine or RAY_ADDRESS); "
                   "default: a Ray started on this machine for the run")
    request = p.add_argument_group("the request every page is run with (as POST /v1/ocr takes it)")
    request.add_argument("--fields", help="extract: comma-separated field names")
    request.add_argument("--schema", help="extract: a JSON Schema file")
    request.add_argument("--target-language", help="translate: the language to translate into")
    request.add_argument("--max-tokens", type=int, help="output token limit per page")
    request.add_argument("--adapter", help="LoRA adapter (vllm engine)")
    request.add_argument("--no-confidence", action="store_true", help="no token logprobs (confidences null)")
    layout = p.add_argument_group("layout and throughput")
    layout.add_argument("--engine-actors", type=int, help="engine actors (default: one per GPU for vllm, one per "
                        "CPU core for embedded)")
    layout.add_argument("--engine-gpus", type=float, help="GPUs per engine actor (default 1 for vllm; 0 runs "
                        "vLLM's CPU build)")
    layout.add_argument("--in-flight", type=int, help="pages in flight per engine actor (default: 2 × vLLM's "
                        "max_num_seqs; 2 for embedded)")
    layout.add_argument("--rows-per-call", type=int, default=1, help="pages per call of an engine actor (default 1)")
    layout.add_argument("--commit-every", type=int, default=256, help="pages per written part (default 256)")
    layout.add_argument("--commit-interval-s", type=float, default=30.0,
                        help="a part is written at least this often while pages arrive (default 30)")
    layout.add_argument("--no-progress", action="store_true", help="no progress line on stderr (the summary stays)")
    store = p.add_argument_group("object stores (credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                                 "AWS_SESSION_TOKEN or the provider's own configuration)")
    store.add_argument("--s3-endpoint", help="S3-compatible endpoint URL (default AWS_ENDPOINT_URL)")
    store.add_argument("--s3-region", help="S3 region (default AWS_REGION)")
    p.set_defaults(func=cmd_batch)
