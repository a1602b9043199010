/* Product-key top-k selection on the CPU: steps 1-3 of kernels/product_keys/reference.py for
   each (query, head) row, given its sub-key scores s1 = q1 K1^T and s2 = q2 K2^T (n each).

     1. the k best of s1 and of s2, best first;
     2. the candidate sums s1[a] + s2[b], only for (a + 1) (b + 1) <= k: with both lists sorted,
        the pair (a, b) is beaten by every pair (a' <= a, b' <= b), (a + 1) (b + 1) - 1 of them,
        so no other pair can be in the top k (about k ln k candidates instead of k^2);
     3. the k best candidates, best first.

   Outputs the sub-key positions i [R, k] and j [R, k] of the chosen keys (value row i n + j);
   the caller takes the scores from s1, s2 with a gather, so gradients stay in PyTorch. Ties
   keep the earlier entry; with NaN scores the choice is arbitrary, but every position is in [0, n). */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP  /* built with -fopenmp: the parallel regions run on torch's own OpenMP threads */
#include <omp.h>
#else
static int omp_get_num_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif
#define MAX_K 256  /* kernels/product_keys/cpu.py checks k against it */

#define RANK_LIMIT 256

/* The k best of x[0..n) into vals/ids, best first, ties to the earlier entry.
   A bound first: the maxima of k disjoint groups of entries are k entries, so the smallest of
   them is at most the k-th largest, and only entries at least that large can be chosen (about
   half a row of 64 for k = 16). Then each survivor's rank (how many survivors beat it) is
   counted for all of them at once: per survivor j, one compare against all survivors, a loop the
   compiler vectorises, with no data-dependent branch. Past RANK_LIMIT survivors, insertion into
   the sorted buffer instead. Scratch: xs, idx, rank of n entries each. */
#define DEFINE_TOPK(NAME, real)                                                                         \
static void NAME##_select(const real *x, long n, long k, real *vals, long *ids, real *xs, long *idx,    \
                          int *rank)                                                                    \
{                                                                                                       \
    for (long m = 0; m < k; m++) { vals[m] = -INFINITY; ids[m] = 0; xs[m] = x[m]; }                     \
    for (long start = k; start < n; start += k)                                                         \
        for (long m = 0; m < k && start + m < n; m++) xs[m] = x[start + m] > xs[m] ? x[start + m] : xs[m];\
    real bound = xs[0];                                                                                 \
    for (long m = 1; m < k; m++) bound = xs[m] < bound ? xs[m] : bound;                                 \
    int c = 0;                                                                                          \
    for (long m = 0; m < n; m++) { xs[c] = x[m]; idx[c] = m; c += x[m] >= bound; }  /* no branch */    \
    if (c <= RANK_LIMIT) {                                                                              \
        for (int m = 0; m < c; m++) rank[m] = 0;                                                        \
        for (int j = 0; j < c; j++) {                                                                   \
            real xj = xs[j];                                                                            \
            for (int m = 0; m < c; m++) rank[m] += (xj > xs[m]) | ((xj == xs[m]) & (j < m));            \
        }                                                                                               \
        for (int m = 0; m < c; m++) {  /* ranks k and over land in the spare slot vals[k] */            \
            long r = rank[m] < k ? rank[m] : k;                                                         \
            vals[r] = xs[m];                                                                            \
            ids[r] = idx[m];                                                                            \
        }                                                                                               \
        return;                                                                                         \
    }                                                                                                   \
    for (int m = 0; m < c; m++) {                                                                       \
        real xm = xs[m];                                                                                \
        if (!(xm > vals[k - 1])) continue;                                                              \
        long r = k - 1;                                                                                 \
        for (; r > 0 && xm > vals[r - 1]; r--) { vals[r] = vals[r - 1]; ids[r] = ids[r - 1]; }          \
        vals[r] = xm;                                                                                   \
        ids[r] = idx[m];                                                                                \
    }                                                                                                   \
}                                                                                                       \
static int NAME##_rows(long start, long stop, long n, long k, const real *scores, long *out_i, long *out_j)\
{                                                                                                       \
    real v1[MAX_K + 1], v2[MAX_K + 1], sums[MAX_K * 8], best[MAX_K + 1];                                \
    long i1[MAX_K + 1], i2[MAX_K + 1], pair[MAX_K * 8], picked[MAX_K + 1];                              \
    long size = n > MAX_K * 8 ? n : MAX_K * 8;                                                          \
    real *xs = (real *)malloc(sizeof(real) * size);                                                     \
    long *idx = (long *)malloc(sizeof(long) * size);                                                    \
    int *rank = (int *)malloc(sizeof(int) * size);                                                      \
    if (!xs || !idx || !rank) { free(xs); free(idx); free(rank); return 2; }                            \
    for (long r = start; r < stop; r++) {                                                               \
        const real *s1 = scores + r * 2 * n, *s2 = s1 + n;                                              \
        NAME##_select(s1, n, k, v1, i1, xs, idx, rank);                                                 \
        NAME##_select(s2, n, k, v2, i2, xs, idx, rank);                                                 \
        long c = 0;                                                                                     \
        for (long a = 0; a < k; a++)                                                                    \
            for (long b = 0; (a + 1) * (b + 1) <= k; b++) {                                             \
                sums[c] = v1[a] + v2[b];                                                                \
                pair[c++] = a * k + b;                                                                  \
            }                                                                                           \
        NAME##_select(sums, c, k, best, picked, xs, idx, rank);                                         \
        for (long m = 0; m < k; m++) {                                                                  \
            out_i[r * k + m] = i1[pair[picked[m]] / k];                                                 \
            out_j[r * k + m] = i2[pair[picked[m]] % k];                                                 \
        }                                                                                               \
    }                                                                                                   \
    free(xs); free(idx); free(rank);                                                                    \
    return 0;                                                                                           \
}                                                                                                       \
int NAME(long R, long n, long k, const real *scores, long *out_i, long *out_j, int threads)             \
{                                                                                                       \
    if (k > MAX_K || k > n || k < 1) return 1;                                                          \
    int status = 0;                                                                                     \
    _Pragma("omp parallel num_threads(threads) reduction(|:status)")                                    \
    {                                                                                                   \
        long team = omp_get_num_threads(), t = omp_get_thread_num();                                    \
        status |= NAME##_rows(R * t / team, R * (t + 1) / team, n, k, scores, out_i, out_j);           \
    }                                                                                                   \
    return status;                                                                                      \
}

DEFINE_TOPK(product_key_topk_f32, float)
DEFINE_TOPK(product_key_topk_f64, double)

/* The weighted bag's backward (out_r = sum_i w_ri V[idx_ri], kernels/product_keys/reference.py):
   one pass over the chosen rows, each read once for both gradients,
     dw_ri  = V[idx_ri] . g_r          dV[idx_ri] += w_ri g_r
   The rows are split over `threads`; rows share value rows, so each thread but the first adds
   into a zeroed table of its own, and the tables are added to grad_values in thread order (the
   same sums every run). grad_values [n_values, D] must come in zeroed. */
#define LANES 16
#define DEFINE_BAG_BACKWARD(NAME, real)                                                                 \
static void NAME##_rows(long start, long stop, long k, long D, const long *indices, const real *weights,\
                        const real *values, const real *grad_out, real *grad_weights, real *grad_values)\
{                                                                                                       \
    for (long r = start; r < stop; r++) {                                                               \
        const real *g = grad_out + r * D;                                                               \
        for (long i = 0; i < k; i++) {                                                                  \
            long row = indices[r * k + i];                                                              \
            const real *v = values + row * D;                                                           \
            real *dv = grad_values + row * D, w = weights[r * k + i], lanes[LANES] = {0}, dot = 0;      \
            long c = 0;                                                                                 \
            for (; c + LANES <= D; c += LANES)  /* LANES partial sums: a dot product that vectorises */ \
                for (long l = 0; l < LANES; l++) {                                                      \
                    lanes[l] += v[c + l] * g[c + l];                                                    \
                    dv[c + l] += w * g[c + l];                                                          \
                }                                                                                       \
            for (; c < D; c++) { dot += v[c] * g[c]; dv[c] += w * g[c]; }                               \
            for (long l = 0; l < LANES; l++) dot += lanes[l];                                           \
            grad_weights[r * k + i] = dot;                                                              \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
int NAME(long R, long k, long D, long n_values, const long *indices, const real *weights,               \
         const real *values, const real *grad_out, real *grad_weights, real *grad_values, int threads)  \
{                                                                                                       \
    if (threads < 1) threads = 1;                                                                       \
    real **tables = (real **)calloc(threads, sizeof(real *));                                           \
    if (!tables) return 2;                                                                              \
    int status = 0;                                                                                     \
    _Pragma("omp parallel num_threads(threads) reduction(|:status)")                                    \
    {                                                                                                   \
        long team = omp_get_num_threads(), t = omp_get_thread_num();                                    \
        real *mine = t == 0 ? grad_values : (real *)calloc(n_values * D, sizeof(real));                 \
        tables[t] = mine;                                                                               \
        if (mine) NAME##_rows(R * t / team, R * (t + 1) / team, k, D, indices, weights, values,         \
                              grad_out, grad_weights, mine);                                            \
        else status |= 2;                                                                               \
    }                                                                                                   \
    for (int t = 1; t < threads; t++) {                                                                 \
        if (!tables[t]) continue;                                                                       \
        for (long e = 0; e < n_values * D; e++) grad_values[e] += tables[t][e];                         \
        free(tables[t]);                                                                                \
    }                                                                                                   \
    free(tables);                                                                                       \
    return status;                                                                                      \
}

DEFINE_BAG_BACKWARD(weighted_bag_backward_f32, float)
DEFINE_BAG_BACKWARD(weighted_bag_backward_f64, double)
