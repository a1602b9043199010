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

/* The scan's backward: reverse-mode through the same loop, token T-1 down to 0, carrying the
   gradients dD, dc of (D_t+1, c_t+1). Per token, from what the forward returned (a_t, e_t, g_f,t,
   D_t, c_t) and y_t = a_t M0 recomputed:
     dg  = dD * D_t + dc * c_t + (the forget gate's own output gradient)
     de  = (read's output gradient) + dc * g_in,t * (1 - tanh^2 e_t),  dg_in,t = dc * tanh(e_t)
     df  = dg * g (1 - g),  [de | df] -> du = [de | df] W_read^T,  dW_read += u^T [de | df],  db_f += df
     u   = D_t * y + c_t:  dD_t = dD * g + du * y + dx * q~_t (+ output),  dc_t = dc * g + du (+ output)
     y   = a M0:  da = dy M0^T (+ output),  dM0 += a^T dy,  dy = du * D_t
     a   = softmax(s):  ds = a * (da - a.da);  s = x M0^T:  dx = ds M0,  dM0 += ds^T x,  x = q~ * D_t
   Inputs: the forward's inputs and outputs and the gradients of its seven outputs (zeros where
   unused); outputs dq_slot, dg_in [B,T,d], dM0 [B,N,d], dW_read [d,2d], db_f [d] (accumulated
   over the batch; they must come in zeroed). */
#define DEFINE_SCAN_BACKWARD(NAME, real, TANH, DOT)                                                          \
int NAME(long B, long T, long N, long d, const real *q_slot, const real *g_in, const real *M0,          \
         const real *W_read, const real *attn, const real *reads, const real *forgets,                  \
         const real *decays, const real *commons, const real *d_attn, const real *d_reads,              \
         const real *d_forgets, const real *d_decays, const real *d_commons, const real *d_D_last,      \
         const real *d_c_last, real *d_q, real *d_g_in, real *d_M0, real *d_W_read, real *d_b_f)        \
{                                                                                                       \
    real *work = (real *)malloc(sizeof(real) * (2 * N + 10 * d));                                       \
    if (!work) return 1;                                                                                \
    real *da = work, *ds = da + N, *y = ds + N, *u = y + d, *dy = u + d;                                \
    real *du = dy + d, *dx = du + d, *dD = dx + d, *dc = dD + d, *dout = dc + d; /* dout: 2d */         \
    for (long b = 0; b < B; b++) {                                                                      \
        const real *M = M0 + b * N * d;                                                                 \
        real *dM = d_M0 + b * N * d;                                                                    \
        for (long i = 0; i < d; i++) { dD[i] = d_D_last[b * d + i]; dc[i] = d_c_last[b * d + i]; }      \
        for (long t = T - 1; t >= 0; t--) {                                                             \
            long row = b * T + t;                                                                       \
            const real *a = attn + row * N, *e = reads + row * d, *g = forgets + row * d;               \
            const real *D = decays + row * d, *c = commons + row * d, *q = q_slot + row * d;            \
            const real *gi = g_in + row * d;                                                            \
            for (long i = 0; i < d; i++) y[i] = 0;                                                      \
            for (long n = 0; n < N; n++) {                                                              \
                real an = a[n];                                                                         \
                const real *r = M + n * d;                                                              \
                for (long i = 0; i < d; i++) y[i] += an * r[i];                                         \
            }                                                                                           \
            for (long i = 0; i < d; i++) {                                                              \
                real th = TANH(e[i]);                                                                   \
                real dg = dD[i] * D[i] + dc[i] * c[i] + d_forgets[row * d + i];                         \
                dout[i] = d_reads[row * d + i] + dc[i] * gi[i] * (1 - th * th);                         \
                dout[d + i] = dg * g[i] * (1 - g[i]);                                                   \
                d_g_in[row * d + i] = dc[i] * th;                                                       \
                u[i] = D[i] * y[i] + c[i];                                                              \
                d_b_f[i] += dout[d + i];                                                                \
            }                                                                                           \
            for (long i = 0; i < d; i++) {  /* du = dout W_read^T; dW_read += u^T dout */               \
                real *dw = d_W_read + i * 2 * d, ui = u[i];                                             \
                for (long j = 0; j < 2 * d; j++) dw[j] += ui * dout[j];                                 \
                du[i] = DOT(dout, W_read + i * 2 * d, 2 * d);                                           \
            }                                                                                           \
            for (long i = 0; i < d; i++) dy[i] = du[i] * D[i];                                          \
            real adot = 0;                                                                              \
            for (long n = 0; n < N; n++) {  /* da = dy M0^T (+ output); dM0 += a^T dy */                \
                const real *r = M + n * d;                                                              \
                real *dr = dM + n * d, an = a[n];                                                       \
                for (long i = 0; i < d; i++) dr[i] += an * dy[i];                                       \
                da[n] = d_attn[row * N + n] + DOT(dy, r, d);                                            \
                adot += an * da[n];                                                                     \
            }                                                                                           \
            for (long n = 0; n < N; n++) ds[n] = a[n] * (da[n] - adot);                                 \
            for (long i = 0; i < d; i++) dx[i] = 0;                                                     \
            for (long n = 0; n < N; n++) {  /* dx = ds M0; dM0 += ds^T (q~ * D) */                      \
                const real *r = M + n * d;                                                              \
                real *dr = dM + n * d, sn = ds[n];                                                      \
                for (long i = 0; i < d; i++) { dx[i] += sn * r[i]; dr[i] += sn * q[i] * D[i]; }         \
            }                                                                                           \
            for (long i = 0; i < d; i++) {                                                              \
                d_q[row * d + i] = dx[i] * D[i];                                                        \
                real dD_t = dD[i] * g[i] + du[i] * y[i] + dx[i] * q[i] + d_decays[row * d + i];         \
                dc[i] = dc[i] * g[i] + du[i] + d_commons[row * d + i];                                  \
                dD[i] = dD_t;                                                                           \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    free(work);                                                                                         \
    return 0;                                                                                           \
}

/* Dot products in LANES partial sums, so that they vectorise without -ffast-math. */
#define LANES 16
#define DEFINE_DOT(NAME, real)                                                                          \
static inline real NAME(const real *x, const real *y, long n)                                           \
{                                                                                                       \
    real lanes[LANES] = {0}, sum = 0;                                                                   \
    long i = 0;                                                                                         \
    for (; i + LANES <= n; i += LANES)                                                                  \
        for (long l = 0; l < LANES; l++) lanes[l] += x[i + l] * y[i + l];                               \
    for (; i < n; i++) sum += x[i] * y[i];                                                              \
    for (long l = 0; l < LANES; l++) sum += lanes[l];                                                   \
    return sum;                                                                                         \
}
DEFINE_DOT(dot_f32, float)
DEFINE_DOT(dot_f64, double)

DEFINE_SCAN_BACKWARD(lm2_scan_backward_f32, float, tanhf, dot_f32)
DEFINE_SCAN_BACKWARD(lm2_scan_backward_f64, double, tanh, dot_f64)
