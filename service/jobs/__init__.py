"""Multi-page jobs: a PDF or several images → per-page results, stored (Redis or in-process) and streamed in page
order. `model` (records, results, views) → `store` (Redis / memory) → `runner` (rasterise, pay, fan out, retry);
the HTTP API is service/http/routes/jobs.py, the CLI client (progress bar) is `client`."""
