"""What a batch reads: its inputs (files, folders, globs, `@list` files, object-store URIs) expanded into documents,
each with the size and modification time its store reports.

Local paths and `file://` URIs go through pyarrow's local filesystem; `s3://bucket/prefix` through pyarrow's S3
filesystem; any other `scheme://` through pyarrow where it knows the scheme (`gs://`, `hdfs://`, `abfs://`), else
fsspec. Credentials are never part of a plan that crosses processes: every process (the driver, each Ray worker)
builds its filesystem from its own environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
`AWS_REGION`, `AWS_ENDPOINT_URL`, or the providers' own configuration files and instance credentials).
"""

from __future__ import annotations

import functools
import glob
import os
import posixpath
from dataclasses import dataclass
from typing import Iterable, Iterator

# what a folder or a prefix is scanned for (a file named on its own, or matched by a glob, is read whatever its name)
DOCUMENT_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".pdf"})
_GLOB_CHARS = frozenset("*?[")


class InputError(ValueError):
    """An input that names nothing (a typo'd path, an empty prefix) or cannot be listed: the run does not start."""


@dataclass(frozen=True)
class StoreOptions:
    """How object-store URIs are reached, besides the credentials each process finds in its environment.
    `s3_endpoint`: an S3-compatible server (MinIO, Ceph, a test server), e.g. `http://127.0.0.1:9000`."""

    s3_endpoint: str | None = None
    s3_region: str | None = None

    @classmethod
    def from_environment(cls, s3_endpoint: str | None = None, s3_region: str | None = None) -> "StoreOptions":
        return cls(s3_endpoint=s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL") or None,
                   s3_region=s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))

    def filesystem(self, uri: str):
        """(pyarrow FileSystem, the path inside it) for a local path or a URI."""
        return _filesystem(self, scheme_of(uri)), path_in_store(uri)


def scheme_of(uri: str) -> str:
    """`s3` for `s3://b/k`, `file` for local paths and `file://` URIs."""
    head, sep, _ = uri.partition("://")
    return head.lower() if sep and head.isalnum() else "file"


def path_in_store(uri: str) -> str:
    """The path a filesystem takes: `bucket/key` for `s3://bucket/key`, an absolute path for local files."""
    scheme = scheme_of(uri)
    if scheme == "file":
        return os.path.abspath(uri.removeprefix("file://"))
    return uri.split("://", 1)[1]


def uri_of(scheme: str, path: str) -> str:
    return path if scheme == "file" else f"{scheme}://{path}"


@functools.lru_cache(maxsize=8)
def _filesystem(options: StoreOptions, scheme: str):
    """One filesystem per process and scheme (S3 clients are costly to build; pyarrow's are thread-safe)."""
    import pyarrow.fs as pafs

    if scheme == "file":
        return pafs.LocalFileSystem()
    if scheme == "s3":
        # delayed open: an object smaller than a part is one PutObject at close (one request; S3-compatible servers
        # whose CompleteMultipartUpload answer pyarrow rejects, moto's among them, take it too)
        kwargs = {"allow_delayed_open": True, **({"region": options.s3_region} if options.s3_region else {})}
        if options.s3_endpoint:
            endpoint = options.s3_endpoint
            if "://" in endpoint:
                kwargs["scheme"], endpoint = endpoint.split("://", 1)
            kwargs["endpoint_override"] = endpoint.rstrip("/")
        return pafs.S3FileSystem(**kwargs)
    try:
        filesystem, _ = pafs.FileSystem.from_uri(f"{scheme}://")
        return filesystem
    except (ValueError, OSError):  # pyarrow knows no such scheme (ArrowInvalid is a ValueError)
        import fsspec

        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(scheme)))


@dataclass(frozen=True)
class Source:
    """One document to read. `uri` is its identity in the output (an absolute local path or `scheme://bucket/key`);
    `name` its path below the input it was found under (folders keep their structure in `--markdown` files)."""

    uri: str
    name: str
    size: int
    mtime: str  # the store's modification time in ns ("" where it reports none): resumes skip unchanged documents


def list_inputs(inputs: Iterable[str], options: StoreOptions) -> list[Source]:
    """Every document the inputs name, each once, sorted by URI. `@FILE` reads inputs from FILE (one per line, `#`
    comments; local or a URI); a folder or prefix is scanned recursively for DOCUMENT_SUFFIXES (hidden files and
    folders skipped); a glob matches files (`**` crosses folders). An input that names nothing raises InputError."""
    found: dict[str, Source] = {}
    for entry in expand_list_files(inputs, options):
        matches = list(_expand(entry, options))
        if not matches:
            raise InputError(f"{entry}: no such file or folder, or nothing to read in it")
        for source in matches:
            found.setdefault(source.uri, source)
    return [found[uri] for uri in sorted(found)]


def expand_list_files(inputs: Iterable[str], options: StoreOptions, depth: int = 0) -> Iterator[str]:
    for entry in inputs:
        entry = entry.strip()
        if not entry.startswith("@"):
            yield entry
            continue
        if depth >= 4:
            raise InputError(f"{entry}: list files nested more than 4 deep")
        filesystem, path = options.filesystem(entry[1:])
        try:
            with filesystem.open_input_stream(path) as stream:
                text = stream.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{entry}: cannot read the list file ({exc})") from None
        lines = [line.strip() for line in text.splitlines()]
        yield from expand_list_files([ln for ln in lines if ln and not ln.startswith("#")], options, depth + 1)


def _expand(entry: str, options: StoreOptions) -> Iterator[Source]:
    import pyarrow.fs as pafs

    scheme = scheme_of(entry)
    if any(c in _GLOB_CHARS for c in entry):
        yield from _glob(entry, scheme, options)
        return
    filesystem, path = options.filesystem(entry)
    try:
        info = filesystem.get_file_info(path)
    except OSError as exc:
        raise InputError(f"{entry}: cannot list it ({exc})") from None
    if info.type == pafs.FileType.File:
        yield _source(scheme, info, posixpath.basename(path))
    elif info.type == pafs.FileType.Directory:
        yield from _scan(filesystem, scheme, path)


def _scan(filesystem, scheme: str, root: str) -> Iterator[Source]:
    import pyarrow.fs as pafs

    root = root.rstrip("/")
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except OSError as exc:
        raise InputError(f"{uri_of(scheme, root)}: cannot list it ({exc})") from None
    for info in infos:
        relative = info.path[len(root):].lstrip("/")
        if info.type != pafs.FileType.File or not is_document_name(relative):
            continue
        yield _source(scheme, info, relative)


def is_document_name(relative: str) -> bool:
    """A folder scan's filter: a document suffix, nothing hidden on the way (`.git/`, `.DS_Store`)."""
    parts = relative.split("/")
    return not any(p.startswith(".") for p in parts) and posixpath.splitext(parts[-1])[1].lower() in DOCUMENT_SUFFIXES


def _glob(pattern: str, scheme: str, options: StoreOptions) -> Iterator[Source]:
    import pyarrow.fs as pafs

    filesystem, path = options.filesystem(pattern)
    # the folder above the first component with a wildcard is listed; the pattern is matched below it
    parts = path.split("/")
    fixed = next(i for i, part in enumerate(parts) if any(c in _GLOB_CHARS for c in part))
    base = "/".join(parts[:fixed]) or "/"
    if scheme == "file":
        matches = sorted(glob.glob(path, recursive=True))
        infos = filesystem.get_file_info(matches) if matches else []
    else:
        try:
            infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as exc:
            raise InputError(f"{pattern}: cannot list {uri_of(scheme, base)} ({exc})") from None
        infos = [info for info in infos if glob_match(info.path, path)]
    for info in infos:
        if info.type == pafs.FileType.File:
            yield _source(scheme, info, info.path[len(base):].lstrip("/") if base != "/" else info.path.lstrip("/"))


def glob_match(path: str, pattern: str) -> bool:
    """Shell-style match where `*` and `?` stay within one path component and `**` spans any number of them."""
    return _glob_regex(pattern).fullmatch(path) is not None


@functools.lru_cache(maxsize=64)
def _glob_regex(pattern: str):
    import re

    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end].replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
            i += 1
    return re.compile("".join(out))


def _source(scheme: str, info, name: str) -> Source:
    mtime = info.mtime_ns
    return Source(uri=uri_of(scheme, info.path), name=name or posixpath.basename(info.path), size=int(info.size or 0),
                  mtime="" if mtime is None else str(mtime))
