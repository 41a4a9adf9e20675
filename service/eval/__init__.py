"""`ocr-serve eval`: OCR quality of the running service on labelled documents (docs/EVAL.md).

manifest (validate the labelled set) → client (every document through the public HTTP API) → score (metrics per page
and document) → report (summary.json, documents.csv/.jsonl, report.md, plots); `compare` pairs two runs of one
manifest with a bootstrap; `importers` and `sample` write manifests. The package talks to the service only over
HTTP, so it measures whatever is deployed; of the service's code it uses only the task table (`service.tasks`) and
the jobs client's progress bar.
"""


class EvalError(Exception):
    """A mistake the user can fix (bad manifest, unreachable service, wrong arguments): printed as one line."""
