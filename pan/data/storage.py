"""The one place pan opens data paths: a local path or a URL (`s3://`, `gs://`, anything fsspec
knows). Read a whole file or a byte range, stat, exists, list, write (atomic for a local file, a put
of the finished bytes for an object store).

Remote calls are retried on transient errors (refused or reset connections, timeouts, 5xx answers,
throttling) with exponential backoff and jitter, a bounded number of tries, then a `StorageError`
naming the URL; a missing object is no transient error (FileNotFoundError at once). Whole-file
reads of remote objects go through a bounded local cache (`DiskCache`: least recently used dropped
first, by bytes), keyed by the object's URL, size and ETag, so a changed object is fetched again.

Endpoints and credentials come from the usual environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_PROFILE ... which s3fs and botocore read; GOOGLE_APPLICATION_CREDENTIALS
for gcsfs). The machine's own settings are environment variables too, because they belong to the
machine (its local disk), not to the run's YAML that runs on a laptop and on a cluster alike:
- PAN_DATA_CACHE: the cache folder (default $XDG_CACHE_HOME/pan/data, else ~/.cache/pan/data);
- PAN_DATA_CACHE_GB: its size (default 20; 0 turns the cache off);
- PAN_DATA_RETRIES: tries of a remote call before it fails (default 6);
- PAN_DATA_READ_AHEAD: remote shard members fetched ahead of the reader, concurrently, per process
  (default 16; 0 turns read-ahead off). See pan/data/read_ahead.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import posixpath
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from pan.data.read_ahead import ReadAhead, Span
from pan.runtime.byte_range import ByteRangeFile

T = TypeVar("T")
PathLike = str | Path

URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
ENV_CACHE, ENV_CACHE_GB, ENV_RETRIES = "PAN_DATA_CACHE", "PAN_DATA_CACHE_GB", "PAN_DATA_RETRIES"
ENV_READ_AHEAD = "PAN_DATA_READ_AHEAD"


class StorageError(OSError):
    """A remote path that could not be reached after every try (the message names the URL)."""


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------

def is_url(path: PathLike) -> bool:
    """True for `scheme://...` (but file://, which is a local path)."""
    match = URL.match(str(path)) if isinstance(path, str) else None
    return match is not None and match.group(1).lower() != "file"


def local(path: PathLike) -> Path:
    """A local path as a Path (file:// stripped)."""
    text = str(path)
    return Path(text[len("file://"):] if text.lower().startswith("file://") else text)


def join(folder: PathLike, *names: str) -> PathLike:
    """`folder/name...`: a URL stays a URL (str), a local folder gives a Path; an absolute name or a
    URL name is returned as it is."""
    for name in names:
        if is_url(name) or os.path.isabs(name):
            folder = name
        elif is_url(folder):
            scheme, rest = str(folder).split("://", 1)
            folder = f"{scheme}://{posixpath.normpath(posixpath.join(rest, name))}"
        else:
            folder = local(folder) / name
    return folder if is_url(folder) else local(folder)


def parent(path: PathLike) -> PathLike:
    """The folder of `path`: a URL's "folder" (its text up to the last slash) stays a URL."""
    if is_url(path):
        scheme, rest = str(path).split("://", 1)
        return f"{scheme}://{posixpath.dirname(rest)}"
    return local(path).parent


def stem(path: PathLike) -> str:
    """The file name without its last suffix, of a local path or a URL."""
    return PurePosixPath(str(path)).stem


def suffix(path: PathLike) -> str:
    """The last suffix of the file name, lower case ("" for none)."""
    return PurePosixPath(str(path)).suffix.lower()


def known_store(url: str) -> str:
    """`url` if fsspec can open its scheme here, else ValueError saying what is missing."""
    import fsspec

    protocol = url.split("://", 1)[0].lower()
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as e:
        raise ValueError(f"{url}: no {protocol}:// store can be opened here ({e})") from None
    return url


# ----------------------------------------------------------------------------------------------
# Retries
# ----------------------------------------------------------------------------------------------

TRANSIENT_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                    errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN, errno.EBUSY,
                    getattr(errno, "EREMOTEIO", errno.EIO)}
# botocore's, aiohttp's and fsspec's names for a connection or a read that broke off
TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                   "ConnectTimeoutError", "HTTPClientError", "ProxyConnectionError", "ClientConnectorError",
                   "ServerDisconnectedError", "ClientOSError", "ClientPayloadError", "FSTimeoutError",
                   "IncompleteRead", "ResponseStreamingError", "ServerTimeoutError"}
THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
              "TooManyRequests", "InternalError", "ServiceUnavailable", "RateExceeded"}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _http_status(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status and error code of a botocore ClientError (or of anything with a `response`)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status, str(response.get("Error", {}).get("Code", ""))


def is_transient(exc: BaseException) -> bool:
    """Worth another try: a connection refused or reset, a timeout, a 5xx answer, throttling. A
    missing object, a permission refused or a bad request is not."""
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        status, code = _http_status(e)
        if status is not None or code:
            return (status is not None and (status >= 500 or status == 429)) or code in THROTTLING
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(k.__name__ in TRANSIENT_NAMES for k in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
    return False


AUTH_NAMES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def is_refusal(exc: BaseException) -> bool:
    """The store refused who we are (no or wrong credentials): no sample of it will read."""
    for e in _chain(exc):
        status, _ = _http_status(e)
        if isinstance(e, PermissionError) or status in (401, 403) or type(e).__name__ in AUTH_NAMES:
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """`tries` calls at most; before try k+1 a random wait in [0, min(max_delay, base_delay * 2^k)]
    ("full jitter": many processes that failed together do not come back together)."""
    tries: int = 6
    base_delay: float = 0.25
    max_delay: float = 8.0

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        return rng() * min(self.max_delay, self.base_delay * 2 ** attempt)


def with_retries(call: Callable[[], T], what: str, policy: RetryPolicy,
                 sleep: Callable[[float], None] = time.sleep, rng: Callable[[], float] = random.random) -> T:
    """`call()`, tried again after a transient error up to `policy.tries` times; then StorageError
    naming `what`. Other errors (a missing object: FileNotFoundError) pass through at once."""
    for attempt in range(policy.tries):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - sorted into transient or not just below
            if not is_transient(e):
                raise
            if attempt + 1 == policy.tries:
                raise StorageError(f"{what}: gave up after {policy.tries} tries "
                                   f"({type(e).__name__}: {e})") from e
            sleep(policy.delay(attempt, rng))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# The local cache of remote whole-file reads
# ----------------------------------------------------------------------------------------------

class DiskCache:
    """Files in `folder`, at most `budget` bytes in all, the least recently used dropped first.
    Several processes (decoding workers, ranks of a node) may share one folder: entries are written
    under a temporary name and renamed, a read that loses a race with an eviction is a miss, and a
    hit refreshes the entry's time (the LRU clock is the files' mtime). The folder is listed only
    when this process's count of the bytes in it passes the budget, and then emptied down to 90% of
    it, so that a full cache is not listed at every put."""

    LOW_WATER = 0.9

    def __init__(self, folder: Path, budget: int):
        self.folder, self.budget = Path(folder), budget
        self.used: int | None = None   # bytes in the folder, as this process last counted them
        self.lock = threading.Lock()   # the count, of the threads of a process (read-ahead's among them)

    def path(self, key: str) -> Path:
        return self.folder / hashlib.sha256(key.encode()).hexdigest()[:40]

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            return None
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.budget:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self.lock:
            if self.used is None:
                self.used = sum(size for _, size, _ in self.entries())
            else:
                self.used += len(data)
            if self.used > self.budget:
                self.evict(keep=path)

    def entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for entry in os.scandir(self.folder):
            if entry.name.startswith(".tmp-"):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return sorted(out)

    def evict(self, keep: Path | None = None) -> None:
        """Drop the least recently used entries until the folder holds LOW_WATER of the budget."""
        entries = self.entries()
        used = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if used <= self.budget * self.LOW_WATER:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            used -= size
        self.used = used


# ----------------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stat:
    size: int
    mtime: float | None   # seconds since the epoch, where the store says
    etag: str | None      # an object store's version tag (None for a local file)


def _env_number(name: str, default: float, kind: type, low: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a{'n integer' if kind is int else ' number'}: "
                         f"unset it or give a value >= {low}") from None
    if value < low:
        raise ValueError(f"{name}={text!r} is below {low}: unset it or give a value >= {low}")
    return value


@dataclass(frozen=True)
class Settings:
    """The machine's storage settings (the PAN_DATA_* environment variables, module docstring)."""
    cache_dir: Path
    cache_bytes: int
    retry: RetryPolicy
    read_ahead: int = 16   # remote members fetched ahead per process (0: none)

    @classmethod
    def from_env(cls) -> Settings:
        """ValueError (one line naming the variable and the fix) for a bad value."""
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = Path(os.environ.get(ENV_CACHE) or os.path.join(home, "pan/data"))
        gb = _env_number(ENV_CACHE_GB, 20.0, float, 0)
        tries = int(_env_number(ENV_RETRIES, RetryPolicy.tries, int, 1))
        ahead = int(_env_number(ENV_READ_AHEAD, cls.read_ahead, int, 0))
        return cls(folder, int(gb * 1e9), RetryPolicy(tries=tries), ahead)


class Storage:
    """Reads and writes of local paths and URLs, with retries and a cache for remote whole files."""

    def __init__(self, settings: Settings, sleep: Callable[[float], None] = time.sleep):
        self.settings, self.sleep = settings, sleep
        self.cache = DiskCache(settings.cache_dir, settings.cache_bytes) if settings.cache_bytes else None
        self.versions: dict[str, str] = {}   # url -> size and ETag, of the shards read (read_member)
        self.lock = threading.Lock()          # `versions` and the pool, shared with read-ahead's threads
        self.pool: ThreadPoolExecutor | None = None   # read-ahead's threads, started by the first ReadAhead
        self.pool_pid = os.getpid()
        self.local = threading.local()        # .ahead: the ReadAhead of this thread's reads (read_ahead)

    # -- remote plumbing ---------------------------------------------------------------------------
    def _fs(self, url: str):
        """(filesystem, path inside it). s3fs's own retries are cut to one try, and botocore's to
        one attempt, so that the policy here is the only one (and its tries are what they say)."""
        import fsspec  # lazy: a local-only run never imports the object-store stack

        protocol = url.split("://", 1)[0].lower()
        options = {}
        if protocol in ("s3", "s3a"):
            options["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                        # botocore's default of 10 would queue read-ahead's requests
                                        "max_pool_connections": max(10, self.settings.read_ahead)}
            # named, so that fsspec's cache of clients keeps one per endpoint (botocore reads it anyway)
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["endpoint_url"] = endpoint
        try:
            fs, path = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as e:  # a store whose package is not installed (gcsfs), or none
            raise StorageError(f"{url}: no {protocol}:// store can be opened here ({e})") from None
        if protocol in ("s3", "s3a"):
            fs.retries = 1
        return fs, path

    def _remote(self, url: str, call: Callable, once: bool = False):
        """`call(fs, path)` with retries (`once`: one try, read-ahead's). A refusal of the credentials
        is a StorageError as well: like an unreachable store, it stops the run instead of making
        every sample a bad one."""
        def attempt():
            fs, path = self._fs(url)
            return call(fs, path)
        try:
            policy = RetryPolicy(tries=1) if once else self.settings.retry
            return with_retries(attempt, str(url), policy, sleep=self.sleep)
        except Exception as e:
            if isinstance(e, StorageError) or not is_refusal(e):
                raise
            raise StorageError(f"{url}: access refused ({type(e).__name__}: {e}): check the credentials "
                               "(AWS_ACCESS_KEY_ID / AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS)") from e

    # -- reads -------------------------------------------------------------------------------------
    def read_bytes(self, path: PathLike) -> bytes:
        """The whole file (a remote one through the local cache)."""
        if not is_url(path):
            return local(path).read_bytes()
        url = str(path)
        if self.cache is None:
            return self._remote(url, lambda fs, p: fs.cat_file(p))
        st = self.stat(url)
        key = f"{url}\0{st.size}\0{st.etag or st.mtime}"
        data = self.cache.get(key)
        if data is None:
            data = self._remote(url, lambda fs, p: fs.cat_file(p))
            self.cache.put(key, data)
        return data

    def read_range(self, path: PathLike, offset: int, size: int) -> bytes:
        """`size` bytes from `offset` (fewer where the file ends first): one pread, or one ranged GET."""
        if not is_url(path):
            fd = os.open(local(path), os.O_RDONLY)
            try:
                return os.pread(fd, size, offset)
            finally:
                os.close(fd)
        return self._remote(str(path), lambda fs, p: fs.cat_file(p, start=offset, end=offset + size))

    def read_member(self, url: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` of a remote object that does not change (a shard's member):
        through the local cache, keyed by the object's version, so that a later epoch reads local
        disk. A short read (a truncated object) is returned as it is and not cached."""
        ahead = getattr(self.local, "ahead", None)
        if ahead is not None:
            data = ahead.take((url, offset, size))
            if data is not None:   # fetched ahead (and put in the cache); else read here, as without
                return data
        if self.cache is None:
            return self.read_range(url, offset, size)
        key = self._member_key(url, offset, size)
        data = self.cache.get(key)
        if data is None:
            data = self.read_range(url, offset, size)
            if len(data) == size:
                self.cache.put(key, data)
        return data

    def _member_key(self, url: str, offset: int, size: int, once: bool = False) -> str:
        """The cache key of a member: of the object's version (its size and ETag, a HEAD the first
        time an object is met)."""
        version = self.versions.get(url)
        if version is None:
            st = self.stat(url, once=once)
            version = f"{st.size}\0{st.etag or st.mtime}"
            with self.lock:
                self.versions[url] = version
                while len(self.versions) > 4096:  # the versions of the shards read lately, bounded
                    self.versions.pop(next(iter(self.versions)))
        return f"{url}\0{version}\0{offset}\0{size}"

    def cached_member(self, url: str, offset: int, size: int) -> bool:
        """Is the member in the local cache, as far as is known without a request?"""
        version = self.versions.get(url)
        return (self.cache is not None and version is not None
                and self.cache.path(f"{url}\0{version}\0{offset}\0{size}").exists())

    def fetch_member(self, url: str, offset: int, size: int) -> bytes:
        """`read_member`'s bytes with one try of each request (no retries, no waits): read-ahead's
        fetch, whose failure leaves the member to `read_member` and its retries."""
        key = self._member_key(url, offset, size, once=True) if self.cache is not None else None
        data = self.cache.get(key) if key is not None else None
        if data is None:
            data = self._remote(url, lambda fs, p: fs.cat_file(p, start=offset, end=offset + size), once=True)
            if key is not None and len(data) == size:
                self.cache.put(key, data)
        return data

    @contextlib.contextmanager
    def read_ahead(self, spans: Iterable[Span]) -> Iterator[ReadAhead | None]:
        """While in the block, this thread's `read_member` takes the members of `spans` (the members
        it is about to read, in the order it reads them) from a `ReadAhead` fetching them. Nothing
        happens without spans or with PAN_DATA_READ_AHEAD=0."""
        spans = list(spans)
        if not spans or self.settings.read_ahead <= 0:
            yield None
            return
        outer = getattr(self.local, "ahead", None)
        ahead = self.local.ahead = ReadAhead(self, spans, self.settings.read_ahead)
        try:
            yield ahead
        finally:
            ahead.close()
            self.local.ahead = outer

    def threads(self) -> ThreadPoolExecutor:
        """Read-ahead's threads (PAN_DATA_READ_AHEAD of them), started when first asked for."""
        with self.lock:
            if self.pool is None or self.pool_pid != os.getpid():  # a forked copy has none of them
                self.pool = ThreadPoolExecutor(self.settings.read_ahead, thread_name_prefix="pan-read-ahead")
                self.pool_pid = os.getpid()
            return self.pool

    def open_read(self, path: PathLike, buffer: int = 1 << 22) -> io.BufferedReader:
        """A seekable binary reader of the file: a remote one read `buffer` bytes at a time, each a
        ranged GET with the retries (so a long read survives an outage that a retry outlasts),
        in bounded memory. The object's size is taken when it opens."""
        if not is_url(path):
            return open(local(path), "rb")
        return io.BufferedReader(RemoteFile(self, str(path), self.stat(path).size), buffer_size=buffer)

    def read_text(self, path: PathLike) -> str:
        return self.read_bytes(path).decode("utf-8-sig")

    def stat(self, path: PathLike, once: bool = False) -> Stat:
        if not is_url(path):
            st = local(path).stat()
            return Stat(st.st_size, st.st_mtime, None)

        def fresh_info(fs, p):
            fs.invalidate_cache(p)   # a listing cached earlier would hide a newer version of the object
            return fs.info(p)
        info = self._remote(str(path), fresh_info, once=once)
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{path} is a folder, not a file")
        modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
        mtime = modified.timestamp() if hasattr(modified, "timestamp") else modified
        etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
        return Stat(int(info["size"]), mtime, str(etag).strip('"') if etag else None)

    def exists(self, path: PathLike) -> bool:
        """A file (not a folder) at `path`."""
        if not is_url(path):
            return local(path).is_file()
        return self._remote(str(path), lambda fs, p: fs.isfile(p))

    def listdir(self, folder: PathLike) -> list[str]:
        """The names of the files directly in `folder` (sorted; none for a missing folder)."""
        if not is_url(folder):
            folder = local(folder)
            return sorted(e.name for e in os.scandir(folder) if e.is_file()) if folder.is_dir() else []

        def names(fs, p):
            try:
                fs.invalidate_cache(p)  # another process may have written since this one listed
                return sorted(posixpath.basename(e["name"].rstrip("/")) for e in fs.ls(p, detail=True)
                              if e.get("type") == "file")
            except FileNotFoundError:
                return []
        return self._remote(str(folder), names)

    # -- writes ------------------------------------------------------------------------------------
    def write_bytes(self, path: PathLike, data: bytes) -> None:
        """A reader sees the whole file or none of it: a local file is written under a temporary
        name and renamed; an object is put whole."""
        if is_url(path):
            self._remote(str(path), lambda fs, p: fs.pipe_file(p, data))
            return
        path = local(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def put_tree(self, folder: Path, path: PathLike) -> None:
        """Put every file under the local `folder` to the same place under `path`."""
        for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            self.put_file(file, join(path, file.relative_to(folder).as_posix()))

    def write_text(self, path: PathLike, text: str) -> None:
        self.write_bytes(path, text.encode("utf-8"))

    def put_file(self, source: Path, path: PathLike) -> None:
        """Copy the finished local file `source` to `path` (a local move is a rename)."""
        if is_url(path):
            self._remote(str(path), lambda fs, p: fs.put_file(str(source), p))
            return
        path = local(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, path)


class RemoteFile(ByteRangeFile):
    """A remote object as a raw seekable file: each read is `Storage.read_range` (one ranged GET)."""

    def __init__(self, store: Storage, url: str, size: int):
        super().__init__(size)
        self.store, self.url = store, url

    def read_at(self, offset: int, count: int) -> bytes:
        return self.store.read_range(self.url, offset, count)


_default: tuple[tuple, Storage] | None = None


def storage() -> Storage:
    """This process's Storage, from the environment (made again in a forked process, whose
    object-store clients must not be its parent's, and when the PAN_DATA_* variables change)."""
    global _default
    key = (os.getpid(), *(os.environ.get(k) for k in (ENV_CACHE, ENV_CACHE_GB, ENV_RETRIES, ENV_READ_AHEAD)))
    if _default is None or _default[0] != key:
        _default = (key, Storage(Settings.from_env()))
    return _default[1]
