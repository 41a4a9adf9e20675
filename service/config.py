"""The one registry of settings, as nested sections in request order: server → limits → auth → rate_limit →
redis → engine (embedded, vllm, lora) → parsing → pdf → jobs (webhook) → serve → observability; `testing` holds
the switches of tests and benchmarks, never set in production.

Every setting has one flat name, unique across sections: the field's name, or its alias where the name alone would
be ambiguous (`rate_limit.enabled` is `rate_limit_enabled`). The flat names are the public interface:
`OCR_<FLAT_NAME>` environment variables (`OCR_MAX_BODY_BYTES=...`), the Helm chart's `settings:` keys and
`Settings(**kwargs)`. The nested form works too: `OCR_LIMITS__MAX_BODY_BYTES`, `{"limits": {...}}`. Lists and
objects are JSON in the environment. Names of settings that moved into a pass-through (`OCR_DTYPE` → vLLM's
`engine_kwargs`, `OCR_MIN_REPLICAS` → Serve's `engine_deployment`) are still read: `LEGACY_NAMES`.

vLLM engine arguments pass through `engine_kwargs` (checked against vLLM's own argument names where vLLM is
importable); Ray Serve deployment options through `engine_deployment` and `ingress_deployment` (checked against Ray
Serve's own), on top of the product's defaults. `ocr-serve config` prints the effective settings, secrets masked;
docs/CONFIG.md is generated from these models (`ocr-serve config --markdown`).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "OCR_"
NESTED_DELIMITER = "__"
# What the client commands (`ocr-serve ocr`, `ocr-serve ui`, `ocr-serve eval`) read: not settings of the service, so
# `ocr-serve config` does not report them as unknown. The key stays out of shell history and `ps`.
CLIENT_VARIABLES = {
    "OCR_URL": "Base URL of the service the client commands call (default http://127.0.0.1:8000).",
    "OCR_API_KEY": "API key the client commands send (`Authorization: Bearer`) unless `--api-key` is given.",
}
DEFAULT_SERVICE_URL = "http://127.0.0.1:8000"
EngineKind = Literal["embedded", "vllm", "mock"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True)


# --- server ---------------------------------------------------------------------------------------------------------

class ServerConfig(Section):
    """The HTTP server."""

    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds to (0.0.0.0 in containers).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the API.")
    request_timeout_s: float = Field(
        300.0, gt=0, description="Hard limit on one request's time inside the service (engine call included).")
    log_level: str = Field("INFO", description="Python log level of the service's loggers.")


# --- admission ------------------------------------------------------------------------------------------------------

class LimitsConfig(Section):
    """What one request may send and cost, each checked before the work it bounds (docs/SECURITY.md)."""

    max_header_bytes: int = Field(
        16 * 1024, ge=1024, le=1024 * 1024,
        description="Largest request line + headers in bytes, counted while they arrive: the HTTP edge (Serve's "
        "proxy, an ingress replica's own port, HAProxy) answers 431 `headers_too_large` and closes the connection. "
        "The edge reads it from the environment (OCR_MAX_HEADER_BYTES; the Helm chart sets it).")
    header_timeout_s: float = Field(
        20.0, gt=0, le=600,
        description="Longest time a request's line and headers may take to arrive: 408 `request_timeout` and the "
        "connection closed (slow-header clients). Read by the HTTP edge from the environment, like max_header_bytes.")
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Time a request's body may take to arrive, extended by one second per body_min_rate_bytes_s "
        "bytes received: a client that sends slower is cut with 408 `request_timeout`.")
    body_min_rate_bytes_s: int = Field(
        1024, ge=0, description="Body bytes per second that earn a slow upload more time beyond body_timeout_s "
        "(0 = the whole body within body_timeout_s).")
    max_concurrent_requests_per_tenant: int = Field(
        64, ge=0, description="Requests to /v1/ one tenant may have in flight on one ingress replica (each replica "
        "counts its own); past it 429 `too_many_concurrent_requests` with Retry-After. 0 = no cap. Off without API "
        "keys (open mode: every caller is one tenant).")
    max_body_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024,
        description="Largest accepted request body in bytes (413 `payload_too_large`).")
    max_json_items: int = Field(
        20_000, ge=100, description="Most items (objects, arrays, values) a JSON request body may hold, counted as "
        "its `{`, `[` and `,` bytes before it is parsed (413 `payload_too_large`): parsing costs CPU per item. A 32 "
        "KiB extraction schema has at most 16 000.")
    max_image_pixels: int = Field(
        40_000_000, ge=10_000,
        description="Largest decoded image in pixels, checked from the header before decoding (decompression bombs).")
    max_image_side: int = Field(20_000, ge=64, description="Largest accepted image width or height in pixels.")
    max_image_aspect_ratio: float = Field(
        200.0, ge=1.0, le=200.0, description="Longest side ÷ shortest side accepted (400 `unsupported_aspect_ratio` "
        "above it); 200 is the HunyuanOCR image processor's own limit.")
    max_frames: int = Field(
        1, ge=1, description="Frames read from multi-frame GIF/TIFF; more frames than this are rejected.")
    allowed_formats: list[str] = Field(
        default_factory=lambda: ["PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF"],
        description="Image formats accepted after magic-byte sniffing (the Content-Type is ignored).")
    max_request_pixels: int = Field(
        500_000_000, ge=10_000, description="Decoded pixels one request may ask for in all: the sum over a job's "
        "images (from their headers) or PDF pages (at the DPI they would be rendered at), refused with 413 "
        "`too_many_pixels` before anything is decoded. A single image is bounded by max_image_pixels.")
    admission_threads: int = Field(
        4, ge=1, le=64, description="Threads of the ingress's admission pool, which runs every image decode and PDF "
        "sandbox call (interactive requests and job pages), apart from asyncio's default executor.")
    admission_threads_per_tenant: int = Field(
        2, ge=1, le=64, description="Admission pool threads one tenant may hold at once (at most admission_threads); "
        "other tenants' waiting work is taken in turn. Without API keys (open mode) everyone is one tenant, which "
        "may use every thread.")
    admission_queue_per_tenant: int = Field(
        32, ge=0, description="Admission work items (a decode, a PDF page) one tenant may have waiting for a "
        "thread; more answer 503 `overloaded` with Retry-After (and the request's tokens are given back).")
    max_text_field_chars: int = Field(
        2000, ge=1, description="Longest free-text request field in characters: field names (422 "
        "`validation_error`), the text of a chat request's user messages and a completion's `prompt` (400 "
        "`prompt_too_long`). Checked before the text is sanitised.")
    max_fields: int = Field(64, ge=1, description="Most fields one extraction request may name.")
    max_schema_bytes: int = Field(32_768, ge=64, description="Largest JSON Schema accepted (an extraction `schema`, "
                                  "a chat `response_format` schema), in bytes.")
    max_schema_validation_steps: int = Field(
        50_000, ge=1_000, description="Budget for validating one model output against a tenant's JSON Schema: one "
        "step per keyword evaluated, one per 512 characters × RE2 instructions a `pattern` scans (50 000 ≈ 0.5 s of "
        "CPU at most); past it the fields are reported unvalidated.")

    @field_validator("allowed_formats")
    @classmethod
    def _upper_formats(cls, value: list[str]) -> list[str]:
        return [fmt.upper() for fmt in value]

    @model_validator(mode="after")
    def _threads(self) -> "LimitsConfig":
        if self.admission_threads_per_tenant > self.admission_threads:
            raise ValueError("admission_threads_per_tenant must not exceed admission_threads")
        return self


class AuthConfig(Section):
    """API keys (service/admission/auth.py)."""

    api_keys_file: Path | None = Field(
        None, description="YAML/JSON file of hashed API keys (mounted from a Secret). None = open (development) mode: "
        "every caller is the anonymous admin.")
    api_keys_reload_interval_s: float = Field(
        1.0, ge=0, description="How often the key file is checked for changes (Secret rotation); 0 = every request.")

    @field_validator("api_keys_file")
    @classmethod
    def _exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists():
            raise ValueError(f"api_keys_file {value} does not exist")
        return value


class RateLimitConfig(Section):
    """The per-tenant token bucket (service/admission/ratelimit.py): in Redis when redis_url is set."""

    enabled: bool = Field(True, alias="rate_limit_enabled", description="Apply the token bucket at all.")
    cost: Literal["image_tokens", "pages", "requests"] = Field(
        "requests", alias="rate_limit_cost", description="What one bucket token pays for: image tokens, pages or "
        "requests.")
    default_rate: float = Field(
        10.0, gt=0, description="Refill rate (tokens/s) for tenants without their own rate (and open mode).")
    default_burst: float = Field(20.0, gt=0, description="Bucket size for tenants without their own burst.")
    fail_mode: Literal["open", "closed"] = Field(
        "open", alias="rate_limit_fail_mode",
        description="When Redis fails: `open` admits via a local bucket, `closed` answers 503.")
    redis_timeout_ms: int = Field(
        50, ge=1, description="Socket timeout of limiter calls to Redis; a dead Redis costs about this (a dropped "
        "connection is retried once on a new one; timeouts are not retried).")
    key_prefix: str = Field(
        "ocr:rl:", alias="rate_limit_key_prefix",
        description="Prefix of the Redis bucket keys (`<prefix>{tenant}`; the hash tag is Cluster-safe).")
    probe_interval_s: float = Field(
        1.0, gt=0, le=5, alias="rate_limit_probe_interval_s",
        description="While Redis is down: how often one request probes it (recovery takes at most this long).")
    backend_log_interval_s: float = Field(
        30.0, ge=0, alias="rate_limit_backend_log_interval_s",
        description="While Redis is down: at most one error log line per this many seconds.")


class RedisConfig(Section):
    """The shared state of the ingress replicas: rate-limit buckets, jobs and their results."""

    url: SecretStr | None = Field(
        None, alias="redis_url",
        description="Redis URL for the rate limiter and job store. None = in-process state (one ingress replica).")
    state_check_interval_s: float = Field(
        5.0, gt=0, le=300, alias="redis_state_check_interval_s",
        description="How often each ingress replica checks whether Redis restarted, failed over or lost the "
        "service's state (rate-limit buckets, jobs); counted in `ocr_redis_resets_total`.")


# --- engine ---------------------------------------------------------------------------------------------------------

class EmbeddedConfig(Section):
    """The embedded CPU engine (rapidocr, ONNX)."""

    det_limit_side_len: int = Field(
        960, ge=32, alias="embedded_det_limit_side_len",
        description="Longest side the detector sees (rapidocr `limit_side_len`).")
    threads: int = Field(0, ge=0, alias="embedded_threads", description="ONNX Runtime intra-op threads (0 = auto).")


# vLLM engine arguments the product sets unless engine_kwargs does (docs/design/engine-settings.md)
VLLM_DEFAULT_KWARGS: dict[str, Any] = {
    "dtype": "auto",
    "load_format": "auto",
    "gpu_memory_utilization": 0.9,  # not set on CPU builds, which size the KV cache by kv_cache_memory_bytes
    "max_num_seqs": 64,
    "enable_prefix_caching": False,  # docs/design/kv-cache-and-caching.md
    "enforce_eager": False,
    "renderer_num_workers": 8,  # threads running the HF image processor (docs/design/image-preprocessing.md)
    "stream_interval": 1,  # every token reaches the replica (repetition guard, streams)
    "mm_processor_cache_gb": 0,  # every page is new; the cache also forbids more than one renderer thread
    "disable_log_stats": True,  # stats go to the Ray stat logger only (docs/METRICS.md), no periodic log lines
    "seed": 0,
}
# vLLM's CPU build (no GPU): in place of gpu_memory_utilization, a KV cache sized in bytes (room for a few full
# contexts of HunyuanOCR-1B at the default max_model_len), and fewer sequences at once than a GPU takes
VLLM_CPU_DEFAULT_KWARGS: dict[str, Any] = {"kv_cache_memory_bytes": 2 * 2**30, "max_num_seqs": 8}
# set by the engine from other settings; engine_kwargs may not name them
VLLM_MANAGED_KWARGS = frozenset({"model", "tokenizer", "served_model_name", "max_model_len", "enable_lora",
                                 "max_loras", "max_lora_rank", "max_cpu_loras", "limit_mm_per_prompt",
                                 "distributed_executor_backend"})


class VLLMConfig(Section):
    """HunyuanOCR on vLLM (service/engine/vllm/)."""

    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine arguments (AsyncEngineArgs names) on top of the product's defaults "
        f"({', '.join(f'{k}={v}' for k, v in VLLM_DEFAULT_KWARGS.items())}; on vLLM's CPU build "
        f"{', '.join(f'{k}={v}' for k, v in VLLM_CPU_DEFAULT_KWARGS.items())} instead of gpu_memory_utilization, "
        "and dtype=float32 on a CPU without bf16 instructions), "
        "e.g. `{\"dtype\": \"bfloat16\", "
        "\"max_num_seqs\": 128, \"kv_cache_memory_bytes\": 25769803776}`. Checked against vLLM's own arguments "
        "where vLLM is importable.")
    image_processor_backend: Literal["pil", "torchvision"] = Field(
        "torchvision", description="Backend of HunyuanOCR's HF image processor (`mm_processor_kwargs`): "
        "`torchvision` packs the same patches as `pil` at 2-3x the images/s (docs/design/image-preprocessing.md).")
    preprocess_processes: int = Field(
        0, ge=0, le=64, description="Processes that render pages for the vLLM engine (PNG decode, tokenizer, HF image "
        "processor) beside the engine replica's process; 0 = vLLM's renderer threads inside it "
        "(docs/design/engines-per-gpu.md). They use CPU outside the replica's Ray CPUs.")
    torch_threads: int = Field(
        1, ge=0, le=256, alias="engine_torch_threads",
        description="PyTorch CPU threads of each vLLM EngineCore process (its `OMP_NUM_THREADS`); 0 = inherit the "
        "environment (docs/design/engine-settings.md).")

    @field_validator("engine_kwargs")
    @classmethod
    def _known_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            return value
        managed = sorted(VLLM_MANAGED_KWARGS & set(value))
        if managed:
            raise ValueError(f"engine_kwargs may not set {managed}: the service sets them from its own settings")
        known = vllm_argument_names()
        unknown = sorted(set(value) - known) if known else []
        if unknown:
            raise ValueError(f"unknown vLLM engine arguments in engine_kwargs: {unknown}")
        return value

    def kwargs(self, *, on_cpu: bool, cpu_bf16: bool = True) -> dict[str, Any]:
        """The product's defaults with engine_kwargs on top; on a CPU without bf16 instructions (AVX512-BF16 or
        AMX), float32, which runs faster there than emulated bf16 (vLLM's `auto` picks bf16 or fp16)."""
        defaults = dict(VLLM_DEFAULT_KWARGS)
        if on_cpu:
            defaults.pop("gpu_memory_utilization")
            defaults.update(VLLM_CPU_DEFAULT_KWARGS)
            if not cpu_bf16:
                defaults["dtype"] = "float32"
        return {**defaults, **self.engine_kwargs}


@functools.lru_cache(maxsize=1)
def vllm_argument_names() -> frozenset[str]:
    """vLLM's engine argument names, or empty where vLLM is not importable (the check is skipped then)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return frozenset()
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


class LoRAConfig(Section):
    """LoRA adapter slots of the vLLM engine (docs/design/lora.md)."""

    enabled: bool = Field(False, alias="enable_lora", description="Enable LoRA adapter slots in vLLM. The slots slow "
                          "requests without an adapter too: leave off where no adapter is served.")
    max_loras: int = Field(4, ge=1, description="LoRA slots on the GPU (adapters active in one batch).")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank accepted.")
    max_cpu_loras: int | None = Field(None, ge=1, description="LoRA adapters cached in CPU memory (LRU); None = "
                                      "max(max_loras, max_adapters_per_replica).")
    adapters_dir: Path | None = Field(
        None, description="Directory whose sub-directories are LoRA adapters (name = directory name).")
    max_adapters_per_replica: int = Field(
        4, ge=1, description="Adapters one replica keeps loaded (Serve multiplexing LRU).")


class EngineConfig(Section):
    """The engine behind the seam in service/engine/protocol.py, and what the ingress budgets for it."""

    kind: EngineKind = Field(
        "embedded", alias="engine",
        description="`embedded` (rapidocr on CPU), `vllm` (HunyuanOCR on vLLM) or `mock` (the test double).")
    model: Path | None = Field(
        None, description="HunyuanOCR model directory for the vLLM engine (config, tokenizer, weights).")
    served_model_name: str = Field("hunyuan-ocr", description="Name of the base model in /v1/models and responses.")
    max_model_len: int = Field(
        8192, ge=256, description="Context length: image tokens + prompt + output must fit (the image is downscaled).")
    max_output_tokens: int = Field(
        2048, ge=1, description="Default and upper bound of output tokens per request (budgeted with the image).")
    min_image_pixels: int = Field(
        512 * 512, ge=1024, description="Processor min_pixels (images are upscaled to it), for the image-token budget "
        "of an engine that does not report its processor's (vLLM reads its model's preprocessor_config).")
    max_engine_image_pixels: int = Field(
        2048 * 2048, ge=1024, description="Processor max_pixels (larger images are downscaled to it), for the "
        "image-token budget of an engine that does not report its processor's; also the cap PDF pages render to.")
    image_transport: Literal["png", "pixels"] = Field(
        "png", alias="engine_image_transport",
        description="How the ingress hands a page to the engine: `png`, a PNG file (the upload itself when it already "
        "is a bare PNG of the admitted pixels), or `pixels`, the decoded RGB rows (larger across Ray; "
        "docs/design/image-transport.md). `ocr-serve batch` always sends pixels.")
    png_pixel_check: Literal["engine", "ingress"] = Field(
        "engine", description="Where the pixels of an uploaded bare PNG that goes on unchanged are decoded: `engine` "
        "(the ingress checks its chunks, CRCs and header; the engine replica decodes it anyway and answers "
        "`invalid_image` for a corrupt pixel stream) or `ingress` (decoded there too). docs/design/image-transport.md.")
    presize: bool = Field(
        False, alias="engine_image_presize",
        description="The ingress resizes each page to the size the engine's image processor would, with that "
        "processor's kernel, so the engine replica skips its resize (needs torchvision in the ingress; "
        "docs/design/image-preprocessing.md).")
    embedded: EmbeddedConfig = Field(default_factory=EmbeddedConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        if self.kind == "vllm" and self.model is None:
            raise ValueError("OCR_MODEL must name a model directory when OCR_ENGINE=vllm")
        if self.min_image_pixels > self.max_engine_image_pixels:
            raise ValueError("min_image_pixels must not exceed max_engine_image_pixels")
        return self


# --- parsing --------------------------------------------------------------------------------------------------------

class ParsingConfig(Section):
    """Prompts, sampling and what is made of the engine's output."""

    repetition_min_chars: int = Field(
        4000, ge=0, description="Repetition guard: output length before a repeating tail may be cut (0 = off).")
    repetition_min_repeats: int = Field(8, ge=2, description="Repetition guard: repeats of the tail unit that count "
                                        "as a loop.")
    repetition_max_unit_chars: int = Field(200, ge=1, description="Repetition guard: longest repeating unit checked.")
    repetition_check_every_chars: int = Field(
        64, ge=1, description="Repetition guard: new output characters between two tail checks while streaming.")
    repetition_penalty: float = Field(1.0, gt=0, description="Sampling repetition penalty (HunyuanOCR 1.5: 1.08).")
    prompt_set: Literal["1.0", "1.5"] = Field(
        "1.5", description="HunyuanOCR prompt wording: `1.5` fixed task-type prompts (Chinese) or `1.0` English "
        "application prompts; tasks without a 1.5 type always use the 1.0 prompt (service/tasks.py).")
    spotting_format: Literal["hunyuan", "json"] = Field(
        "hunyuan", description="Spotting output HunyuanOCR 1.5 is asked for: `hunyuan` (<ref>/<quad> markup) or "
        "`json` ([{box, text}]). The parser reads every format either way.")
    spotting_guided_json: bool = Field(
        False, description="With spotting_format=json: constrain spotting output to the line-array JSON Schema "
        "(vLLM structured output), so every output parses into lines.")
    include_raw_output: bool = Field(
        True, description="Allow requests to ask for the raw model output (`include_raw`: text, token logprobs, "
        "rendered prompt) for replay with `ocr-serve parse`.")
    extraction_guided_retry: bool = Field(
        False, description="Retry an extraction once with guided (structured) JSON decoding when validation fails.")


# --- documents and jobs ---------------------------------------------------------------------------------------------

class PDFConfig(Section):
    """The PDF sandbox (service/admission/pdf.py): a PDFium subprocess with CPU, memory and time limits."""

    max_dpi: int = Field(200, ge=36, alias="max_pdf_dpi",
                         description="Highest rasterisation DPI (the image budget may choose lower).")
    render_timeout_s: float = Field(
        30.0, gt=0, alias="pdf_render_timeout_s",
        description="Longest time to open, parse or render one page before it counts as a bomb.")
    document_cpu_s: float = Field(
        60.0, gt=0, alias="pdf_document_cpu_s",
        description="CPU seconds one document may use in all, over every sandbox process it needs (RLIMIT_CPU); "
        "pages not rendered by then fail `invalid_pdf`.")
    document_timeout_s: float = Field(
        120.0, gt=0, alias="pdf_document_timeout_s",
        description="Seconds the ingress may wait for one document's sandbox in all (a job's pacing by the engine or "
        "the rate limit is not counted); pages not rendered by then fail `invalid_pdf`.")
    render_memory_mb: int = Field(
        1024, ge=256, alias="pdf_render_memory_mb",
        description="Address-space limit of the PDFium subprocess in MiB (PDF bombs).")


class WebhookConfig(Section):
    """Job webhooks (service/jobs/webhook.py): the final job status POSTed to a URL the client names."""

    allowed_hosts: list[str] = Field(
        default_factory=list, alias="webhook_allowed_hosts",
        description="Host names, IP addresses or CIDR networks that may receive webhooks although they are "
        "loopback/private/link-local (explicit allow-list). Empty: only public addresses.")
    timeout_s: float = Field(
        10.0, gt=0, le=120, alias="webhook_timeout_s",
        description="Time limit of the DNS lookup at POST and of each delivery attempt.")
    max_attempts: int = Field(
        3, ge=1, le=10, alias="webhook_max_attempts",
        description="Delivery attempts; retried on 5xx, 408, 429, connection errors and timeouts, with backoff.")
    secret: SecretStr | None = Field(
        None, alias="webhook_secret", description="HMAC-SHA256 key; when set each delivery carries `X-OCR-Timestamp` "
        "and `X-OCR-Signature: sha256=<hex HMAC of timestamp + '.' + body>`.")

    @field_validator("allowed_hosts")
    @classmethod
    def _normalise(cls, value: list[str]) -> list[str]:
        return [host.strip().lower().strip("[]").rstrip(".") for host in value if host.strip()]


class JobsConfig(Section):
    """Multi-page jobs (service/jobs/, docs/JOBS.md)."""

    max_pages: int = Field(50, ge=1, alias="max_pdf_pages", description="Most pages one job may have.")
    max_bytes: int = Field(50 * 1024 * 1024, ge=1024, alias="max_pdf_bytes",
                           description="Largest job upload (one PDF or all its images) in bytes.")
    ttl_s: int = Field(3600, ge=10, alias="job_ttl_s", description="How long job results are kept.")
    page_retries: int = Field(2, ge=0, alias="job_page_retries",
                              description="Retries of a page whose engine call failed.")
    page_concurrency: int = Field(8, ge=1, alias="job_page_concurrency",
                                  description="Pages of one job in flight at once.")
    pages_in_flight: int | None = Field(
        None, ge=1, alias="job_pages_in_flight",
        description="Job pages one ingress replica has at the engines at once, all jobs and tenants together, "
        "granted to the tenants' jobs in turn; interactive requests take no slot. None: half the engines' request "
        "slots at their fewest replicas, shared by the ingress replicas (docs/JOBS.md, Fairness).")
    max_running_per_tenant: int = Field(
        4, ge=1, alias="max_running_jobs_per_tenant",
        description="Jobs one tenant may have running at once (counted in Redis across ingress replicas when "
        "redis_url is set); another one answers 429 `too_many_jobs`.")
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)


# --- Ray Serve ------------------------------------------------------------------------------------------------------

# Serve options of the engine deployment unless engine_deployment sets them (num_gpus: 1 for vllm, else 0)
ENGINE_DEPLOYMENT_DEFAULTS: dict[str, Any] = {
    "max_ongoing_requests": 32,
    "max_queued_requests": 256,
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 60.0,
    "ray_actor_options": {"num_cpus": 1.0},
    "autoscaling_config": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 8.0,
                           "upscale_delay_s": 10.0, "downscale_delay_s": 60.0, "look_back_period_s": 30.0},
}
INGRESS_DEPLOYMENT_DEFAULTS: dict[str, Any] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}
# options the service sets itself (the graceful stop, from graceful_shutdown_*; the deployment's name)
SERVE_MANAGED_OPTIONS = frozenset({"name", "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s"})


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class _ServeOptionsProbe:
    """What `check_deployment_options` hands Ray Serve to validate options with."""


def check_deployment_options(options: dict[str, Any], what: str, *, build: bool = True) -> dict[str, Any]:
    """Ray Serve's own check of deployment options: the names of `serve.deployment`'s parameters and of
    `AutoscalingConfig`'s fields, then the deployment built from them (its DeploymentConfig and ReplicaConfig
    validate every value)."""
    import inspect

    from ray import serve
    from ray.serve.config import AutoscalingConfig

    allowed = set(inspect.signature(serve.deployment).parameters) - {"_func_or_class"} - SERVE_MANAGED_OPTIONS
    unknown = sorted(set(options) - allowed)
    scaling = options.get("autoscaling_config")
    if isinstance(scaling, dict):
        unknown += [f"autoscaling_config.{k}" for k in sorted(set(scaling) - set(AutoscalingConfig.model_fields))]
    if unknown:
        raise ValueError(f"{what}: unknown or service-managed Serve deployment options {unknown}")
    if not build:
        return options
    try:
        serve.deployment(_ServeOptionsProbe, **options)
    except Exception as exc:  # Serve's ValueError/TypeError, or a pydantic ValidationError of its config models
        errors = getattr(exc, "errors", None)
        if callable(errors):
            first = errors()[0]
            detail = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        else:
            detail = str(exc).strip().splitlines()[0]
        raise ValueError(f"{what}: {detail[:300]}") from None
    return options


class ServeConfig(Section):
    """The Ray Serve application (service/serve/): its topology, and the deployments' options on top of the
    product's defaults."""

    topology: Literal["split", "colocated"] = Field(
        "split", alias="serve_topology",
        description="`split`: CPU ingress replicas (HTTP, admission, image work) call engine replicas through Serve "
        "handles; ingress and engines scale apart. `colocated`: each replica serves HTTP and holds an engine in one "
        "process, so no Serve hop lies between them; ingress_deployment is then unused (docs/design/topology.md).")
    engine_deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray Serve options of the engine deployment on top of the defaults ("
        + json.dumps(ENGINE_DEPLOYMENT_DEFAULTS) + "; num_gpus 1 for vllm): any `serve.deployment` option, e.g. "
        "`{\"autoscaling_config\": {\"max_replicas\": 4}, \"max_replicas_per_node\": 1}`. A fixed replica count: "
        "`num_replicas`, or equal min_replicas and max_replicas.")
    ingress_deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray Serve options of the ingress deployment (split topology) on top of the defaults ("
        + json.dumps(INGRESS_DEPLOYMENT_DEFAULTS) + ").")
    latency_target_ms: float | None = Field(
        None, gt=0, description="Autoscaler latency rule: p95 target in ms (None = Serve's queue-depth rule only; "
        "service/serve/autoscaling.py).")
    latency_downscale_ratio: float = Field(
        0.8, gt=0, le=1, description="Autoscaler latency rule: replicas are removed only while p95 is below "
        "latency_target_ms × this ratio (hysteresis) and the queue is short.")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="Time in-flight requests get to finish when a replica (ingress or engine) stops or "
        "`ocr-serve serve` drains; what is left then gets 503 `shutting_down`.")
    graceful_shutdown_wait_loop_s: float = Field(
        0.25, gt=0, description="How often a stopping replica checks whether its in-flight requests have finished "
        "(docs/design/graceful-stop.md).")

    def engine_options(self, engine_kind: str) -> dict[str, Any]:
        """The engine deployment's Serve options: the defaults, the GPU the engine needs, engine_deployment on top
        and the graceful stop. Equal min and max replicas (and no autoscaling otherwise asked for) mean a fixed
        count."""
        defaults = _merge(ENGINE_DEPLOYMENT_DEFAULTS,
                          {"ray_actor_options": {"num_gpus": 1.0 if engine_kind == "vllm" else 0.0}})
        options = _merge(defaults, self.engine_deployment)
        scaling = options.get("autoscaling_config") or {}
        if "num_replicas" in options:
            options.pop("autoscaling_config", None)
        elif scaling.get("min_replicas") == scaling.get("max_replicas"):
            options["num_replicas"] = scaling["min_replicas"]
            options.pop("autoscaling_config")
        options.update(graceful_shutdown_timeout_s=self.graceful_shutdown_timeout_s,
                       graceful_shutdown_wait_loop_s=self.graceful_shutdown_wait_loop_s)
        return options

    def autoscaling(self) -> dict[str, Any]:
        """The engine deployment's autoscaling settings, defaults included (also where the count is fixed)."""
        return _merge(ENGINE_DEPLOYMENT_DEFAULTS, self.engine_deployment)["autoscaling_config"]

    def engine_replicas(self, engine_kind: str) -> tuple[int, int]:
        """(fewest, most) engine replicas: a fixed count, or the autoscaler's range."""
        options = self.engine_options(engine_kind)
        if "num_replicas" in options:
            return options["num_replicas"], options["num_replicas"]
        scaling = options["autoscaling_config"]
        return scaling["min_replicas"], scaling["max_replicas"]

    def ingress_options(self) -> dict[str, Any]:
        return {**_merge(INGRESS_DEPLOYMENT_DEFAULTS, self.ingress_deployment),
                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
                "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s}

    @model_validator(mode="after")
    def _serve_options(self) -> "ServeConfig":
        scaling = _merge(ENGINE_DEPLOYMENT_DEFAULTS, self.engine_deployment).get("autoscaling_config") or {}
        if scaling.get("min_replicas", 1) > scaling.get("max_replicas", 1):
            raise ValueError(f"min_replicas ({scaling['min_replicas']}) > max_replicas ({scaling['max_replicas']})")
        # the product's defaults are valid: Serve checks what the settings change
        if self.engine_deployment:  # the names as given, then the options they make
            check_deployment_options(self.engine_deployment, "engine_deployment", build=False)
            check_deployment_options(_without_managed(self.engine_options("embedded")), "engine_deployment")
        if self.ingress_deployment:
            check_deployment_options(self.ingress_deployment, "ingress_deployment", build=False)
            check_deployment_options(_without_managed(self.ingress_options()), "ingress_deployment")
        return self


def _without_managed(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in SERVE_MANAGED_OPTIONS}


class ObservabilityConfig(Section):
    """Metrics (docs/METRICS.md)."""

    metrics_enabled: bool = Field(
        True, description="Record `ocr_*` (and vLLM's `vllm:*`) metrics through Ray's metrics agent.")
    metrics_export_port: int | None = Field(
        8080, ge=1, le=65535, description="`ocr-serve serve`: port of Ray's Prometheus endpoint on this machine, the "
        "one `ocr-serve metrics prometheus-config` scrapes (8080, as in KubeRay's pods). Empty (null) = any free "
        "port, printed at start. A port in use stops the start.")
    latency_slo_s: float = Field(
        10.0, gt=0, description="p95 end-to-end latency objective in seconds (dashboards, `OCRHighP95Latency` alert).")


class TestingConfig(Section):
    """Switches for tests and benchmarks only: never set in production (not in the Helm chart's values)."""

    mock_delay_s: float = Field(0.0, ge=0, description="Mock engine: seconds each request takes.")
    mock_start_delay_s: float = Field(0.0, ge=0, description="Mock engine: seconds its start takes, times the Serve "
                                      "replica's rank (replicas that come up one by one).")
    mock_time_scale: float = Field(
        0.0, ge=0, description="Mock engine: above 0 it takes the time of one vLLM engine on one H200 (requests share "
        "its steps as in continuous batching; step times fitted to measured ones, docs/design/scaling-model.md), "
        "times this factor; 0: mock_delay_s per request.")
    fixed_output_tokens: bool = Field(
        False, alias="bench_fixed_output_tokens",
        description="Every request generates exactly its max_tokens output tokens (ignore_eos + min_tokens), so "
        "benchmark runs compare like for like.")


# --- the registry ---------------------------------------------------------------------------------------------------

class Settings(BaseSettings):
    """Settings of the OCR service (module docstring): sections, each setting also known by its flat name."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    server: ServerConfig = Field(default_factory=ServerConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    parsing: ParsingConfig = Field(default_factory=ParsingConfig)
    pdf: PDFConfig = Field(default_factory=PDFConfig)
    jobs: JobsConfig = Field(default_factory=JobsConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    testing: TestingConfig = Field(default_factory=TestingConfig)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        # both nested before pydantic-settings merges them (init over environment)
        return NestedInitSource(settings_cls, init_settings), OCREnvSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        return nest(data) if isinstance(data, dict) else data

    @property
    def engine_deployment(self) -> dict[str, Any]:
        """The engine deployment's Serve options for this engine (ServeConfig.engine_options)."""
        return self.serve.engine_options(self.engine.kind)

    @property
    def job_pages_in_flight(self) -> int:
        """jobs.pages_in_flight, or half the engines' request slots at their fewest replicas per ingress replica."""
        if self.jobs.pages_in_flight is not None:
            return self.jobs.pages_in_flight
        ongoing = self.engine_deployment["max_ongoing_requests"]
        if self.serve.topology == "colocated":  # each replica's own engine
            return max(1, ongoing // 2)
        fewest, _ = self.serve.engine_replicas(self.engine.kind)
        return max(1, ongoing * max(1, fewest) // (2 * self.serve.ingress_options()["num_replicas"]))

    def masked(self) -> dict[str, Any]:
        """Effective settings as JSON-able values, secrets masked (for `ocr-serve config` and logs)."""
        return json.loads(self.model_dump_json())  # SecretStr dumps as "**********"


# --- flat names -----------------------------------------------------------------------------------------------------

def _leaves(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[str, tuple[str, ...], FieldInfo]]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, path + (name,))
        else:
            yield info.alias or name, path + (name,), info


def flat_names() -> dict[str, tuple[tuple[str, ...], FieldInfo]]:
    """Every setting's flat name → (its path of field names, its field)."""
    return {flat: (path, info) for flat, path, info in _leaves(Settings)}


_GIB = 1024 ** 3
_NUMBER, _INTEGER, _BOOLEAN, _STRING = {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": "string"}


def _optional(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _same(value: Any) -> Any:
    return value


# Older flat names of settings that moved into a pass-through: name → (path, how its value converts, its JSON Schema)
LEGACY_NAMES: dict[str, tuple[tuple[str, ...], Callable[[Any], Any], dict[str, Any]]] = {
    "load_format": (("engine", "vllm", "engine_kwargs", "load_format"), _same, _STRING),
    "dtype": (("engine", "vllm", "engine_kwargs", "dtype"), _same, _STRING),
    "gpu_memory_utilization": (("engine", "vllm", "engine_kwargs", "gpu_memory_utilization"), float,
                               {**_NUMBER, "exclusiveMinimum": 0, "maximum": 1}),
    "max_num_seqs": (("engine", "vllm", "engine_kwargs", "max_num_seqs"), int, {**_INTEGER, "minimum": 1}),
    "max_num_batched_tokens": (("engine", "vllm", "engine_kwargs", "max_num_batched_tokens"), int,
                               _optional({**_INTEGER, "minimum": 1})),
    "enable_prefix_caching": (("engine", "vllm", "engine_kwargs", "enable_prefix_caching"), _same, _BOOLEAN),
    "enforce_eager": (("engine", "vllm", "engine_kwargs", "enforce_eager"), _same, _BOOLEAN),
    "kv_cache_memory_gb": (("engine", "vllm", "engine_kwargs", "kv_cache_memory_bytes"),
                           lambda v: int(float(v) * _GIB), _optional({**_NUMBER, "exclusiveMinimum": 0})),
    "preprocess_workers": (("engine", "vllm", "engine_kwargs", "renderer_num_workers"), int,
                           {**_INTEGER, "minimum": 1, "maximum": 64}),
    "engine_stream_interval": (("engine", "vllm", "engine_kwargs", "stream_interval"), int,
                               {**_INTEGER, "minimum": 1, "maximum": 256}),
    **{name: (("serve", "engine_deployment", "autoscaling_config", key), conv, schema)
       for name, key, conv, schema in (
           ("min_replicas", "min_replicas", int, {**_INTEGER, "minimum": 0}),
           ("max_replicas", "max_replicas", int, {**_INTEGER, "minimum": 1}),
           ("initial_replicas", "initial_replicas", int, _optional({**_INTEGER, "minimum": 0})),
           ("target_ongoing_requests", "target_ongoing_requests", float, {**_NUMBER, "exclusiveMinimum": 0}),
           ("upscale_delay_s", "upscale_delay_s", float, {**_NUMBER, "minimum": 0}),
           ("downscale_delay_s", "downscale_delay_s", float, {**_NUMBER, "minimum": 0}),
           ("autoscaling_look_back_s", "look_back_period_s", float, {**_NUMBER, "exclusiveMinimum": 0}),
           ("autoscaling_metrics_interval_s", "metrics_interval_s", float, {**_NUMBER, "exclusiveMinimum": 0}))},
    "max_ongoing_requests": (("serve", "engine_deployment", "max_ongoing_requests"), int, {**_INTEGER, "minimum": 1}),
    "max_queued_requests": (("serve", "engine_deployment", "max_queued_requests"), int, {**_INTEGER, "minimum": -1}),
    "health_check_period_s": (("serve", "engine_deployment", "health_check_period_s"), float,
                              {**_NUMBER, "exclusiveMinimum": 0}),
    "health_check_timeout_s": (("serve", "engine_deployment", "health_check_timeout_s"), float,
                               {**_NUMBER, "exclusiveMinimum": 0}),
    "engine_num_gpus": (("serve", "engine_deployment", "ray_actor_options", "num_gpus"), float,
                        _optional({**_NUMBER, "minimum": 0})),
    "engine_num_cpus": (("serve", "engine_deployment", "ray_actor_options", "num_cpus"), float,
                        {**_NUMBER, "minimum": 0}),
    "ingress_num_cpus": (("serve", "ingress_deployment", "ray_actor_options", "num_cpus"), float,
                         {**_NUMBER, "minimum": 0}),
    "ingress_replicas": (("serve", "ingress_deployment", "num_replicas"), int, {**_INTEGER, "minimum": 1}),
}
# an older pass-through merged into engine_kwargs as it is
LEGACY_MERGED = {"vllm_extra_args": ("engine", "vllm", "engine_kwargs")}


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        node = tree.get(key)
        if not isinstance(node, dict):
            node = tree[key] = {} if node is None else dict(node) if isinstance(node, dict) else node
        tree = node
    tree[path[-1]] = value


def nest(data: dict[str, Any]) -> dict[str, Any]:
    """Settings given by flat names (and older names) as the nested form; nested input passes unchanged. A flat
    name that collides with a section name (`engine`: the engine's kind) is a flat name when its value is not an
    object."""
    names = flat_names()
    sections = set(Settings.model_fields)
    out: dict[str, Any] = {}
    flat: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in sections and (isinstance(value, (dict, BaseModel)) or key not in names):
            existing = out.get(key)
            value = value.model_dump(by_alias=False) if isinstance(value, BaseModel) else value
            out[key] = _merge(existing, value) if isinstance(existing, dict) and isinstance(value, dict) else value
        else:
            flat.append((key, value))
    for key, value in flat:
        if key in names:
            path = names[key][0]
            existing = _get(out, path)
            # an object merges with what nested names or older names set inside it (OCR_ENGINE_KWARGS and
            # OCR_ENGINE__VLLM__ENGINE_KWARGS__STREAM_INTERVAL both apply)
            _set(out, path, _merge(value, existing) if isinstance(value, dict) and isinstance(existing, dict)
                 else value)
        elif key in LEGACY_NAMES:
            path, convert, _ = LEGACY_NAMES[key]
            if value is not None and value != "":
                _set(out, path, convert(value))
        elif key in LEGACY_MERGED:
            extra = json.loads(value) if isinstance(value, str) else value
            for name, item in (extra or {}).items():
                _set(out, LEGACY_MERGED[key] + (name,), item)
        else:
            out[key] = value  # unknown: the model refuses it (extra="forbid")
    return out


def _complex(info: FieldInfo) -> bool:
    """Whether an environment value of this field is JSON (lists, objects)."""
    text = str(info.annotation)
    return text.startswith(("list", "dict")) or "list[" in text or "dict[" in text


class NestedInitSource(PydanticBaseSettingsSource):
    """`Settings(**kwargs)`: flat and older names nested, like the environment's."""

    def __init__(self, settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self.init = init

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return nest(self.init())


class OCREnvSource(PydanticBaseSettingsSource):
    """`OCR_*` environment variables by flat name (`OCR_MAX_BODY_BYTES`), nested path (`OCR_LIMITS__MAX_BODY_BYTES`)
    or older name (`LEGACY_NAMES`); lists and objects as JSON. Unknown `OCR_*` names are reported by
    `env_problems()` (`ocr-serve config`, `ocr-serve serve`), not refused: other tools share the prefix."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads everything at once

    def __call__(self) -> dict[str, Any]:
        return nest(read_env(os.environ)[0])


def read_env(environ: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The settings the environment sets, nested (flat names at their paths; older names kept flat for `nest`), and
    the `OCR_*` variables that name no setting. Objects set by a flat name and keys set inside them by nested names
    merge, the nested ones winning."""
    names = flat_names()
    values: dict[str, Any] = {}
    older: dict[str, Any] = {}
    unknown: list[str] = []
    # flat names first, nested paths after: the more specific name wins
    for var, raw in sorted(environ.items(), key=lambda item: NESTED_DELIMITER in item[0]):
        if not var.startswith(ENV_PREFIX) or var in CLIENT_VARIABLES:
            continue
        key = var[len(ENV_PREFIX):].lower()
        if NESTED_DELIMITER in key:
            path = tuple(key.split(NESTED_DELIMITER))
            info = _field_at(path)
            if info is None:
                unknown.append(var)
                continue
            _put(values, path, _env_value(raw, info))
        elif key in names:
            path, info = names[key]
            _put(values, path, _env_value(raw, info))
        elif key in LEGACY_NAMES or key in LEGACY_MERGED:
            older[key] = raw
        else:
            unknown.append(var)
    return {**values, **older}, sorted(unknown)


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """`_set`, merging an object into one already there."""
    existing = _get(tree, path)
    _set(tree, path, _merge(existing, value) if isinstance(existing, dict) and isinstance(value, dict) else value)


def _field_at(path: tuple[str, ...]) -> FieldInfo | None:
    model: type[BaseModel] = Settings
    info = None
    for i, key in enumerate(path):
        info = model.model_fields.get(key) or next(
            (f for f in model.model_fields.values() if f.alias == key), None)
        if info is None:
            return None
        annotation = info.annotation
        if i < len(path) - 1:
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                model = annotation
            elif _complex(info):
                return info  # a key inside a dict setting
            else:
                return None
    return info


def _env_value(raw: str, info: FieldInfo) -> Any:
    if _complex(info):
        return json.loads(raw) if raw.strip() else ({} if "dict" in str(info.annotation) else [])
    if raw == "" and "None" in str(info.annotation):
        return None
    return raw


def env_problems(environ: dict[str, str] | None = None) -> list[str]:
    """One line per `OCR_*` variable that names no setting (a typo is otherwise ignored) or uses an older name."""
    environ = dict(os.environ if environ is None else environ)
    _, unknown = read_env(environ)
    names = set(flat_names()) | {var[len(ENV_PREFIX):].lower() for var in CLIENT_VARIABLES}
    problems = []
    for var in unknown:
        near = _closest(var[len(ENV_PREFIX):].lower(), names)
        problems.append(f"{var} is not a setting" + (f" (did you mean OCR_{near.upper()}?)" if near else ""))
    for var in sorted(environ):
        key = var[len(ENV_PREFIX):].lower() if var.startswith(ENV_PREFIX) else ""
        if key in LEGACY_NAMES:
            path = ".".join(LEGACY_NAMES[key][0])
            problems.append(f"{var} is an older name: it sets {path} (docs/CONFIG.md)")
        elif key in LEGACY_MERGED:
            problems.append(f"{var} is an older name: use OCR_ENGINE_KWARGS")
    return problems


def _closest(name: str, names: set[str]) -> str | None:
    import difflib

    match = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return match[0] if match else None


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with explicit overrides (CLI flags, by flat name) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
