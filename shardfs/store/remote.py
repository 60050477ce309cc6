"""The only module that talks to the store: listing, ranged reads, streams and small objects.

Everything goes through fsspec, so every backend it knows (s3, gcs, http, hf, file, memory)
works. Which shards a source URL names is ``source_urls``; the fsspec filesystem, its options
and the translation of its exceptions (in one place) are ``store_client``; finding the shards
is ``shard_listing``. This module reads and writes their bytes, and counts the shard bytes
and GETs that cross the wire (``Stats.bytes_fetched``, ``store_requests``; the index scans'
part in ``scan_bytes``, ``scan_requests``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING

import fsspec

from ..config import SourceConfig, format_bytes
from ..errors import ShardChangedError, ShardfsError, StoreReadError
from ..stats import Stats
from ..store.shards import Readable
from . import http_ranges, responses, s3_ranges
from .client import S3_PROTOCOLS, open_filesystem, protocol_of, translate_errors, version_of
from .listing import ShardListing
from .object_writes import LOCAL_PROTOCOLS as _LOCAL_PROTOCOLS
from .object_writes import ObjectWrites
from .plain_ranges import fsspec_range, read_local_file
from .responses import PreconditionFailed, TransientError, WrongLengthError, pieces_of
from .shards import ShardInfo, ShardStream
from .urls import SHARD_SUFFIX, select
from .whole_shards import WHOLE_SHARDS_MEMORY, WholeShards

if TYPE_CHECKING:  # imported when used: only S3 needs urllib3
    from .presigned import PresignedRanges

log = logging.getLogger(__name__)

# Fast-path failures in a row (other than changed shards and transient faults) after which
# requests go straight to s3fs for a while; the fast path is then tried again.
_FAST_FAILURES_TO_PAUSE = 3
_FAST_PAUSE_S = 60.0
# Errors that say the code is wrong, not the store: never retried.
_PROGRAMMING_ERRORS: tuple[type[Exception], ...] = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    NotImplementedError,
    RecursionError,
)

__all__ = ["SHARD_SUFFIX", "ShardInfo", "Store", "translate_errors"]


class Store(ObjectWrites):
    """A source of shards behind an fsspec filesystem; ``stats`` counts what it fetches."""

    def __init__(self, config: SourceConfig, stats: Stats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else Stats()
        selection = select(config.url)
        fs, root = open_filesystem(config, selection.root)
        self.fs: fsspec.AbstractFileSystem = fs
        self.protocol = protocol_of(fs)
        self._listing = ShardListing(fs, root, config, selection, self.protocol)
        self.is_http = self._listing.is_http
        self._path = self._listing.path
        self._call = self._listing.call
        self._presigned: PresignedRanges | None = None
        self._unversioned: list[str] | None = None  # shards with no version, once listed
        # Set by list_shards where reads cannot be checked against the indexed version.
        self.version_warning: str | None = None
        self._fast_failures = 0
        self._fast_paused_until = 0.0
        self._fast_lock = threading.Lock()
        # Set when the server first answers a ranged GET with the whole shard: from then on
        # whole shards are kept in memory (bounded) and each is fetched by one GET at a time.
        self._whole: WholeShards | None = None
        self._whole_lock = threading.Lock()
        self.range_warning: str | None = None
        if self.protocol in S3_PROTOCOLS and hasattr(fs, "url"):
            from .presigned import PresignedRanges

            self._presigned = PresignedRanges(
                fs,
                connect_timeout=config.connect_timeout,
                stall_timeout=config.stall_timeout,
            )

    @property
    def root(self) -> str:
        """The store path the shard names are relative to."""
        return self._listing.root

    def _endpoint(self) -> str:
        endpoint = self.config.endpoint_url or ""
        if not endpoint:
            client_kwargs = self.config.storage_options.get("client_kwargs") or {}
            endpoint = str(client_kwargs.get("endpoint_url", ""))
        if not endpoint and self.protocol in S3_PROTOCOLS:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL", ""
            )
        return endpoint

    @property
    def identity(self) -> str:
        """A stable id of this source, used to key the persisted index."""
        selection = self._listing.selection
        named = selection.names or selection.globs or ()
        if selection.globs:
            named = ("glob", *named)
        text = f"{self.protocol}://{self.root}|{self._endpoint()}|{'|'.join(named)}"
        if self.config.shard_format != "auto":  # other rows from the same shards
            text += f"|format={self.config.shard_format}"
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def location(self, shard: ShardInfo) -> str:
        """Where a shard's bytes live, whatever source URL named it (keys the block cache)."""
        path = self._path(shard.name)
        where = path if self.is_http else f"{self.protocol}://{path}"
        return f"{where}|{self._endpoint()}"

    def describe(self) -> str:
        return self.config.url

    def parts(self) -> list[tuple[Store, str]]:
        """The stores of the sources behind this one, each with the suffix its shard names
        carry here: this store itself, with none (several sources: ``store_set``). Objects
        next to the shards (sidecars, ``classes.txt``) are read from each part."""
        return [(self, "")]

    def list_shards(self) -> list[ShardInfo]:
        """The shards the source URL names, sorted by name (``ShardListing.shards``)."""
        shards = self._listing.shards()
        self._note_unchecked(shards)
        return shards

    @property
    def listing_warnings(self) -> list[str]:
        """What the user should hear once about the last listing: shards left out (compressed
        tars), and reads that cannot be checked (``version_warning``)."""
        found = (self._listing.skipped_warning, self.version_warning)
        return [line for line in found if line]

    def _note_unchecked(self, shards: list[ShardInfo]) -> None:
        """Word, once, that reads cannot tell a replaced shard from the indexed one where the
        store gives nothing to check (``version_warning``; callers show it to the user)."""
        if self._unversioned is not None:
            return
        self._unversioned = [s.name for s in shards if not s.etag] if self.is_http else []
        if self._unversioned:
            self.version_warning = (
                f"{self.config.url}: the server gives no ETag or Last-Modified for "
                f"{len(self._unversioned)} shard(s) (first: {self._unversioned[0]}), so no "
                "version check: a shard changed in place may be served mixed"
            )
        elif not self.checks_identity:
            self.version_warning = (
                f"{self.config.url}: this store ({self.protocol}) offers no version check on "
                "reads, only a length check: a shard changed in place may be served mixed"
            )

    def _current(self, shard: ShardInfo) -> ShardInfo | None:
        """The shard as the store shows it now, or None if it is gone."""
        if self.is_http:
            (found,) = self._call(shard.name, lambda: self._listing.head_many([shard.name]))
            return None if found is None else ShardInfo(shard.name, found.size, found.version)
        info = self._call(shard.name, lambda: self._listing.info_or_none(self._path(shard.name)))
        return None if info is None else ShardInfo(shard.name, int(info["size"]), version_of(info))

    def check_current(self, shard: ShardInfo) -> None:
        """Raise ShardChangedError if the shard no longer matches what was indexed."""
        current = self._current(shard)
        if current is None:
            raise ShardChangedError(f"{shard.name}: gone from the store")
        if current.identity != shard.identity:
            raise ShardChangedError(f"{shard.name}: changed in the store since it was indexed")

    def read_range(self, shard: ShardInfo, start: int, end: int, *, retries: int = 4) -> bytes:
        """Bytes ``[start, end)`` of a shard as indexed.

        Every answer is checked against the request and the shard's identity. Transient
        failures (5xx, 429, resets, stalls, a wrong length or range) are retried with backoff,
        up to ``retries`` attempts and within ``read_timeout`` seconds; then StoreReadError.
        A shard that is another version or gone raises ShardChangedError at once.
        """
        return b"".join(self.read_pieces(shard, start, end, max(1, end - start), retries=retries))

    def read_pieces(
        self, shard: ShardInfo, start: int, end: int, piece: int, *, retries: int = 4
    ) -> responses.Pieces:
        """``read_range`` in one GET, as consecutive pieces of ``piece`` bytes (the last may
        be shorter): on S3 each piece comes from the socket on its own, so a GET for several
        blocks yields the blocks without cutting them out of one buffer."""
        return self.fetch(shard, start, end, piece, retries=retries).pieces

    def fetch(
        self,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        *,
        retries: int = 4,
        scan: bool = False,
        land: responses.Landing | None = None,
    ) -> responses.Fetched:
        """``read_pieces`` (each piece received into ``land(n)`` memory where the GET can),
        and the whole shard where the server sent it (``Fetched``).

        Each GET and the bytes its answer carried are counted in ``stats`` (``scan``: as an
        index scan's too). Once the server has ignored Range, shards it sent whole are kept
        in memory (``whole_shards``) and reads of them are cut from the copy."""
        if start >= end:
            return responses.Fetched([b""])
        whole = self._whole
        if whole is None:
            return self._fetch(shard, start, end, piece, retries, scan, land)
        with whole.lock(shard):  # readers of one shard wait for its one GET
            body = whole.get(shard)
            if body is not None:
                return responses.Fetched(pieces_of(body[start:end], piece))
            return self._fetch(shard, start, end, piece, retries, scan, land)

    def streams_pieces(self, shard: ShardInfo | None = None) -> bool:
        """Whether ``stream`` hands a GET's pieces on as they land (for ``shard``, or any)."""
        fast = self._presigned is not None and time.monotonic() >= self._fast_paused_until
        return fast and self._whole is None

    def stream(
        self,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        *,
        retries: int = 4,
        land: responses.Landing | None = None,
        whole: Callable[[bytes], None] | None = None,
    ) -> Generator[responses.Piece, None, None]:
        """``fetch``'s pieces, each handed on as soon as it has landed where the GET can (a
        presigned GET on S3 answered with the range), so a GET for several blocks holds one
        piece's memory at a time; elsewhere once the GET has landed whole (``whole`` is given
        the shard where the server sent all of it). A GET cut partway is asked again, through
        ``fetch``, from the first piece not handed on. No piece handed on is referred to here
        while the caller holds it: a suspended ``yield piece`` would hold its landing memory
        (8 streams of 8 MiB blocks then held all of it, and each next piece waited 1 s)."""
        fast, at = self._presigned, start
        if fast is not None and self.streams_pieces(shard):
            try:
                streamed = self._streamed(fast, shard, start, end, piece, land, whole)
                with contextlib.closing(streamed) as pieces:
                    for data in pieces:
                        at += len(data)
                        handed = [data]
                        del data  # see the docstring's end
                        yield handed.pop()
            except _PROGRAMMING_ERRORS:
                raise
            except Exception as exc:  # the rest through ``fetch``, which tells what it was
                log.info("read %s [%d:%d] failed (%s); fetching the rest", shard.name, at, end, exc)
        if at < end:
            got = self.fetch(shard, at, end, piece, retries=retries, land=land)
            if got.whole is not None and whole is not None:
                whole(got.whole)
            landed = got.pieces[::-1]
            del got
            while landed:
                yield landed.pop()

    def _streamed(
        self,
        fast: PresignedRanges,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        land: responses.Landing | None,
        whole: Callable[[bytes], None] | None,
    ) -> Generator[responses.Piece, None, None]:
        """One presigned GET's pieces as they land (``stream``), counted."""
        path = self._path(shard.name)
        deadline = time.monotonic() + self.config.read_timeout
        self.stats.add(store_requests=1)
        answer = fast.answer(path, start, end, shard.size, shard.etag, deadline)
        if answer.status != 206:  # the whole shard: kept, as ``fetch`` keeps it
            body = bytes(fast.body(answer, path, start, end, shard.size, deadline, shard.size)[0])
            self.stats.add(bytes_fetched=len(body))
            self._range_ignored(shard, body)
            if whole is not None:
                whole(body)
            yield from pieces_of(body[start:end], piece)
            return
        body_pieces = fast.stream(answer, path, start, end, shard.size, deadline, piece, land)
        with contextlib.closing(body_pieces) as pieces:
            for data in pieces:
                self.stats.add(bytes_fetched=len(data))
                handed = [data]
                del data
                yield handed.pop()

    def _fetch(
        self,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        retries: int,
        scan: bool,
        land: responses.Landing | None = None,
    ) -> responses.Fetched:
        path = self._path(shard.name)
        deadline = time.monotonic() + self.config.read_timeout
        delay = 0.1
        attempt = 0
        while True:
            attempt += 1
            try:
                self.stats.add(store_requests=1, scan_requests=int(scan))
                pieces = self._get_pieces(path, shard, start, end, deadline, piece, land)
                got = sum(map(len, pieces))
                self.stats.add(bytes_fetched=got, scan_bytes=got if scan else 0)
                if got == end - start:
                    return responses.Fetched(pieces)
                # The answers' checks let only the range or the whole shard through.
                body = b"".join(pieces)  # one piece of bytes: itself
                self._range_ignored(shard, body)
                return responses.Fetched(pieces_of(body[start:end], piece), body)
            except PreconditionFailed as exc:
                raise ShardChangedError(f"{shard.name}: changed in the store ({exc})") from exc
            except FileNotFoundError as exc:
                raise ShardChangedError(f"{shard.name}: gone from the store") from exc
            except ShardfsError:
                raise
            except _PROGRAMMING_ERRORS:
                raise  # a bug is not retried: it would fail the same way each time
            except Exception as exc:
                left = deadline - time.monotonic()
                if attempt >= retries or left <= delay:
                    if isinstance(exc, WrongLengthError):
                        self._raise_if_changed(shard)
                    err = translate_errors(f"{shard.name} [{start}:{end}]", exc)
                    raise StoreReadError(f"{err} (after {attempt} attempt(s))") from exc
                log.warning("read %s [%d:%d] failed (%s); retrying", shard.name, start, end, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _range_ignored(self, shard: ShardInfo, body: bytes) -> None:
        """A ranged GET was answered with the whole shard: count it, say so once (the
        server's name in ``range_warning``, logged), and keep the shard in memory."""
        self.stats.add(whole_shard_answers=1)
        with self._whole_lock:
            whole = self._whole
            first = whole is None
            if whole is None:
                whole = self._whole = WholeShards()
        if first:
            self.range_warning = (
                f"{self._server(shard)} ignores Range: it answered a ranged GET of "
                f"{shard.name} with the whole shard ({format_bytes(shard.size)}); shards it "
                "sends whole are kept (all their blocks in the block cache, else up to "
                f"{format_bytes(WHOLE_SHARDS_MEMORY)} in memory), but each read of a shard "
                "not kept downloads the whole shard again; serve the shards from a server "
                "that supports byte ranges"
            )
            log.warning("%s", self.range_warning)
        whole.keep(shard, body)

    def _server(self, shard: ShardInfo) -> str:
        """The server this store asks, as the user named it."""
        if self.is_http:
            parts = urllib.parse.urlsplit(self._path(shard.name))
            return f"{parts.scheme}://{parts.netloc}"
        return self._endpoint() or f"{self.protocol}://{self.root.split('/', 1)[0]}"

    def _raise_if_changed(self, shard: ShardInfo) -> None:
        """ShardChangedError if the listing no longer shows the indexed shard; quiet if it
        does or if the store cannot say."""
        try:
            self.check_current(shard)
        except ShardChangedError:
            raise
        except ShardfsError as exc:
            log.debug("could not check %s against the store: %s", shard.name, exc)

    def _get_pieces(
        self,
        path: str,
        shard: ShardInfo,
        start: int,
        end: int,
        deadline: float,
        piece: int,
        land: responses.Landing | None = None,
    ) -> responses.Pieces:
        """One checked ranged GET, as pieces: a presigned URL on S3 when that path works,
        else s3fs; a local file directly; any other store through fsspec. A server that
        ignored Range gives the whole shard instead, as one piece."""
        timeout = max(0.05, deadline - time.monotonic())
        if self.protocol in _LOCAL_PROTOCOLS:
            data = read_local_file(path, shard, start, end)
        elif self.is_http:
            data = http_ranges.get_range(self.fs, path, start, end, shard.size, shard.etag, timeout)
        elif self.protocol not in S3_PROTOCOLS:
            data = fsspec_range(self.fs, path, shard.name, start, end, timeout)
        else:
            fast = self._presigned
            if fast is None or time.monotonic() < self._fast_paused_until:
                data = s3_ranges.get_range(
                    self.fs, path, start, end, shard.size, shard.etag, timeout
                )
            else:
                try:
                    got = fast.get(path, start, end, shard.size, shard.etag, deadline, piece, land)
                except (PreconditionFailed, TransientError, FileNotFoundError):
                    raise  # another version, a failure to retry, or gone for both paths
                except Exception as exc:
                    timeout = max(0.05, deadline - time.monotonic())
                    data = s3_ranges.get_range(
                        self.fs, path, start, end, shard.size, shard.etag, timeout
                    )
                    # Only a failure that s3fs does not share is the fast path's own (a 403
                    # on both, say, is the store's answer, not a reason to stop presigning).
                    self._fast_path_failed(exc)
                else:
                    self._fast_failures = 0
                    return got
        return pieces_of(data, piece) if len(data) == end - start else [data]

    def _fast_path_failed(self, exc: Exception) -> None:
        """This request goes through s3fs, which checks the same things; after several
        failures in a row, all requests do for a while."""
        with self._fast_lock:
            self._fast_failures += 1
            if self._fast_failures < _FAST_FAILURES_TO_PAUSE:
                log.info("presigned GET failed (%s); this request goes through s3fs", exc)
                return
            self._fast_failures = 0
            self._fast_paused_until = time.monotonic() + _FAST_PAUSE_S
        log.info(
            "presigned GETs failed %d times in a row (last: %s); using s3fs for %.0f s",
            _FAST_FAILURES_TO_PAUSE,
            exc,
            _FAST_PAUSE_S,
        )

    @property
    def checks_identity(self) -> bool:
        """Whether every read is checked against the indexed version of its shard (over
        HTTP: once listed, whether every shard has an ETag or a Last-Modified date)."""
        if self.is_http:
            return self._unversioned is not None and not self._unversioned
        return self.protocol in (*S3_PROTOCOLS, *_LOCAL_PROTOCOLS)

    @contextlib.contextmanager
    def open_stream(self, shard: ShardInfo, block_size: int = 8 << 20) -> Iterator[Readable]:
        """A sequential reader over a whole shard, for index scans (counted as such):
        checked ranged reads of ``block_size`` bytes, the next one fetched while the caller
        parses this one; one GET in all where the server sends the whole shard."""

        def fetch(start: int, end: int) -> bytes:
            got = self.fetch(shard, start, end, max(1, end - start), scan=True)
            if got.whole is not None:
                return got.whole[start:]  # the rest of the shard: nothing more is asked for
            return b"".join(got.pieces)  # one piece of bytes: itself

        stream = ShardStream(fetch, shard.size, block_size)
        try:
            yield stream
        finally:
            stream.close()

    def read_object(self, name: str) -> bytes | None:
        """A small object next to the shards (sidecar, classes.txt), or None if absent."""
        path = self._path(name)
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise translate_errors(name, exc) from exc

    def list_names(self) -> list[str]:
        """Names of every object under the root (empty if the root does not exist)."""
        prefix = self.root + "/" if self.root else ""
        try:
            found = self.fs.find(self.root, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise translate_errors(self.config.url, exc) from exc
        return sorted(p[len(prefix) :] if p.startswith(prefix) else p for p in found)
