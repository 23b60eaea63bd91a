/* The id check and the SGD update of embedding rows on CPU, for dlrm_hybrid/parallel/
 * cpu_lookup.py (through ctypes).
 *
 * Layout, as in fbgemm's table batches: the tables, all `dim` wide, lie one after another in
 * `w`, table f (rows[f] rows) starting at row first_row[f]; bag (f, b) holds
 * ids[offsets[f * batch + b] .. offsets[f * batch + b + 1]); the pooled gradient is
 * [batch, features * dim] in rows of `stride` floats.
 */
#include <stdint.h>

#define PREFETCH_AHEAD 32
#define FLOATS_PER_LINE 16

/* The position of the first id outside its table, or -1. A branch-free pass over the ids first
 * (an id below 0 is a huge unsigned one): 0.1 ms a step here, where a per-table min/max in
 * torch took 0.8 ms. */
__attribute__((target_clones("avx512f", "avx2", "default")))
int64_t first_bad_id(const int64_t *ids, const int64_t *offsets, const int64_t *rows,
                     int64_t batch, int64_t features) {
  uint64_t bad = 0;
#pragma omp parallel for reduction(| : bad)
  for (int64_t f = 0; f < features; ++f)
    for (int64_t i = offsets[f * batch]; i < offsets[(f + 1) * batch]; ++i)
      bad |= (uint64_t)ids[i] >= (uint64_t)rows[f];
  if (!bad) return -1;
  for (int64_t f = 0; f < features; ++f)
    for (int64_t i = offsets[f * batch]; i < offsets[(f + 1) * batch]; ++i)
      if ((uint64_t)ids[i] >= (uint64_t)rows[f]) return i;
  return -1;
}

/* For every id i of bag (f, b): w[first_row[f] + ids[i]] -= lr * grad[b, f]; ids checked.
 *
 * Sum pooling makes a looked-up row's gradient its bag's gradient, and SGD is linear, so the
 * rows are updated id by id: no sort, no per-row sum (fbgemm sums a row's gradients first; the
 * two differ only in rounding where a row occurs twice in one step). The rows are scattered
 * over the tables and mostly not in cache: the row PREFETCH_AHEAD ids ahead is prefetched
 * instead of waiting on each row in turn (2 cores: 32 ahead 3.8 ms, 16 4.1 ms, 8 4.7 ms a step).
 *
 * Tables go to OpenMP threads whole, so no row is updated by two threads. The OpenMP runtime is
 * torch's (both name it libgomp.so.1 and torch loads first): the threads are torch's intra-op
 * threads, already awake after the step's last parallel op. With Python threads of our own
 * instead, the update took 6.8 ms a step in training, not 4.0 (2 cores): torch's idle threads
 * spin for a while after each parallel op, holding the core our thread needed. */
__attribute__((target_clones("avx512f", "avx2", "default")))
void sgd_rows(float *restrict w, const int64_t *ids, const int64_t *offsets,
              const int64_t *first_row, const float *restrict grad, int64_t batch,
              int64_t stride, int64_t dim, int64_t features, float lr) {
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t f = 0; f < features; ++f) {
    const int64_t *bags = offsets + f * batch;
    float *table = w + first_row[f] * dim;
    for (int64_t b = 0; b < batch; ++b) {
      const float *g = grad + b * stride + f * dim;
      for (int64_t i = bags[b]; i < bags[b + 1]; ++i) {
        if (i + PREFETCH_AHEAD < bags[batch]) {
          const float *ahead = table + ids[i + PREFETCH_AHEAD] * dim;
          for (int64_t d = 0; d < dim; d += FLOATS_PER_LINE) __builtin_prefetch(ahead + d, 1, 3);
        }
        float *row = table + ids[i] * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] -= lr * g[d];
      }
    }
  }
}
