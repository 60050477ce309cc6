"""``CachedReader``, ``seam``'s ``RangeReader`` through the persistent block cache."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Generator

from ..cache import EVICT_ANY, EVICT_NONE, RETIRED_BEFORE, BlockCache, BlockKey, NoRoom
from ..cache.block_cache import BlockFile
from ..cache.landing import READAHEAD_BYTES
from ..stats import Stats
from ..store.remote import Store
from ..store.responses import Landing
from ..store.shards import ShardInfo
from .block_runs import RUN_BLOCKS, BlockRun, UnreadPrefetched, runs_of
from .files_ahead import FilesAhead
from .fills import Arrivals, Block, BlockFetch, BlockFills, ColdClock, Completion, Fetch
from .local_blocks import LocalBlocks
from .range_reads import RangeReads
from .readahead import Prefetcher
from .seam import shard_key_of

# How often an order hint's reads look at the cache's room (``wants_files_ahead``).
ROOM_CHECK_S = 0.05
ROOM_CHECK_MAX_S = 1.0
FASTEST_FILL = 2e9  # bytes/s: no store fills the cache faster than this


class CachedReader:
    """Reads through the persistent block cache: each block of a shard is fetched once.

    A miss fetches its whole block in the reader's thread (one GET, into landing memory),
    or with ``split_misses`` only the bytes asked for, completing the block later
    (``fills``). Each block that becomes local (stored, or first found cached) is published
    once on ``local_blocks``, where the kernel pusher listens. With a ``Prefetcher``, a
    shard's first read also schedules the rest of it. While the cache is paused (full or
    read-only disk), cached blocks still serve; misses fetch what is read and a little more.

    A cache smaller than the data (``dataset_bytes``): a miss fetches its whole block only
    when the block fits, or when room can be made from *cold* blocks, those no read has
    used while this reader served ``dataset_bytes`` (an epoch's worth of reads). Otherwise
    it fetches the bytes read, as above, and keeps nothing: under a shuffled order every
    cached block is as likely to be read next as the missing one, so trading one for the
    other only adds egress. Once full, the cache's contents change only as blocks go cold.
    """

    def __init__(
        self,
        store: Store,
        cache: BlockCache,
        stats: Stats,
        *,
        retries: int = 4,
        prefetcher: Prefetcher | None = None,
        split_misses: bool = False,
        dataset_bytes: int | None = None,
        local_blocks: LocalBlocks | None = None,
    ) -> None:
        self.split_misses = split_misses
        # None: plain LRU, any block may be evicted for a miss (readers outside a mount).
        self.dataset_bytes = dataset_bytes
        self._cold = ColdClock(dataset_bytes)
        self.store, self.cache, self.stats = store, cache, stats
        self._fills = BlockFills(cache, stats)
        self.retries, self.prefetcher = retries, prefetcher
        self.block_size = cache.config.block_size
        self._keys: dict[ShardInfo, str] = {}
        self._scheduled: set[str] = set()
        self._lock = threading.Lock()
        # Told once per block when the block is first known to be on local disk (stored by
        # this process, or hit), with its bytes when this process just stored it.
        self.local_blocks = local_blocks if local_blocks is not None else LocalBlocks()
        self._announced: set[tuple[str, int]] = set()
        self._ahead = FilesAhead()
        self._cache_full = (-1.0, False)  # (when to look again, whether the cache is full)
        # While an order hint is followed, reads no longer queue their whole shard: the
        # hint's plan queues blocks in the order they will be read (``prefetch_blocks``).
        # ``streaming_hint``: they stream through a cache smaller than the data (retired
        # once read, ``retire_blocks``): no file is fetched ahead as a range.
        self.follow_hint = self.streaming_hint = False
        self._unread = UnreadPrefetched(stats)  # the prefetched-but-unread count
        # Blocks a readahead GET for several blocks is bringing, not yet stored.
        self.coming = Arrivals(store.config.read_timeout)
        self._ranges = RangeReads(
            cache, self.coming, stats, self._ahead, self._get, store.config.read_timeout
        )
        # Blocks with bytes fetched as ranges this epoch: never fetched whole after that.
        self.paid_in_part = self._ranges.paid

    def _announce(
        self, shard: ShardInfo, skey: str, index: int, block: Block | None = None
    ) -> None:
        """Publish that a block is local, once per block (while anyone listens)."""
        if not self.local_blocks.listening or (skey, index) in self._announced:
            return
        with self._lock:
            if (skey, index) in self._announced:
                return
            self._announced.add((skey, index))
        start = index * self.block_size
        self.local_blocks.publish(shard, start, start + self._block_len(shard, index), block)

    def _announce_if_local(self, shard: ShardInfo, skey: str, index: int) -> None:
        unknown = self.local_blocks.listening and (skey, index) not in self._announced
        if unknown and self.cache.contains(BlockKey(skey, index)):
            self._announce(shard, skey, index)

    def shard_key(self, shard: ShardInfo) -> str:
        key = self._keys.get(shard)
        if key is None:
            key = shard_key_of(self.store, shard, self.block_size)
            self._keys[shard] = key
        return key

    def _fetch_range(self, shard: ShardInfo, skey: str, index: int) -> Fetch:
        """Bytes of block ``index`` for its claim's owner; the whole block lands in memory it
        is stored from. A readahead GET that chose the block before the claim (its mark
        seen too late) brings it, held as kept: its bytes are taken, not fetched again. A
        block a range GET marked paid in part since the read's look (``_over_budget``) is
        not fetched, whole or as a split miss's first part: ``NoRoom``, and the read
        fetches its own bytes as a range (a split miss's later parts need no look: a
        range marking the block then waits for the claim, and takes the stored block)."""
        base, whole = index * self.block_size, self._block_len(shard, index)
        brought: list[bytes | None] = []

        def fetch(lo: int, hi: int) -> Block:
            if not brought:
                self.coming.wait(skey, index)
                brought.append(self._ahead.take_kept(skey, base, base + whole))
                if brought[0] is None and self.paid_in_part.holds(skey, index):
                    raise NoRoom(BlockKey(skey, index))  # looked at again, claimed
            if brought[0] is not None:
                return memoryview(brought[0])[lo:hi]
            if lo == 0 and hi == whole:
                return self.get_pieces(shard, base, base + hi, hi, self.cache.landing)[0]
            return self._get(shard, base + lo, base + hi)

        return fetch

    def _get(self, shard: ShardInfo, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` from the store in one piece (a join of one is no copy)."""
        return b"".join(self.get_pieces(shard, start, end, max(1, end - start)))

    def get_pieces(
        self, shard: ShardInfo, start: int, end: int, piece: int, land: Landing | None = None
    ) -> list[Block]:
        """One GET as pieces (into ``land`` memory if given); a whole shard sent is cached."""
        got = self.store.fetch(shard, start, end, piece, retries=self.retries, land=land)
        if got.whole is not None:
            self._keep_whole(shard, got.whole)
        return got.pieces

    def _keep_whole(self, shard: ShardInfo, body: bytes) -> None:
        """Store the blocks of a whole shard that are not cached or being fetched, as far as
        they fit without evicting (as an index scan's blocks)."""
        skey, size = self.shard_key(shard), self.block_size
        for index in range(self.block_count(shard)):
            block = body[index * size : (index + 1) * size]
            if self.cache.offer(BlockKey(skey, index), block):
                self._announce(shard, skey, index, block)

    def stream_pieces(
        self, shard: ShardInfo, start: int, end: int, piece: int, land: Landing | None = None
    ) -> Generator[Block, None, None]:
        """``get_pieces``, each piece handed on as it lands where the store can."""
        kept = functools.partial(self._keep_whole, shard)
        return self.store.stream(shard, start, end, piece, retries=self.retries, land=land,
            whole=kept)  # fmt: skip

    def block_count(self, shard: ShardInfo) -> int:
        return -(-shard.size // self.block_size)

    def _block_len(self, shard: ShardInfo, index: int) -> int:
        return min(self.block_size, shard.size - index * self.block_size)

    def read(self, shard: ShardInfo, start: int, end: int, extent_end: int | None = None) -> bytes:
        if start >= end:
            return b""
        skey = self.shard_key(shard)
        if self.cache.degraded:
            return self._ranges.read(shard, skey, start, end, extent_end)
        size = self.block_size
        evict_before = self._cold.tick(end - start)
        first, last = start // size, (end - 1) // size
        held = self._ahead.fetching(skey, start)  # its bytes are taken, not fetched again
        if held or self._over_budget(shard, skey, first, last, evict_before):
            self.stats.add(range_reads=1)
            return self._ranges.read(shard, skey, start, end, extent_end, count_waits=True)
        pieces = []
        waited = False
        for index in range(first, last + 1):
            block_start = index * size
            block_len = self._block_len(shard, index)
            key = BlockKey(skey, index)
            if not self.cache.contains(key):
                if not waited:
                    waited = True
                    self.stats.add(reads_waited_on_network=1)
                self.coming.wait(skey, index)  # each one a GET brings, not only the first
            self._unread.first_read(skey, index, block_len)
            lo = max(start, block_start) - block_start
            hi = min(end, block_start + block_len) - block_start
            fetch = self._fetch_range(shard, skey, index)
            try:
                if self.prefetcher is not None and self.split_misses:
                    data, rest = self._fills.read_split(
                        key, lo, hi, block_len, fetch, evict_before=evict_before
                    )
                    if rest is not None:
                        self._complete_later(shard, skey, index, rest)
                else:
                    announce = functools.partial(self._announce, shard, skey, index)
                    keep = functools.partial(self.keep_unstored, shard, skey, index)
                    data, _ = self._fills.read(key, lo, hi, block_len, fetch,
                        evict_before=evict_before, stored=announce, unstored=keep)  # fmt: skip
            except NoRoom:  # the room went to another fetch, or a range marked it, meanwhile
                self.stats.add(range_reads=1)
                data = self._ranges.read(
                    shard, skey, block_start + lo, block_start + hi, extent_end
                )
            pieces.append(data)
            self._announce_if_local(shard, skey, index)
        if self.prefetcher is not None and skey not in self._scheduled and not self.follow_hint:
            self.read_ahead(shard, after=last)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _complete_later(self, shard: ShardInfo, skey: str, index: int, rest: Completion) -> None:
        """Have a fill thread complete a split miss's block, then publish it."""

        def complete() -> None:
            block = rest()
            if block is not None:
                self._announce(shard, skey, index, block)

        assert self.prefetcher is not None
        try:
            self.prefetcher.run_soon(complete)
        except Exception:
            complete()  # it holds the block's claim: it must run

    def _over_budget(
        self, shard: ShardInfo, skey: str, first: int, last: int, evict_before: float
    ) -> bool:
        """Whether a block of this read is missing and could be kept only by evicting
        blocks that are not cold, or had bytes fetched as a range this epoch (then the
        read is fetched as a range: a whole block would pay for those bytes again)."""
        paid = self.paid_in_part
        if evict_before == EVICT_ANY and not paid:
            return False
        for index in range(first, last + 1):
            if self._coming_or_cached(skey, index):
                continue
            if paid.holds(skey, index):
                return True
            if not self.cache.room_for(self._block_len(shard, index), evict_before):
                return True
        return False

    def _coming_or_cached(self, skey: str, index: int) -> bool:
        """Block ``index`` is cached, or being fetched to be (a read's fill, a readahead
        GET): its bytes are paid for already, not to be fetched as a range."""
        key = BlockKey(skey, index)
        held = self.cache.contains(key) or self.cache.in_flight(key)
        return held or self.coming.expected(skey, index)

    def wants_files_ahead(self) -> bool:
        """Whether the next hinted files should be fetched as ranges: only while the cache
        is full (otherwise it takes whole blocks, which the hint's block plan brings)."""
        if self.prefetcher is None or self.dataset_bytes is None or self.streaming_hint:
            return False
        now = time.monotonic()
        if now >= self._cache_full[0]:  # asked on every hinted read: a ledger query, a statvfs
            self._cache_full = self._look_for_room(now)
        return self._cache_full[1]

    def _look_for_room(self, now: float) -> tuple[float, bool]:
        """(when to look again, whether the cache is full): full is no room for a block
        without evicting blocks still in use. Looked at again within ``ROOM_CHECK_S``, or,
        while the free room is many blocks, once fetches at ``FASTEST_FILL`` could have
        used it up (at most ``ROOM_CHECK_MAX_S`` later: other writers share the disk)."""
        fits, free = self.cache.look(self.block_size, RETIRED_BEFORE)
        if free < 2 * self.block_size:
            return now + ROOM_CHECK_S, not fits
        wait = min(ROOM_CHECK_MAX_S, max(ROOM_CHECK_S, free / FASTEST_FILL))
        return now + wait, False

    def prefetch_files(self, extents: list[tuple[ShardInfo, int, int]]) -> int:
        """Queue these files (shard, start, end), in this order, to be fetched as ranges
        ahead of their reads (an order hint's next files) when their blocks cannot be cached
        without evicting blocks still in use; files the cache holds or will take are not."""
        if not extents or self.prefetcher is None or not self.wants_files_ahead():
            return 0
        tasks = []
        for shard, start, end in extents:
            skey = self.shard_key(shard)
            held = functools.partial(self._coming_or_cached, skey)
            span = self._ahead.claim_missing(skey, start, end, held, self.block_size)
            if span is not None:
                tasks.append(functools.partial(self._fetch_file_ahead, shard, skey, *span))
        return self.prefetcher.schedule(tasks, hinted=True)

    def _fetch_file_ahead(self, shard: ShardInfo, skey: str, start: int, end: int) -> None:
        size = self.block_size

        def needed() -> bool:  # its blocks cannot be cached without evicting ones in use
            return self._over_budget(
                shard, skey, start // size, (end - 1) // size, self._cold.tick(0)
            )

        def fetch(lo: int, hi: int) -> bytes:
            data = self._ranges.get_paid_once(shard, skey, lo, hi)
            self.stats.add(files_fetched_ahead=1)
            return data

        held = functools.partial(self._coming_or_cached, skey)
        filled = self._ahead.fetch_claimed(skey, start, end, held, size, needed, fetch)
        if filled is not None and self.local_blocks.listening:
            # the kernel pusher puts its file into the page cache: no READ needs to come
            # (the bytes stay held until the file is opened, ``files_opened``)
            at, data = filled
            self.local_blocks.publish(shard, at, at + len(data), data)

    @property
    def holds_files_ahead(self) -> bool:
        return self._ahead.held > 0

    def files_opened(self, files: list[tuple[ShardInfo, int, int]]) -> None:
        """Readers opened these files (shard, start, end) from the kernel's page cache: what
        was fetched ahead of them goes soon after (``FilesAhead.opened``)."""
        released = self._ahead.opened([(self.shard_key(s), a, b) for s, a, b in files])
        if released:
            self.stats.add(files_ahead_opened=released)

    def read_local(
        self, shard: ShardInfo, start: int, end: int, *, quiet: bool = False
    ) -> bytes | None:
        """A read served from memory by cached blocks alone, or None on any miss or when the
        bytes would have to come from the disk first.

        ``quiet``: a read on nobody's behalf (kernel pushes): no statistics, no readahead,
        and it may wait for the disk."""
        if start >= end:
            return b""
        size = self.block_size
        skey = self.shard_key(shard)
        first, last = start // size, (end - 1) // size
        if first != last:
            return None  # spans blocks: rare, let the blocking path assemble it
        block_start = first * size
        data = self.cache.peek(
            BlockKey(skey, first),
            start - block_start,
            end - block_start,
            self._block_len(shard, first),
            count=not quiet,
            nowait=not quiet,
        )
        if data is not None and not quiet:
            self._cold.tick(end - start)
            self._announce(shard, skey, first)
            self._unread.first_read(skey, first, self._block_len(shard, first))
            ahead = self.prefetcher is not None and not self.follow_hint
            if ahead and skey not in self._scheduled:
                self.read_ahead(shard, after=last)
        return data

    def verified_block(
        self, shard: ShardInfo, index: int, buffer: bytearray | memoryview
    ) -> memoryview | None:
        """Block ``index``'s data read into ``buffer``, verified, or None (``read_into``)."""
        key = BlockKey(self.shard_key(shard), index)
        return self.cache.read_into(key, self._block_len(shard, index), buffer)

    def block_file(self, shard: ShardInfo, index: int) -> BlockFile | None:
        """Block ``index``'s file, its header verified, or None when it is not cached
        (``BlockCache.opened``)."""
        key = BlockKey(self.shard_key(shard), index)
        return self.cache.opened(key, self._block_len(shard, index))

    def block_used(self, shard: ShardInfo, index: int) -> None:
        """Reads were answered from a cached block without this reader (``BlockCache.touch``;
        a prefetched block counts as read, ``prefetched_bytes_read``)."""
        skey = self.shard_key(shard)
        self.cache.touch(BlockKey(skey, index))
        self._unread.first_read(skey, index, self._block_len(shard, index))

    def retire_blocks(self, blocks: list[tuple[ShardInfo, int]]) -> None:
        """Blocks the readers are done with (an order hint's files in them all opened):
        the first to make room for the next ones (``BlockCache.retire``). The ledger write
        goes to a fetch thread: the caller may be the FUSE session's own thread."""
        keys = [BlockKey(self.shard_key(shard), index) for shard, index in blocks]
        self.stats.add(blocks_retired=len(blocks))
        if self.prefetcher is None:
            self.cache.retire(keys)
            return
        try:
            self.prefetcher.run_soon(functools.partial(self.cache.retire, keys))
        except Exception:
            self.cache.retire(keys)

    def new_order(self) -> None:
        """A new order hint: reads warm the blocks they use again, and a new epoch may
        fetch whole any block (``paid_in_part``)."""
        self.cache.unretire_all()
        self.paid_in_part.clear()
        self.paid_in_part.active = self.follow_hint

    def cache_holds_dataset(self, beside: int = 0) -> bool:
        """Whether the cache, with ``beside`` bytes kept elsewhere, holds the dataset."""
        return self.dataset_bytes is None or self.dataset_bytes <= self.cache.limit() + beside

    def cache_blocks(self) -> int:
        """Whole blocks the cache's bound holds."""
        return self.cache.limit() // self.block_size

    def hinted_run(self) -> int:
        """Blocks of a shard that an order hint may fetch with one GET when the cache holds
        the data (``HintedOrder``'s ``run``): ``RUN_BLOCKS`` where the store hands a GET's
        blocks on as they land (``Store.stream``). Elsewhere a run lands whole first, so it
        is as long as keeps a GET of every stream within the readahead's landing memory: 1
        at the default 8 streams of 8 MiB blocks, 4 at 1 MiB blocks."""
        if self.prefetcher is None:
            return 1
        if self.store.streams_pieces():
            return RUN_BLOCKS
        fits = READAHEAD_BYTES // (self.prefetcher.streams * self.block_size)
        return max(1, min(RUN_BLOCKS, fits))

    def read_ahead(self, shard: ShardInfo, after: int = -1) -> int:
        """Queue every block of ``shard`` (from ``after + 1``, wrapping); once per shard."""
        if self.prefetcher is None:
            return 0
        skey = self.shard_key(shard)
        with self._lock:
            if skey in self._scheduled:
                return 0
            self._scheduled.add(skey)
        count = self.block_count(shard)
        order = [(after + 1 + i) % count for i in range(count) if (after + 1 + i) % count != after]
        return self._schedule([(shard, i) for i in order], hinted=False)

    def prefetch_blocks(self, blocks: list[tuple[ShardInfo, int]]) -> int:
        """Queue these blocks, in this order, ahead of whole-shard readahead (an order
        hint's plan); like all readahead, a block that would not fit is skipped."""
        if self.prefetcher is None or not blocks:
            return 0
        return self._schedule(blocks, hinted=True)

    def _schedule(self, blocks: list[tuple[ShardInfo, int]], *, hinted: bool) -> int:
        """Queue the blocks in this order, consecutive blocks of a shard in runs of up to
        ``RUN_BLOCKS`` fetched with one GET each; returns how many blocks were queued."""
        assert self.prefetcher is not None
        # A hint's blocks may take the room of retired ones (read by now); other
        # readahead only uses free room.
        evict_before = RETIRED_BEFORE if hinted else EVICT_NONE
        tasks = (
            BlockRun(self, shard, self.shard_key(shard), run, evict_before).task
            for shard, run in runs_of(blocks)
        )
        self.prefetcher.schedule(tasks, hinted=hinted)
        return len(blocks)

    def keep_unstored(self, shard: ShardInfo, skey: str, index: int, block: Block) -> None:
        """A block fetched that could not be stored after all (no room by then, or a failed
        write): held with the files ahead, so that none of its files is fetched again."""
        if self._ahead.keep(skey, index * self.block_size, bytes(block)):
            self.stats.add(blocks_kept_unstored=1)

    def prefetch_one(
        self,
        shard: ShardInfo,
        skey: str,
        index: int,
        fetch: BlockFetch,
        evict_before: float,
        held: int = 0,
    ) -> bool:
        """Fetch and store one block ahead of need (``Fills.prefetch``; ``held``: room held
        for it, used or given back); whether it was stored. ``fetch`` raises ``NoRoom`` for
        a block marked paid in part by the time it is claimed: nothing is fetched."""
        block_len = self._block_len(shard, index)
        key = BlockKey(skey, index)
        self._unread.add(skey, index)
        announce = functools.partial(self._announce, shard, skey, index)
        keep = functools.partial(self.keep_unstored, shard, skey, index)
        try:
            block = self._fills.prefetch(key, block_len, fetch,
                evict_before=evict_before, held=held, stored=announce, unstored=keep)  # fmt: skip
        except NoRoom:  # marked paid in part between the run's look and its claim
            self.stats.add(blocks_paid_in_part=1)
            block = None
        stored = block is not None
        if stored:
            self.stats.add(prefetched_bytes=block_len)
        else:
            self._unread.not_stored(skey, index, block_len)
            self._announce_if_local(shard, skey, index)  # cached before
        return stored
