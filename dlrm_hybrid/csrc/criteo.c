/* Criteo TSV preprocessing kernels for dlrm_hybrid/data/criteo/native.py (through ctypes): the
 * line parser, the value -> id lookup and the key counter. One thread each; the caller runs one
 * per worker process. Results equal the numpy code's (data/criteo/parse.py, criteo_tsv.map_ids,
 * np.unique), which the tests check.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { NUM_NUMERICAL = 13, NUM_CATEGORICAL = 26, NUM_FIELDS = 40, MAX_DIGITS = 18 };
enum { WRONG_FIELD_COUNT, BAD_LABEL, BAD_NUMERIC, BAD_CATEGORY };
enum { BLANK_LINE = 5, LUT_SIZE = 1 << 16 };

#define ONES 0x0101010101010101ULL
#define HIGH 0x8080808080808080ULL
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define EMPTY_KEY UINT64_MAX

/* ---- parser ------------------------------------------------------------------------------ */

/* Bit i set where block[i] is a tab or newline: the separators of 64 bytes in a few vector
 * compares, then taken one by one with ctz (the simdjson way), instead of a branch per byte. */
static uint64_t separator_bits(const uint8_t *block, int64_t n) {
  uint64_t bits = 0;
#if defined(__SSE2__)
  if (n == 64) {
    const __m128i tab = _mm_set1_epi8('\t'), newline = _mm_set1_epi8('\n');
    for (int k = 0; k < 4; ++k) {
      __m128i v = _mm_loadu_si128((const __m128i *)(block + 16 * k));
      __m128i hit = _mm_or_si128(_mm_cmpeq_epi8(v, tab), _mm_cmpeq_epi8(v, newline));
      bits |= (uint64_t)(uint16_t)_mm_movemask_epi8(hit) << (16 * k);
    }
    return bits;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    bits |= (uint64_t)(block[i] == '\t' || block[i] == '\n') << i;
  return bits;
}

typedef struct {
  const uint8_t *data;
  int64_t size, base;  /* bits: separators of data[base .. base + 64) not yet taken */
  uint64_t bits;
} Scanner;

static inline int64_t next_separator(Scanner *s) {
  while (!s->bits) {
    s->base += 64;
    int64_t n = s->size - s->base < 64 ? s->size - s->base : 64;
    s->bits = separator_bits(s->data + s->base, n);
  }
  int64_t at = s->base + __builtin_ctzll(s->bits);
  s->bits &= s->bits - 1;
  return at;
}

/* I1..I13: 1 and the value (negatives 0, -1 where empty), or 0 where not an integer of at most
 * 18 characters. As parse.py: a '-' first counts as a sign only in a field longer than 1. */
static inline int parse_integer(const uint8_t *p, int64_t length, int64_t *value) {
  if (length == 0) { *value = -1; return 1; }
  if (length > MAX_DIGITS) return 0;
  int negative = length > 1 && p[0] == '-';
  uint64_t v = 0;
  for (int64_t i = negative; i < length; ++i) {
    unsigned digit = (unsigned)p[i] - '0';
    if (digit > 9) return 0;
    v = v * 10 + digit;
  }
  *value = negative ? 0 : (int64_t)v;
  return 1;
}

/* C1..C26: 1 and the value (-1 where empty), or 0 where not empty or 8 hex digits. The 8 bytes
 * checked and decoded at once (SWAR), as parse.py's _parse_hex does across rows. */
static inline int parse_hex(const uint8_t *p, int64_t length, int64_t *value) {
  if (length == 0) { *value = -1; return 1; }
  if (length != 8) return 0;
  uint64_t w;
  memcpy(&w, p, 8); /* first character in the lowest byte (little-endian) */
  if (w & HIGH) return 0;
  /* per byte below 0x80: x + (0x80 - lo) has its top bit set iff x >= lo, with no carry out */
  uint64_t digit = (w + ONES * (0x80 - '0')) & ~(w + ONES * (0x7F - '9'));
  uint64_t lower = w | ONES * 0x20;
  uint64_t letter = (lower + ONES * (0x80 - 'a')) & ~(lower + ONES * (0x7F - 'f'));
  if (((digit | letter) & HIGH) != HIGH) return 0;
  uint64_t x = __builtin_bswap64((w & (ONES * 0x0F)) + ((w >> 6) & ONES) * 9);
  x = (x | (x >> 4)) & 0x00FF00FF00FF00FFULL;
  x = (x | (x >> 8)) & 0x0000FFFF0000FFFFULL;
  x = (x | (x >> 16)) & 0x00000000FFFFFFFFULL;
  *value = (int64_t)x;
  return 1;
}

/* Parse `size` bytes of lines, each ending in '\n' (the last one too), as parse.py's
 * parse_lines. Per line: skipped (-1 kept, else the kind) and crlf; per kept row: label, dense
 * (float16 bits: lut[x] for x < LUT_SIZE, 0 where empty; larger x are left to the caller as
 * (index into dense, x) pairs in big_at/big_value, up to big_capacity) and cats; short: the field
 * counts of the rows short only by trailing fields that parse. Returns the rows kept, or -1
 * when more than big_capacity integers were too large for the table (nothing else is wrong:
 * the caller retries with room for all). */
int64_t parse_lines(const uint8_t *data, int64_t size, int pad_short, const uint16_t *lut,
                    uint8_t *labels, uint16_t *dense, int64_t *cats, int8_t *skipped,
                    uint8_t *crlf, int64_t *short_counts, int64_t *n_short, int64_t *big_at,
                    int64_t *big_value, int64_t big_capacity, int64_t *n_big) {
  Scanner scan = {data, size, -64, 0};
  int64_t start = 0, line = 0, rows = 0, shorts = 0, bigs = 0;
  int64_t ends[NUM_FIELDS + 1];
  while (start < size) {
    int64_t count = 0, at;
    do {
      at = next_separator(&scan);
      if (count <= NUM_FIELDS) ends[count] = at;
      ++count;
    } while (data[at] != '\n');
    int cr = at > 0 && data[at - 1] == '\r';
    crlf[line] = (uint8_t)cr;
    if (count <= NUM_FIELDS) ends[count - 1] -= cr;
    int64_t last_start = count == 1 ? start : count <= NUM_FIELDS ? ends[count - 2] + 1 : 0;
    int last_empty = count <= NUM_FIELDS && ends[count - 1] == last_start;
    int8_t why = WRONG_FIELD_COUNT;
    if (count == 1 && last_empty) {
      why = BLANK_LINE;
    } else if (count == NUM_FIELDS || (count < NUM_FIELDS && !last_empty)) {
      int64_t bigs_before = bigs, x, begin[NUM_FIELDS], length[NUM_FIELDS];
      for (int j = 0; j < NUM_FIELDS; ++j) { /* empty past the line's fields */
        begin[j] = j == 0 ? start : j < count ? ends[j - 1] + 1 : at;
        length[j] = j < count ? ends[j] - begin[j] : 0;
      }
      why = -1;
      if (length[0] != 1 || (data[start] != '0' && data[start] != '1')) why = BAD_LABEL;
      for (int j = 0; j < NUM_NUMERICAL && why < 0; ++j) {
        if (!parse_integer(data + begin[1 + j], length[1 + j], &x)) {
          why = BAD_NUMERIC;
        } else if (x < LUT_SIZE) {
          dense[rows * NUM_NUMERICAL + j] = x < 0 ? 0 : lut[x];
        } else {
          if (bigs == big_capacity) return -1;
          dense[rows * NUM_NUMERICAL + j] = 0;
          big_at[bigs] = rows * NUM_NUMERICAL + j;
          big_value[bigs++] = x;
        }
      }
      for (int j = 0; j < NUM_CATEGORICAL && why < 0; ++j) {
        int field = 1 + NUM_NUMERICAL + j;
        if (!parse_hex(data + begin[field], length[field], &cats[rows * NUM_CATEGORICAL + j]))
          why = BAD_CATEGORY;
      }
      if (count < NUM_FIELDS) {
        if (why < 0) short_counts[shorts++] = count;
        if (why >= 0 || !pad_short) why = WRONG_FIELD_COUNT;
      }
      if (why < 0) labels[rows++] = data[start] - '0';
      else bigs = bigs_before;
    }
    skipped[line++] = why;
    start = at + 1;
  }
  *n_short = shorts;
  *n_big = bigs;
  return rows;
}

/* ---- value -> id lookup ------------------------------------------------------------------ */

/* A feature's table: 2^bits slots of 8 bytes, (id << 32 | value), 0 where empty (ids are >= 1),
 * linear probing from the top bits of value * GOLDEN. */
static inline uint64_t home(uint64_t key, int bits) { return (key * GOLDEN) >> (64 - bits); }

void id_insert(uint64_t *slots, int bits, const uint32_t *values, const uint32_t *ids,
               int64_t n) {
  uint64_t mask = (1ULL << bits) - 1;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t at = home(values[i], bits);
    while (slots[at] && (uint32_t)slots[at] != values[i]) at = (at + 1) & mask;
    if (!slots[at]) slots[at] = (uint64_t)ids[i] << 32 | values[i]; /* a repeat keeps the first */
  }
}

enum { MAP_BLOCK = 16 }; /* rows whose slots are prefetched before any is read */

/* out[r, f] = the id of cats[r, f] in feature f's table (slots + offset[f], 2^bits[f] slots), 0
 * for -1 and values not there. The home slots of MAP_BLOCK rows are prefetched first: most
 * lookups in the large tables miss the cache (tables of Criteo 1TB's size, 607 MiB: 396 ns a
 * row, 464 without the prefetch, on a loaded AMD EPYC core). */
void id_map(const uint64_t *slots, const int64_t *offset, const int32_t *bits,
            const int64_t *cats, int64_t n, uint32_t *out) {
  uint64_t at[MAP_BLOCK * NUM_CATEGORICAL];
  for (int64_t r0 = 0; r0 < n; r0 += MAP_BLOCK) {
    int64_t m = (n - r0 < MAP_BLOCK ? n - r0 : MAP_BLOCK) * NUM_CATEGORICAL;
    const int64_t *c = cats + r0 * NUM_CATEGORICAL;
    for (int64_t i = 0; i < m; ++i) {
      int f = (int)(i % NUM_CATEGORICAL);
      at[i] = home((uint64_t)c[i], bits[f]);
      __builtin_prefetch(slots + offset[f] + at[i]);
    }
    for (int64_t i = 0; i < m; ++i) {
      int f = (int)(i % NUM_CATEGORICAL);
      const uint64_t *table = slots + offset[f];
      uint64_t mask = (1ULL << bits[f]) - 1, key = (uint64_t)c[i], a = at[i];
      /* -1 (and any key of 2^32 or more) equals no 32-bit value: it ends on an empty slot */
      while (table[a] && (uint32_t)table[a] != key) a = (a + 1) & mask;
      out[r0 * NUM_CATEGORICAL + i] = (uint32_t)(table[a] >> 32);
    }
  }
}

/* ---- key counter ------------------------------------------------------------------------- */

/* `slots` pairs (key, count) of 16 bytes, EMPTY_KEY where empty; linear probing from
 * fastrange(key * GOLDEN, n_slots). */
static inline uint64_t spot(uint64_t key, int64_t n_slots) {
  return (uint64_t)(((unsigned __int128)(key * GOLDEN) * (uint64_t)n_slots) >> 64);
}

enum { COUNT_BLOCK = 16 };

/* Count the keys value << 5 | feature of [n, 26] cats (-1 skipped) into the table of `size`
 * keys. Returns the new size; -1, adding nothing, when size + the non-missing values exceeds
 * `capacity`; -2, adding nothing, when a value is outside [-1, 2^32). */
int64_t count_keys(uint64_t *slots, int64_t n_slots, int64_t size, int64_t capacity,
                   const int64_t *cats, int64_t n) {
  int64_t present = 0, m = n * NUM_CATEGORICAL;
  uint64_t outside = 0;
  for (int64_t i = 0; i < m; ++i) {
    present += cats[i] >= 0;
    outside |= (uint64_t)(cats[i] + 1) > (1ULL << 32);
  }
  if (outside) return -2;
  if (size + present > capacity) return -1;
  uint64_t key[COUNT_BLOCK * NUM_CATEGORICAL], at[COUNT_BLOCK * NUM_CATEGORICAL];
  for (int64_t r0 = 0; r0 < n; r0 += COUNT_BLOCK) {
    int64_t b = (n - r0 < COUNT_BLOCK ? n - r0 : COUNT_BLOCK) * NUM_CATEGORICAL;
    const int64_t *c = cats + r0 * NUM_CATEGORICAL;
    for (int64_t i = 0; i < b; ++i) {
      key[i] = (uint64_t)c[i] << 5 | (uint64_t)(i % NUM_CATEGORICAL);
      at[i] = spot(key[i], n_slots);
      __builtin_prefetch(slots + 2 * at[i], 1);
    }
    for (int64_t i = 0; i < b; ++i) {
      if (c[i] < 0) continue;
      uint64_t a = at[i];
      while (slots[2 * a] != key[i] && slots[2 * a] != EMPTY_KEY) a = a + 1 == (uint64_t)n_slots ? 0 : a + 1;
      if (slots[2 * a] == EMPTY_KEY) { slots[2 * a] = key[i]; slots[2 * a + 1] = 0; ++size; }
      ++slots[2 * a + 1];
    }
  }
  return size;
}

enum { RADIX_BITS = 11, RADIX = 1 << RADIX_BITS };

/* Move the table's keys and counts out (in key order) and empty it. LSD radix sort of the
 * (key, count) pairs, 11 bits a pass, passes only over the bits some key has: 2.1M keys in
 * 0.12 s where numpy's argsort + take of the pairs took 0.40 s (benchmarks/preprocess_stages.py;
 * np.sort of the keys alone cannot carry the counts). */
void drain_keys(uint64_t *slots, int64_t n_slots, uint64_t *keys, uint64_t *counts,
                uint64_t *spare_keys, uint64_t *spare_counts) {
  int64_t n = 0;
  uint64_t any = 0;
  for (int64_t i = 0; i < n_slots; ++i)
    if (slots[2 * i] != EMPTY_KEY) {
      keys[n] = slots[2 * i];
      counts[n++] = slots[2 * i + 1];
      any |= slots[2 * i];
    }
  memset(slots, 0xFF, (size_t)n_slots * 16);
  uint64_t *k = keys, *c = counts, *k2 = spare_keys, *c2 = spare_counts, *t;
  int64_t histogram[RADIX];
  for (int shift = 0; shift < 64 && (any >> shift); shift += RADIX_BITS) {
    memset(histogram, 0, sizeof histogram);
    for (int64_t i = 0; i < n; ++i) ++histogram[(k[i] >> shift) & (RADIX - 1)];
    int64_t total = 0;
    for (int d = 0; d < RADIX; ++d) { int64_t h = histogram[d]; histogram[d] = total; total += h; }
    for (int64_t i = 0; i < n; ++i) {
      int64_t to = histogram[(k[i] >> shift) & (RADIX - 1)]++;
      k2[to] = k[i];
      c2[to] = c[i];
    }
    t = k; k = k2; k2 = t;
    t = c; c = c2; c2 = t;
  }
  if (k != keys) { /* an odd number of passes: the result is in the spare arrays */
    memcpy(keys, k, (size_t)n * 8);
    memcpy(counts, c, (size_t)n * 8);
  }
}
