/* xxh3-64 (seed 0) of a chunk, the checksum the block format keeps for every chunk of a
 * block file (cache/block_format.py): _sums.c computes them for a block's header, and the
 * FUSE hot path (fuse/_hot.c) checks the bytes it serves against them. From libxxhash's
 * header (libxxhash-dev), inlined, in two builds: SSE2 (any x86-64) and AVX2, picked once
 * at load time; the same sums as Python's xxhash. */
#ifndef SHARDFS_XXH3_H
#define SHARDFS_XXH3_H

#include <stddef.h>
#include <stdint.h>

uint64_t shardfs_xxh3_plain(const void *data, size_t len);
uint64_t shardfs_xxh3_avx2(const void *data, size_t len); /* the plain build off x86-64 GCC */
int shardfs_has_avx2(void);

#endif
