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

Sanitising is linear in the text (a hostile `<<<…｜｜｜` nests one token per removal) and only ever sees at most
`max_chars` characters: callers refuse longer text first (fields, chat messages); the cut here is the last guard.
"""

from __future__ import annotations

import re

from service.schema import OCRRequest
from service.config import Settings
from service.tasks import HUNYUAN_15_PROMPTS, SPOTTING_LINES_SCHEMA, TASKS, hunyuan_task_for

# <｜...｜>, <|...|>, and their halves; plus control characters
_SPECIAL_TOKEN = re.compile(r"<\s*[｜|][^<>]{0,128}?[｜|]\s*>|<[｜|]|[｜|]>|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_BARS = "｜|"
_MAX_TOKEN_NAME = 128  # the `{0,128}` of _SPECIAL_TOKEN
_LANGUAGE_NAMES = {"en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "fr": "French",
                   "de": "German", "es": "Spanish", "ru": "Russian", "ar": "Arabic", "pt": "Portuguese",
                   "it": "Italian", "tr": "Turkish", "th": "Thai", "vi": "Vietnamese", "id": "Indonesian",
                   "ms": "Malay"}
_ONLY_15 = ("spotting_json", "layout")  # no 1.0 wording exists


def sanitize_user_text(text: str, max_chars: int = 2000) -> str:
    """At most `max_chars` characters of `text`, without special-token look-alikes and control characters."""
    return strip_special_tokens(text[:max_chars]).replace("｜", "|").strip()


def strip_special_tokens(text: str) -> str:
    """What `_SPECIAL_TOKEN.sub("", text)`, repeated until nothing changes, leaves — removal can create a new match
    (`<<｜｜` → `<｜` → ``), so the repetition takes up to len(text)/2 passes over the whole text; this takes
    O(n log n) time whatever the nesting."""
    once = _SPECIAL_TOKEN.sub("", text)
    if once == text or not _SPECIAL_TOKEN.search(once):
        return once  # one pass was enough (any text without nested tokens), at the regex engine's speed
    return _TokenStripper(text).fixed_point()


class _TokenStripper:
    """The passes of `_SPECIAL_TOKEN.sub` simulated on a linked list of the text's characters.

    A match starts at `<` (a whole token `<\\s*B…B\\s*>`, else the half `<B`; B = a bar), at a bar (`B>`) or at a
    control character, and reads only characters after its start. Within a pass the leftmost match wins and the scan
    goes on after it, so removing a match at once changes nothing that pass still reads. A later pass can only match
    where a removal joined two characters: at the character left of the join (`<B`, `B>`), or at the nearest `<`
    left of it when no `>` lies between (a whole token reads up to the first angle bracket after its `<`). So each
    pass tries only those positions, and a whole token is decided from four lookups (union-find over the characters
    still there) and one count (Fenwick tree): the token is `<` + spaces + bar + at most 128 characters + the last
    non-space before the first `>` after it, which must be a bar.
    """

    def __init__(self, text: str):
        self.text = text
        n = self.n = len(text)
        space = [c.isspace() for c in text]  # exactly the regex's `\s` (str patterns)
        angle = [c in "<>" for c in text]
        self.alive = [True] * n
        self.prev = list(range(-1, n - 1))
        self.next = list(range(1, n + 1))
        self.head = 0 if n else n
        # union-find "nearest kept character at or after i / at or before i" of a kind; backward ones are shifted by
        # one (slot 0 stands for "none")
        self.next_solid = [i + 1 if space[i] else i for i in range(n)] + [n]
        self.prev_solid = [0] + [i if space[i] else i + 1 for i in range(n)]
        self.next_angle = [i if angle[i] else i + 1 for i in range(n)] + [n]
        self.prev_angle = [0] + [i + 1 if angle[i] else i for i in range(n)]
        self.space = space
        self.angle = angle
        self.kept = [0] * (n + 1)  # Fenwick tree of kept characters, behind by `removed` (flushed when counting)
        self.removed: list[int] = []
        for i in range(1, n + 1):
            self.kept[i] += 1
            parent = i + (i & -i)
            if parent <= n:
                self.kept[parent] += self.kept[i]

    @staticmethod
    def _find(parent: list[int], i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    def _kept_before(self, i: int) -> int:
        """Kept characters at indices < i."""
        kept, n = self.kept, self.n
        for j in self.removed:
            j += 1
            while j <= n:
                kept[j] -= 1
                j += j & -j
        self.removed.clear()
        total = 0
        while i > 0:
            total += kept[i]
            i -= i & -i
        return total

    def _match_end(self, p: int) -> int | None:
        """Index of the last character of the match starting at p, or None."""
        text, n, c = self.text, self.n, self.text[p]
        if c == "<":
            bar = self._find(self.next_solid, p + 1)
            if bar < n and text[bar] in _BARS:
                close = self._find(self.next_angle, p + 1)
                if close < n and text[close] == ">":
                    last = self._find(self.prev_solid, close) - 1  # slot close = index close - 1
                    if (last > bar and text[last] in _BARS
                            and self._kept_before(last) - self._kept_before(bar + 1) <= _MAX_TOKEN_NAME):
                        return close
            after = self.next[p]
            return after if after < n and text[after] in _BARS else None
        if c in _BARS:
            after = self.next[p]
            return after if after < n and text[after] == ">" else None
        return p if _CONTROL.match(c) else None

    def _remove(self, start: int, end: int) -> None:
        left, i = self.prev[start], start
        while True:
            following = self.next[i]
            self.alive[i] = False
            if not self.space[i]:
                self.next_solid[i], self.prev_solid[i + 1] = i + 1, i
            if self.angle[i]:
                self.next_angle[i], self.prev_angle[i + 1] = i + 1, i
            self.removed.append(i)
            if i == end:
                break
            i = following
        right = self.next[end]
        if left >= 0:
            self.next[left] = right
        else:
            self.head = right
        if right < self.n:
            self.prev[right] = left

    def fixed_point(self) -> str:
        text, bars = self.text, _BARS
        candidates = [i for i, c in enumerate(text) if c == "<" or c in bars or _CONTROL.match(c)]
        while candidates:
            retry: set[int] = set()
            for p in candidates:
                if not self.alive[p]:
                    continue  # inside an earlier match of this pass
                end = self._match_end(p)
                if end is None:
                    continue
                left = self.prev[p]
                self._remove(p, end)
                if left < 0:
                    continue
                if text[left] == "<" or text[left] in bars:
                    retry.add(left)
                opener = self._find(self.prev_angle, left + 1) - 1
                if opener >= 0 and text[opener] == "<":
                    retry.add(opener)
            candidates = sorted(retry)
        kept, i = [], self.head
        while i < self.n:
            kept.append(text[i])
            i = self.next[i]
        return "".join(kept)


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
                                 spotting_format=settings.parsing.spotting_format)
    if task_type in _ONLY_15 or (task_type and settings.parsing.prompt_set == "1.5"):
        return task_type
    return None


def build_prompt(req: OCRRequest, settings: Settings) -> str:
    """The user text of the chat turn for this request (the engine adds the chat template and the image token)."""
    task_type = prompt_task_type(req, settings)
    if task_type is not None:
        return HUNYUAN_15_PROMPTS[task_type]
    task = TASKS[req.task]
    limit = settings.limits.max_text_field_chars
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
    if req.task == "spotting" and settings.parsing.spotting_guided_json and prompt_task_type(req, settings) == "spotting_json":
        return SPOTTING_LINES_SCHEMA
    return None
