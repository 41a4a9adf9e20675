"""The one registry of settings: every knob of the service, read from `OCR_*` environment variables.

`ocr-serve config` prints the effective values (secrets masked). Fields are grouped in request order:
server → admission (body, image, auth, limiter) → engine → parsing → Serve deployment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EngineKind = Literal["embedded", "vllm", "mock"]


class Settings(BaseSettings):
    """Settings of the OCR service. Env prefix `OCR_` (e.g. `OCR_ENGINE=vllm`)."""

    model_config = SettingsConfigDict(env_prefix="OCR_", extra="forbid", validate_default=True)

    # --- server -------------------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds to (0.0.0.0 in containers).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the API.")
    request_timeout_s: float = Field(
        300.0, gt=0, description="Hard limit on one request's time inside the service (engine call included)."
    )
    log_level: str = Field("INFO", description="Python log level of the service's loggers.")
    max_header_bytes: int = Field(
        16 * 1024, ge=1024, le=1024 * 1024,
        description="Largest request line + headers in bytes, counted while they arrive: the HTTP edge (Serve's "
        "proxy, an ingress replica's own port, HAProxy) answers 431 `headers_too_large` and closes the connection "
        "before reading more. The edge reads it from the environment (OCR_MAX_HEADER_BYTES; the Helm chart sets it).")
    header_timeout_s: float = Field(
        20.0, gt=0, le=600,
        description="Longest time a request's line and headers may take to arrive, from the connection's opening "
        "or the request's first byte: 408 `request_timeout` and the connection closed (slow-header clients). Read "
        "by the HTTP edge from the environment, like max_header_bytes.")
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Time a request's body may take to arrive, extended by one second per body_min_rate_bytes_s "
        "bytes received: a client that sends slower is cut with 408 `request_timeout`.")
    body_min_rate_bytes_s: int = Field(
        1024, ge=0, description="Body bytes per second that earn a slow upload more time beyond body_timeout_s "
        "(0 = the whole body within body_timeout_s).")
    max_concurrent_requests_per_tenant: int = Field(
        64, ge=0, description="Requests to /v1/ one tenant may have in flight on one ingress replica (each replica "
        "counts its own); past it 429 `too_many_concurrent_requests` with Retry-After. 0 = no cap.")

    # --- admission: body and image ------------------------------------------------------------------------------
    max_body_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024,
        description="Largest accepted request body in bytes (413 `payload_too_large`)."
    )
    max_image_pixels: int = Field(
        40_000_000,
        ge=10_000,
        description="Largest decoded image in pixels, checked from the header before decoding (decompression bombs).",
    )
    max_image_side: int = Field(20_000, ge=64, description="Largest accepted image width or height in pixels.")
    max_image_aspect_ratio: float = Field(
        200.0, ge=1.0, le=200.0, description="Longest side ÷ shortest side accepted (400 `unsupported_aspect_ratio` "
        "above it). 200 is the HunyuanOCR image processor's own limit (its `smart_resize` raises above it); a 1×4000 "
        "strip holds no document.")
    max_frames: int = Field(
        1, ge=1, description="Frames read from multi-frame GIF/TIFF; more frames than this are rejected."
    )
    allowed_formats: list[str] = Field(
        default_factory=lambda: ["PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF"],
        description="Image formats accepted after magic-byte sniffing (the Content-Type is ignored).",
    )
    max_json_items: int = Field(
        20_000, ge=100, description="Most items (objects, arrays, values) a JSON request body may hold, counted as "
        "its `{`, `[` and `,` bytes before it is parsed (413 `payload_too_large`): parsing costs CPU per item, and "
        "a body of tiny values at `max_body_bytes` would hold the ingress for seconds. A 32 KiB extraction schema "
        "has at most 16 000.")
    max_request_pixels: int = Field(
        500_000_000, ge=10_000, description="Decoded pixels one request may ask for in all: the sum over a job's "
        "images (read from their headers) or PDF pages (at the DPI they would be rendered at), refused with 413 "
        "`too_many_pixels` before anything is decoded. Bounds the decode and render work one job buys (fifty A4 "
        "scans at 300 dpi are 435 MP); a single image is bounded by max_image_pixels."
    )
    admission_threads: int = Field(
        4, ge=1, le=64, description="Threads of the ingress's admission pool, which runs every image decode and PDF "
        "sandbox call (interactive requests and job pages), apart from asyncio's default executor."
    )
    admission_threads_per_tenant: int = Field(
        2, ge=1, le=64, description="Admission pool threads one tenant may hold at once (at most admission_threads): "
        "the rest stay free for other tenants, whose waiting work is taken in turn, one tenant after another. "
        "Without API keys (open mode) everyone is one tenant, which may use every thread."
    )
    admission_queue_per_tenant: int = Field(
        32, ge=0, description="Admission work items (a decode, a PDF page) one tenant may have waiting for a "
        "thread; more answer 503 `overloaded` with Retry-After (and the request's tokens are given back)."
    )
    max_text_field_chars: int = Field(
        2000, ge=1, description="Longest free-text request field in characters: field names (422 "
        "`validation_error`), the text of a chat request's user messages and a completion's `prompt` (400 "
        "`prompt_too_long`). Checked before the text is sanitised."
    )
    max_fields: int = Field(64, ge=1, description="Most fields one extraction request may name.")
    max_schema_bytes: int = Field(32_768, ge=64, description="Largest JSON Schema accepted (an extraction `schema`, "
                                  "a chat `response_format` schema), in bytes.")
    max_schema_validation_steps: int = Field(
        50_000, ge=1_000, description="Budget for validating one model output against a tenant's JSON Schema: one "
        "step per keyword evaluated, one per 512 characters × RE2 instructions a `pattern` scans (50 000 ≈ 0.5 s of "
        "CPU at most; a 300-row table takes ≈ 6 000); past it the fields are reported unvalidated. Bounds schemas "
        "whose `$ref`s fan out exponentially.")

    # --- admission: keys and rate limits -------------------------------------------------------------------------
    api_keys_file: Path | None = Field(
        None, description="YAML/JSON file of hashed API keys (mounted from a Secret). None = open (development) mode."
    )
    redis_url: SecretStr | None = Field(
        None, description="Redis URL for the rate limiter and job store. None = in-process state (single node)."
    )
    rate_limit_cost: Literal["image_tokens", "pages", "requests"] = Field(
        "requests", description="What one bucket token pays for: image tokens, pages or requests."
    )
    default_rate: float = Field(
        10.0, gt=0, description="Refill rate (tokens/s) for tenants without their own rate (and open mode)."
    )
    default_burst: float = Field(20.0, gt=0, description="Bucket size for tenants without their own burst.")
    rate_limit_enabled: bool = Field(True, description="Apply the token bucket at all.")
    rate_limit_fail_mode: Literal["open", "closed"] = Field(
        "open", description="When Redis fails: `open` admits via a local bucket, `closed` answers 503."
    )
    redis_timeout_ms: int = Field(
        50, ge=1, description="Socket timeout of limiter calls to Redis; a dead Redis costs about this (a dropped "
        "connection is retried once on a new one, which a dead Redis refuses at once; timeouts are not retried)."
    )
    rate_limit_key_prefix: str = Field(
        "ocr:rl:", description="Prefix of the Redis bucket keys (`<prefix>{tenant}`; the hash tag is Cluster-safe)."
    )
    rate_limit_probe_interval_s: float = Field(
        1.0, gt=0, le=5,
        description="While Redis is down: how often one request probes it (recovery takes at most this long).",
    )
    rate_limit_backend_log_interval_s: float = Field(
        30.0, ge=0, description="While Redis is down: at most one error log line per this many seconds."
    )
    redis_state_check_interval_s: float = Field(
        5.0, gt=0, le=300, description="How often each ingress replica checks whether Redis restarted, failed over "
        "or lost the service's state (rate-limit buckets, jobs); counted in `ocr_redis_resets_total`."
    )
    api_keys_reload_interval_s: float = Field(
        1.0, ge=0, description="How often the key file is checked for changes (Secret rotation); 0 = every request."
    )

    # --- engine -------------------------------------------------------------------------------------------------
    engine: EngineKind = Field(
        "embedded", description="`embedded` (rapidocr on CPU), `vllm` (HunyuanOCR on vLLM) or `mock` (tests)."
    )
    model: Path | None = Field(
        None, description="HunyuanOCR model directory for the vLLM engine (config, tokenizer, weights)."
    )
    served_model_name: str = Field("hunyuan-ocr", description="Name of the base model in /v1/models and responses.")
    load_format: str = Field("auto", description="vLLM load format (`dummy` = random weights, for benchmarks).")
    dtype: str = Field("auto", description="vLLM weight/activation dtype (`bfloat16` on GPUs).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory vLLM may take (weights + KV cache)."
    )
    max_model_len: int = Field(
        8192, ge=256, description="Context length: image tokens + prompt + output must fit (the image is downscaled)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Most sequences vLLM runs in one batch.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="vLLM scheduler token budget per step.")
    enable_prefix_caching: bool = Field(
        False, description="vLLM prefix caching (off: HunyuanOCR crashed on prefix-cache hits before vLLM PR #53456)."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs / compile (faster start, slower steps).")
    image_processor_backend: Literal["pil", "torchvision"] = Field(
        "torchvision", description="Backend of HunyuanOCR's HF image processor in vLLM (`mm_processor_kwargs`). vLLM "
        "0.26 pins `pil`; `torchvision` packs patches identically (checked by `bench preprocess`) at 2-3x the "
        "images/s, and this per-image CPU work caps a replica's throughput (docs/BENCHMARKS.md)."
    )
    engine_image_transport: Literal["png", "pixels"] = Field(
        "png", description="How the ingress hands a page to an engine that takes both (vLLM). `png`: a PNG file (the "
        "upload itself when it already is a bare PNG of the admitted pixels); the engine replica decodes it. "
        "`pixels`: the decoded 8-bit RGB rows, so the replica decodes nothing, but each page in flight is height × "
        "width × 3 bytes (an A4 page at 150 dpi 6.4 MB, against 0.17 MB of PNG) and crosses Ray as such; on CPU "
        "that cost more than the decode it saves (docs/BENCHMARKS.md). The embedded engine always gets PNG."
    )
    png_pixel_check: Literal["engine", "ingress"] = Field(
        "engine", description="Where the pixels of an uploaded bare PNG (8-bit RGB, pixel chunks only) that goes to "
        "the engine as it is get decoded. `engine`: the ingress checks its chunks, their CRCs and its header (type, "
        "size limits) and decodes nothing; the engine replica decodes every PNG page anyway and answers "
        "`invalid_image` (400) when the pixel stream is corrupt. One full decode less per page on the request path "
        "(docs/BENCHMARKS.md, `bench cpu --parts png_check`). Streams too: their 200 waits for the engine's first "
        "output. `ingress`: the ingress decodes it too, so an engine replica only ever decodes pixel streams that "
        "decoded once already."
    )
    engine_image_presize: bool = Field(
        False, description="The ingress resizes each page to the size the engine's image processor would (sides in "
        "multiples of 32, area within the processor's min/max pixels) with that processor's own kernel, so the "
        "processor in the engine replica skips its resize and the model sees identical pixels. Moves that CPU work "
        "to the ingress, which scales out: on the H200 (with `pixels`) the replica's CPU at 128 clients fell from "
        "234 % to 166 %, its docs/s stayed the same (docs/BENCHMARKS.md, seventh session). Needs torchvision in "
        "the ingress (it comes with vLLM); without it the engine resizes. With `png` transport the ingress also "
        "re-encodes pages it resized."
    )
    preprocess_workers: int = Field(
        8, ge=1, le=64, description="Threads that run the HF image processor for the engine (vLLM "
        "`renderer_num_workers`): one thread caps a GPU at ≈ 1 / (processor time per page)."
    )
    preprocess_processes: int = Field(
        0, ge=0, le=64, description="Processes that render pages for the vLLM engine (PNG decode, tokenizer, HF "
        "image processor), beside the engine replica's process; 0 = vLLM's renderer threads (`preprocess_workers`) "
        "inside it, under the GIL the token stream needs too. On the H200 (docs/BENCHMARKS.md, thirtieth session) 4 "
        "per engine took the replicas' CPU from 118-267 % to 50-85 % and served 0.96-1.19x the ID cards/s with two "
        "engines per GPU, but 0.76-0.99x with one engine and 0.92-0.93x for A4 pages (each process renders one page "
        "at a time); 8 with one engine served 1.02-1.29x the ID cards/s and 0.94-0.99x the A4 pages/s (thirty-fourth "
        "and thirty-seventh sessions). They start while vLLM's engine starts (started after it, they had made the "
        "service ready 23-61 s later) and use CPU outside the replica's Ray CPUs."
    )
    engine_torch_threads: int = Field(
        1, ge=0, le=256, description="PyTorch CPU threads of each vLLM EngineCore process (its `OMP_NUM_THREADS`). "
        "The EngineCore's CPU tensor work (each step's image batch, input preparation) is small; with one thread per "
        "core it spins threads against the frontend's: on the H200 raw `vllm serve` served 1.25x the ID cards/s with "
        "1 thread (docs/BENCHMARKS.md). 0 = inherit the environment (Ray sets floor(engine_num_cpus))."
    )
    engine_stream_interval: int = Field(
        1, ge=1, le=256, description="Output tokens the vLLM engine gathers before it hands a request's output to "
        "the engine replica (vLLM `stream_interval`; the first and the last token go at once). 1 = every decode "
        "step: the replica takes each token as it comes (its repetition check; a stream's next piece). "
        "More: fewer hand-overs per page on the replica's event loop, and a stream's text in pieces of that many "
        "tokens; the repetition guard then acts up to that many tokens later. On the H200 our replica kept up with "
        "every token (the last one arrived 1-26 ms after the engine core made it) and 16 changed nothing "
        "measurable (docs/BENCHMARKS.md, eighteenth session)."
    )
    max_output_tokens: int = Field(
        2048, ge=1, description="Default and upper bound of output tokens per request (budgeted with the image)."
    )
    bench_fixed_output_tokens: bool = Field(
        False, description="Benchmarks only: every request generates exactly its max_tokens output tokens "
        "(ignore_eos + min_tokens), so runs compare like for like (docs/BENCHMARKS.md). Never in production."
    )
    min_image_pixels: int = Field(
        512 * 512, ge=1024, description="Processor min_pixels (images are upscaled to it), for the image-token "
        "budget of an engine that does not report its processor's (vLLM reads its model's preprocessor_config).")
    max_engine_image_pixels: int = Field(
        2048 * 2048, ge=1024, description="Processor max_pixels (larger images are downscaled to it), for the "
        "image-token budget of an engine that does not report its processor's; also the cap PDF pages render to."
    )
    enable_lora: bool = Field(False, description="Enable LoRA adapter slots in vLLM. The slots slow requests "
                              "without an adapter too (docs/DEPLOY.md): leave off where no adapter is served.")
    max_loras: int = Field(4, ge=1, description="LoRA slots on the GPU (adapters active in one batch).")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank accepted.")
    max_cpu_loras: int | None = Field(None, ge=1, description="LoRA adapters cached in CPU memory (LRU).")
    adapters_dir: Path | None = Field(
        None, description="Directory whose sub-directories are LoRA adapters (name = directory name)."
    )
    max_adapters_per_replica: int = Field(
        4, ge=1, description="Adapters one replica keeps loaded (Serve multiplexing LRU)."
    )
    vllm_extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra vLLM engine arguments (JSON object), passed as they are."
    )
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="vLLM KV cache size in GiB instead of gpu_memory_utilization's share (CPU engines "
        "need it; None = vLLM's default)."
    )
    embedded_det_limit_side_len: int = Field(
        960, ge=32, description="Embedded engine: longest side the detector sees (rapidocr `limit_side_len`)."
    )
    embedded_threads: int = Field(0, ge=0, description="Embedded engine: ONNX Runtime intra-op threads (0 = auto).")
    mock_delay_s: float = Field(0.0, ge=0, description="Mock engine: seconds each request takes (tests, autoscaling).")
    mock_start_delay_s: float = Field(0.0, ge=0, description="Mock engine: seconds its start takes, times the Serve "
                                      "replica's rank (tests of start-up with replicas that come up one by one).")

    # --- parsing / output -----------------------------------------------------------------------------------------
    repetition_min_chars: int = Field(
        4000, ge=0, description="Repetition guard: output length before a repeating tail may be cut (0 = off)."
    )
    repetition_min_repeats: int = Field(
        8, ge=2, description="Repetition guard: repeats of the tail unit that count as a loop."
    )
    repetition_max_unit_chars: int = Field(200, ge=1, description="Repetition guard: longest repeating unit checked.")
    repetition_check_every_chars: int = Field(
        64, ge=1, description="Repetition guard: new output characters between two tail checks while streaming."
    )
    prompt_set: Literal["1.0", "1.5"] = Field(
        "1.5", description="HunyuanOCR prompt wording: `1.5` fixed task-type prompts (Chinese) or `1.0` English "
        "application prompts; tasks without a 1.5 type always use the 1.0 prompt (service/tasks.py)."
    )
    spotting_format: Literal["hunyuan", "json"] = Field(
        "hunyuan", description="Spotting output HunyuanOCR 1.5 is asked for: `hunyuan` (<ref>/<quad> markup, task "
        "spotting_hunyuan) or `json` ([{box, text}], task spotting_json). The parser reads every format either way."
    )
    spotting_guided_json: bool = Field(
        False, description="With spotting_format=json: constrain spotting output to the line-array JSON Schema "
        "(vLLM structured output), so every output parses into lines."
    )
    include_raw_output: bool = Field(
        True, description="Allow requests to ask for the raw model output (`include_raw`: text, token logprobs, "
        "rendered prompt) for replay with `ocr-serve parse`."
    )
    extraction_guided_retry: bool = Field(
        False, description="Retry an extraction once with guided (structured) JSON decoding when validation fails."
    )
    repetition_penalty: float = Field(1.0, gt=0, description="Sampling repetition penalty (HunyuanOCR 1.5: 1.08).")

    # --- jobs (multi-page) ------------------------------------------------------------------------------------------
    max_pdf_pages: int = Field(50, ge=1, description="Most pages one job may have.")
    max_pdf_bytes: int = Field(50 * 1024 * 1024, ge=1024, description="Largest PDF/job upload in bytes.")
    max_pdf_dpi: int = Field(200, ge=36, description="Highest rasterisation DPI (the image budget may choose lower).")
    job_ttl_s: int = Field(3600, ge=10, description="How long job results are kept.")
    job_page_retries: int = Field(2, ge=0, description="Retries of a page whose engine call failed.")
    job_page_concurrency: int = Field(8, ge=1, description="Pages of one job in flight at once.")
    job_pages_in_flight: int | None = Field(
        None, ge=1, description="Job pages one ingress replica has at the engines at once, all jobs and tenants "
        "together, granted to the tenants' jobs in turn. Interactive requests (/v1/ocr, OpenAI) take no slot: with "
        "job pages filling fewer than all of the engines' request slots, they find a free one instead of queueing "
        "behind a job backlog. None: half the engines' slots at their fewest replicas (max_ongoing_requests × "
        "min_replicas / 2), shared by the ingress replicas (docs/JOBS.md, Fairness)."
    )
    max_running_jobs_per_tenant: int = Field(
        4, ge=1, description="Jobs one tenant may have running at once (counted in Redis across ingress replicas "
        "when redis_url is set); another one answers 429 `too_many_jobs`."
    )
    pdf_render_timeout_s: float = Field(
        30.0, gt=0, description="PDF sandbox: longest time to open/parse/render one page before it counts as a bomb."
    )
    pdf_document_cpu_s: float = Field(
        60.0, gt=0, description="PDF sandbox: CPU seconds one document may use in all (opening, loading and rendering "
        "its pages, over every sandbox process it needs: RLIMIT_CPU); pages not rendered by then fail `invalid_pdf`."
    )
    pdf_document_timeout_s: float = Field(
        120.0, gt=0, description="PDF sandbox: seconds the ingress may wait for one document's sandbox in all (a job's "
        "pacing by the engine or the rate limit is not counted); pages not rendered by then fail `invalid_pdf`."
    )
    pdf_render_memory_mb: int = Field(
        1024, ge=256, description="PDF sandbox: address-space limit of the PDFium subprocess in MiB (PDF bombs)."
    )
    webhook_allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Job webhooks: host names, IP addresses or CIDR networks that may receive webhooks although they "
        "are loopback/private/link-local (explicit allow-list, JSON list). Empty: only public addresses.",
    )
    webhook_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Job webhooks: time limit of the DNS lookup at POST and of each delivery "
        "attempt (connect, send, read the answer)."
    )
    webhook_max_attempts: int = Field(
        3, ge=1, le=10, description="Job webhooks: delivery attempts; retried on 5xx, 408, 429, connection errors and "
        "timeouts, with backoff 1 s doubling up to 30 s."
    )
    webhook_secret: SecretStr | None = Field(
        None, description="Job webhooks: HMAC-SHA256 key; when set each delivery carries `X-OCR-Timestamp` and "
        "`X-OCR-Signature: sha256=<hex HMAC of timestamp + '.' + body>`."
    )

    # --- Ray Serve deployment --------------------------------------------------------------------------------------
    serve_topology: Literal["split", "colocated"] = Field(
        "split", description="`split`: CPU ingress replicas (HTTP, admission, image work) call engine replicas "
        "through Serve handles; ingress and engines scale apart. `colocated`: each replica serves HTTP and holds "
        "an engine in one process, so no Serve hop lies between them; ingress_replicas and ingress_num_cpus "
        "are then unused (engine_num_cpus covers the process), and max_queued_requests counts per replica. Lower "
        "latency at one client; but the image work is no longer spread over other processes, and a request on a "
        "replica that dies is not retried on another (docs/DEPLOY.md)."
    )
    engine_num_gpus: float | None = Field(
        None, ge=0, description="GPUs per engine replica; None = 1 for `vllm`, 0 otherwise."
    )
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per engine replica.")
    ingress_num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per ingress replica.")
    ingress_replicas: int = Field(1, ge=1, description="Ingress replicas (HTTP, validation, image decode).")
    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas (autoscaling).")
    max_replicas: int = Field(1, ge=1, description="Most engine replicas (autoscaling).")
    initial_replicas: int | None = Field(None, ge=0, description="Engine replicas at start (None = min_replicas).")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Queue-depth target: ongoing requests per engine replica the autoscaler aims for."
    )
    max_ongoing_requests: int = Field(32, ge=1, description="Requests one engine replica takes at once.")
    max_queued_requests: int = Field(
        256, ge=-1, description="Requests waiting for an engine replica before new ones get 503 (-1 = unbounded)."
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="Autoscaler: seconds over target before adding replicas.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Autoscaler: seconds under target before removing.")
    latency_target_ms: float | None = Field(
        None, gt=0, description="Autoscaler latency rule: p95 target in ms (None = queue-depth rule only)."
    )
    latency_downscale_ratio: float = Field(
        0.8, gt=0, le=1, description="Autoscaler latency rule: replicas are removed only while p95 is below "
        "latency_target_ms × this ratio (hysteresis) and the queue is short (service/serve/autoscaling.py)."
    )
    autoscaling_look_back_s: float = Field(
        30.0, gt=0, description="Autoscaler: window over which queue depth and p95 latency are averaged."
    )
    autoscaling_metrics_interval_s: float = Field(
        10.0, gt=0, description="Autoscaler: how often replicas and handles push queue/latency metrics "
        "(below autoscaling_look_back_s)."
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Serve health check period of engine replicas.")
    health_check_timeout_s: float = Field(60.0, gt=0, description="Serve health check timeout of engine replicas.")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="Time in-flight requests get to finish when a replica (ingress or engine) stops."
    )
    graceful_shutdown_wait_loop_s: float = Field(
        0.25, gt=0, description="How often a stopping replica checks whether its in-flight requests have finished. "
        "Each stop waits at least one period, and Serve stops the ingress before the engine: with Serve's default "
        "of 2 s every shutdown took 4 s longer."
    )

    # --- observability ---------------------------------------------------------------------------------------------
    metrics_enabled: bool = Field(
        True, description="Record `ocr_*` (and vLLM's `vllm:*`) metrics through Ray's metrics agent (docs/METRICS.md)."
    )
    metrics_export_port: int | None = Field(
        None, ge=1, le=65535,
        description="`ocr-serve serve`: port of Ray's Prometheus endpoint on this node (None = Ray picks a free one; "
        "KubeRay uses 8080).",
    )
    latency_slo_s: float = Field(
        10.0, gt=0, description="p95 end-to-end latency objective in seconds (dashboards, `OCRHighP95Latency` alert)."
    )

    @field_validator("allowed_formats")
    @classmethod
    def _upper_formats(cls, value: list[str]) -> list[str]:
        return [fmt.upper() for fmt in value]

    @field_validator("webhook_allowed_hosts")
    @classmethod
    def _normalise_webhook_hosts(cls, value: list[str]) -> list[str]:
        return [host.strip().lower().strip("[]").rstrip(".") for host in value if host.strip()]

    @field_validator("vllm_extra_args", mode="before")
    @classmethod
    def _parse_json_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> "Settings":
        if self.engine == "vllm" and self.model is None:
            raise ValueError("OCR_MODEL must name a model directory when OCR_ENGINE=vllm")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.min_image_pixels > self.max_engine_image_pixels:
            raise ValueError("min_image_pixels must not exceed max_engine_image_pixels")
        if self.admission_threads_per_tenant > self.admission_threads:
            raise ValueError("admission_threads_per_tenant must not exceed admission_threads")
        if self.api_keys_file is not None and not self.api_keys_file.exists():
            raise ValueError(f"api_keys_file {self.api_keys_file} does not exist")
        return self

    @property
    def resolved_job_pages_in_flight(self) -> int:
        if self.job_pages_in_flight is not None:
            return self.job_pages_in_flight
        if self.serve_topology == "colocated":  # each replica's own engine
            return max(1, self.max_ongoing_requests // 2)
        return max(1, self.max_ongoing_requests * max(1, self.min_replicas) // (2 * self.ingress_replicas))

    @property
    def resolved_engine_num_gpus(self) -> float:
        if self.engine_num_gpus is not None:
            return self.engine_num_gpus
        return 1.0 if self.engine == "vllm" else 0.0

    def masked(self) -> dict[str, Any]:
        """Effective settings as JSON-able values, secrets masked (for `ocr-serve config` and logs)."""
        out = json.loads(self.model_dump_json())
        for name, value in out.items():
            if isinstance(getattr(self, name), SecretStr) and value is not None:
                out[name] = "**********"
        return out


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with explicit overrides (CLI flags) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
