/* The compiled hot path of the FUSE adapter: the requests every file sends, answered
 * without the interpreter.
 *
 * Python keeps the control plane (fuse/hot_path.py). It builds the libfuse operations
 * table with ctypes, then puts these handlers in four of its slots; each falls back to the
 * Python handler it replaced for anything it does not answer itself:
 *   - read: a file of a block published *in memory* (fetched, its files not pushed to the
 *     kernel yet) is answered from those bytes. A file Python has *published* (its bytes
 *     lie wholly in one cache block file, whose header Python verified) is answered with
 *     one pread of the chunks that hold it, checked against the header's xxh3 sums (the
 *     block format's, _xxh3.h); else Python. A read whose pages are not all in the page
 *     cache is queued for this module's disk readers, threads that read it (with O_DIRECT
 *     where the file system takes it: past the page cache), check it and answer it, so
 *     neither the session's thread nor the interpreter waits on the disk for it. A file an
 *     order hint follows is answered so too; its READ that reaches the file's end is then
 *     queued for a Python thread as its open is (below): the hint counts it as read.
 *   - ioctl: every ioctl but the order hint's is answered ENOTTY here, as Python did. The
 *     TCGETS of a default-buffered open() of a file the kernel holds whole, while an order
 *     hint follows that file, is then queued for a Python thread (``opened``): the hint
 *     counts it as read.
 *   - forget, forget_multi: nothing to free, but the kernel's lookups of each inode are
 *     counted (``hot_track_inodes``): one it gave all back holds neither pages nor a push.
 *   - lookup (when Python asks for it, ``hot_serve_lookups``): a name in a folder Python
 *     published (``hot_publish_folder``, the table in _entries.c) is answered here, and the
 *     pusher's ``known`` byte of its inode set, as Python's handler does; else Python.
 * And for the kernel pusher (pushes.py), hot_push stores a block's files with one call.
 * No libfuse header is needed: libfuse's functions arrive as addresses from ctypes, and the
 * per-mount state travels as the session's userdata. Python calls the exported hot_*
 * functions through ctypes, which releases the interpreter lock around them.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_entries.h"
#include "../cache/_xxh3.h"

typedef void *req_t;
typedef int (*reply_err_fn)(req_t, int);
typedef int (*reply_buf_fn)(req_t, const char *, size_t);
typedef void (*reply_none_fn)(req_t);
typedef void *(*userdata_fn)(req_t);
typedef void (*read_fn)(req_t, uint64_t, size_t, int64_t, void *);
typedef void (*ioctl_fn)(req_t, uint64_t, unsigned, void *, void *, unsigned, const void *,
                         size_t, size_t);
typedef void (*opened_fn)(uint64_t);
typedef void (*lookup_fn)(req_t, uint64_t, const char *);

/* libfuse's struct fuse_entry_param */
struct entry_param {
    uint64_t ino;
    uint64_t generation;
    struct stat attr;
    double attr_timeout;
    double entry_timeout;
};
typedef int (*reply_entry_fn)(req_t, const struct entry_param *);

/* Published block files held open at once, oldest dropped first: at most this many, and at
 * most what hot_limit_blocks allows (each holds a descriptor and its sums, 1 KiB for an
 * 8 MiB block of 64 KiB chunks). A dataset whose blocks outnumber them publishes blocks
 * again and again, each time reading a block file's header; 4096 8 MiB blocks are 32 GiB. */
#define MAX_BLOCKS 4096
#define MAX_OPENED 4096 /* opens queued for Python at once; past that, Python is called */
/* Files across two blocks held at once, the oldest replaced first: each block published
 * links up to two, and most blocks are published twice (from memory, then from their
 * file), so that the files of the blocks held stay published. */
#define MAX_EDGES (4 * MAX_BLOCKS)
/* The disk readers read block files with O_DIRECT: the block's bytes go straight into their
 * buffer, not through the page cache, so they cost no page-cache pages (each file's bytes
 * are cached once, in the file's own pages, not twice) and no copy out of them. Reads of
 * whole pages, at page offsets, into a page-aligned buffer. */
#define DIRECT_ALIGN 4096
#define NO_DIRECT (-2)

struct slot {
    int32_t block; /* 1 + index into blocks, 0: not published, < 0: -1 - index into edges */
    int32_t generation;
    int64_t pos;   /* the file's first byte in the block's data */
    int64_t size;
};

struct block {
    int fd; /* -1: none (free, or a block in memory) */
    /* The same file opened again with O_DIRECT, for the disk readers (opened at their
     * first read of the block): -1 not yet, NO_DIRECT when the file system refuses it. */
    int direct_fd;
    const unsigned char *mem; /* a block in memory (hot_publish_memory): its data */
    int32_t generation;
    int64_t data_pos;   /* where the block's data starts in the file */
    int64_t data_len;
    int64_t chunk;      /* bytes per checked chunk */
    uint64_t *sums;     /* each chunk's xxh3, from the block file's verified header */
    uint64_t count;
    uint64_t *inos;
    int used; /* a READ was answered from it since the last hot_sweep */
};

/* A file lying across two published blocks (hot_publish_edge): its first ``head`` bytes end
 * block 0's data, from ``pos``; the rest begin block 1's. Each block is taken as it was
 * when the edge was published (its generation): one dropped or replaced since leaves the
 * file to Python. About one file in 80 of 100 KB lies across an 8 MiB block's end; each
 * cost the interpreter two checked reads and a worker's hand-over. */
struct edge {
    uint64_t ino;
    int32_t block[2]; /* 1 + index into blocks; 0: never used */
    int32_t generation[2];
    int64_t pos, head, size;
};

struct hot_counters {
    uint64_t reads;           /* READs answered here */
    uint64_t bytes;           /* their bytes */
    uint64_t delivered_bytes; /* bytes of files reaching a reader for the first time */
    uint64_t published;       /* files published */
    uint64_t dropped_blocks;  /* published blocks found removed from the cache */
    uint64_t checksum_failures; /* reads whose chunks no longer matched: Python re-reads */
    uint64_t not_in_memory;     /* reads left to Python: their pages were not cached */
    uint64_t disk_reads;        /* reads the disk readers answered (pages not cached) */
    uint64_t memory_reads;      /* reads answered from a block in memory, before its push */
    uint64_t lookups;           /* LOOKUPs answered here (published folders) */
    uint64_t forgotten;         /* inodes whose lookups the kernel all gave back */
    uint64_t direct_reads;      /* disk reads with O_DIRECT (past the page cache) */
    uint64_t edge_reads;        /* reads of files across two blocks (hot_publish_edge) */
    uint64_t watched_reads;     /* reads of files an order hint follows */
};

/* A READ whose pages were not in memory, waiting for a disk reader. */
struct miss {
    struct miss *next;
    req_t req;
    uint64_t ino;
    size_t size;
    int64_t off;
};

struct ctx {
    reply_err_fn reply_err;
    reply_buf_fn reply_buf;
    reply_none_fn reply_none;
    userdata_fn userdata;
    read_fn py_read;
    ioctl_fn py_ioctl;
    opened_fn py_opened;
    uint64_t hint_ino;
    unsigned hint_cmd;
    uint64_t n_ino;            /* inodes 0 .. n_ino - 1 have a slot */
    uint8_t *in_kernel;        /* 1: the kernel holds the whole file (may be NULL) */
    const uint8_t *watched;    /* 1: the order hint must see this file's reads */
    uint8_t *delivered;        /* one bit per inode: bytes counted once */
    struct slot *slots;
    struct block blocks[MAX_BLOCKS];
    unsigned next_block;
    unsigned max_blocks; /* blocks used, oldest dropped first: 1 .. MAX_BLOCKS */
    char *buffer;
    size_t buffer_size;
    struct edge edges[MAX_EDGES]; /* files across two blocks, the oldest replaced first */
    unsigned next_edge;
    unsigned char *joined; /* the session thread's reply to a READ of such a file */
    size_t joined_size;
    pthread_mutex_t lock;
    struct hot_counters counters;
    struct miss *miss_head, *miss_tail; /* READs queued for the disk readers */
    pthread_cond_t miss_ready;
    pthread_t *disk_threads;
    unsigned disk_count; /* disk readers running; 0: misses go to Python */
    int direct_reads;    /* whether they read with O_DIRECT (hot_direct_reads) */
    int disk_stop;
    int opened_fd; /* an eventfd told when ``opened`` gets its first inode; -1: none */
    unsigned opened_count;
    uint64_t opened[MAX_OPENED]; /* inodes whose opens Python has yet to take */
    /* LOOKUPs (hot_serve_lookups): the published folders, Python's handler for the rest */
    struct entries *entries;
    lookup_fn py_lookup;
    reply_entry_fn reply_entry;
    uint8_t *known;    /* the pusher's: 1 while the kernel holds the inode (may be NULL) */
    /* hot_track_inodes: per inode, the lookups the kernel was given less those it gave
     * back (FORGET); at 0 it holds the inode no more. NULL: not counted. */
    uint32_t *lookup_counts;
    pthread_mutex_t inode_lock;
    uint32_t uid, gid; /* what every entry shows */
    int64_t blksize;
    double timeout;
};

/* The checksum of a chunk: xxh3-64, the build this CPU runs best (set at module load). */
static uint64_t (*chunk_sum)(const void *, size_t) = shardfs_xxh3_plain;

/* Whether a block slot holds a published block (a block file, or a block in memory). */
static int in_use(const struct block *b) { return b->fd >= 0 || b->mem != NULL; }

static void drop_block_locked(struct ctx *c, unsigned index) {
    struct block *b = &c->blocks[index];
    if (!in_use(b))
        return;
    for (uint64_t i = 0; i < b->count; i++) {
        struct slot *s = &c->slots[b->inos[i]];
        if (s->block == (int32_t)index + 1 && s->generation == b->generation)
            s->block = 0;
    }
    if (b->fd >= 0)
        close(b->fd);
    if (b->direct_fd >= 0)
        close(b->direct_fd);
    b->direct_fd = -1;
    free(b->inos);
    free(b->sums);
    b->fd = -1;
    b->mem = NULL; /* the caller's again once the lock is let go */
    b->inos = NULL;
    b->sums = NULL;
    b->count = 0;
}

/* Where a READ of a published file lies: the whole checked chunks that hold it (``len``
 * bytes at ``at`` in the block file) and what to reply (``n`` bytes from ``skip`` in them). */
struct span {
    unsigned block; /* index into blocks */
    int32_t generation;
    int64_t size;   /* the file's */
    int64_t first;  /* its first chunk */
    int64_t at, len, skip;
    size_t n;
};

/* Whether block ``index``'s file is still in the cache (under the lock); one evicted or
 * cleared since is dropped here, so that its disk space is held no longer. */
static int still_cached_locked(struct ctx *c, unsigned index) {
    struct stat st;
    if (fstat(c->blocks[index].fd, &st) == 0 && st.st_nlink > 0)
        return 1;
    drop_block_locked(c, index);
    c->counters.dropped_blocks++;
    return 0;
}

/* The span of ``n`` bytes at ``start`` in the data of block file ``index``, for a READ of a
 * file ``size`` bytes long. */
static struct span span_of(const struct ctx *c, unsigned index, int64_t size, int64_t start,
                           size_t n) {
    const struct block *b = &c->blocks[index];
    int64_t first = 0, span_start = 0, span_len = 0;
    if (n > 0) {
        first = start / b->chunk;
        int64_t last = (start + (int64_t)n - 1) / b->chunk;
        span_start = first * b->chunk;
        int64_t span_end = (last + 1) * b->chunk;
        span_len = (span_end < b->data_len ? span_end : b->data_len) - span_start;
    }
    return (struct span){index, b->generation, size, first, b->data_pos + span_start,
                         span_len, start - span_start, n};
}

/* How many bytes a READ of ``size`` at ``off`` gets of a file ``file_size`` long. */
static size_t reply_len(int64_t file_size, size_t size, int64_t off) {
    if (off < 0 || off >= file_size)
        return 0;
    return (size_t)(file_size - off) < size ? (size_t)(file_size - off) : size;
}

/* Find the READ's span (under the lock); 0 when the file is not published, or its block
 * was removed from the cache since (then its disk space is let go of here). */
static int locate_locked(struct ctx *c, uint64_t ino, size_t size, int64_t off,
                         struct span *out) {
    struct slot s = c->slots[ino];
    if (s.block <= 0)
        return 0;
    struct block *b = &c->blocks[s.block - 1];
    if (b->fd < 0 || b->generation != s.generation)
        return 0; /* a block in memory is read_published's own case */
    if (!still_cached_locked(c, (unsigned)(s.block - 1)))
        return 0;
    size_t n = reply_len(s.size, size, off);
    *out = span_of(c, (unsigned)(s.block - 1), s.size, n ? s.pos + off : 0, n);
    return 1;
}

/* One block's share of a READ of a file across two blocks: its bytes, read as a READ of a
 * file in that block alone would be (``sp``), or straight from ``mem`` for a block in
 * memory; ``out``: where they go in the reply. */
struct part {
    struct span sp;
    const unsigned char *mem;
    size_t out;
};

/* The edge ``ino``'s slot points to, if it is still that file's and both its blocks are
 * as they were when it was published (under the lock); else NULL. */
static const struct edge *edge_of_locked(const struct ctx *c, uint64_t ino) {
    struct slot s = c->slots[ino];
    if (s.block >= 0)
        return NULL;
    const struct edge *e = &c->edges[-s.block - 1];
    if (e->ino != ino)
        return NULL;
    for (int i = 0; i < 2; i++) {
        const struct block *b = &c->blocks[e->block[i] - 1];
        if (!in_use(b) || b->generation != e->generation[i])
            return NULL;
    }
    return e;
}

/* Where a READ of a file across two blocks lies (under the lock): its parts, one per block
 * it has bytes in (*count, 0 to 2), and the bytes to reply (*n); 0 when the file is not
 * published so now (a block file removed from the cache is dropped here). */
static int locate_edge_locked(struct ctx *c, uint64_t ino, size_t size, int64_t off,
                              struct part parts[2], int *count, size_t *n) {
    const struct edge *e = edge_of_locked(c, ino);
    if (e == NULL)
        return 0;
    *n = reply_len(e->size, size, off);
    parts[0].sp.size = e->size; /* the file's, even when no part has bytes */
    *count = 0;
    for (int i = 0; i < 2; i++) {
        unsigned index = (unsigned)(e->block[i] - 1);
        const struct block *b = &c->blocks[index];
        if (b->fd >= 0 && !still_cached_locked(c, index))
            return 0;
        /* the file's bytes [lo, hi) lie in this block, from ``at`` in its data */
        int64_t lo = i == 0 ? 0 : e->head, hi = i == 0 ? e->head : e->size;
        int64_t at = i == 0 ? e->pos : 0;
        int64_t from = off > lo ? off : lo, to = off + (int64_t)*n < hi ? off + (int64_t)*n : hi;
        if (*n == 0 || from >= to)
            continue;
        struct part *p = &parts[(*count)++];
        int64_t start = at + (from - lo);
        p->out = (size_t)(from - off);
        p->mem = b->mem != NULL ? b->mem + start : NULL;
        p->sp = span_of(c, index, e->size, start, (size_t)(to - from));
    }
    return 1;
}

/* Whether ``data`` (the span's bytes, read without the lock) still matches the block's
 * sums, the block unchanged meanwhile (under the lock). A mismatch drops the block: Python
 * reads it again, checks the block format's sums, and fetches the block anew. */
static int verified_locked(struct ctx *c, const struct span *sp, const unsigned char *data) {
    struct block *b = &c->blocks[sp->block];
    if (b->fd < 0 || b->generation != sp->generation)
        return 0; /* dropped or replaced while it was read */
    for (int64_t at = 0; at < sp->len; at += b->chunk) {
        int64_t len = sp->len - at < b->chunk ? sp->len - at : b->chunk;
        if (chunk_sum(data + at, (size_t)len) != b->sums[sp->first + at / b->chunk]) {
            drop_block_locked(c, sp->block);
            c->counters.checksum_failures++;
            return 0;
        }
    }
    return 1;
}

/* Count a READ answered here of ``n`` bytes at ``off`` of a file ``size`` long (under the
 * lock). */
static void served_locked(struct ctx *c, uint64_t ino, int64_t off, int64_t size, size_t n) {
    c->counters.reads++;
    c->counters.bytes += n;
    if (c->watched[ino])
        c->counters.watched_reads++;
    if (off == 0 && (int64_t)n == size && c->in_kernel != NULL)
        c->in_kernel[ino] = 1;
    uint8_t bit = (uint8_t)(1u << (ino & 7));
    if (!(c->delivered[ino >> 3] & bit)) {
        c->delivered[ino >> 3] |= bit;
        c->counters.delivered_bytes += (uint64_t)size;
    }
}

/* Count a READ answered here from one block (under the lock). */
static void answered_locked(struct ctx *c, uint64_t ino, int64_t off, const struct span *sp) {
    c->blocks[sp->block].used = 1;
    served_locked(c, ino, off, sp->size, sp->n);
}

/* Count a READ answered here of a file across two blocks (under the lock). */
static void answered_edge_locked(struct ctx *c, uint64_t ino, int64_t off, size_t n,
                                 const struct part *parts, int count) {
    for (int i = 0; i < count; i++)
        c->blocks[parts[i].sp.block].used = 1;
    served_locked(c, ino, off, parts[0].sp.size, n);
    c->counters.edge_reads++;
}

/* Whether a part's block in memory is still published as it was located (under the lock):
 * its memory may be let go of once it is not. */
static int memory_part_current_locked(const struct ctx *c, const struct part *p) {
    const struct block *b = &c->blocks[p->sp.block];
    return b->mem != NULL && b->generation == p->sp.generation;
}

/* Make *buffer hold at least ``need`` bytes, page-aligned; 0 when out of memory. */
static int room_for(unsigned char **buffer, size_t *capacity, size_t need) {
    if (need <= *capacity)
        return 1;
    void *grown = NULL;
    if (posix_memalign(&grown, DIRECT_ALIGN, need) != 0)
        return 0;
    free(*buffer);
    *buffer = grown;
    *capacity = need;
    return 1;
}

/* Hand a READ whose pages are not in memory to the disk readers (under the lock); 0 when
 * none run (Python answers it). */
static int queue_miss_locked(struct ctx *c, req_t req, uint64_t ino, size_t size,
                             int64_t off) {
    if (c->disk_count == 0 || c->disk_stop)
        return 0;
    struct miss *m = malloc(sizeof *m);
    if (m == NULL)
        return 0;
    *m = (struct miss){NULL, req, ino, size, off};
    if (c->miss_tail != NULL)
        c->miss_tail->next = m;
    else
        c->miss_head = m;
    c->miss_tail = m;
    pthread_cond_signal(&c->miss_ready);
    return 1;
}

/* Answer a READ of a file whose block is published in memory (under the lock, which
 * hot_drop takes before the caller may let go of that memory); 0 when it is not. */
static int read_memory_locked(struct ctx *c, req_t req, uint64_t ino, size_t size,
                              int64_t off) {
    struct slot s = c->slots[ino];
    if (s.block <= 0)
        return 0;
    const struct block *b = &c->blocks[s.block - 1];
    if (b->mem == NULL || b->generation != s.generation)
        return 0;
    size_t n = reply_len(s.size, size, off);
    c->reply_buf(req, (const char *)b->mem + s.pos + (n ? off : 0), n);
    struct span sp = {(unsigned)(s.block - 1), s.generation, s.size, 0, 0, 0, 0, n};
    answered_locked(c, ino, off, &sp);
    c->counters.memory_reads++;
    return 1;
}

/* cachestat(2) (Linux 6.5): how many pages of a range of a file are in the page cache,
 * without reading any. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct cachestat_range {
    uint64_t off, len;
};
struct cachestat_counts {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};
static int no_cachestat; /* the kernel has none: every span counts as not cached */

/* Whether every page of bytes [at, at + len) of ``fd`` is in the page cache. */
static int all_cached(int fd, int64_t at, int64_t len) {
    if (no_cachestat || len <= 0)
        return 0;
    int64_t page = getpagesize();
    int64_t first = at / page, end = (at + len + page - 1) / page;
    struct cachestat_range range = {(uint64_t)(first * page), (uint64_t)((end - first) * page)};
    struct cachestat_counts counts;
    if (syscall(__NR_cachestat, fd, &range, &counts, 0) != 0) {
        if (errno == ENOSYS)
            no_cachestat = 1;
        return 0;
    }
    return counts.nr_cache >= (uint64_t)(end - first);
}

/* Make the session thread's buffer hold ``len`` bytes (under the lock); 0 when out of
 * memory. */
static int session_buffer_locked(struct ctx *c, int64_t len) {
    if ((size_t)len <= c->buffer_size)
        return 1;
    char *grown = realloc(c->buffer, (size_t)len);
    if (grown == NULL)
        return 0;
    c->buffer = grown;
    c->buffer_size = (size_t)len;
    return 1;
}

/* Whether the session thread leaves a block file's span to the disk readers (under the
 * lock): one they read with O_DIRECT unless its pages are all cached (a read of missing
 * pages, even RWF_NOWAIT, which then answers EAGAIN, reads them into the page cache, the
 * very copy their reads leave out). */
static int for_disk_readers_locked(const struct ctx *c, const struct span *sp) {
    const struct block *b = &c->blocks[sp->block];
    return c->direct_reads && b->direct_fd != NO_DIRECT && c->disk_count > 0 &&
           !all_cached(b->fd, sp->at, sp->len);
}

/* Answer a READ of a file across two published blocks on the session thread (under the
 * lock): from memory, or from block files whose pages are cached; one that must wait on
 * the disk is queued for the disk readers. 0 when it is not answered (Python answers it). */
static int read_edge_locked(struct ctx *c, req_t req, uint64_t ino, size_t size, int64_t off) {
    struct part parts[2];
    int count;
    size_t n;
    if (!locate_edge_locked(c, ino, size, off, parts, &count, &n) ||
        !room_for(&c->joined, &c->joined_size, n ? n : 1))
        return 0;
    for (int i = 0; i < count; i++) {
        const struct part *p = &parts[i];
        if (p->mem != NULL) {
            memcpy(c->joined + p->out, p->mem, p->sp.n);
            continue;
        }
        if (!session_buffer_locked(c, p->sp.len))
            return 0;
        struct iovec iov = {c->buffer, (size_t)p->sp.len};
        if (for_disk_readers_locked(c, &p->sp) ||
            preadv2(c->blocks[p->sp.block].fd, &iov, 1, p->sp.at, RWF_NOWAIT) != p->sp.len) {
            if (queue_miss_locked(c, req, ino, size, off))
                return 1;
            c->counters.not_in_memory++;
            return 0;
        }
        if (!verified_locked(c, &p->sp, (unsigned char *)c->buffer))
            return 0;
        memcpy(c->joined + p->out, c->buffer + p->sp.skip, p->sp.n);
    }
    c->reply_buf(req, (const char *)c->joined, n);
    answered_edge_locked(c, ino, off, n, parts, count);
    return 1;
}

/* Answer a READ from a published file; 0 when it is not one (Python answers it). */
static int read_published(struct ctx *c, req_t req, uint64_t ino, size_t size, int64_t off) {
    int answered = 0;
    struct span sp;
    pthread_mutex_lock(&c->lock);
    if (c->slots[ino].block < 0) {
        answered = read_edge_locked(c, req, ino, size, off);
        goto out;
    }
    if (read_memory_locked(c, req, ino, size, off)) {
        answered = 1;
        goto out;
    }
    if (!locate_locked(c, ino, size, off, &sp))
        goto out;
    if (!session_buffer_locked(c, sp.len))
        goto out;
    if (sp.len > 0) {
        /* never wait on the disk here, the one thread that answers requests: a block
         * not in the page cache is read by the disk readers (or Python's workers) */
        struct iovec iov = {c->buffer, (size_t)sp.len};
        if (for_disk_readers_locked(c, &sp) ||
            preadv2(c->blocks[sp.block].fd, &iov, 1, sp.at, RWF_NOWAIT) != sp.len) {
            answered = queue_miss_locked(c, req, ino, size, off);
            if (!answered)
                c->counters.not_in_memory++;
            goto out;
        }
        if (!verified_locked(c, &sp, (unsigned char *)c->buffer))
            goto out;
    }
    c->reply_buf(req, c->buffer + sp.skip, sp.n);
    answered = 1;
    answered_locked(c, ino, off, &sp);
out:
    pthread_mutex_unlock(&c->lock);
    return answered;
}

/* The block's O_DIRECT descriptor (under the lock), opened at the first call: the block
 * file reopened through /proc/self/fd, a description of its own (the flag is the
 * description's, which the plain descriptor shares with Python's). -1 when the file
 * system refuses O_DIRECT: plain reads then, for this block. */
static int direct_fd_locked(struct block *b) {
    if (b->direct_fd == -1) {
        char path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", b->fd);
        int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        b->direct_fd = fd >= 0 ? fd : NO_DIRECT;
    }
    return b->direct_fd >= 0 ? b->direct_fd : -1;
}

/* Read the span's bytes into *buffer (grown as needed, page-aligned), through ``direct``
 * (whole pages around the span) when it is a descriptor, else ``fd``; where the bytes
 * start in the buffer, or NULL. A direct read the file system refuses after all (EINVAL)
 * falls back to ``fd`` and sets *refused. */
static const unsigned char *read_span(int fd, int direct, const struct span *sp,
                                      unsigned char **buffer, size_t *capacity,
                                      int *refused) {
    int64_t lo = direct >= 0 ? sp->at & ~(int64_t)(DIRECT_ALIGN - 1) : sp->at;
    int64_t hi = sp->at + sp->len;
    if (direct >= 0)
        hi = (hi + DIRECT_ALIGN - 1) & ~(int64_t)(DIRECT_ALIGN - 1);
    size_t need = (size_t)(hi - lo);
    if (!room_for(buffer, capacity, need))
        return NULL;
    if (direct >= 0) {
        /* a block file written buffered may end before the last page: a short read is
         * fine as long as it holds the span */
        ssize_t got = pread(direct, *buffer, need, lo);
        if (got >= sp->at - lo + sp->len)
            return *buffer + (sp->at - lo);
        if (!(got < 0 && errno == EINVAL))
            return NULL;
        *refused = 1;
    }
    if (pread(fd, *buffer, (size_t)sp->len, sp->at) != sp->len)
        return NULL;
    return *buffer;
}

/* A direct read of the span's block was refused after all (under the lock): its block
 * reads through the page cache from now on, unless the block changed meanwhile (then
 * ``direct`` may not be its descriptor any more, and is left alone). */
static void direct_refused_locked(struct ctx *c, const struct span *sp, int direct) {
    struct block *b = &c->blocks[sp->block];
    if (b->generation == sp->generation && b->direct_fd == direct) {
        close(direct);
        b->direct_fd = NO_DIRECT;
    }
}

/* A disk reader's buffers for READs of files across two blocks: one per block, and the
 * reply. */
struct edge_buffers {
    unsigned char *part[2], *joined;
    size_t part_size[2], joined_size;
};

/* Answer a queued READ of a file across two blocks on a disk reader, as disk_reader does
 * one of a file in one block (called and returning under the lock, let go of while it
 * reads and replies); 0 when it cannot (the caller hands it to Python). */
static int disk_edge_locked(struct ctx *c, const struct miss *m, struct edge_buffers *eb) {
    struct part parts[2];
    int count, fds[2] = {-1, -1}, direct[2] = {-1, -1}, refused[2] = {0, 0};
    size_t n;
    if (!locate_edge_locked(c, m->ino, m->size, m->off, parts, &count, &n))
        return 0;
    for (int i = 0; i < count; i++) {
        if (parts[i].mem != NULL)
            continue;
        struct block *b = &c->blocks[parts[i].sp.block];
        fds[i] = b->fd;
        direct[i] = c->direct_reads ? direct_fd_locked(b) : -1;
    }
    pthread_mutex_unlock(&c->lock);
    /* Without the lock, as disk_reader reads: what changed meanwhile shows at the checks */
    const unsigned char *data[2] = {NULL, NULL};
    int ok = 1;
    for (int i = 0; i < count && ok; i++) {
        if (parts[i].mem != NULL || parts[i].sp.len == 0)
            continue;
        data[i] = read_span(fds[i], direct[i], &parts[i].sp, &eb->part[i], &eb->part_size[i],
                            &refused[i]);
        ok = data[i] != NULL;
    }
    pthread_mutex_lock(&c->lock);
    int any_direct = 0;
    for (int i = 0; i < count; i++) {
        if (refused[i])
            direct_refused_locked(c, &parts[i].sp, direct[i]);
        any_direct |= direct[i] >= 0 && !refused[i] && parts[i].sp.len > 0;
    }
    /* each block still as it was located (one in memory may have been let go of), the
     * bytes read from disk still matching their sums */
    ok = ok && room_for(&eb->joined, &eb->joined_size, n ? n : 1);
    for (int i = 0; i < count && ok; i++) {
        const struct part *p = &parts[i];
        if (p->mem != NULL) {
            if ((ok = memory_part_current_locked(c, p)))
                memcpy(eb->joined + p->out, p->mem, p->sp.n);
        } else if ((ok = verified_locked(c, &p->sp, data[i]))) {
            memcpy(eb->joined + p->out, data[i] + p->sp.skip, p->sp.n);
        }
    }
    if (!ok)
        return 0;
    answered_edge_locked(c, m->ino, m->off, n, parts, count);
    c->counters.disk_reads++;
    c->counters.direct_reads += (uint64_t)any_direct;
    pthread_mutex_unlock(&c->lock);
    c->reply_buf(m->req, (const char *)eb->joined, n);
    pthread_mutex_lock(&c->lock);
    return 1;
}

/* A disk reader: answers queued READs with a pread that may wait on the disk (O_DIRECT
 * where the file system takes it), checked as the session thread checks its own; what it
 * cannot answer goes to Python's handler (which may be called from any thread). Drains the
 * queue before it stops. */
static void *disk_reader(void *arg) {
    struct ctx *c = arg;
    unsigned char *buffer = NULL;
    size_t capacity = 0;
    struct edge_buffers eb = {{NULL, NULL}, NULL, {0, 0}, 0};
    pthread_setname_np(pthread_self(), "shardfs-disk");
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (c->miss_head == NULL && !c->disk_stop)
            pthread_cond_wait(&c->miss_ready, &c->lock);
        struct miss *m = c->miss_head;
        if (m == NULL)
            break;
        c->miss_head = m->next;
        if (c->miss_head == NULL)
            c->miss_tail = NULL;
        if (c->slots[m->ino].block < 0) {
            if (!disk_edge_locked(c, m, &eb)) {
                pthread_mutex_unlock(&c->lock);
                c->py_read(m->req, m->ino, m->size, m->off, NULL);
                pthread_mutex_lock(&c->lock);
            }
            free(m);
            continue;
        }
        struct span sp;
        int ok = locate_locked(c, m->ino, m->size, m->off, &sp);
        int fd = ok ? c->blocks[sp.block].fd : -1;
        int direct = ok && c->direct_reads ? direct_fd_locked(&c->blocks[sp.block]) : -1;
        pthread_mutex_unlock(&c->lock);
        /* Without the lock: the block may be dropped meanwhile and its descriptors closed
         * (even reused); verified_locked then sees its generation changed, or a sum that
         * no longer matches, and nothing read here is served. */
        const unsigned char *data = buffer; /* what a READ of no bytes replies from */
        int refused = 0;
        if (ok && sp.len > 0) {
            data = read_span(fd, direct, &sp, &buffer, &capacity, &refused);
            ok = data != NULL;
        }
        pthread_mutex_lock(&c->lock);
        if (refused)
            direct_refused_locked(c, &sp, direct);
        if (ok)
            ok = verified_locked(c, &sp, data);
        if (ok) {
            answered_locked(c, m->ino, m->off, &sp);
            c->counters.disk_reads++;
            if (direct >= 0 && !refused && sp.len > 0)
                c->counters.direct_reads++;
        }
        pthread_mutex_unlock(&c->lock);
        if (ok)
            c->reply_buf(m->req, (const char *)data + sp.skip, sp.n);
        else
            c->py_read(m->req, m->ino, m->size, m->off, NULL);
        free(m);
        pthread_mutex_lock(&c->lock);
    }
    pthread_mutex_unlock(&c->lock);
    free(buffer);
    free(eb.part[0]);
    free(eb.part[1]);
    free(eb.joined);
    return NULL;
}

/* libfuse's fuse_req_userdata: the same function for every session of the process. */
static userdata_fn req_userdata;

/* Tell the order hint that a reader has file ``ino`` whole: queued for Python's thread
 * (hot_take_opened), so this thread never waits on the interpreter lock for it; called in
 * place only when the queue is full. */
static void note_opened(struct ctx *c, uint64_t ino) {
    int queued = 0;
    pthread_mutex_lock(&c->lock);
    if (c->opened_fd >= 0 && c->opened_count < MAX_OPENED) {
        if (c->opened_count == 0) {
            /* under the lock, so close() cannot take the fd away meanwhile; a short
             * write means the counter is full and Python is awake already */
            uint64_t one = 1;
            (void)!write(c->opened_fd, &one, sizeof one);
        }
        c->opened[c->opened_count++] = ino;
        queued = 1;
    }
    pthread_mutex_unlock(&c->lock);
    if (!queued)
        c->py_opened(ino);
}

/* Answer a READ of a published file (in memory or in its block file); 0 when it is not
 * one. A READ that reaches the end of a file an order hint follows counts as its read:
 * queued for the hint. When it came before its block (Python waited for the fetch),
 * Python told the hint of the read before it waited. */
static int answer_published(struct ctx *c, req_t req, uint64_t ino, size_t size,
                            int64_t off) {
    if (ino >= c->n_ino || !c->slots[ino].block)
        return 0;
    /* the file's size, taken before the answer: a slot let go of meanwhile reads 0 */
    int64_t file_size = c->slots[ino].size;
    if (!read_published(c, req, ino, size, off))
        return 0;
    if (c->watched[ino] && off + (int64_t)size >= file_size)
        note_opened(c, ino);
    return 1;
}

static void hot_read(req_t req, uint64_t ino, size_t size, int64_t off, void *fi) {
    struct ctx *c = req_userdata(req);
    if (!answer_published(c, req, ino, size, off))
        c->py_read(req, ino, size, off, fi);
}

static void hot_ioctl(req_t req, uint64_t ino, unsigned cmd, void *arg, void *fi,
                      unsigned flags, const void *in_buf, size_t in_size, size_t out_size) {
    struct ctx *c = req_userdata(req);
    if (ino == c->hint_ino && cmd == c->hint_cmd && in_buf != NULL) {
        c->py_ioctl(req, ino, cmd, arg, fi, flags, in_buf, in_size, out_size);
        return;
    }
    c->reply_err(req, ENOTTY);
    if (cmd == TCGETS && ino < c->n_ino && c->in_kernel != NULL && c->in_kernel[ino] &&
        c->watched[ino])
        note_opened(c, ino);
}

/* The kernel was given ``delta`` more entries of inode ``ino`` (a LOOKUP's or
 * READDIRPLUS's, counted before the reply goes), or gave ``-delta`` back (a FORGET, or a
 * reply that did not reach it). While any are held the pusher may store the file's pages;
 * once none are, the kernel dropped the inode with its pages: the pusher's ``known`` and
 * ``in_kernel`` bytes are cleared, so no push is tried (and refused) until a new lookup. */
static void count_lookups(struct ctx *c, uint64_t ino, int64_t delta, int forget) {
    if (c->lookup_counts == NULL || ino >= c->n_ino)
        return;
    pthread_mutex_lock(&c->inode_lock);
    uint32_t held = c->lookup_counts[ino];
    int64_t n = (int64_t)held + delta;
    if (n > (int64_t)UINT32_MAX)
        n = UINT32_MAX;
    if (n <= 0) {
        n = 0;
        if (c->known != NULL)
            __atomic_store_n(&c->known[ino], 0, __ATOMIC_SEQ_CST);
        if (c->in_kernel != NULL)
            __atomic_store_n(&c->in_kernel[ino], 0, __ATOMIC_SEQ_CST);
        if (forget && held > 0)
            __atomic_fetch_add(&c->counters.forgotten, 1, __ATOMIC_RELAXED);
    } else if (delta > 0 && c->known != NULL) {
        __atomic_store_n(&c->known[ino], 1, __ATOMIC_SEQ_CST);
    }
    c->lookup_counts[ino] = (uint32_t)n;
    pthread_mutex_unlock(&c->inode_lock);
}

static int64_t given_back(uint64_t nlookup) {
    return nlookup > INT64_MAX ? INT64_MIN + 1 : -(int64_t)nlookup;
}

static void hot_forget(req_t req, uint64_t ino, uint64_t nlookup) {
    struct ctx *c = req_userdata(req);
    count_lookups(c, ino, given_back(nlookup), 1);
    c->reply_none(req);
}

struct forget_one { /* the kernel's struct fuse_forget_one, libfuse's fuse_forget_data */
    uint64_t ino;
    uint64_t nlookup;
};

static void hot_forget_multi(req_t req, size_t count, void *forgets) {
    struct ctx *c = req_userdata(req);
    const struct forget_one *f = forgets;
    for (size_t i = 0; i < count; i++)
        count_lookups(c, f[i].ino, given_back(f[i].nlookup), 1);
    c->reply_none(req);
}

static void hot_lookup(req_t req, uint64_t parent, const char *name) {
    struct ctx *c = req_userdata(req);
    struct entry_attr a;
    if (c->entries == NULL || !entries_find(c->entries, parent, name, strlen(name), &a)) {
        c->py_lookup(req, parent, name);
        return;
    }
    /* as Python's FuseOperations._entry, from AttributeRule's fields */
    struct entry_param e;
    memset(&e, 0, sizeof e);
    e.ino = a.ino;
    e.attr.st_ino = a.ino;
    e.attr.st_mode = a.mode;
    e.attr.st_nlink = S_ISDIR(a.mode) ? 2 : 1;
    e.attr.st_uid = c->uid;
    e.attr.st_gid = c->gid;
    e.attr.st_size = a.size;
    e.attr.st_blksize = c->blksize;
    e.attr.st_blocks = (a.size + 511) / 512;
    e.attr.st_atim.tv_sec = e.attr.st_mtim.tv_sec = e.attr.st_ctim.tv_sec = a.mtime;
    e.attr_timeout = e.entry_timeout = c->timeout;
    if (c->lookup_counts != NULL) {
        count_lookups(c, a.ino, 1, 0); /* before the kernel has it: a FORGET may follow */
        if (c->reply_entry(req, &e) != 0)
            count_lookups(c, a.ino, -1, 0); /* interrupted: the kernel took nothing */
    } else {
        c->reply_entry(req, &e);
        if (c->known != NULL && a.ino < c->n_ino)
            c->known[a.ino] = 1; /* as pusher.inode_known(ino, push_waiting=False) */
    }
    __atomic_fetch_add(&c->counters.lookups, 1, __ATOMIC_RELAXED);
}

/* -- called from Python through ctypes ------------------------------------------------ */

/* Answer a READ Python holds as hot_read would (a file of a published block, in memory or
 * in its block file); 0 when that is not one: Python answers it. For a READ that came
 * before its block: Python waited for the block's fetch. */
int hot_answer(struct ctx *c, req_t req, uint64_t ino, size_t size, int64_t off) {
    return answer_published(c, req, ino, size, off);
}

/* How many blocks may be published at once (the size of hot_sweep's ``used``). */
unsigned hot_max_blocks(void) { return MAX_BLOCKS; }

/* The handlers' addresses, in the order read, ioctl, forget, forget_multi, lookup. */
void hot_handlers(void **out) {
    out[0] = (void *)hot_read;
    out[1] = (void *)hot_ioctl;
    out[2] = (void *)hot_forget;
    out[3] = (void *)hot_forget_multi;
    out[4] = (void *)hot_lookup;
}

/* Answer LOOKUPs in published folders from now on (install the lookup handler after this):
 * ``py_lookup`` is Python's handler, for the names not published; ``reply_entry`` libfuse's
 * fuse_reply_entry; ``known`` the pusher's table (or NULL); every entry shows ``uid``,
 * ``gid`` and ``blksize``, and is kept ``timeout`` seconds. At most ``max_entries`` entries
 * are held. 0, or -ENOMEM. Call once, before requests come. */
int hot_serve_lookups(struct ctx *c, void *py_lookup, void *reply_entry, uint8_t *known,
                      uint32_t uid, uint32_t gid, int64_t blksize, double timeout,
                      uint64_t max_entries) {
    c->entries = entries_new(c->n_ino, max_entries);
    if (c->entries == NULL)
        return -ENOMEM;
    c->py_lookup = (lookup_fn)py_lookup;
    c->reply_entry = (reply_entry_fn)reply_entry;
    c->known = known;
    c->uid = uid;
    c->gid = gid;
    c->blksize = blksize;
    c->timeout = timeout;
    return 0;
}

/* Publish folder ``parent``'s entries (see entries_add_folder): how many were added, 0
 * when it was published already, or a negative errno (-ENOSPC: past the bound). */
int64_t hot_publish_folder(struct ctx *c, uint64_t parent, uint64_t count, const char *names,
                           const int64_t *name_ends, const uint64_t *inos,
                           const int64_t *sizes, const int64_t *mtimes,
                           const uint32_t *modes) {
    if (c->entries == NULL)
        return -EINVAL;
    return entries_add_folder(c->entries, parent, count, names, name_ends, inos, sizes,
                              mtimes, modes);
}

/* Count the kernel's lookups of each inode from now on (call before requests come):
 * ``counts`` (one uint32 per inode) and ``known`` are the pusher's, shared. */
void hot_track_inodes(struct ctx *c, uint32_t *counts, uint8_t *known) {
    c->lookup_counts = counts;
    c->known = known;
}

/* The kernel was given (``delta`` 1) or did not get (-1) one entry of each of ``inos``, by
 * a reply of Python's (count_lookups). */
void hot_count_lookups(struct ctx *c, const uint64_t *inos, uint64_t n, int64_t delta) {
    for (uint64_t i = 0; i < n; i++)
        count_lookups(c, inos[i], delta, 0);
}

/* Whether folder ``parent`` is published. */
int hot_folder_published(struct ctx *c, uint64_t parent) {
    return c->entries != NULL && entries_has_folder(c->entries, parent);
}

/* The state of one mount; NULL when out of memory. ``fns``: reply_err, reply_buf,
 * reply_none, fuse_req_userdata, then the Python read, ioctl and opened handlers. */
struct ctx *hot_new(void **fns, uint64_t hint_ino, unsigned hint_cmd, uint64_t n_ino,
                    uint8_t *in_kernel, const uint8_t *watched, uint8_t *delivered) {
    struct ctx *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    /* untouched pages of a large table cost no memory (calloc maps zero pages) */
    c->slots = calloc(n_ino, sizeof *c->slots);
    if (c->slots == NULL) {
        free(c);
        return NULL;
    }
    c->reply_err = (reply_err_fn)fns[0];
    c->reply_buf = (reply_buf_fn)fns[1];
    c->reply_none = (reply_none_fn)fns[2];
    req_userdata = (userdata_fn)fns[3];
    c->py_read = (read_fn)fns[4];
    c->py_ioctl = (ioctl_fn)fns[5];
    c->py_opened = (opened_fn)fns[6];
    c->hint_ino = hint_ino;
    c->hint_cmd = hint_cmd;
    c->n_ino = n_ino;
    c->in_kernel = in_kernel;
    c->watched = watched;
    c->delivered = delivered;
    for (unsigned i = 0; i < MAX_BLOCKS; i++)
        c->blocks[i].fd = c->blocks[i].direct_fd = -1;
    c->max_blocks = MAX_BLOCKS;
    c->direct_reads = 1;
    c->opened_fd = -1;
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->inode_lock, NULL);
    pthread_cond_init(&c->miss_ready, NULL);
    return c;
}

/* Start ``count`` disk readers for the READs whose pages are not in memory; returns how
 * many started (0: such READs go to Python, as before). Call once, before requests come. */
unsigned hot_start_disk_readers(struct ctx *c, unsigned count) {
    c->disk_threads = calloc(count ? count : 1, sizeof *c->disk_threads);
    if (c->disk_threads == NULL)
        return 0;
    unsigned started = 0;
    for (; started < count; started++)
        if (pthread_create(&c->disk_threads[started], NULL, disk_reader, c) != 0)
            break;
    pthread_mutex_lock(&c->lock);
    c->disk_count = started;
    pthread_mutex_unlock(&c->lock);
    return started;
}

/* Publish at most ``count`` blocks at once (1 .. MAX_BLOCKS): what the process's descriptor
 * limit leaves for them. Call before the first hot_publish. */
void hot_limit_blocks(struct ctx *c, unsigned count) {
    pthread_mutex_lock(&c->lock);
    c->max_blocks = count < 1 ? 1 : count > MAX_BLOCKS ? MAX_BLOCKS : count;
    c->next_block %= c->max_blocks;
    pthread_mutex_unlock(&c->lock);
}

/* Whether the disk readers read block files with O_DIRECT (1, the default) or through the
 * page cache (0: SHARDFS_DIRECT_READS=0). Call before requests come. */
void hot_direct_reads(struct ctx *c, int on) {
    pthread_mutex_lock(&c->lock);
    c->direct_reads = on != 0;
    pthread_mutex_unlock(&c->lock);
}

/* Stop the disk readers once they have answered every READ queued. */
static void stop_disk_readers(struct ctx *c) {
    pthread_mutex_lock(&c->lock);
    unsigned count = c->disk_count;
    c->disk_stop = 1;
    pthread_cond_broadcast(&c->miss_ready);
    pthread_mutex_unlock(&c->lock);
    for (unsigned i = 0; i < count; i++)
        pthread_join(c->disk_threads[i], NULL);
    free(c->disk_threads);
    c->disk_threads = NULL;
}

/* Queue the opens the ioctl handler sees, telling eventfd ``fd`` (-1: call Python at once,
 * as before). */
void hot_queue_opened(struct ctx *c, int fd) {
    pthread_mutex_lock(&c->lock);
    c->opened_fd = fd;
    pthread_mutex_unlock(&c->lock);
}

/* Move up to ``max`` queued inodes into ``out``, oldest first; returns how many. */
unsigned hot_take_opened(struct ctx *c, uint64_t *out, unsigned max) {
    pthread_mutex_lock(&c->lock);
    unsigned n = c->opened_count < max ? c->opened_count : max;
    memcpy(out, c->opened, n * sizeof *out);
    memmove(c->opened, c->opened + n, (c->opened_count - n) * sizeof *out);
    c->opened_count -= n;
    pthread_mutex_unlock(&c->lock);
    return n;
}

/* Put a block and its files into slot after slot (under the lock; the oldest block there
 * dropped): file i is inode inos[i], at byte pos[i] of the block's data, sizes[i] long; ones
 * outside the data are left out. Takes ``sums`` and ``kept`` (room for ``count`` inodes). */
static unsigned install_locked(struct ctx *c, int fd, const unsigned char *mem,
                               int64_t data_pos, int64_t data_len, int64_t chunk,
                               uint64_t *sums, uint64_t *kept, uint64_t count,
                               const uint64_t *inos, const int64_t *pos,
                               const int64_t *sizes) {
    unsigned index = c->next_block;
    c->next_block = (index + 1) % c->max_blocks;
    drop_block_locked(c, index);
    struct block *b = &c->blocks[index];
    b->fd = fd;
    b->direct_fd = -1;
    b->mem = mem;
    b->generation++;
    b->data_pos = data_pos;
    b->data_len = data_len;
    b->chunk = chunk;
    b->sums = sums;
    b->inos = kept;
    b->count = 0;
    for (uint64_t i = 0; i < count; i++) {
        if (inos[i] >= c->n_ino || pos[i] < 0 || sizes[i] < 0 || pos[i] + sizes[i] > data_len)
            continue;
        struct slot *s = &c->slots[inos[i]];
        s->block = (int32_t)index + 1;
        s->generation = b->generation;
        s->pos = pos[i];
        s->size = sizes[i];
        kept[b->count++] = inos[i];
    }
    b->used = 0;
    return index;
}

/* Publish the files of one block file: ``data_len`` bytes of data at ``data_pos`` in the
 * file, cut into chunks of ``chunk`` bytes whose xxh3 sums (``sums_le``, ``sums_len`` bytes:
 * one little-endian 64-bit word per chunk) the caller read from the file's header and
 * verified. Every READ answered here checks the chunks it serves against them, as Python's
 * reads do. File i is inode inos[i], at byte pos[i] of the data, sizes[i] long. The
 * descriptor is this module's from now on, even on an error. Returns the block's slot (what
 * hot_sweep reports), with its generation in *generation (for hot_publish_edge), or a
 * negative errno. */
int hot_publish(struct ctx *c, int own, int64_t data_pos, int64_t data_len, int64_t chunk,
                const unsigned char *sums_le, uint64_t sums_len, uint64_t count,
                const uint64_t *inos, const int64_t *pos, const int64_t *sizes,
                int32_t *generation) {
    uint64_t chunks = 0;
    if (chunk > 0 && data_len >= 0)
        chunks = (uint64_t)((data_len + chunk - 1) / chunk);
    if (chunk <= 0 || data_len < 0 || sums_le == NULL || sums_len != 8 * chunks) {
        close(own);
        return -EINVAL;
    }
    uint64_t *kept = malloc((count ? count : 1) * sizeof *kept);
    uint64_t *sums = malloc((chunks ? chunks : 1) * sizeof *sums);
    if (kept == NULL || sums == NULL) {
        free(kept);
        free(sums);
        close(own);
        return -ENOMEM;
    }
    for (uint64_t i = 0; i < chunks; i++) {
        uint64_t word = 0;
        for (int byte = 7; byte >= 0; byte--)
            word = word << 8 | sums_le[8 * i + (uint64_t)byte];
        sums[i] = word;
    }
    pthread_mutex_lock(&c->lock);
    unsigned index = install_locked(c, own, NULL, data_pos, data_len, chunk, sums, kept,
                                    count, inos, pos, sizes);
    c->counters.published += c->blocks[index].count;
    *generation = c->blocks[index].generation;
    pthread_mutex_unlock(&c->lock);
    return (int)index;
}

/* Publish the files of a block held in memory (fetched, its files not yet stored into the
 * kernel): their READs are answered from ``data`` itself, with no copy and no sums. The
 * caller keeps ``data`` alive and unchanged until hot_drop of this block (or hot_clear,
 * hot_free) has returned. Files as for hot_publish. Returns the block's slot, with its
 * generation in *generation (for hot_drop), or a negative errno. */
int hot_publish_memory(struct ctx *c, const unsigned char *data, int64_t data_len,
                       uint64_t count, const uint64_t *inos, const int64_t *pos,
                       const int64_t *sizes, int32_t *generation) {
    if (data == NULL || data_len <= 0)
        return -EINVAL;
    uint64_t *kept = malloc((count ? count : 1) * sizeof *kept);
    if (kept == NULL)
        return -ENOMEM;
    pthread_mutex_lock(&c->lock);
    unsigned index = install_locked(c, -1, data, 0, data_len, 1, NULL, kept, count, inos,
                                    pos, sizes);
    *generation = c->blocks[index].generation;
    pthread_mutex_unlock(&c->lock);
    return (int)index;
}

/* Publish a file lying across two published blocks: its first ``head`` bytes end the data
 * of the block in ``slot0``, from byte ``pos``; its other ``size - head`` bytes begin the
 * data of the block in ``slot1``. Each slot must still hold the block it was given as (the
 * generation hot_publish or hot_publish_memory returned); the file is left to Python
 * again once either is dropped or replaced. Returns 0, -ESTALE when a block is no longer
 * there, or -EINVAL. */
int hot_publish_edge(struct ctx *c, uint64_t ino, int64_t size, unsigned slot0,
                     int32_t generation0, int64_t pos, int64_t head, unsigned slot1,
                     int32_t generation1) {
    if (ino >= c->n_ino || pos < 0 || head <= 0 || size <= head || slot0 >= MAX_BLOCKS ||
        slot1 >= MAX_BLOCKS || slot0 == slot1)
        return -EINVAL;
    pthread_mutex_lock(&c->lock);
    const struct block *b0 = &c->blocks[slot0], *b1 = &c->blocks[slot1];
    int result = 0;
    if (!in_use(b0) || !in_use(b1) || b0->generation != generation0 ||
        b1->generation != generation1)
        result = -ESTALE;
    else if (pos + head != b0->data_len || size - head > b1->data_len)
        result = -EINVAL;
    if (result == 0) {
        unsigned index = c->next_edge;
        c->next_edge = (index + 1) % MAX_EDGES;
        struct edge *e = &c->edges[index];
        if (e->block[0] != 0 && c->slots[e->ino].block == -(int32_t)index - 1)
            c->slots[e->ino].block = 0; /* the file it held goes back to Python */
        *e = (struct edge){ino, {(int32_t)slot0 + 1, (int32_t)slot1 + 1},
                           {generation0, generation1}, pos, head, size};
        c->slots[ino] = (struct slot){-(int32_t)index - 1, 0, pos, size};
    }
    pthread_mutex_unlock(&c->lock);
    return result;
}

/* Unpublish the block hot_publish_memory put in ``slot`` as ``generation``, unless it was
 * dropped or replaced since; once this returns, no READ reads its memory. */
void hot_drop(struct ctx *c, unsigned slot, int32_t generation) {
    pthread_mutex_lock(&c->lock);
    if (slot < MAX_BLOCKS && c->blocks[slot].generation == generation)
        drop_block_locked(c, slot);
    pthread_mutex_unlock(&c->lock);
}

/* Whether inode ``ino`` is published now. */
int hot_published(struct ctx *c, uint64_t ino) {
    pthread_mutex_lock(&c->lock);
    int found = ino < c->n_ino && (c->slots[ino].block > 0 || edge_of_locked(c, ino) != NULL);
    pthread_mutex_unlock(&c->lock);
    return found;
}

/* Drop the published blocks the cache has removed since (evicted, cleared, or by another
 * mount): their disk space is freed once no descriptor holds them. ``used`` (MAX_BLOCKS
 * bytes) gets 1 for each slot whose block answered a READ since the last sweep, so that
 * the cache sees those reads too. Returns how many blocks were dropped. */
unsigned hot_sweep(struct ctx *c, uint8_t *used) {
    unsigned dropped = 0;
    pthread_mutex_lock(&c->lock);
    for (unsigned i = 0; i < MAX_BLOCKS; i++) {
        struct stat st;
        used[i] = (uint8_t)(in_use(&c->blocks[i]) && c->blocks[i].used);
        c->blocks[i].used = 0;
        if (c->blocks[i].fd >= 0 && (fstat(c->blocks[i].fd, &st) != 0 || st.st_nlink == 0)) {
            drop_block_locked(c, i);
            dropped++;
        }
    }
    c->counters.dropped_blocks += dropped;
    pthread_mutex_unlock(&c->lock);
    return dropped;
}

/* Unpublish everything (the files stay correct; this frees their descriptors). */
void hot_clear(struct ctx *c) {
    pthread_mutex_lock(&c->lock);
    for (unsigned i = 0; i < MAX_BLOCKS; i++)
        drop_block_locked(c, i);
    pthread_mutex_unlock(&c->lock);
}

void hot_counters(struct ctx *c, struct hot_counters *out) {
    pthread_mutex_lock(&c->lock);
    *out = c->counters;
    pthread_mutex_unlock(&c->lock);
}

/* Free a mount's state: call only once its session no longer answers requests. */
void hot_free(struct ctx *c) {
    if (c == NULL)
        return;
    stop_disk_readers(c);
    hot_clear(c);
    pthread_cond_destroy(&c->miss_ready);
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->inode_lock);
    free(c->buffer);
    free(c->joined);
    free(c->slots);
    entries_free(c->entries);
    free(c);
}

/* -- kernel pushes of a block's files (pushes.py), without the interpreter ------------- */

struct push_buf { /* libfuse's struct fuse_buf and fuse_bufvec of one buffer */
    size_t size;
    int flags;
    void *mem;
    int fd;
    int64_t pos;
};
struct push_vec {
    size_t count, idx, off;
    struct push_buf buf[1];
};
typedef int (*notify_store_fn)(void *, uint64_t, int64_t, struct push_vec *, int);

/* Store ``count`` files into the kernel's page cache with FUSE_NOTIFY_STORE: file i is inode
 * inos[i], sizes[i] bytes at base + pos[i] (-EINVAL if not within the ``len`` there, or
 * if the inode is not below ``n_ino``). The pusher's tables, one byte per inode: in_kernel (set here on success; a file already
 * set is skipped) and known (the kernel was given the inode; else the file is marked in
 * ``waiting`` and skipped, unless ``known`` turned 1 meanwhile). results[i]: 0 pushed,
 * 1 already in the kernel, 2 left waiting, or libfuse's negative errno. Returns the bytes
 * pushed. Call from the pusher's thread only. */
int64_t hot_push(void *notify, void *session, const unsigned char *base, int64_t len,
                 uint64_t count, const uint64_t *inos, const int64_t *pos, const int64_t *sizes,
                 uint64_t n_ino, uint8_t *in_kernel, uint8_t *known, uint8_t *waiting,
                 int32_t *results) {
    notify_store_fn store = (notify_store_fn)notify;
    struct push_vec vec = {1, 0, 0, {{0, 0, NULL, -1, 0}}};
    int64_t pushed = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t ino = inos[i];
        if (ino >= n_ino || pos[i] < 0 || sizes[i] < 0 || pos[i] + sizes[i] > len) {
            results[i] = -EINVAL;
            continue;
        }
        if (__atomic_load_n(&in_kernel[ino], __ATOMIC_SEQ_CST)) {
            results[i] = 1;
            continue;
        }
        if (!__atomic_load_n(&known[ino], __ATOMIC_SEQ_CST)) {
            /* the session thread sets known, then looks at waiting: one of us sees the
             * other's mark (at worst the file is read through a READ, never lost) */
            __atomic_store_n(&waiting[ino], 1, __ATOMIC_SEQ_CST);
            if (!__atomic_load_n(&known[ino], __ATOMIC_SEQ_CST)) {
                results[i] = 2;
                continue;
            }
            __atomic_store_n(&waiting[ino], 0, __ATOMIC_SEQ_CST);
        }
        vec.buf[0].size = (size_t)sizes[i];
        vec.buf[0].mem = (void *)(base + pos[i]);
        vec.idx = vec.off = 0;
        results[i] = store(session, ino, 0, &vec, 0);
        if (results[i] == 0) {
            __atomic_store_n(&in_kernel[ino], 1, __ATOMIC_SEQ_CST);
            pushed += sizes[i];
        }
    }
    return pushed;
}

/* An importable module, so that pip builds it and Python finds its file. */
static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "_hot",
    "The compiled FUSE hot path; its functions are called through ctypes (hot_path.py).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hot(void) {
    if (shardfs_has_avx2())
        chunk_sum = shardfs_xxh3_avx2;
    return PyModule_Create(&hot_module);
}
