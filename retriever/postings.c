/* LEB128 varints and the delta-coded posting block format described in postings.h. */
#include "retriever/postings.h"

#include "retriever/status.h"

size_t varint_put(uint8_t *out, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        out[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

int varint_get(const uint8_t *p, size_t n, uint64_t *v, size_t *used)
{
    uint64_t r = 0;
    for (size_t i = 0; i < n && i < VARINT_MAX; i++) {
        uint64_t b = p[i] & 0x7F;
        if (i == 9 && b > 1)
            return RET_ECORRUPT; /* past 64 bits */
        r |= b << (7 * i);
        if (!(p[i] & 0x80)) {
            *v = r;
            *used = i + 1;
            return RET_OK;
        }
    }
    return RET_ECORRUPT;
}

int postings_encode(uint32_t base, const struct Posting *p, size_t n, uint8_t *out, size_t *size)
{
    uint32_t max_tf = 0, min_len = n ? UINT32_MAX : 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i].tf == 0 || (i == 0 ? p[i].id < base : p[i].id <= p[i - 1].id))
            return RET_EINPUT;
        if (p[i].tf > max_tf) max_tf = p[i].tf;
        if (p[i].len < min_len) min_len = p[i].len;
    }
    size_t o = 0;
    o += varint_put(out + o, n);
    o += varint_put(out + o, n ? p[n - 1].id - base : 0);
    o += varint_put(out + o, max_tf);
    o += varint_put(out + o, min_len);
    uint32_t prev = base;
    for (size_t i = 0; i < n; i++) {
        o += varint_put(out + o, p[i].id - prev);
        o += varint_put(out + o, p[i].tf);
        o += varint_put(out + o, p[i].len);
        prev = p[i].id;
    }
    *size = o;
    return RET_OK;
}

static int get32(const uint8_t *buf, size_t len, size_t *o, uint32_t *v)
{
    uint64_t x;
    size_t used;
    if (varint_get(buf + *o, len - *o, &x, &used) || x > UINT32_MAX)
        return RET_ECORRUPT;
    *o += used;
    *v = (uint32_t)x;
    return RET_OK;
}

int postings_header(uint32_t base, const uint8_t *buf, size_t len, struct PostingsHeader *h)
{
    size_t o = 0;
    uint32_t last_delta;
    if (get32(buf, len, &o, &h->count) || get32(buf, len, &o, &last_delta) ||
        get32(buf, len, &o, &h->max_tf) || get32(buf, len, &o, &h->min_len))
        return RET_ECORRUPT;
    if ((uint64_t)base + last_delta > UINT32_MAX)
        return RET_ECORRUPT;
    h->last_id = base + last_delta;
    h->size = o;
    return RET_OK;
}

int postings_decode(uint32_t base, const uint8_t *buf, size_t len, struct Posting *out, size_t cap,
                    size_t *n)
{
    struct PostingsHeader h;
    *n = 0;
    if (postings_header(base, buf, len, &h) || h.count > cap)
        return RET_ECORRUPT;
    size_t o = h.size;
    uint64_t prev = base;
    uint32_t max_tf = 0, min_len = h.count ? UINT32_MAX : 0;
    for (uint32_t i = 0; i < h.count; i++) {
        uint32_t d, tf, l;
        if (get32(buf, len, &o, &d) || get32(buf, len, &o, &tf) || get32(buf, len, &o, &l))
            return RET_ECORRUPT;
        if ((i > 0 && d == 0) || tf == 0 || prev + d > UINT32_MAX)
            return RET_ECORRUPT;
        prev += d;
        out[i].id = (uint32_t)prev;
        out[i].tf = tf;
        out[i].len = l;
        if (tf > max_tf) max_tf = tf;
        if (l < min_len) min_len = l;
    }
    if (o != len || max_tf != h.max_tf || min_len != h.min_len || (h.count && prev != h.last_id) || (!h.count && h.last_id != base))
        return RET_ECORRUPT;
    *n = h.count;
    return RET_OK;
}
