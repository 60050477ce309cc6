/* The plain build of xxh3 (see _xxh3.h), and which build this CPU runs. */
#include "_xxh3.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t shardfs_xxh3_plain(const void *data, size_t len) { return XXH3_64bits(data, len); }

int shardfs_has_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
#else
    return 0;
#endif
}
