/* Folder entries published by Python, looked up by (folder inode, name) without the
 * interpreter.
 *
 * After ``echo 3 > drop_caches``, or once the kernel has let go of a dentry, every open of
 * a file begins with a LOOKUP of its name. Answered in Python, through ctypes and the view's
 * SQLite index, that cost about 17 us of user CPU per file here: about as much as the rest
 * of a cold file. Python publishes a whole folder at once (the listing it packs for a
 * READDIR, or after its first LOOKUP there), and C answers later LOOKUPs in it from this
 * table. A name not found is still Python's (negative entries, the mount's own files).
 *
 * Layout: the entries in one array, their names in one byte arena, an open-addressed
 * table of entry numbers keyed by a hash of (folder, name), kept at most half full, and a
 * bit per folder inode that was published. Lookups share a read lock; a publish takes the
 * write lock once per folder. An entry costs about 48 bytes, its name, and 8 bytes of table.
 */
#include "_entries.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

struct stored {
    uint64_t parent;
    uint64_t name_at; /* offset into names */
    struct entry_attr attr;
    uint32_t name_len;
};

struct entries {
    pthread_rwlock_t lock;
    uint64_t n_ino;
    uint64_t max_entries;
    struct stored *list;
    uint64_t count, cap;
    char *names;
    uint64_t names_len, names_cap;
    uint32_t *table; /* entry number + 1; 0: free */
    uint64_t table_size; /* a power of two */
    uint8_t *folders; /* one bit per folder inode: published */
};

static uint64_t key_hash(uint64_t parent, const char *name, size_t len) {
    uint64_t h = 0xcbf29ce484222325ull ^ (parent * 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

struct entries *entries_new(uint64_t n_ino, uint64_t max_entries) {
    struct entries *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->folders = calloc(n_ino / 8 + 1, 1);
    if (t->folders == NULL) {
        free(t);
        return NULL;
    }
    t->n_ino = n_ino;
    t->max_entries = max_entries < UINT32_MAX / 2 ? max_entries : UINT32_MAX / 2;
    pthread_rwlock_init(&t->lock, NULL);
    return t;
}

void entries_free(struct entries *t) {
    if (t == NULL)
        return;
    pthread_rwlock_destroy(&t->lock);
    free(t->list);
    free(t->names);
    free(t->table);
    free(t->folders);
    free(t);
}

static void place(struct entries *t, uint32_t number) {
    const struct stored *e = &t->list[number];
    uint64_t mask = t->table_size - 1;
    uint64_t i = key_hash(e->parent, t->names + e->name_at, e->name_len) & mask;
    while (t->table[i])
        i = (i + 1) & mask;
    t->table[i] = number + 1;
}

/* Room for ``more`` entries and ``bytes`` of names (under the write lock). */
static int reserve(struct entries *t, uint64_t more, uint64_t bytes) {
    if (t->count + more > t->cap) {
        uint64_t cap = t->cap ? t->cap : 1024;
        while (cap < t->count + more)
            cap *= 2;
        struct stored *list = realloc(t->list, cap * sizeof *list);
        if (list == NULL)
            return -ENOMEM;
        t->list = list;
        t->cap = cap;
    }
    if (t->names_len + bytes > t->names_cap) {
        uint64_t cap = t->names_cap ? t->names_cap : 16384;
        while (cap < t->names_len + bytes)
            cap *= 2;
        char *names = realloc(t->names, cap);
        if (names == NULL)
            return -ENOMEM;
        t->names = names;
        t->names_cap = cap;
    }
    if (2 * (t->count + more) > t->table_size) {
        uint64_t size = t->table_size ? t->table_size : 4096;
        while (size < 2 * (t->count + more))
            size *= 2;
        uint32_t *table = calloc(size, sizeof *table);
        if (table == NULL)
            return -ENOMEM;
        free(t->table);
        t->table = table;
        t->table_size = size;
        for (uint64_t n = 0; n < t->count; n++)
            place(t, (uint32_t)n);
    }
    return 0;
}

int64_t entries_add_folder(struct entries *t, uint64_t parent, uint64_t count,
                           const char *names, const int64_t *name_ends, const uint64_t *inos,
                           const int64_t *sizes, const int64_t *mtimes, const uint32_t *modes) {
    if (parent >= t->n_ino)
        return -EINVAL;
    int64_t bytes = count ? name_ends[count - 1] : 0;
    for (uint64_t i = 0; i < count; i++) {
        int64_t from = i ? name_ends[i - 1] : 0;
        if (name_ends[i] < from || name_ends[i] > bytes)
            return -EINVAL;
    }
    pthread_rwlock_wrlock(&t->lock);
    int64_t result;
    if (t->folders[parent / 8] & (1u << (parent % 8))) {
        result = 0;
    } else if (t->count + count > t->max_entries) {
        result = -ENOSPC;
    } else if ((result = reserve(t, count, (uint64_t)bytes)) == 0) {
        memcpy(t->names + t->names_len, names, (size_t)bytes);
        for (uint64_t i = 0; i < count; i++) {
            int64_t from = i ? name_ends[i - 1] : 0;
            struct stored *e = &t->list[t->count];
            e->parent = parent;
            e->name_at = t->names_len + (uint64_t)from;
            e->name_len = (uint32_t)(name_ends[i] - from);
            e->attr.ino = inos[i];
            e->attr.size = sizes[i];
            e->attr.mtime = mtimes[i];
            e->attr.mode = modes[i];
            place(t, (uint32_t)t->count);
            t->count++;
        }
        t->names_len += (uint64_t)bytes;
        t->folders[parent / 8] |= (uint8_t)(1u << (parent % 8));
        result = (int64_t)count;
    }
    pthread_rwlock_unlock(&t->lock);
    return result;
}

int entries_has_folder(struct entries *t, uint64_t parent) {
    if (parent >= t->n_ino)
        return 0;
    pthread_rwlock_rdlock(&t->lock);
    int found = (t->folders[parent / 8] >> (parent % 8)) & 1;
    pthread_rwlock_unlock(&t->lock);
    return found;
}

int entries_find(struct entries *t, uint64_t parent, const char *name, size_t len,
                 struct entry_attr *out) {
    int found = 0;
    pthread_rwlock_rdlock(&t->lock);
    if (t->table_size) {
        uint64_t mask = t->table_size - 1;
        for (uint64_t i = key_hash(parent, name, len) & mask; t->table[i]; i = (i + 1) & mask) {
            const struct stored *e = &t->list[t->table[i] - 1];
            if (e->parent == parent && e->name_len == len &&
                memcmp(t->names + e->name_at, name, len) == 0) {
                *out = e->attr;
                found = 1;
                break;
            }
        }
    }
    pthread_rwlock_unlock(&t->lock);
    return found;
}

uint64_t entries_count(struct entries *t) {
    pthread_rwlock_rdlock(&t->lock);
    uint64_t count = t->count;
    pthread_rwlock_unlock(&t->lock);
    return count;
}
