/* Folder entries published by Python, so that a LOOKUP of one is answered in C (_hot.c's
 * hot_lookup). See _entries.c. */
#ifndef SHARDFS_ENTRIES_H
#define SHARDFS_ENTRIES_H

#include <pthread.h>
#include <stdint.h>

/* What a LOOKUP's reply needs of one entry (the rest is the mount's: owner, I/O size). */
struct entry_attr {
    uint64_t ino;
    int64_t size;
    int64_t mtime;
    uint32_t mode;
};

struct entries;

/* An empty table for folders of inodes below ``n_ino``, holding at most ``max_entries``
 * entries; NULL when out of memory. */
struct entries *entries_new(uint64_t n_ino, uint64_t max_entries);
void entries_free(struct entries *t);

/* Add the ``count`` entries of folder ``parent``: entry i is named by bytes
 * ``names[name_ends[i - 1] .. name_ends[i])`` (from 0 for the first). Returns how many were
 * added: 0 when the folder was published already, -ENOSPC when they would pass the table's
 * bound (nothing added), -EINVAL for a folder out of range, -ENOMEM. */
int64_t entries_add_folder(struct entries *t, uint64_t parent, uint64_t count,
                           const char *names, const int64_t *name_ends, const uint64_t *inos,
                           const int64_t *sizes, const int64_t *mtimes, const uint32_t *modes);

/* Whether folder ``parent`` was published. */
int entries_has_folder(struct entries *t, uint64_t parent);

/* The entry ``name`` (``len`` bytes) of folder ``parent`` into *out; 0 when not published. */
int entries_find(struct entries *t, uint64_t parent, const char *name, size_t len,
                 struct entry_attr *out);

/* Entries held. */
uint64_t entries_count(struct entries *t);

#endif
