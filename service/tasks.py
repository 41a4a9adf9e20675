"""The task table: every OCR task, its HunyuanOCR prompt (exact wording in one place) and what its output is.

Prompts follow HunyuanOCR's documented application prompts (1.0 free prompts; the 1.5 task types are mapped in
`hunyuan_task`). User-supplied parts (field names, target language) are sanitised before they are formatted in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OutputKind = Literal["lines", "text", "markdown", "html", "latex", "json"]


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str  # str.format template; placeholders: {fields}, {target_language}
    output: OutputKind
    hunyuan_task: str  # the HunyuanOCR 1.5 task type this corresponds to
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
            "doc_parse",
            "Plain text in reading order.",
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
            "structured_parse",
            "Named fields (or a JSON Schema's properties) as validated JSON with per-field confidence.",
            1024,
        ),
        Task(
            "translate",
            "First extract the text, then translate the text content into {target_language}. If it is a document, "
            "ignore the header and footer. Formulas should be represented in LaTeX format, and tables should be "
            "represented in HTML format.",
            "markdown",
            "trans_other2en",
            "Text extracted and translated into `target_language`.",
            4096,
        ),
        Task(
            "subtitles",
            "Extract the subtitles from the image.",
            "text",
            "doc_parse",
            "Subtitle text of a video frame.",
            512,
        ),
        Task(
            "layout",
            "Analyze the layout of the document image: output each layout element's category and its coordinates "
            "in a formatted manner.",
            "lines",
            "layout",
            "Layout regions with categories and boxes.",
        ),
    ]
}

TaskName = Literal[
    "spotting", "text", "document", "table", "formula", "chart", "extract", "translate", "subtitles", "layout"
]
