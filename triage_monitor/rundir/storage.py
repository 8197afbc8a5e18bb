"""Where a run directory's bytes live: a local directory or an S3-compatible object store, behind one interface.

:class:`Store` wraps a ``pyarrow.fs`` file system and the run's root in it.  Everything that reads or writes a run
(:mod:`~triage_monitor.rundir.layout`, the writer, the manifest, the readers of :mod:`~triage_monitor.offline.analysis`) goes
through it, with paths relative to the run's root (``"tokens/steps-...parquet"``), so one code path serves both.

Locations (:func:`open_store`):

* a local path, or a ``file://`` URI: :class:`pyarrow.fs.LocalFileSystem`.  A write goes to a hidden temporary
  name in the same directory and is renamed into place (atomic on POSIX file systems);
* ``s3://bucket/prefix``: :class:`pyarrow.fs.S3FileSystem` (AWS S3 and S3-compatible stores: MinIO, Ceph, R2,
  GCS's XML interoperability API, ...).  Credentials, region and endpoint come from the usual places — the
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` / ``AWS_PROFILE`` /
  ``AWS_DEFAULT_REGION`` / ``AWS_ENDPOINT_URL`` variables, ``~/.aws/credentials`` and ``~/.aws/config``,
  instance metadata — or from the URI's query (``s3://bucket/run?endpoint_override=host:9000&scheme=http``;
  :data:`S3_URI_OPTIONS`).  An object appears whole when its upload completes (S3 has no rename and needs none);
  an upload that fails in Python is deleted again, one cut short by a killed process never appears;
* any other scheme (``gs://``, ``hdfs://``, ``abfs://``, ``http://``, ...): refused with
  :class:`~triage_monitor.errors.UnsupportedLocationError` naming it — never a local folder of that name.

Imports pyarrow and the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Union

import pyarrow as pa
import pyarrow.fs as pafs

from ..errors import UnsupportedLocationError

#: Prefix of the hidden temporary files a local write goes through (readers and dataset discovery skip them).
TEMP_PREFIX = ".tmp-"
#: URI schemes a run directory may use besides local paths: the object stores tested (docs/reliability.md).
OBJECT_STORE_SCHEMES = ("s3",)

#: A location given as ``scheme://...`` (an object store or a remote file system).
_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: The same after ``pathlib.Path`` has collapsed the double slash (``Path("s3://b/r")`` is ``s3:/b/r``): a first
#: component of two or more scheme characters and a colon (one letter and a colon is a Windows drive).
_COLLAPSED_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):$")


class UriParts(NamedTuple):
    """A location split by :func:`split_uri`: its lower-case URI scheme (None for a plain path) and its text."""

    scheme: Optional[str]
    text: str


def split_uri(location) -> UriParts:
    """``(scheme or None, text)`` of a location: the lower-case URI scheme and the location as a URI string, or
    ``(None, str(location))`` for a plain path.  A ``Path`` that collapsed ``s3://b/r`` into ``s3:/b/r`` is
    read as the URI it was."""
    text = str(location)
    m = _URI_RE.match(text)
    if m:
        return UriParts(m.group(1).lower(), text)
    parts = Path(text).parts
    c = _COLLAPSED_URI_RE.match(parts[0]) if parts else None
    if c:
        return UriParts(c.group(1).lower(), f"{c.group(1)}://{text[len(c.group(1)) + 2:]}")
    return UriParts(None, text)


def local_path(location, what: str = "run directory") -> Path:
    """The local path of ``location`` (a path, or a ``file://`` URI).

    Raises:
        UnsupportedLocationError: any other URI scheme (an object store included: this output must be local),
            naming it and ``what``."""
    scheme, text = split_uri(location)
    if scheme is None:
        return Path(location)
    if scheme == "file":
        return Path("/" + text.split("://", 1)[1].lstrip("/"))
    raise UnsupportedLocationError(text, scheme, what, supported="a local path or file://")


def is_remote(location) -> bool:
    """True when ``location`` names an object store (``s3://...``)."""
    return split_uri(location)[0] in OBJECT_STORE_SCHEMES


class Entry(NamedTuple):
    """One file of a listing: its name (no directory), size in bytes and modification time (ns; 0 unknown)."""

    name: str
    size: int
    mtime_ns: int


class FileIdentity(NamedTuple):
    """A store's identity by a path (:func:`store_identity`): ``("file", absolute path)``."""

    kind: str
    path: str


class S3Identity(NamedTuple):
    """An ``s3://`` store's identity (:func:`store_identity`): ``("s3", endpoint, scheme, region, virtual addressing,
    key id or profile, bucket/prefix)``."""

    kind: str
    endpoint: str
    scheme: str
    region: str
    virtual_addressing: bool
    key: str
    root: str


#: What names the bytes a store reaches (:func:`store_identity`); hashed and compared like the plain tuple.
StoreIdentity = Union[FileIdentity, S3Identity]


class Store:
    """A run directory's root in a file system: every path argument is relative to it (``"run.json"``,
    ``"tokens/..."``; ``""`` the root itself), with ``/`` separators.

    Attributes:
        location: the location as given (a local path as a string, or the URI): what a worker process needs to
            open the same store (:func:`open_store`).
        fs: the ``pyarrow.fs.FileSystem``.
        root: the run's root in ``fs`` (a local absolute path, or ``bucket/prefix``).
        is_local: True on a local file system (renames, ``flock`` and ``O_EXCL`` exist there).
        identity: what names the bytes this store reaches (:func:`store_identity`): the key of every
            process-level cache of a store or of its files.
    """

    def __init__(self, location: str, fs: pafs.FileSystem, root: str, is_local: bool,
                 identity: Optional[StoreIdentity] = None):
        self.location, self.fs, self.root, self.is_local = location, fs, root.rstrip("/") or "/", is_local
        self.identity: StoreIdentity = identity or FileIdentity("file" if is_local else "?", self.root)

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    def __reduce__(self):                   # pickled as its location: a worker process opens its own client
        return (open_store, (self.location,))

    # ------------------------------------------------------------------------------------------- names
    def full(self, rel: str = "") -> str:
        """The path of ``rel`` in :attr:`fs` (``root/rel``)."""
        rel = str(rel).strip("/")
        return f"{self.root}/{rel}" if rel else self.root

    def display(self, rel: str = "") -> str:
        """``rel`` as a user reads it in a message: a local path, or the URI of an object."""
        if self.is_local:
            return str(Path(self.full(rel)))
        scheme = split_uri(self.location)[0]
        return f"{scheme}://{self.full(rel)}"

    def local(self, rel: str = "") -> Path:
        """The local ``Path`` of ``rel``.

        Raises:
            UnsupportedLocationError: the store is not local (the caller needs a local file: a lock, a link)."""
        if not self.is_local:
            scheme = split_uri(self.location).scheme
            assert scheme is not None       # a store that is not local is opened from a URI (open_store)
            raise UnsupportedLocationError(self.location, scheme, "this operation", supported="a local path")
        return Path(self.full(rel))

    # ------------------------------------------------------------------------------------------ looking
    def info(self, rel: str = "") -> pafs.FileInfo:
        """The ``pyarrow.fs.FileInfo`` of ``rel`` (``type`` is ``FileType.NotFound`` when absent)."""
        return self.fs.get_file_info(self.full(rel))

    def exists(self, rel: str = "") -> bool:
        return self.info(rel).type != pafs.FileType.NotFound

    def is_file(self, rel: str) -> bool:
        return self.info(rel).type == pafs.FileType.File

    def is_dir(self, rel: str = "") -> bool:
        return self.info(rel).type == pafs.FileType.Directory

    def listdir(self, rel: str = "") -> list[Entry]:
        """The files directly in directory ``rel`` (:class:`Entry`, unsorted); empty when it does not exist.
        Directories are left out.  One listing call (on an object store: one request per 1,000 names)."""
        sel = pafs.FileSelector(self.full(rel), allow_not_found=True, recursive=False)
        out = []
        for fi in self.fs.get_file_info(sel):
            if fi.type == pafs.FileType.File:
                mt = fi.mtime_ns if fi.mtime_ns is not None else 0
                out.append(Entry(fi.base_name, int(fi.size or 0), int(mt)))
        return out

    def dirs(self, rel: str = "") -> list[str]:
        """The names of the directories directly in ``rel`` (empty when it does not exist)."""
        sel = pafs.FileSelector(self.full(rel), allow_not_found=True, recursive=False)
        return [fi.base_name for fi in self.fs.get_file_info(sel) if fi.type == pafs.FileType.Directory]

    # ------------------------------------------------------------------------------------------ reading
    def open_input(self, rel: str):
        """A random-access ``pyarrow.NativeFile`` on ``rel`` (for ``pq.ParquetFile``, IPC readers).

        Raises:
            FileNotFoundError, OSError: it cannot be opened."""
        return self.fs.open_input_file(self.full(rel))

    def read_bytes(self, rel: str) -> bytes:
        """The whole content of ``rel``.

        Raises:
            FileNotFoundError, OSError: it cannot be read."""
        with self.fs.open_input_stream(self.full(rel)) as f:
            return f.read()

    # ------------------------------------------------------------------------------------------ writing
    def makedirs(self, rel: str = "") -> None:
        """Create directory ``rel`` and its parents (on an object store: nothing to do, prefixes need no
        creation; the bucket must exist).

        Raises:
            OSError: it cannot be created."""
        if self.is_local:
            Path(self.full(rel)).mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def writing(self, rel: str, suffix: str = "") -> Iterator:
        """``with store.writing(rel) as out:`` a writable binary file (a Python file locally, a
        ``pyarrow.NativeFile`` on an object store; pyarrow's writers take either) whose content appears at ``rel``
        whole, when the block ends without an exception, or not at all.

        Local: written under a hidden temporary name (:data:`TEMP_PREFIX`, ``suffix`` appended) in the same
        directory and renamed over ``rel``.  Object store: uploaded under such a hidden name beside ``rel``, then
        moved onto ``rel`` (a server-side copy: the object at ``rel`` changes whole or not at all); when the block
        raises or the upload or the copy fails, the temporary object is deleted and an earlier object at ``rel``
        is kept as it was (uploading to ``rel`` itself would complete the half-written upload on the way out, over
        the earlier object).  The parent directory is created.

        Raises:
            OSError, pyarrow.ArrowException: the file cannot be written (no temporary file is left behind)."""
        target = self.full(rel)
        if self.is_local:
            parent = os.path.dirname(target)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f"{TEMP_PREFIX}{uuid.uuid4().hex}{suffix}")
            try:
                with open(tmp, "xb") as out:    # the OS's own error (errno, file name) when it cannot be created
                    yield out
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
            return
        parent, _, _ = target.rpartition("/")
        tmp = f"{parent}/{TEMP_PREFIX}{uuid.uuid4().hex}{suffix}"
        out = self.fs.open_output_stream(tmp)
        moved = False
        try:
            try:
                yield out
            except BaseException:
                with contextlib.suppress(Exception):
                    out.close()
                raise
            out.close()
            self.fs.move(tmp, target)
            moved = True
        finally:
            if not moved:
                with contextlib.suppress(Exception):
                    self.fs.delete_file(tmp)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` whole (:meth:`writing`).

        Raises:
            OSError: it cannot be written."""
        with self.writing(rel) as out:
            out.write(data)

    def delete(self, rel: str) -> None:
        """Remove file ``rel``; a missing file is no error.

        Raises:
            OSError: it exists and cannot be removed."""
        try:
            self.fs.delete_file(self.full(rel))
        except FileNotFoundError:
            pass

    def delete_dir(self, rel: str) -> None:
        """Remove directory ``rel`` and everything in it; a missing one is no error."""
        try:
            self.fs.delete_dir(self.full(rel))
        except FileNotFoundError:
            pass


def _open_local(text: str, location) -> Store:
    p = local_path(location)
    root = os.path.abspath(p)
    return Store(str(location) if isinstance(location, str) else str(p), pafs.LocalFileSystem(), root, True,
                 FileIdentity("file", root))


def store_identity(location) -> StoreIdentity:
    """What names the bytes ``location`` reaches, in this process's environment, without a network call: a local
    path's ``("file", absolute path)``; an ``s3://`` URI's ``("s3", endpoint, scheme, region, virtual addressing,
    credentials' key id or profile, bucket/prefix)`` with the endpoint and region from the URI's query or the
    AWS variables (:func:`open_store`'s rules).  Two locations with the same identity are the same store; the same
    URI with another ``AWS_ENDPOINT_URL`` is another (a cache keyed by the URI alone would read one endpoint's
    objects for another's).

    Raises:
        UnsupportedLocationError, ValueError: as :func:`open_store`."""
    scheme, text = split_uri(location)
    if scheme is None or scheme == "file":
        return FileIdentity("file", os.path.abspath(local_path(location)))
    if scheme not in OBJECT_STORE_SCHEMES:
        raise UnsupportedLocationError(text, scheme, "run directory")
    root, opts = _s3_options(text)
    key = os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE") or ""
    return S3Identity("s3", opts.get("endpoint_override") or "", opts.get("scheme") or "https",
                      opts.get("region") or "", bool(opts.get("force_virtual_addressing")), key, root)


def open_store(location) -> Store:
    """The :class:`Store` of a run location (a path, ``file://``, or ``s3://bucket/prefix[?options]``; see the
    module docstring).

    Raises:
        UnsupportedLocationError: a URI scheme other than ``file`` and ``s3`` (a ValueError naming it).
        ValueError: an ``s3://`` URI without a bucket, or with a query option not in :data:`S3_URI_OPTIONS`.

    Nothing is read or written: an object store is first contacted by the first operation."""
    scheme, text = split_uri(location)
    if scheme is None or scheme == "file":
        return _open_local(text, location)
    if scheme not in OBJECT_STORE_SCHEMES:
        raise UnsupportedLocationError(text, scheme, "run directory")
    fs, root, is_local = _s3(text)
    return Store(text, fs, root, is_local, store_identity(text))


#: The options an ``s3://`` URI's query may set (``pyarrow.fs.S3FileSystem``'s arguments of these names).
S3_URI_OPTIONS = ("region", "endpoint_override", "scheme", "force_virtual_addressing")


class S3Options(NamedTuple):
    """An ``s3://`` URI read by :func:`_s3_options`: ``"bucket/prefix"`` and the ``S3FileSystem`` arguments."""

    root: str
    options: dict[str, Any]


def _s3_options(text: str) -> S3Options:
    """``("bucket/prefix", {S3FileSystem argument: value})`` of an ``s3://`` URI: the region comes from the URI's
    query, else ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else the AWS SDK's own default (None); the endpoint from
    the query, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``."""
    from urllib.parse import parse_qsl

    rest = text.split("://", 1)[1]
    path, _, query = rest.partition("?")
    root = path.strip("/")
    if not root:
        raise ValueError(f"{text}: name a bucket (s3://bucket/prefix)")
    opts: dict[str, Any] = {}
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k not in S3_URI_OPTIONS:
            raise ValueError(f"{text}: unknown option {k!r} in the URI's query (known: {', '.join(S3_URI_OPTIONS)})")
        opts[k] = v.lower() in ("1", "true", "yes") if k == "force_virtual_addressing" else v
    opts.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_override" not in opts:       # the AWS SDKs' variables, as pyarrow's from_uri reads them
        scheme, sep, host = endpoint.partition("://")
        opts["endpoint_override"] = host.rstrip("/") if sep else endpoint
        if sep:
            opts.setdefault("scheme", scheme)
    return S3Options(root, opts)


class S3Location(NamedTuple):
    """An ``s3://`` URI opened by :func:`_s3`: the file system, ``"bucket/prefix"`` in it, and False (not local)."""

    fs: pafs.S3FileSystem
    root: str
    is_local: bool


def _s3(text: str) -> S3Location:
    """``(S3FileSystem, "bucket/prefix", False)`` of an ``s3://`` URI (:func:`_s3_options`), built without a
    network call."""
    root, opts = _s3_options(text)
    try:
        fs = pafs.S3FileSystem(**{k: v for k, v in opts.items() if v is not None})
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise ValueError(f"{text}: not a usable s3:// location ({exc})") from None
    return S3Location(fs, root, False)
