"""`ocr-serve batch`: bulk OCR of folders, globs, list files and buckets on Ray Data, resumable, every page written
exactly once. inputs.py lists the documents, stages.py is the work on Ray Data (read and render in CPU tasks, an
actor pool of engines), output.py the records, keys and the output folder, run.py the driver (docs/BATCH.md).

It sits beside the CLI: it uses the service's admission, engines and parsing (service.pipeline, service.engine,
service.parsing) and nothing below it imports it."""
