/* Checksums of document and chunk records (schema 3): what each covers, and the checks made
 * when a record is read. A document's covers its key and its whole record (header, title,
 * meta, text); a chunk's covers its own record, its document's title and the chunk's text, so
 * that a search hit is checked without reading the rest of its document. Records written
 * before schema 3 carry none; only a store upgraded from then may hold them, and their title
 * and text are then at least checked as UTF-8, so that no read hands out bytes that are not
 * text. The hashes are text/hash.h's, in the machine's byte order, as LMDB's file is. */
#include "retriever/store_internal.h"

#include <stdio.h>

#include "retriever/status.h"
#include "text/hash.h"
#include "text/utf8.h"

uint64_t doc_sum(const MDB_val *k, const void *rec, size_t len)
{
    return hash_u64(hash_bytes(k->mv_data, k->mv_size) ^ hash_u64(hash_bytes(rec, len)));
}

uint32_t chunk_sum(const void *rec, size_t rec_len, const char *title, size_t title_len,
                   const char *text, size_t text_len)
{
    uint8_t buf[CHUNK_RECORD_MAX];
    if (rec_len > sizeof buf)
        rec_len = sizeof buf;
    memcpy(buf, rec, rec_len);
    if (rec_len >= CHUNK_SUM_OFFSET + 4)
        put_le32(buf + CHUNK_SUM_OFFSET, 0);
    uint64_t h = hash_bytes(buf, rec_len);
    h = hash_u64(h ^ hash_bytes(title, title_len));
    h = hash_u64(h ^ hash_bytes(text, text_len));
    uint32_t s = (uint32_t)(h ^ (h >> 32));
    return s ? s : 1;
}

/* The id of a doc key for a message: printable ASCII, the rest as '?', at most 64 bytes. */
static const char *shown_id(const char *id, size_t len, char *out, size_t cap)
{
    size_t n = len < cap - 4 ? len : cap - 4, k = 0;
    for (size_t i = 0; i < n; i++)
        out[k++] = (id[i] >= 0x20 && id[i] < 0x7F) ? id[i] : '?';
    if (n < len)
        out[k++] = '.', out[k++] = '.', out[k++] = '.';
    out[k] = 0;
    return out;
}

static int damaged(const struct Store *s, const char *coll, const char *id, size_t id_len,
                   const char *what, char *err, size_t errlen)
{
    char shown[72];
    return ret_fail(err, errlen, RET_ECORRUPT, "document \"%s\" in collection \"%s\" is damaged "
                    "(%s); run `diffrag-store --data-dir %s verify`, then restore a backup or "
                    "rebuild the store", shown_id(id, id_len, shown, sizeof shown), coll, what,
                    s->dir);
}

int doc_record_check(const struct Store *s, const char *coll, const MDB_val *k, const MDB_val *v,
                     const struct DocHeader *h, char *err, size_t errlen)
{
    const char *id = (const char *)k->mv_data + 4;
    size_t id_len = k->mv_size - 4;
    if (h->summed) {
        if (doc_sum(k, v->mv_data, v->mv_size - DOC_SUM_SIZE) != h->sum)
            return damaged(s, coll, id, id_len, "its checksum does not match its bytes", err,
                           errlen);
        return RET_OK;
    }
    if (!s->unsummed)
        return damaged(s, coll, id, id_len, "its record has no checksum, which every record of "
                       "this store has", err, errlen);
    const char *title = (const char *)v->mv_data + DOC_HEADER_SIZE;
    const char *text = title + h->title_len + h->meta_len;
    if (!utf8_valid(title, h->title_len, NULL) || !utf8_valid(text, h->text_len, NULL))
        return damaged(s, coll, id, id_len, "its title or text is not valid UTF-8; the record "
                       "predates checksums", err, errlen);
    return RET_OK;
}

int chunk_record_check(const struct Store *s, const char *coll, uint32_t chunk_id,
                       const MDB_val *v, const struct ChunkRecord *cr, const char *doc_id,
                       size_t doc_id_len, const char *title, size_t title_len, const char *text,
                       char *err, size_t errlen)
{
    char what[96];
    const char *slice = text + cr->byte_start;
    size_t len = cr->byte_end - cr->byte_start;
    if (cr->sum) {
        if (chunk_sum(v->mv_data, v->mv_size, title, title_len, slice, len) == cr->sum)
            return RET_OK;
        snprintf(what, sizeof what, "chunk %u: its checksum does not match its bytes", chunk_id);
        return damaged(s, coll, doc_id, doc_id_len, what, err, errlen);
    }
    if (!s->unsummed) {
        snprintf(what, sizeof what, "chunk %u: its record has no checksum, which every record of "
                 "this store has", chunk_id);
        return damaged(s, coll, doc_id, doc_id_len, what, err, errlen);
    }
    if (!utf8_valid(title, title_len, NULL) || !utf8_valid(slice, len, NULL)) {
        snprintf(what, sizeof what, "chunk %u: its title or text is not valid UTF-8; the record "
                 "predates checksums", chunk_id);
        return damaged(s, coll, doc_id, doc_id_len, what, err, errlen);
    }
    return RET_OK;
}
