/* LM2 factored bank scan on the CPU: the loop of kernels/lm2/reference.py (_factored_steps) in C.

   Per token t of sequence b, with D_t, c_t the bank's common decay and write (M_t = D_t*M0 + c_t):
     a_t    = softmax((q~_t * D_t) M0^T)           scores as axpys over M0^T rows (N-wide)
     u_t    = D_t * (a_t M0) + c_t                 read of the bank before W_V
     [e | f] = u_t [W_V | W_V W_f]                 one (d x 2d) matrix-vector product
     g_f    = sigmoid(f + b_f)
     D_t+1  = g_f * D_t,  c_t+1 = g_f * c_t + g_in,t * tanh(e)
   Every inner loop is an axpy over contiguous memory, so the compiler vectorises it without
   reassociating sums (no -ffast-math); results match the reference to rounding.
   Outputs: attn [B,T,N], reads, forgets, decays (D_t), commons (c_t) [B,T,d], D_last, c_last [B,d]. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DEFINE_SCAN(NAME, real, EXP, TANH)                                                              \
int NAME(long B, long T, long N, long d, const real *q_slot, const real *g_in, const real *M0,          \
         const real *W_read, const real *b_f, real *attn, real *reads, real *forgets, real *decays,     \
         real *commons, real *D_last, real *c_last)                                                     \
{                                                                                                       \
    real *work = (real *)malloc(sizeof(real) * (N * d + N + 6 * d));                                    \
    if (!work) return 1;                                                                                \
    real *M0T = work, *s = M0T + N * d, *x = s + N, *u = x + d, *o = u + d, *D = o + 2 * d, *c = D + d; \
    for (long b = 0; b < B; b++) {                                                                      \
        const real *M = M0 + b * N * d;                                                                 \
        for (long n = 0; n < N; n++)                                                                    \
            for (long i = 0; i < d; i++) M0T[i * N + n] = M[n * d + i];                                 \
        for (long i = 0; i < d; i++) { D[i] = 1; c[i] = 0; }                                            \
        for (long t = 0; t < T; t++) {                                                                  \
            long row = b * T + t;                                                                       \
            const real *q = q_slot + row * d, *gi = g_in + row * d;                                     \
            real *a = attn + row * N, *e = reads + row * d, *gf = forgets + row * d;                    \
            memcpy(decays + row * d, D, sizeof(real) * d);                                              \
            memcpy(commons + row * d, c, sizeof(real) * d);                                             \
            for (long n = 0; n < N; n++) s[n] = 0;                                                      \
            for (long i = 0; i < d; i++) {                                                              \
                real xi = q[i] * D[i];                                                                  \
                const real *r = M0T + i * N;                                                            \
                for (long n = 0; n < N; n++) s[n] += xi * r[n];                                         \
            }                                                                                           \
            real top = s[0], total = 0;                                                                 \
            for (long n = 1; n < N; n++) top = s[n] > top ? s[n] : top;                                 \
            for (long n = 0; n < N; n++) { a[n] = EXP(s[n] - top); total += a[n]; }                     \
            for (long n = 0; n < N; n++) a[n] /= total;                                                 \
            for (long i = 0; i < d; i++) x[i] = 0;                                                      \
            for (long n = 0; n < N; n++) {                                                              \
                real an = a[n];                                                                         \
                const real *r = M + n * d;                                                              \
                for (long i = 0; i < d; i++) x[i] += an * r[i];                                         \
            }                                                                                           \
            for (long i = 0; i < d; i++) u[i] = D[i] * x[i] + c[i];                                     \
            for (long j = 0; j < 2 * d; j++) o[j] = 0;                                                  \
            for (long i = 0; i < d; i++) {                                                              \
                real ui = u[i];                                                                         \
                const real *r = W_read + i * 2 * d;                                                     \
                for (long j = 0; j < 2 * d; j++) o[j] += ui * r[j];                                     \
            }                                                                                           \
            for (long j = 0; j < d; j++) {                                                              \
                real g = 1 / (1 + EXP(-(o[d + j] + b_f[j])));                                           \
                e[j] = o[j];                                                                            \
                gf[j] = g;                                                                              \
                D[j] = g * D[j];                                                                        \
                c[j] = g * c[j] + gi[j] * TANH(o[j]);                                                   \
            }                                                                                           \
        }                                                                                               \
        memcpy(D_last + b * d, D, sizeof(real) * d);                                                    \
        memcpy(c_last + b * d, c, sizeof(real) * d);                                                    \
    }                                                                                                   \
    free(work);                                                                                         \
    return 0;                                                                                           \
}

DEFINE_SCAN(lm2_scan_f32, float, expf, tanhf)
DEFINE_SCAN(lm2_scan_f64, double, exp, tanh)
