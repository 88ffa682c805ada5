/* Copies of a push's boxes, and their CRC32s, at memory speed (`tandem.kernels.copy`).
 *
 * A box is `rows` rows of `row_bytes` bytes, each row contiguous, rows `stride` bytes apart
 * (a slice of a larger array), on either side. Bytes are taken in C order:
 *
 * - `crc_copy`: the CRC32 of each piece (`PIECE` bytes) as read from the source, then the
 *   piece copied from L1 to the destination: the source is read from memory once, and its
 *   checksum costs a pass over cache instead of a pass over memory. The checksum never reads
 *   the destination. On the bench host 2 KiB pieces ran at or above a plain streaming copy's
 *   speed on one core, 4 KiB pieces 20% slower (median of 6 interleaved runs over 272 MiB).
 * - `copy`: a copy alone.
 * - `crc`: the CRC32 of the bytes, a page (4 KiB) per call.
 *
 * With `stream`, a copy stores past the cache (non-temporal stores: no read for ownership,
 * and megabytes of weights do not evict what is in cache), for bytes no one reads soon;
 * without, through it (memcpy), for bytes read next. The CRC32 itself is ISA-L's
 * (`crc32_gzip_refl`, zlib's CRC32), passed in by pointer from the `isal` package, which
 * links it.
 */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, uint64_t);

#define PAGE 4096
#define PIECE 2048

/* n bytes from src to dst; `stream`: past the cache where the CPU can (x86: 16-byte
 * streaming stores, as fast as 64-byte ones on the bench host: 12.8 against 12.2 GiB/s). */
static void put(unsigned char *dst, const unsigned char *src, int64_t n, int stream) {
#if defined(__x86_64__)
  if (stream) {
    int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head > n) head = n;
    memcpy(dst, src, (size_t)head);
    int64_t i = head;
    for (; i + 16 <= n; i += 16)
      _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
    memcpy(dst + i, src + i, (size_t)(n - i));
    return;
  }
#endif
  (void)stream;
  memcpy(dst, src, (size_t)n);
}

static void fence(int stream) {
#if defined(__x86_64__)
  if (stream) _mm_sfence(); /* streamed stores are weakly ordered: done before we return */
#endif
  (void)stream;
}

uint32_t crc_copy(unsigned char *dst, int64_t dst_stride, const unsigned char *src,
                  int64_t src_stride, int64_t rows, int64_t row_bytes, crc_fn crc,
                  uint32_t value, int stream) {
  for (int64_t r = 0; r < rows; r++) {
    const unsigned char *s = src + r * src_stride;
    unsigned char *d = dst + r * dst_stride;
    for (int64_t at = 0; at < row_bytes; at += PIECE) {
      int64_t n = row_bytes - at < PIECE ? row_bytes - at : PIECE;
      value = crc(value, s + at, (uint64_t)n);
      put(d + at, s + at, n, stream);
    }
  }
  fence(stream);
  return value;
}

void copy(unsigned char *dst, int64_t dst_stride, const unsigned char *src, int64_t src_stride,
          int64_t rows, int64_t row_bytes, int stream) {
  for (int64_t r = 0; r < rows; r++)
    put(dst + r * dst_stride, src + r * src_stride, row_bytes, stream);
  fence(stream);
}

uint32_t crc(const unsigned char *src, int64_t src_stride, int64_t rows, int64_t row_bytes,
             crc_fn fn, uint32_t value) {
  for (int64_t r = 0; r < rows; r++) {
    const unsigned char *s = src + r * src_stride;
    for (int64_t at = 0; at < row_bytes; at += PAGE) {
      int64_t n = row_bytes - at < PAGE ? row_bytes - at : PAGE;
      value = fn(value, s + at, (uint64_t)n);
    }
  }
  return value;
}
