"""The fast tier: runs after `pip install -e '.[dev]'` alone (no torch, no vLLM, no Debian servers, no Ray cluster),
with only the light fixtures of tests/conftest.py. In-process apps, fakes where a server would be needed."""
