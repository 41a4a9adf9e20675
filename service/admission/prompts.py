"""The task prompt sent with the image: HunyuanOCR's documented wording (service.tasks) with sanitised user parts.

User text never carries model special tokens: HunyuanOCR's placeholders look like `<｜hy_place▁holder▁no▁100｜>`
(full-width bars) and an image-start token without an image kills vLLM's engine (GHSA-hpv8-x276-m59f). Anything
shaped like a special token — full-width or ASCII bars — is removed before formatting.
"""

from __future__ import annotations

import json
import re

from service.api.protocol import OCRRequest
from service.settings import Settings
from service.tasks import TASKS

# <｜...｜>, <|...|>, and their halves; plus control characters
_SPECIAL_TOKEN = re.compile(r"<\s*[｜|][^<>]{0,128}?[｜|]\s*>|<[｜|]|[｜|]>|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_LANGUAGE_NAMES = {"en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "fr": "French",
                   "de": "German", "es": "Spanish", "ru": "Russian", "ar": "Arabic", "pt": "Portuguese"}


def sanitize_user_text(text: str, max_chars: int = 2000) -> str:
    """Remove special-token look-alikes and control characters; bound the length."""
    previous = None
    while previous != text:  # removal can create a new match (`<｜<｜x｜>｜>`)
        previous, text = text, _SPECIAL_TOKEN.sub("", text)
    return text.replace("｜", "|")[:max_chars].strip()


def field_names(req: OCRRequest) -> list[str]:
    """Field names for extraction: explicit `fields`, else the schema's properties."""
    if req.fields:
        return list(req.fields)
    if req.json_schema and isinstance(req.json_schema.get("properties"), dict):
        return list(req.json_schema["properties"])
    return []


def build_prompt(req: OCRRequest, settings: Settings) -> str:
    """The user text of the chat turn for this request (the engine adds the chat template and the image token)."""
    task = TASKS[req.task]
    limit = settings.max_text_field_chars
    if req.task == "extract":
        names = [sanitize_user_text(n, limit) for n in field_names(req)]
        names = [n for n in names if n]
        prompt = task.prompt.format(fields=json.dumps(names, ensure_ascii=False))
    elif req.task == "translate":
        target = sanitize_user_text(req.target_language or "English", 64)
        prompt = task.prompt.format(target_language=_LANGUAGE_NAMES.get(target.lower(), target))
    else:
        prompt = task.prompt
    if req.language:
        lang = sanitize_user_text(req.language, 64)
        if lang:
            prompt += f" The text is in {_LANGUAGE_NAMES.get(lang.lower(), lang)}."
    return prompt
