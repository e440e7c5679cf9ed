/* The vectorised attention inner loop, written once over a small vector vocabulary and
 * compiled per instruction set by attention_avx512.c and attention_avx2.c, which define:
 *   VEC, VL (lanes), VMASK; vzero, vload, vstore, vset1, vfma, vmul, vadd, vmax, vhmax, vhsum,
 *   vexp2, vkeep_lt(v, first_lane_index, limit, fill): lanes at index >= limit become fill,
 *   load_half(dst, src, n): n f16 -> f32 (n a multiple of VL); vload_h(p): VL f16 as f32;
 *   vload_q8(p): VL int8 as f32; IVEC (VL int32 lanes), ivzero, ivset1, ivadd, ivcvt (to
 *   VEC), ivload_pairs(p): 2 VL int8 as 2 VL int16, ivmadd(a, b): the sums of adjacent int16
 *   products as VL int32; ivlow16 / ivhigh16: each lane's low / high int16, sign-extended;
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

enum { ENC_F32, ENC_F16, ENC_Q8 };

/* One register block of rb rows against one tile. Kt/Vt are f32, or read as stored when few
 * rows share the tile, as in decode (converting in the loops beats staging the tile): f16,
 * or int8 whose per-position scales (ks for the keys, vs for the values) multiply the scores
 * and the probabilities. */
static inline __attribute__((always_inline)) void
attend_block(const int rb, const int enc, const int *lim, int nvmax, const float *Q,
             const float *qs, const void *Kt, const void *Vt, const float *ks, const float *vs,
             int hd, float *S, float *O, float *M, float *L)
{
    /* Scores S (rb, TILE) = Q (rb, hd) . Kt (hd, TILE), masked to each row's visible keys.
     * int8 keys: Q holds each row's query as int16 pairs (one int32 per two dimensions, rows
     * hd apart) with the row's scale in qs; a multiply-add scores 2 dimensions of VL keys. */
    for (int c0 = 0; enc == ENC_Q8 && c0 < TILE; c0 += KC * VL) {
        const int32_t *Qp = (const int32_t *)(const void *)Q;
        IVEC acc[RB][KC];
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
            for (int c = 0; c < KC; c++)
                if (r < rb) acc[r][c] = ivzero();
        for (int d2 = 0; d2 < hd / 2; d2++) {
            IVEC kv[KC];
            const int8_t *kp = (const int8_t *)Kt + (size_t)d2 * 2 * TILE + 2 * c0;
#pragma GCC unroll 8
            for (int c = 0; c < KC; c++) kv[c] = ivload_pairs(kp + 2 * c * VL);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++)
                if (r < rb) {
                    IVEC q = ivset1(Qp[(size_t)r * hd + d2]);
#pragma GCC unroll 8
                    for (int c = 0; c < KC; c++) acc[r][c] = ivadd(acc[r][c], ivmadd(kv[c], q));
                }
        }
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++)
            if (r < rb) {
                VEC qr = vset1(qs[r]);
#pragma GCC unroll 8
                for (int c = 0; c < KC; c++) {
                    VEC sc = vmul(vmul(ivcvt(acc[r][c]), vload(ks + c0 + c * VL)), qr);
                    vstore(S + r * TILE + c0 + c * VL, vkeep_lt(sc, c0 + c * VL, lim[r], -INFINITY));
                }
            }
    }
    for (int c0 = 0; enc != ENC_Q8 && c0 < TILE; c0 += KC * VL) {
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
                kv[c] = enc == ENC_F16 ? vload_h((const uint16_t *)Kt + at + c * VL)
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
            /* int8 values: each probability carries its value's scale into the product
             * (positions past the tile's written ones are never read below). */
            vstore(sr + c, enc == ENC_Q8 ? vmul(p, vload(vs + c)) : p);
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
                vv[c] = c >= nd            ? vzero()
                        : enc == ENC_F16 ? vload_h((const uint16_t *)Vt + at + c * VL)
                        : enc == ENC_Q8  ? vload_q8((const int8_t *)Vt + at + c * VL)
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
    size_t tile_bytes = kv_tile_elems(a->kv_type, hd) * kv_elem_bytes(a->kv_type);
    size_t el = kv_elem_bytes(a->kv_type);
    /* Stage a tile in f32 when many rows share it; read it as stored when few do. */
    int direct = a->kv_type != KV_F32 && R <= 2 * RB && !a->rowwise;
    int enc = !direct ? ENC_F32 : a->kv_type == KV_F16 ? ENC_F16 : ENC_Q8;
    float *qs = Kf; /* int8 keys read as stored: the rows' query scales (Kf is unused then) */
    if (enc == ENC_Q8)
        /* Each row's query to int16 (largest magnitude to 32767), as pairs of dimensions
         * packed in one int32, in place: pair i is written after q[2i], q[2i+1] are read. */
        for (int r = 0; r < R; r++) {
            float *q = Q + (size_t)r * hd, amax = 0.f;
            for (int d = 0; d < hd; d++) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
            float inv = amax > 0.f ? 32767.f / amax : 0.f;
            qs[r] = amax / 32767.f;
            int32_t *qp = (int32_t *)(void *)q;
            for (int i = 0; i < hd / 2; i++) {
                uint32_t lo = (uint16_t)(int16_t)rintf(q[2 * i] * inv);
                uint32_t hi = (uint16_t)(int16_t)rintf(q[2 * i + 1] * inv);
                qp[i] = (int32_t)(lo | hi << 16);
            }
        }
    for (int k0 = kb; k0 < ke; k0 += TILE) {
        int nk = ke - k0 < TILE ? ke - k0 : TILE;
        size_t at = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type, hd, g, k0);
        const void *Kt, *Vt;
        const float *ks = NULL, *vs = NULL;
        if (a->kv_type == KV_F32) {
            Kt = (const float *)a->k + at;
            Vt = (const float *)a->v + at;
        } else if (direct) {
            const char *kt = (const char *)a->k + at * kv_elem_bytes(a->kv_type);
            const char *vt = (const char *)a->v + at * kv_elem_bytes(a->kv_type);
            Kt = kt;
            Vt = vt;
            if (enc == ENC_Q8) {
                ks = cpu_kv_q8_scales(kt, hd);
                vs = cpu_kv_q8_scales(vt, hd);
            }
            /* Few rows per tile make this a stream from memory: keep the next PREFETCH_TILES
             * tiles of the range on their way while this one is worked on. */
            for (int ahead = k0 == kb ? 1 : PREFETCH_TILES; ahead <= PREFETCH_TILES; ahead++) {
                if (k0 + ahead * TILE >= ke) break;
                size_t ahead_at = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride,
                                               a->kv_type, hd, g, k0 + ahead * TILE) * el;
                const char *pk = (const char *)a->k + ahead_at, *pv = (const char *)a->v + ahead_at;
                for (size_t off = 0; off < tile_bytes; off += 64) {
                    _mm_prefetch(pk + off, _MM_HINT_T0);
                    _mm_prefetch(pv + off, _MM_HINT_T0);
                }
            }
        } else if (a->kv_type == KV_F16) {
            /* Keys past nk in the tile may be unwritten: converted anyway (the tile is one
             * run), then masked before they count. */
            load_half(Kf, (const uint16_t *)a->k + at, hd * TILE);
            load_half(Vf, (const uint16_t *)a->v + at, nk * hd);
            Kt = Kf;
            Vt = Vf;
        } else {
            const int8_t *kt = (const int8_t *)a->k + at, *vt = (const int8_t *)a->v + at;
            const float *kss = cpu_kv_q8_scales(kt, hd), *vss = cpu_kv_q8_scales(vt, hd);
            /* Paired keys (d even in the low int16 of each int32 lane) back to K[d][j]. */
            for (int d = 0; d < hd; d += 2)
                for (int c = 0; c < TILE; c += VL) {
                    IVEC p = ivload_pairs(kt + (size_t)d * TILE + 2 * c);
                    VEC sc = vload(kss + c);
                    vstore(Kf + (size_t)d * TILE + c, vmul(ivcvt(ivlow16(p)), sc));
                    vstore(Kf + (size_t)(d + 1) * TILE + c, vmul(ivcvt(ivhigh16(p)), sc));
                }
            for (int j = 0; j < nk; j++) {
                VEC sc = vset1(vss[j]);
                for (int d = 0; d < hd; d += VL)
                    vstore(Vf + (size_t)j * hd + d, vmul(vload_q8(vt + (size_t)j * hd + d), sc));
            }
            Kt = Kf;
            Vt = Vf;
        }
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            int lim[RB], nvmax = 0;
            for (int r = 0; r < RB; r++) {
                int t = (r0 + (r < rb ? r : 0)) / G;
                int v = ATTN_ROW_POS(a, t0 + t) + 1 - k0;
                v = v > nk ? nk : v;
                lim[r] = v;
                if (r < rb && v > nvmax) nvmax = v;
            }
            if (nvmax <= 0) continue;
            float *Or = O + (size_t)r0 * hd;
            const float *Qr = Q + (size_t)r0 * hd;
#define ATTEND_CASE(n) case n: \
            if (enc == ENC_F16) \
                attend_block(n, ENC_F16, lim, nvmax, Qr, qs + r0, Kt, Vt, ks, vs, hd, S, Or, M + r0, L + r0); \
            else if (enc == ENC_Q8) \
                attend_block(n, ENC_Q8, lim, nvmax, Qr, qs + r0, Kt, Vt, ks, vs, hd, S, Or, M + r0, L + r0); \
            else \
                attend_block(n, ENC_F32, lim, nvmax, Qr, qs + r0, Kt, Vt, ks, vs, hd, S, Or, M + r0, L + r0); \
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
