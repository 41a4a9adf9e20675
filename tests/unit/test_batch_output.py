"""`ocr-serve batch` without Ray: how inputs are listed, page keys, and how the output folder resumes after a kill
at any point of a commit (a part without its manifest, a temporary file, a manifest without its part)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.batch.inputs import InputError, StoreOptions, glob_match, list_inputs
from service.batch.output import Done, OutputError, OutputStore, page_key, page_record


def touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_folders_globs_and_list_files(tmp_path):
    for name in ("a/1.png", "a/b/2.PDF", "a/b/3.jpg", "a/notes.txt", "a/.git/x.png", "a/.hidden.png", "c/4.tiff"):
        touch(tmp_path / name)
    (tmp_path / "list.txt").write_text(f"# comment\n{tmp_path / 'c' / '4.tiff'}\n\n{tmp_path / 'a' / '1.png'}\n")
    options = StoreOptions()
    names = lambda inputs: [s.name for s in list_inputs(inputs, options)]
    # a folder: recursive, documents only, nothing hidden; names below the folder
    assert names([str(tmp_path / "a")]) == ["1.png", "b/2.PDF", "b/3.jpg"]
    # a glob: `*` within a folder, `**` across; a list file; every document once
    assert names([str(tmp_path / "a" / "*" / "*.jpg")]) == ["b/3.jpg"]
    assert sorted(names([str(tmp_path / "**" / "*.png")])) == ["a/1.png"]
    sources = list_inputs([f"@{tmp_path / 'list.txt'}", str(tmp_path / "a" / "1.png")], options)
    assert [s.name for s in sources] == ["1.png", "4.tiff"] and all(s.uri.startswith("/") for s in sources)
    assert sources[0].size == 1 and sources[0].mtime
    with pytest.raises(InputError, match="no such file"):
        list_inputs([str(tmp_path / "missing")], options)


def test_glob_match():
    assert glob_match("b/in/x/y.pdf", "b/in/**/*.pdf") and glob_match("b/in/y.pdf", "b/in/**/*.pdf")
    assert not glob_match("b/in/x/y.pdf", "b/in/*.pdf") and glob_match("b/in/y1.pdf", "b/in/y?.pdf")
    assert glob_match("b/in/a.png", "b/in/[ab].png") and not glob_match("b/in/c.png", "b/in/[!c].png")


def test_page_keys_follow_content_page_task_and_settings():
    key = page_key("/d/a.pdf", "00" * 32, 1, "text", "s1")
    assert key != page_key("/d/a.pdf", "11" * 32, 1, "text", "s1")
    assert key != page_key("/d/a.pdf", "00" * 32, 2, "text", "s1")
    assert key != page_key("/d/a.pdf", "00" * 32, 1, "document", "s1")
    assert key != page_key("/d/a.pdf", "00" * 32, 1, "text", "s2")
    assert key == page_key("/d/a.pdf", "00" * 32, 1, "text", "s1")


def record(source: str, page: int, pages: int = 2) -> dict:
    doc = {"source": source, "name": Path(source).name, "page": page, "pages": pages, "sha256": "ab" * 32}
    return page_record(doc, task="text", key=page_key(source, "ab" * 32, page, "text", "s"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_resume_after_a_kill_between_part_and_manifest(tmp_path, fmt):
    store = OutputStore(str(tmp_path), StoreOptions(), fmt)
    store.open_run({"request": {"task": "text"}})
    first = [record("/d/a.pdf", 1), record("/d/a.pdf", 2)]
    part = store.commit(first, [Done.of(r, size=10, mtime="5") for r in first])
    second = [record("/d/b.pdf", 1)]
    lost = store.commit(second, [Done.of(r, size=10, mtime="5") for r in second])
    # killed after the second part, before its manifest; and in the middle of writing a third
    (tmp_path / "_manifest" / f"{lost}.manifest.jsonl").unlink()
    touch(tmp_path / "_tmp" / "deadbeef.tmp", b"half a part")
    # a manifest whose part never became visible
    (tmp_path / "_manifest" / "part-gone.jsonl.manifest.jsonl").write_text(json.dumps(
        {**{k: v for k, v in Done.of(record("/d/c.pdf", 1), 1, "1").__dict__.items() if k != "part"}}) + "\n")
    store = OutputStore(str(tmp_path), StoreOptions(), fmt)
    store.clean_temporary()
    index, notes = store.load_done()
    assert not list((tmp_path / "_tmp").iterdir())
    assert sorted(d.key for d in index.by_key.values()) == sorted(r["key"] for r in first + second)
    assert any("had no manifest" in n for n in notes) and any("missing part" in n for n in notes)
    assert (tmp_path / "_manifest" / f"{lost}.manifest.jsonl").exists()  # rebuilt from the part
    # a.pdf was written whole with this size and time: skipped unread; b.pdf's rebuilt entry has no size: read again
    assert index.complete("/d/a.pdf", 10, "5") and not index.complete("/d/a.pdf", 11, "5")
    assert not index.complete("/d/b.pdf", 10, "5") and index.written_pages("/d/b.pdf") == ("ab" * 32, [1])
    assert part in {d.part for d in index.by_key.values()}


def test_an_output_folder_keeps_its_settings_and_format(tmp_path):
    store = OutputStore(str(tmp_path), StoreOptions(), "jsonl")
    digest = store.open_run({"request": {"task": "text"}, "limits": {"a": 1}})
    assert store.open_run({"request": {"task": "text"}, "limits": {"a": 1}}) == digest
    with pytest.raises(OutputError, match="differing: limits"):
        store.open_run({"request": {"task": "text"}, "limits": {"a": 2}})
    with pytest.raises(OutputError, match="--format jsonl"):
        OutputStore(str(tmp_path), StoreOptions(), "parquet").open_run({"request": {"task": "text"}})
