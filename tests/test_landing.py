"""Landing buffers: blocks received into the memory their O_DIRECT write is made from."""

from __future__ import annotations

import gc
import mmap
import threading
import time

import pytest

from shardfs.cache import landing
from shardfs.cache.block_format import header_len
from shardfs.cache.landing import PAGE, LandingBuffers, _address, anonymous_map

CHUNK = 64 << 10


def test_a_taken_view_is_written_in_place_after_its_header() -> None:
    landing = LandingBuffers(CHUNK)
    length = 300_000
    view = landing.take(length)
    assert len(view) == length and not view.readonly
    view[:] = bytes(range(256)) * (length // 256) + bytes(length % 256)
    lead = header_len(length, CHUNK)
    header = bytes([7]) * lead
    whole = landing.in_place(header, view)
    assert whole is not None
    assert len(whole) % PAGE == 0 and len(whole) >= lead + length
    assert bytes(whole[:lead]) == header
    assert bytes(whole[lead : lead + length]) == bytes(view)


def test_other_data_or_a_header_of_another_length_is_not_in_place() -> None:
    landing = LandingBuffers(CHUNK)
    view = landing.take(10_000)
    lead = header_len(10_000, CHUNK)
    assert landing.in_place(bytes(lead), bytes(10_000)) is None  # plain bytes
    assert landing.in_place(bytes(lead + 8), view) is None  # not the room made
    assert landing.in_place(bytes(lead), view[8:]) is None  # not where take() put it
    foreign = memoryview(mmap.mmap(-1, PAGE * 4))[lead : lead + 10_000]
    assert landing.in_place(bytes(lead), foreign) is None  # a mapping of someone else's
    assert landing.in_place(bytes(lead), view) is not None


def test_a_buffer_is_reused_only_once_nothing_refers_to_it() -> None:
    landing = LandingBuffers(CHUNK, keep=2 * 64 << 10)
    first = landing.take(50_000)
    first[:4] = b"keep"
    held = first[:10]  # a slice still refers to the mapping
    del first
    second = landing.take(50_000)
    assert bytes(held[:4]) == b"keep"  # a new buffer: the held one is untouched
    second[:4] = b"next"
    assert bytes(held[:4]) == b"keep"
    address = id(second.obj)
    del second
    gc.collect()
    third = landing.take(50_000)
    assert id(third.obj) == address  # unreferenced: taken again, no new mapping
    del held, third


def test_idle_buffers_beyond_keep_are_unmapped() -> None:
    landing = LandingBuffers(CHUNK, keep=28 << 10)  # one idle 24 KiB buffer
    views = [landing.take(20_000) for _ in range(4)]
    assert len(landing._maps) == 4
    del views
    taken = landing.take(20_000)  # one reused, one kept idle, the other two unmapped
    assert len(landing._maps) == 2
    assert sum(m is taken.obj for m in landing._maps) == 1


def _mapping_field(address: int, field: str) -> str:
    """A field of /proc/self/smaps (``"Rss:"``, ``"VmFlags:"``) for the mapping holding
    ``address``: what follows the field's name."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif head == field and inside:
                return line.split(maxsplit=1)[1]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``address``."""
    return _mapping_field(address, "VmFlags:").split()


def test_prefilled_buffers_are_resident_kept_and_taken_without_mapping_more() -> None:
    length = 200_000
    landing = LandingBuffers(CHUNK, keep=0)  # no idle buffer kept, but prefilled ones
    mapped = landing.prefill(length, 3)
    assert mapped == landing.mapped_bytes == 3 * len(landing._maps[0])
    assert len(landing._maps) == 3
    size = -(-(header_len(length, CHUNK) + length) // PAGE) * PAGE
    resident = [int(_mapping_field(_address(m), "Rss:").split()[0]) << 10 for m in landing._maps]
    assert min(resident) >= size  # faulted in already: no page left for a fetch to fault
    views = [landing.take(length) for _ in range(3)]
    assert landing.mapped_bytes == mapped  # the three prefilled buffers, no new mapping
    assert {id(view.obj) for view in views} == {id(m) for m in landing._maps}
    del views
    gc.collect()
    again = landing.take(length)  # all three idle again: none unmapped, one taken
    assert len(landing._maps) == 3 and landing.mapped_bytes == mapped
    fourth = [landing.take(length) for _ in range(3)]  # a fourth at once: mapped fresh
    assert landing.mapped_bytes > mapped
    del again, fourth


def test_a_block_sized_buffer_is_private_and_asks_for_huge_pages() -> None:
    size = (8 << 20) + PAGE  # an 8 MiB block and its header
    mapping = anonymous_map(size)
    assert len(mapping) == 10 << 20  # whole huge pages: the kernel aligns it on one
    base = _address(mapping)
    flags = _vm_flags(base)
    assert "sh" not in flags  # private: shmem takes no huge pages here
    assert "hg" in flags  # MADV_HUGEPAGE over the huge pages within the size
    assert "hg" not in _vm_flags(base + (8 << 20))  # the last, partial one stays small
    memoryview(mapping)[size - 1 :: -PAGE] = bytes(-(-size // PAGE))  # it takes writes
    mapping.close()


def test_a_small_buffer_is_not_rounded_to_huge_pages() -> None:
    mapping = anonymous_map(300_000)
    assert len(mapping) == 300_000
    assert "hg" not in _vm_flags(_address(mapping))
    mapping.close()


def test_readahead_waits_for_room_until_a_block_is_let_go() -> None:
    buffers = LandingBuffers(CHUNK)
    held = [buffers.take(1 << 20) for _ in range(3)]  # three blocks not yet written
    in_use = buffers.in_use()
    assert in_use >= 3 << 20
    with buffers.room(1 << 20, limit=in_use + (1 << 20), timeout=0.0) as fits:
        assert fits  # a block's worth of room left
        # A second GET counts the first one's bytes, still coming, against the limit.
        started = time.monotonic()
        with buffers.room(1 << 20, limit=in_use + (1 << 20), timeout=0.05) as second:
            assert not second and time.monotonic() - started >= 0.05
    threading.Timer(0.05, held.clear).start()  # the pusher lets the blocks go
    started = time.monotonic()
    with buffers.room(2 << 20, limit=2 << 20, timeout=5.0) as fits:
        waited = time.monotonic() - started
    assert fits and 0.04 <= waited < 5.0
    assert buffers.in_use() == 0
    with buffers.room(64 << 20, limit=1 << 20, timeout=0.0) as fits:
        assert fits  # nothing in use: a GET larger than the limit still goes


def test_room_left_early_is_given_back() -> None:
    buffers = LandingBuffers(CHUNK)
    try:
        with buffers.room(1 << 20, limit=1 << 20, timeout=0.0):
            raise OSError("the GET failed")
    except OSError:
        pass
    with buffers.room(1 << 20, limit=1 << 20, timeout=0.0) as fits:
        assert fits


def test_a_get_waiting_for_room_looks_again_when_a_holder_lets_buffers_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(landing, "_ROOM_POLL_S", 30.0)  # no look of its own in this test
    buffers = LandingBuffers(CHUNK)
    held = [buffers.take(1 << 20) for _ in range(2)]
    waited: list[float] = []

    def get() -> None:
        started = time.monotonic()
        with buffers.room(1 << 20, limit=1 << 20, timeout=60.0) as fits:
            assert fits
            waited.append(time.monotonic() - started)

    waiter = threading.Thread(target=get)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()  # no room: it waits
    held.clear()  # the pusher drops the blocks...
    buffers.released()  # ...and says so
    waiter.join(timeout=20.0)
    assert not waiter.is_alive() and waited and waited[0] < 20.0
