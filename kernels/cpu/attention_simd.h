/* The vectorised attention inner loop, written once over a small vector vocabulary and
 * compiled per instruction set by attention_avx512.c and attention_avx2.c, which define:
 *   VEC, VL (lanes), VMASK; vzero, vload, vstore, vset1, vfma, vmul, vadd, vmax, vhmax, vhsum,
 *   vexp2, vkeep_lt(v, first_lane_index, limit, fill): lanes at index >= limit become fill,
 *   load_half(dst, src, n): n f16 -> f32 (n a multiple of VL); vload_h(p): VL f16 as f32;
 *   RB (rows per register block), KC (vectors of keys per chunk), DC (vectors of head dims
 *   per chunk) with RB*KC and RB*DC accumulators fitting the register file;
 *   ATTEND (the function's name).
 *
 * ATTEND advances the online-softmax state of R = bq * G query rows (tokens t0..t0+bq-1 of
 * KV group g, all G query heads of the group, row r = t*G + j) over the keys kb..ke-1 (kb a
 * multiple of KV_TILE); positions past a row's own are masked. The state, in base 2 (the
 * queries are pre-scaled by scale*log2(e)): M (R) running max, L (R) running sum, O (R, hd)
 * unnormalised output. `ws` holds ATTN_WS_FLOATS(R, hd) floats. */

#define TILE KV_TILE
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 4
#endif

/* One register block of rb rows against one tile. Kt/Vt are f32, or f16 when `half` (few
 * rows share the tile, as in decode: converting in the loops beats staging the tile). */
static inline __attribute__((always_inline)) void
attend_block(const int rb, const int half, const int *lim, int nvmax, const float *Q,
             const void *Kt, const void *Vt, int hd, float *S, float *O, float *M, float *L)
{
    /* Scores S (rb, TILE) = Q (rb, hd) . Kt (hd, TILE), masked to each row's visible keys. */
    for (int c0 = 0; c0 < TILE; c0 += KC * VL) {
        VEC s[RB][KC];
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
            for (int c = 0; c < KC; c++)
                if (r < rb) s[r][c] = vzero();
        for (int d = 0; d < hd; d++) {
            VEC kv[KC];
            size_t at = (size_t)d * TILE + c0;
#pragma GCC unroll 8
            for (int c = 0; c < KC; c++)
                kv[c] = half ? vload_h((const uint16_t *)Kt + at + c * VL)
                             : vload((const float *)Kt + at + c * VL);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++)
                if (r < rb) {
                    VEC q = vset1(Q[(size_t)r * hd + d]);
#pragma GCC unroll 8
                    for (int c = 0; c < KC; c++) s[r][c] = vfma(q, kv[c], s[r][c]);
                }
        }
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++)
            if (r < rb)
#pragma GCC unroll 8
                for (int c = 0; c < KC; c++)
                    vstore(S + r * TILE + c0 + c * VL,
                           vkeep_lt(s[r][c], c0 + c * VL, lim[r], -INFINITY));
    }
    /* Online softmax: new running maxima, then the rescale factors of all rows in one vector
     * exp2 (a scalar exp2f per row and tile costs as much as the tile's products while the
     * maxima still move, near the diagonal), then the probabilities into S. */
    float corr[VL], m_new[RB];
    for (int r = 0; r < VL; r++) corr[r] = 0.f;
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        if (r >= rb) break;
        m_new[r] = M[r];
        if (lim[r] <= 0) continue; /* nothing visible in this tile for this row */
        const float *sr = S + r * TILE;
        VEC mx = vload(sr);
        for (int c = VL; c < TILE; c += VL) mx = vmax(mx, vload(sr + c));
        float m_tile = vhmax(mx);
        if (m_tile > m_new[r]) m_new[r] = m_tile;
        /* -inf - -inf would be NaN: a row with nothing seen yet has O = L = 0 anyway. */
        corr[r] = M[r] == -INFINITY ? -INFINITY : M[r] - m_new[r];
    }
    vstore(corr, vexp2(vload(corr)));
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        if (r >= rb) break;
        float *sr = S + r * TILE;
        if (lim[r] <= 0) {
            corr[r] = 1.f;
            for (int c = 0; c < TILE; c += VL) vstore(sr + c, vzero());
            continue;
        }
        if (M[r] == -INFINITY) corr[r] = 0.f;
        VEC sum = vzero(), neg = vset1(-m_new[r]);
        for (int c = 0; c < TILE; c += VL) {
            VEC p = vkeep_lt(vexp2(vadd(vload(sr + c), neg)), c, lim[r], 0.f);
            sum = vadd(sum, p);
            vstore(sr + c, p);
        }
        L[r] = L[r] * corr[r] + vhsum(sum);
        M[r] = m_new[r];
    }
    /* O (rb, hd) = O * corr + P (rb, nvmax) . Vt (nvmax, hd). */
    for (int d0 = 0; d0 < hd; d0 += DC * VL) {
        int nd = (hd - d0) / VL < DC ? (hd - d0) / VL : DC;
        VEC o[RB][DC];
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++)
            if (r < rb) {
                VEC cr = vset1(corr[r]);
#pragma GCC unroll 8
                for (int c = 0; c < DC; c++)
                    o[r][c] = c < nd ? vmul(vload(O + (size_t)r * hd + d0 + c * VL), cr) : vzero();
            }
        for (int kk = 0; kk < nvmax; kk++) {
            VEC vv[DC];
            size_t at = (size_t)kk * hd + d0;
#pragma GCC unroll 8
            for (int c = 0; c < DC; c++)
                vv[c] = c >= nd ? vzero()
                        : half ? vload_h((const uint16_t *)Vt + at + c * VL)
                               : vload((const float *)Vt + at + c * VL);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++)
                if (r < rb) {
                    VEC p = vset1(S[r * TILE + kk]);
#pragma GCC unroll 8
                    for (int c = 0; c < DC; c++) o[r][c] = vfma(p, vv[c], o[r][c]);
                }
        }
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++)
            if (r < rb)
#pragma GCC unroll 8
                for (int c = 0; c < DC; c++)
                    if (c < nd) vstore(O + (size_t)r * hd + d0 + c * VL, o[r][c]);
    }
}

void ATTEND(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke, float *ws,
            float *O, float *M, float *L)
{
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head, R = bq * G;
    float *Q = ws;
    float *Kf = Q + (size_t)R * hd;
    float *Vf = Kf + (size_t)hd * TILE;
    float *S = Vf + (size_t)hd * TILE;
    const float qscale = a->scale * 1.44269504088896341f;
    for (int r = 0; r < R; r++) {
        const float *src = a->q + (size_t)(t0 + r / G) * a->q_stride + (size_t)(g * G + r % G) * hd;
        for (int d = 0; d < hd; d++) Q[(size_t)r * hd + d] = src[d] * qscale;
    }
    size_t head = (size_t)g * a->kv_head_stride;
    /* Stage a tile in f32 when many rows share it; read f16 directly when few do. */
    int direct = a->kv_type == KV_F16 && R <= 2 * RB;
    for (int k0 = kb; k0 < ke; k0 += TILE) {
        int nk = ke - k0 < TILE ? ke - k0 : TILE;
        const void *Kt, *Vt;
        if (a->kv_type == KV_F32) {
            Kt = (const float *)a->k + head + (size_t)k0 * hd;
            Vt = (const float *)a->v + head + (size_t)k0 * hd;
        } else if (direct) {
            Kt = (const uint16_t *)a->k + head + (size_t)k0 * hd;
            Vt = (const uint16_t *)a->v + head + (size_t)k0 * hd;
            /* Few rows per tile make this a stream from memory: keep the next PREFETCH_TILES
             * tiles of the range on their way while this one is worked on. */
            for (int ahead = k0 == kb ? 1 : PREFETCH_TILES; ahead <= PREFETCH_TILES; ahead++) {
                if (k0 + ahead * TILE >= ke) break;
                const char *pk = (const char *)((const uint16_t *)Kt + (size_t)ahead * TILE * hd);
                const char *pv = (const char *)((const uint16_t *)Vt + (size_t)ahead * TILE * hd);
                for (int off = 0; off < TILE * hd * 2; off += 64) {
                    _mm_prefetch(pk + off, _MM_HINT_T0);
                    _mm_prefetch(pv + off, _MM_HINT_T0);
                }
            }
        } else {
            /* Keys past nk in the tile may be unwritten: converted anyway (the tile is one
             * run), then masked before they count. */
            load_half(Kf, (const uint16_t *)a->k + head + (size_t)k0 * hd, hd * TILE);
            load_half(Vf, (const uint16_t *)a->v + head + (size_t)k0 * hd, nk * hd);
            Kt = Kf;
            Vt = Vf;
        }
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            int lim[RB], nvmax = 0;
            for (int r = 0; r < RB; r++) {
                int t = (r0 + (r < rb ? r : 0)) / G;
                int v = a->pos0 + t0 + t + 1 - k0;
                v = v > nk ? nk : v;
                lim[r] = v;
                if (r < rb && v > nvmax) nvmax = v;
            }
            if (nvmax <= 0) continue;
            float *Or = O + (size_t)r0 * hd;
            const float *Qr = Q + (size_t)r0 * hd;
#define ATTEND_CASE(n) case n: \
            if (direct) attend_block(n, 1, lim, nvmax, Qr, Kt, Vt, hd, S, Or, M + r0, L + r0); \
            else attend_block(n, 0, lim, nvmax, Qr, Kt, Vt, hd, S, Or, M + r0, L + r0); \
            break;
            switch (rb) {
#if RB >= 6
            ATTEND_CASE(6) ATTEND_CASE(5) ATTEND_CASE(4) ATTEND_CASE(3)
#endif
            ATTEND_CASE(2) ATTEND_CASE(1)
            }
#undef ATTEND_CASE
        }
    }
}
