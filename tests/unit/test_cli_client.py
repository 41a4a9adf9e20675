"""`ocr-serve ocr` as a user runs it (a subprocess): a service that is down, one that never answers, a missing file
and bad usage each give one line on stderr and their exit status, never a traceback; against a real service (the
ingress app with the embedded engine, served by uvicorn in this process) the key and URL come from OCR_API_KEY and
OCR_URL, and --text / --compact print what they say. Also `ocr-serve config`'s warning for unknown OCR_* variables,
which the client's variables do not trigger."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from service.config import Settings
from service.http.app import create_app
from service.pipeline.context import AppContext
from tests.fixtures.api_inprocess import BearerTenants
from tests.fixtures.documents import normalise_text, render_document
from tests.fixtures.pdfs import page_texts, text_pdf
from tests.fixtures.reliability import wait_for

CLIENT_ENV = ("OCR_URL", "OCR_API_KEY")


def ocr_serve(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True,
                          env={**environ, **(env or {})}, timeout=timeout)


def one_line_failure(run: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert run.returncode == code, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and run.stdout == "", run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ocr-serve ocr: "), run.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def image_file(tmp_path):
    document = render_document(["Invoice number 20261130", "Total 1,234.56 EUR"], size=(900, 300), top=60, gap=120)
    path = tmp_path / "invoice.png"
    document.image.save(path)
    return path, document


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: nothing listens there


@pytest.fixture
def silent_server():
    """Accepts connections and reads, never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for conn in held:
        conn.close()


@pytest.fixture
def live_service(embedded_engine):
    """The ingress app around the embedded engine, over HTTP on a loopback port; `Bearer <tenant>` keys."""
    import uvicorn

    app = create_app(AppContext(settings=Settings(), engine=embedded_engine, authenticator=BearerTenants()))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, interval_s=0.05, what="uvicorn started")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_service_down_is_one_line_with_the_url_and_what_to_do(image_file, closed_port):
    url = f"http://127.0.0.1:{closed_port}"
    run = ocr_serve("ocr", str(image_file[0]), "--url", url)
    one_line_failure(run, 3, f"cannot connect to {url}", "ocr-serve serve", "OCR_URL")
    # the URL comes from OCR_URL too
    run = ocr_serve("ocr", str(image_file[0]), env={"OCR_URL": url + "/"})
    one_line_failure(run, 3, f"cannot connect to {url} ")


def test_a_service_that_never_answers_times_out_in_one_line(image_file, silent_server):
    url = f"http://127.0.0.1:{silent_server}"
    run = ocr_serve("ocr", str(image_file[0]), "--url", url, "--timeout", "1", timeout=60)
    one_line_failure(run, 3, f"no answer from {url} within 1 s", "--timeout")


def test_missing_file_and_bad_url_are_usage_errors(tmp_path, closed_port):
    run = ocr_serve("ocr", str(tmp_path / "nope.png"), "--url", f"http://127.0.0.1:{closed_port}")
    one_line_failure(run, 2, f"cannot read {tmp_path / 'nope.png'}", "No such file")
    run = ocr_serve("ocr", str(tmp_path), "--url", f"http://127.0.0.1:{closed_port}")  # a folder
    one_line_failure(run, 2, f"cannot read {tmp_path}")
    (tmp_path / "a.png").write_bytes(b"x")
    run = ocr_serve("ocr", str(tmp_path / "a.png"), "--url", "ftp://example")
    one_line_failure(run, 2, "invalid service URL 'ftp://example'")


def test_every_option_says_its_default():
    import argparse

    from service.cli import client

    sub = argparse.ArgumentParser(prog="ocr-serve").add_subparsers()
    client.add_cli(sub)
    options = [action for action in sub.choices["ocr"]._actions if action.option_strings and action.dest != "help"]
    assert len(options) >= 10
    for action in options:
        assert action.help and "default" in action.help, action.dest


def test_against_a_real_service(image_file, live_service):
    path, document = image_file
    # the key from OCR_API_KEY, the URL from OCR_URL: nothing secret on the command line
    env = {"OCR_URL": live_service, "OCR_API_KEY": "acme"}
    run = ocr_serve("ocr", str(path), "--text", env=env)
    assert run.returncode == 0, run.stderr
    for line in document.lines:
        assert normalise_text(line.text) in normalise_text(run.stdout)
    assert not run.stdout.lstrip().startswith("{")

    run = ocr_serve("ocr", str(path), "--compact", "--task", "text", env=env)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.strip().splitlines()) == 1
    assert json.loads(run.stdout)["task"] == "text"

    run = ocr_serve("ocr", str(path), env=env)  # default: indented JSON with the lines and their boxes
    assert run.returncode == 0 and len(run.stdout.splitlines()) > 10
    assert len(json.loads(run.stdout)["lines"]) >= 2

    # no key: the service's 401 in one line that says where the key goes; JSON output keeps the error body
    run = ocr_serve("ocr", str(path), "--text", env={"OCR_URL": live_service})
    one_line_failure(run, 1, f"{live_service} answered 401 unauthorized", "OCR_API_KEY")
    run = ocr_serve("ocr", str(path), "--task", "table", "--compact", env=env)
    assert run.returncode == 1 and json.loads(run.stdout)["error"]["code"] == "unsupported_task"


def test_a_pdf_runs_as_a_job_and_text_gives_each_page(tmp_path, live_service):
    pdf = tmp_path / "two.pdf"
    pdf.write_bytes(text_pdf(2))
    run = ocr_serve("ocr", str(pdf), "--text", "--task", "text", env={"OCR_URL": live_service, "OCR_API_KEY": "acme"})
    assert run.returncode == 0, run.stderr
    pages = run.stdout.rstrip("\n").split("\f")  # pages split by form feeds, as pdftotext does
    assert len(pages) == 2
    for text, lines in zip(pages, page_texts(2)):
        assert all(normalise_text(line) in normalise_text(text) for line in lines)
    assert "2/2 pages" in run.stderr  # the progress bar


def test_config_warns_about_unknown_variables_but_not_the_clients(monkeypatch, capsys):
    from service.cli.main import main

    monkeypatch.setenv("OCR_MAX_BODDY_BYTES", "1")
    monkeypatch.setenv("OCR_API_KEY", "secret-key")
    monkeypatch.setenv("OCR_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("OCR_API_KEYZ", "1")
    assert main(["config"]) == 0
    err = capsys.readouterr().err
    assert "OCR_MAX_BODDY_BYTES is not a setting (did you mean OCR_MAX_BODY_BYTES?)" in err
    assert "OCR_API_KEYZ is not a setting (did you mean OCR_API_KEY?)" in err
    assert "OCR_API_KEY is" not in err and "OCR_URL" not in err and "secret-key" not in err
