"""The task table: every OCR task, its HunyuanOCR prompt (exact wording, kept only here) and what its output is.

Two documented prompt sets exist and both are reproduced verbatim:

* HunyuanOCR 1.0 "application-oriented prompts" (README of Tencent-Hunyuan/HunyuanOCR, English column) — free
  prompts; field extraction and translation carry a user part (field list, target language).
* HunyuanOCR 1.5 fixed task types (`inference/utils/tasks.py`, `TASK_PROMPTS`) — 12 Chinese prompts the 1.5 model
  was trained on; upstream deliberately exposes only the task type, never free text, because hand-edited
  instructions degrade quality.

Setting `prompt_set` picks the set ("1.5" default: the served model is 1.5-shaped). A task with no 1.5 type
(`extract`, `subtitles`, translation into a language other than English/Chinese) always uses its 1.0 prompt; `layout`
exists only in 1.5 and uses the 1.5 prompt in both sets. User parts (field names, target language) are sanitised by
service.admission.prompts before they are formatted in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OutputKind = Literal["lines", "text", "markdown", "html", "latex", "json"]
PromptSet = Literal["1.0", "1.5"]

# HunyuanOCR 1.5 task types → official prompts, verbatim (inference/utils/tasks.py of Tencent-Hunyuan/HunyuanOCR).
HUNYUAN_15_PROMPTS: dict[str, str] = {
    "doc_parse": "提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，表格用html格式表达，"
                 "文档中公式用latex格式表示，按照阅读顺序组织进行解析。",
    "structured_parse": "提取图中的文字。",
    "spotting_json": "检测并识别图中所有的文字行，请按从上到下、从左到右的阅读顺序进行识别。 "
                     "输出格式为 JSON 数组，每个元素必须包含："
                     '"box": [xmin, ymin, xmax, ymax]（坐标需归一化到 [0, 1000] 范围内）；'
                     '"text": "识别出的文字内容"。 '
                     "注意：请直接输出 JSON 数组，不要包含任何多余的描述性文字。",
    "spotting_hunyuan": "检测并识别图片中的文字，将文本坐标格式化输出。",
    "layout": "按照阅读顺序解析图中的版式信息。",
    "layout_parse": "提取文档图片中所有内容用markdown格式表示，表格用html格式表达，文档中公式用latex格式表示，"
                    "请按照阅读顺序组织进行全文解析，并输出版式分析信息。",
    "chart_parse": "解析图中的图表，对于流程图使用Mermaid格式表示，其他图表使用Markdown格式表示。",
    "formula": "识别图片中的公式，用LaTeX格式表示。",
    "table": "把图中的表格解析为HTML。",
    "doc_trans_en2zh": "先解析文档，再将文档内容翻译为中文，其中页眉、页脚忽略，公式用latex格式表示，表格用html格式表示。",
    "trans_other2en": "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，再将文字内容翻译为英文。",
    "trans_other2zh": "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，再将文字内容翻译为中文。",
}


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str  # HunyuanOCR 1.0 English prompt; str.format placeholders: {fields}, {target_language}
    output: OutputKind
    hunyuan_task: str | None  # the HunyuanOCR 1.5 task type (key of HUNYUAN_15_PROMPTS); None = 1.0 prompt only
    description: str
    default_max_tokens: int = 2048


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task(
            "spotting",
            "Detect and recognize text in the image, and output the text coordinates in a formatted manner.",
            "lines",
            "spotting_hunyuan",
            "Text lines with boxes (pixels of the uploaded image) and confidences.",
        ),
        Task(
            "text",
            "Extract the text in the image.",
            "text",
            "structured_parse",
            "Plain text in reading order (also for non-document scenes: street views, classical texts).",
        ),
        Task(
            "document",
            "Extract all information from the main body of the document image and represent it in markdown format, "
            "ignoring headers and footers. Tables should be expressed in HTML format, formulas in the document should "
            "be represented using LaTeX format, and the parsing should be organized according to the reading order.",
            "markdown",
            "doc_parse",
            "Markdown in reading order; tables as HTML, formulas as LaTeX; headers/footers dropped.",
            4096,
        ),
        Task("table", "Parse the table in the image into HTML.", "html", "table", "One table as HTML."),
        Task(
            "formula",
            "Identify the formula in the image and represent it using LaTeX format.",
            "latex",
            "formula",
            "A formula as LaTeX.",
            512,
        ),
        Task(
            "chart",
            "Parse the chart in the image; use Mermaid format for flowcharts and Markdown for other charts.",
            "markdown",
            "chart_parse",
            "A chart as Markdown (flowcharts as Mermaid).",
        ),
        Task(
            "extract",
            "Extract the content of the fields: {fields} from the image and return it in JSON format.",
            "json",
            None,
            "Named fields (or a JSON Schema's properties) as validated JSON with per-field confidence.",
            1024,
        ),
        Task(
            "translate",
            "First extract the text, then translate the text content into {target_language}. If it is a document, "
            "ignore the header and footer. Formulas should be represented in LaTeX format, and tables should be "
            "represented in HTML format.",
            "markdown",
            "trans_other2en",  # the 1.5 type depends on the languages: see translation_task()
            "Text extracted and translated into `target_language`.",
            4096,
        ),
        Task(
            "subtitles",
            "Extract the subtitles from the image.",
            "text",
            None,
            "Subtitle text of a video frame.",
            512,
        ),
        Task(
            "layout",
            HUNYUAN_15_PROMPTS["layout"],  # 1.0 documents no layout prompt
            "lines",
            "layout",
            "Layout regions in reading order: category, box and (when the model gives it) their text.",
        ),
    ]
}

TaskName = Literal[
    "spotting", "text", "document", "table", "formula", "chart", "extract", "translate", "subtitles", "layout"
]

# Spotting output formats the service can ask HunyuanOCR 1.5 for (setting `spotting_format`).
SPOTTING_TASK_TYPES = {"hunyuan": "spotting_hunyuan", "json": "spotting_json"}


def translation_task(target: str, source: str | None) -> str | None:
    """The 1.5 translation task type for these languages (ISO codes or names), None when 1.5 has none."""
    target, source = target.strip().lower(), (source or "").strip().lower()
    if target in ("en", "english"):
        return "trans_other2en"
    if target in ("zh", "chinese", "zh-cn", "zh-hans", "中文"):
        return "doc_trans_en2zh" if source in ("en", "english") else "trans_other2zh"
    return None


def hunyuan_task_for(task: Task, *, target_language: str | None = None, source_language: str | None = None,
                     spotting_format: str = "hunyuan") -> str | None:
    """The 1.5 task type a request maps to (None: only the 1.0 prompt applies)."""
    if task.name == "translate":
        return translation_task(target_language or "en", source_language)
    if task.name == "spotting":
        return SPOTTING_TASK_TYPES[spotting_format]
    return task.hunyuan_task


# The line array HunyuanOCR 1.5 writes for `spotting_json`; enforced by structured output with spotting_guided_json
SPOTTING_LINES_SCHEMA: dict = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "box": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "minItems": 4, "maxItems": 4},
            "text": {"type": "string"},
        },
        "required": ["box", "text"],
        "additionalProperties": False,
    },
}
