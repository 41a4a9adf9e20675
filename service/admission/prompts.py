"""The task prompt sent with the image: HunyuanOCR's documented wording (service.tasks) with sanitised user parts.

Choice of wording, per request (setting `prompt_set`, default "1.5"):
* the task maps to a HunyuanOCR 1.5 task type (service.tasks.hunyuan_task_for) and the set is "1.5" → that type's
  fixed prompt, verbatim; nothing is appended (upstream: edited 1.5 instructions lose accuracy);
* otherwise → the 1.0 English prompt, with the field list (`['name', 'id_number']`, the README's Python-list form) or
  the target language formatted in, and the optional language hint appended as one sentence.
`spotting_json` and `layout` exist only as 1.5 prompts and are used in both sets.

User text never carries model special tokens: HunyuanOCR's placeholders look like `<｜hy_place▁holder▁no▁100｜>`
(full-width bars) and an image-start token without an image kills vLLM's engine (GHSA-hpv8-x276-m59f). Anything
shaped like a special token — full-width or ASCII bars — is removed before formatting.
"""

from __future__ import annotations

import re

from service.api.protocol import OCRRequest
from service.settings import Settings
from service.tasks import HUNYUAN_15_PROMPTS, TASKS, hunyuan_task_for

# <｜...｜>, <|...|>, and their halves; plus control characters
_SPECIAL_TOKEN = re.compile(r"<\s*[｜|][^<>]{0,128}?[｜|]\s*>|<[｜|]|[｜|]>|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_LANGUAGE_NAMES = {"en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "fr": "French",
                   "de": "German", "es": "Spanish", "ru": "Russian", "ar": "Arabic", "pt": "Portuguese",
                   "it": "Italian", "tr": "Turkish", "th": "Thai", "vi": "Vietnamese", "id": "Indonesian",
                   "ms": "Malay"}
_ONLY_15 = ("spotting_json", "layout")  # no 1.0 wording exists


def sanitize_user_text(text: str, max_chars: int = 2000) -> str:
    """Remove special-token look-alikes and control characters; bound the length."""
    previous = None
    while previous != text:  # removal can create a new match (`<｜<｜x｜>｜>`)
        previous, text = text, _SPECIAL_TOKEN.sub("", text)
    return text.replace("｜", "|")[:max_chars].strip()


def language_name(code_or_name: str) -> str:
    return _LANGUAGE_NAMES.get(code_or_name.lower(), code_or_name)


def field_names(req: OCRRequest) -> list[str]:
    """Field names for extraction: explicit `fields`, else the schema's properties."""
    if req.fields:
        return list(req.fields)
    if req.json_schema and isinstance(req.json_schema.get("properties"), dict):
        return list(req.json_schema["properties"])
    return []


def format_field_list(names: list[str]) -> str:
    """The README's form: `['单价', '上车时间']` (Python list repr)."""
    return "[" + ", ".join(repr(name) for name in names) + "]"


def prompt_task_type(req: OCRRequest, settings: Settings) -> str | None:
    """The HunyuanOCR 1.5 task type whose fixed prompt this request gets, or None for the 1.0 prompt."""
    task = TASKS[req.task]
    target = sanitize_user_text(req.target_language or "en", 64)
    source = sanitize_user_text(req.language or "", 64)
    task_type = hunyuan_task_for(task, target_language=target, source_language=source,
                                 spotting_format=settings.spotting_format)
    if task_type in _ONLY_15 or (task_type and settings.prompt_set == "1.5"):
        return task_type
    return None


def build_prompt(req: OCRRequest, settings: Settings) -> str:
    """The user text of the chat turn for this request (the engine adds the chat template and the image token)."""
    task_type = prompt_task_type(req, settings)
    if task_type is not None:
        return HUNYUAN_15_PROMPTS[task_type]
    task = TASKS[req.task]
    limit = settings.max_text_field_chars
    if req.task == "extract":
        names = [sanitize_user_text(n, limit) for n in field_names(req)]
        prompt = task.prompt.format(fields=format_field_list([n for n in names if n]))
    elif req.task == "translate":
        target = sanitize_user_text(req.target_language or "en", 64)
        prompt = task.prompt.format(target_language=language_name(target or "en"))
    else:
        prompt = task.prompt
    if req.language:
        lang = sanitize_user_text(req.language, 64)
        if lang:
            prompt += f" The text is in {language_name(lang)}."
    return prompt


def guided_json_for(req: OCRRequest, settings: Settings) -> dict | None:
    """JSON Schema for structured output on the first attempt (spotting in JSON mode only; extraction retries later)."""
    if req.task == "spotting" and settings.spotting_guided_json and prompt_task_type(req, settings) == "spotting_json":
        from service.parsing.spotting import SPOTTING_LINES_SCHEMA

        return SPOTTING_LINES_SCHEMA
    return None
