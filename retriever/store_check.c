/* Damaged stores: the data file's size against LMDB's meta pages (checked before LMDB maps
 * it), a bounded sample check of the records for start-up, checks run in a child process so
 * that LMDB aborting or faulting on a damaged page ends only the child, and the damaged mark
 * that turns a store read-only. */
#include "retriever/store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "retriever/postings.h"
#include "retriever/status.h"
#include "text/utf8.h"

/* ---- the meta pages ----
 *
 * LMDB's data file starts with two meta pages, page 0 at offset 0 and page 1 at offset
 * psize. Each is a page header followed by the meta record; the one with the higher txnid is
 * the current one. These mirror MDB_page's header and MDB_meta in LMDB's mdb.c (0.9.x, not in
 * lmdb.h), in the writer's native byte order and word size (pgno_t and txnid_t are size_t):
 *
 *   page header: pgno (size_t) | pad (u16) | flags (u16, P_META = 0x08) | lower/upper (u32)
 *   meta:        magic (u32, 0xBEEFC0DE) | version (u32, 1) | address (pointer) |
 *                mapsize (size_t) | dbs[2] (free and main B-tree roots; dbs[0].pad holds the
 *                page size) | last_pg (size_t: the last page in use) | txnid (size_t) */
struct LmdbPageHead {
    size_t pgno;
    uint16_t pad, flags;
    uint32_t lower_upper;
};

struct LmdbDb {
    uint32_t pad;                 /* dbs[0]: the page size */
    uint16_t flags, depth;
    size_t branch_pages, leaf_pages, overflow_pages, entries, root;
};

struct LmdbMeta {
    uint32_t magic, version;
    void *address;
    size_t mapsize;
    struct LmdbDb dbs[2];
    size_t last_pg, txnid;
};

#define LMDB_P_META 0x08
#define LMDB_MAGIC 0xBEEFC0DEu
#define LMDB_DATA_VERSION 1

/* Reads the meta page at `off`: 1 valid, 0 not an LMDB meta page, -1 short file, -2 error. */
static int read_meta(int fd, off_t off, struct LmdbMeta *m)
{
    unsigned char buf[sizeof(struct LmdbPageHead) + sizeof(struct LmdbMeta)];
    ssize_t n;
    do
        n = pread(fd, buf, sizeof buf, off);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return -2;
    if ((size_t)n < sizeof buf)
        return -1;
    struct LmdbPageHead h;
    memcpy(&h, buf, sizeof h);
    memcpy(m, buf + sizeof h, sizeof *m);
    uint32_t psize = m->dbs[0].pad;
    return (h.flags & LMDB_P_META) && m->magic == LMDB_MAGIC && m->version == LMDB_DATA_VERSION &&
           psize >= 512 && psize <= 65536 && (psize & (psize - 1)) == 0;
}

int store_check_file(const char *dir, char *err, size_t errlen)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/data.mdb", dir) >= (int)sizeof path)
        return ret_fail(err, errlen, RET_EIO, "data directory path too long");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? RET_OK
                               : ret_fail(err, errlen, RET_EIO, "cannot open %s: %s", path, strerror(errno));
    struct LmdbMeta m[2];
    int ok[2] = { 0, 0 }, st = RET_OK;
    struct stat sb;
    /* The size after the meta pages: the file only grows, and a commit writes its pages before
     * its meta page, so a file read in this order never looks short when it is not. */
    ok[0] = read_meta(fd, 0, &m[0]);
    if (ok[0] == 1)
        ok[1] = read_meta(fd, (off_t)m[0].dbs[0].pad, &m[1]);
    if (fstat(fd, &sb)) {
        st = ret_fail(err, errlen, RET_EIO, "cannot stat %s: %s", path, strerror(errno));
        goto out;
    }
    if (sb.st_size == 0)
        goto out;           /* LMDB has not written it yet: it starts a new store */
    for (int i = 0; i < 2; i++) {
        if (ok[i] == -2) {
            st = ret_fail(err, errlen, RET_EIO, "cannot read %s: %s", path, strerror(errno));
            goto out;
        }
        if (ok[i] != 1) {
            st = ret_fail(err, errlen, RET_ECORRUPT,
                          "store at %s is damaged: %s (%lld bytes) has no valid LMDB meta page %d%s",
                          dir, path, (long long)sb.st_size, i,
                          ok[i] == -1 ? ": the file is too short to hold it" : "");
            goto out;
        }
    }
    const struct LmdbMeta *cur = &m[m[1].txnid > m[0].txnid];
    uint64_t psize = cur->dbs[0].pad;
    if ((uint64_t)cur->last_pg >= UINT64_MAX / psize - 1) {
        st = ret_fail(err, errlen, RET_ECORRUPT, "store at %s is damaged: %s's meta page claims "
                      "page %llu as its last", dir, path, (unsigned long long)cur->last_pg);
        goto out;
    }
    uint64_t need = ((uint64_t)cur->last_pg + 1) * psize;
    if ((uint64_t)sb.st_size < need)
        st = ret_fail(err, errlen, RET_ECORRUPT,
                      "store at %s is damaged: %s holds %llu bytes, but its meta page (transaction "
                      "%llu) uses %llu pages of %llu bytes, %llu bytes: the file was cut short "
                      "(restore a backup or rebuild the store)", dir, path,
                      (unsigned long long)sb.st_size, (unsigned long long)cur->txnid,
                      (unsigned long long)cur->last_pg + 1, (unsigned long long)psize,
                      (unsigned long long)need);
out:
    close(fd);
    return st;
}

/* ---- the damaged mark ---- */

int store_mark_damaged(struct Store *s, const char *why)
{
    int expect = 0;
    if (!__atomic_compare_exchange_n(&s->damaged, &expect, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 0;
    snprintf(s->damage, sizeof s->damage, "%s", why && why[0] ? why : "damaged");
    __atomic_store_n(&s->damaged, 2, __ATOMIC_RELEASE);
    return 1;
}

int store_damaged(struct Store *s, char *why, size_t cap)
{
    int d = __atomic_load_n(&s->damaged, __ATOMIC_ACQUIRE);
    if (why && cap)
        snprintf(why, cap, "%s", d == 2 ? s->damage : d ? "damaged" : "");
    return d != 0;
}

/* ---- the sample check ---- */

#define SAMPLE_BUDGET 100000
#define SAMPLE_SECONDS 0.5
#define SAMPLE_RUN 8              /* records read after each seek */
#define SAMPLE_MIN_POINTS 64      /* seeks per database and collection, at least */
#define SAMPLE_MAX_POINTS 8192
#define SAMPLE_POSTINGS 8         /* postings of a block looked up */
#define SEEK_KEY_MAX 64

/* Keys to seek to (after the collection prefix), SEEK_KEY_MAX bytes a slot. */
struct SeekKeys {
    uint8_t *bytes;
    uint8_t *len;
    size_t n, cap;
};

struct Sample {
    struct Store *s;
    MDB_txn *txn;
    struct StoreVerifyReport *rep;
    size_t left;                  /* records still to read */
    double deadline;
    struct Posting *buf;
    /* gathered from the chunks sampled, so that the documents and the postings sampled spread
     * over their databases as their keys do: the chunks' document ids, words of their text */
    struct SeekKeys doc_keys, term_keys;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int seek_init(struct SeekKeys *sk, size_t cap)
{
    sk->bytes = malloc(cap * SEEK_KEY_MAX);
    sk->len = malloc(cap);
    sk->n = 0;
    sk->cap = cap;
    return sk->bytes && sk->len ? 0 : -1;
}

static void seek_free(struct SeekKeys *sk)
{
    free(sk->bytes);
    free(sk->len);
    memset(sk, 0, sizeof *sk);
}

static void seek_add(struct SeekKeys *sk, const void *p, size_t len)
{
    if (sk->n == sk->cap || len == 0)
        return;
    if (len > SEEK_KEY_MAX)
        len = SEEK_KEY_MAX;
    memcpy(sk->bytes + sk->n * SEEK_KEY_MAX, p, len);
    sk->len[sk->n++] = (uint8_t)len;
}

static int word_byte(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
}

/* A word of text (ASCII letters and digits, lowercased) from a spot that `salt` picks. */
static void seek_add_word(struct SeekKeys *sk, const char *text, size_t len, uint32_t salt)
{
    if (len == 0)
        return;
    size_t i = (size_t)((uint64_t)salt * 2654435761u % len), n = 0;
    char w[SEEK_KEY_MAX];
    while (i < len && word_byte(text[i]))
        i++;
    while (i < len && !word_byte(text[i]))
        i++;
    while (i < len && n < sizeof w && word_byte(text[i])) {
        char ch = text[i++];
        w[n++] = ch >= 'A' && ch <= 'Z' ? (char)(ch - 'A' + 'a') : ch;
    }
    seek_add(sk, w, n);
}

static void problem(struct Sample *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(struct Sample *x, const char *fmt, ...)
{
    if (x->rep->problems++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(x->rep->first_problem, sizeof x->rep->first_problem, fmt, ap);
        va_end(ap);
    }
}

/* One more record read; 0 when the budget or the time is spent. */
static int spend(struct Sample *x)
{
    if (x->left == 0)
        return 0;
    x->left--;
    if ((x->left & 63) == 0 && now_s() > x->deadline)
        x->left = 0;
    return 1;
}

/* An LMDB error other than MDB_NOTFOUND is a finding; 1 when rc was one. */
static int lmdb_problem(struct Sample *x, int rc, const char *coll, const char *what)
{
    if (rc == 0 || rc == MDB_NOTFOUND)
        return 0;
    problem(x, "collection \"%s\": %s while reading %s", coll, mdb_strerror(rc), what);
    x->left = 0;      /* LMDB fails every later call of the transaction (MDB_BAD_TXN) */
    return 1;
}

static int same_coll(const MDB_val *k, uint32_t coll)
{
    return k->mv_size >= 4 && get_be32(k->mv_data) == coll;
}

/* The chunk `cid` exists and its record decodes; *n_terms receives its length. 0 found,
 * 1 missing or malformed (reported), -1 an LMDB error (reported). */
static int chunk_exists(struct Sample *x, const struct CollRecord *c, const char *name,
                        uint32_t cid, uint32_t *n_terms)
{
    uint8_t kb[8];
    MDB_val k = { key_chunk(kb, c->id, cid), kb }, v;
    int rc = mdb_get(x->txn, x->s->db_chunks, &k, &v);
    if (rc == MDB_NOTFOUND) {
        problem(x, "collection \"%s\": a record points at missing chunk %u", name, cid);
        return 1;
    }
    if (lmdb_problem(x, rc, name, "a chunk"))
        return -1;
    struct ChunkRecord cr;
    const char *did;
    size_t did_len;
    if (chunk_record_decode(&v, &cr, &did, &did_len)) {
        problem(x, "collection \"%s\": chunk %u: malformed record", name, cid);
        return 1;
    }
    *n_terms = cr.n_terms;
    return 0;
}

/* Visitors of one record: 0 go on, -1 stop (an LMDB error, reported). */
typedef int (*VisitFn)(struct Sample *x, const struct CollRecord *c, const char *name,
                       const MDB_val *k, const MDB_val *v);

/* A chunk against its document; gathers seek keys for the other databases. */
static int visit_chunk(struct Sample *x, const struct CollRecord *c, const char *name,
                       const MDB_val *k, const MDB_val *v)
{
    x->rep->chunks++;
    uint32_t cid = k->mv_size == 8 ? get_be32((const uint8_t *)k->mv_data + 4) : 0;
    struct ChunkRecord cr;
    const char *did;
    size_t did_len;
    if (k->mv_size != 8 || chunk_record_decode(v, &cr, &did, &did_len)) {
        problem(x, "collection \"%s\": chunk %u: malformed key or record", name, cid);
        return 0;
    }
    seek_add(&x->doc_keys, did, did_len);
    char why[512];
    uint8_t dkb[KEY_MAX];
    MDB_val dk = { key_doc(dkb, c->id, did, did_len), dkb }, dv;
    int rc = mdb_get(x->txn, x->s->db_docs, &dk, &dv);
    struct DocHeader h;
    const char *title, *text;
    const void *meta;
    if (rc == MDB_NOTFOUND)
        problem(x, "collection \"%s\": chunk %u points at a missing document", name, cid);
    else if (lmdb_problem(x, rc, name, "a document"))
        return -1;
    else if (doc_record_decode(&dv, &h, &title, &meta, &text))
        problem(x, "collection \"%s\": document of chunk %u: malformed record", name, cid);
    else if (cid < h.first_chunk || cid - h.first_chunk >= h.n_chunks ||
             cr.chunk != cid - h.first_chunk || cr.byte_end > h.text_len)
        problem(x, "collection \"%s\": chunk %u does not match its document", name, cid);
    else if (!utf8_valid(text + cr.byte_start, cr.byte_end - cr.byte_start, NULL))
        problem(x, "collection \"%s\": the text of chunk %u is not valid UTF-8", name, cid);
    else if (chunk_record_check(x->s, name, cid, v, &cr, did, did_len, title, h.title_len, text,
                                why, sizeof why))
        problem(x, "%s", why);
    else
        seek_add_word(&x->term_keys, text + cr.byte_start, cr.byte_end - cr.byte_start, cid);
    return 0;
}

/* A document: its record decodes, its chunk range is allocated, its first chunk exists. */
static int visit_doc(struct Sample *x, const struct CollRecord *c, const char *name,
                     const MDB_val *k, const MDB_val *v)
{
    x->rep->docs++;
    struct DocHeader h;
    const char *title, *text;
    const void *meta;
    size_t id_len = k->mv_size - 4;
    if (id_len == 0 || id_len > INDEX_MAX_ID_BYTES || doc_record_decode(v, &h, &title, &meta, &text)) {
        problem(x, "collection \"%s\": malformed document key or record", name);
        return 0;
    }
    if ((uint64_t)h.first_chunk + h.n_chunks > c->next_chunk_id) {
        problem(x, "collection \"%s\": document \"%.*s\" claims chunk ids beyond the allocator",
                name, (int)(id_len > 64 ? 64 : id_len), (const char *)k->mv_data + 4);
        return 0;
    }
    char why[512];
    if (doc_record_check(x->s, name, k, v, &h, why, sizeof why)) {
        problem(x, "%s", why);
        return 0;
    }
    uint32_t n_terms;
    return h.n_chunks && chunk_exists(x, c, name, h.first_chunk, &n_terms) < 0 ? -1 : 0;
}

/* A postings key: a header decodes; a block decodes, and its first postings name live chunks
 * of the length they say. */
static int visit_posting(struct Sample *x, const struct CollRecord *c, const char *name,
                         const MDB_val *k, const MDB_val *v)
{
    const char *kp = (const char *)k->mv_data + 4;
    const char *z = memchr(kp, 0, k->mv_size - 4);
    size_t tlen = z ? (size_t)(z - kp) : 0;
    size_t rest = z ? k->mv_size - 4 - tlen - 1 : 1;
    if (!z || tlen == 0 || tlen > ANALYZE_MAX_TERM || (rest != 0 && rest != 4)) {
        problem(x, "collection \"%s\": malformed postings key", name);
        return 0;
    }
    if (rest == 0) {
        struct TermHeader th;
        if (term_header_decode(v, &th))
            problem(x, "collection \"%s\": term \"%.*s\": malformed header", name, (int)tlen, kp);
        return 0;
    }
    uint32_t base = get_be32((const uint8_t *)z + 1);
    size_t np;
    if (postings_decode(base, v->mv_data, v->mv_size, x->buf, POSTINGS_BLOCK * 4, &np) || np == 0) {
        problem(x, "collection \"%s\": term \"%.*s\": malformed block at %u", name, (int)tlen, kp, base);
        return 0;
    }
    for (size_t i = 0; i < np && i < SAMPLE_POSTINGS; i++) {
        x->rep->postings++;
        uint32_t n_terms = 0;
        int f = chunk_exists(x, c, name, x->buf[i].id, &n_terms);
        if (f < 0)
            return -1;
        if (f == 0 && n_terms != x->buf[i].len)
            problem(x, "collection \"%s\": term \"%.*s\": the posting for chunk %u has length %u, "
                    "the chunk %u", name, (int)tlen, kp, x->buf[i].id, x->buf[i].len, n_terms);
    }
    return 0;
}

/* Reads collection c's records of database dbi: all of them when the database holds no more
 * than `share` records, else SAMPLE_RUN after the collection's start and after each seek key. */
static void walk(struct Sample *x, MDB_dbi dbi, const char *what, const struct CollRecord *c,
                 const char *name, const struct SeekKeys *keys, size_t entries, size_t share,
                 VisitFn fn)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(x->txn, dbi, &cur);
    if (lmdb_problem(x, rc, name, what))
        return;
    int whole = entries <= share;
    size_t points = whole ? 1 : keys->n + 1, run = whole ? SIZE_MAX : SAMPLE_RUN;
    for (size_t p = 0; p < points && x->left; p++) {
        uint8_t kb[4 + SEEK_KEY_MAX];
        size_t kl = 4;
        put_be32(kb, c->id);
        if (p > 0) {
            memcpy(kb + 4, keys->bytes + (p - 1) * SEEK_KEY_MAX, keys->len[p - 1]);
            kl += keys->len[p - 1];
        }
        MDB_val k = { kl, kb }, v;
        size_t n = 0;
        int stop = 0;
        for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); rc == 0 && same_coll(&k, c->id) &&
             n < run && spend(x); rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT), n++)
            if ((stop = fn(x, c, name, &k, &v) < 0))
                break;
        if (stop || lmdb_problem(x, rc, name, what))
            break;
    }
    mdb_cursor_close(cur);
}

/* One collection: chunks at ids spread evenly over its allocator, then documents and postings
 * from the keys those chunks gave. */
static int sample_collection(struct Sample *x, const struct CollRecord *c, const char *name,
                             const MDB_stat *sc, const MDB_stat *sd, const MDB_stat *sp, size_t share)
{
    size_t points = share / SAMPLE_RUN;
    points = points < SAMPLE_MIN_POINTS ? SAMPLE_MIN_POINTS
           : points > SAMPLE_MAX_POINTS ? SAMPLE_MAX_POINTS : points;
    struct SeekKeys chunk_keys;
    if (seek_init(&chunk_keys, points) || seek_init(&x->doc_keys, points) ||
        seek_init(&x->term_keys, points)) {
        seek_free(&chunk_keys);
        return -1;
    }
    for (size_t p = 1; p < points; p++) {
        uint8_t id[4];
        put_be32(id, (uint32_t)((uint64_t)c->next_chunk_id * p / points));
        seek_add(&chunk_keys, id, 4);
    }
    walk(x, x->s->db_chunks, "the chunks", c, name, &chunk_keys, sc->ms_entries, share, visit_chunk);
    walk(x, x->s->db_docs, "the documents", c, name, &x->doc_keys, sd->ms_entries, share, visit_doc);
    walk(x, x->s->db_postings, "the postings", c, name, &x->term_keys, sp->ms_entries, share,
         visit_posting);
    seek_free(&chunk_keys);
    seek_free(&x->doc_keys);
    seek_free(&x->term_keys);
    return 0;
}

int store_check_sample(struct Store *s, size_t budget, struct StoreVerifyReport *rep, char *err,
                       size_t errlen)
{
    memset(rep, 0, sizeof *rep);
    struct Sample x = { .s = s, .rep = rep, .left = budget ? budget : SAMPLE_BUDGET,
                        .deadline = now_s() + SAMPLE_SECONDS };
    x.buf = malloc(POSTINGS_BLOCK * 4 * sizeof *x.buf);
    if (!x.buf)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    int st = store_txn_begin(s, MDB_RDONLY, &x.txn, err, errlen);
    if (st) {
        free(x.buf);
        return st;
    }
    MDB_stat sc, sd, sp, ss;
    int rc = mdb_stat(x.txn, s->db_stats, &ss);
    if (!rc) rc = mdb_stat(x.txn, s->db_docs, &sd);
    if (!rc) rc = mdb_stat(x.txn, s->db_chunks, &sc);
    if (!rc) rc = mdb_stat(x.txn, s->db_postings, &sp);
    MDB_cursor *cur = NULL;
    if (!rc)
        rc = mdb_cursor_open(x.txn, s->db_stats, &cur);
    if (rc) {
        problem(&x, "%s while reading the databases' roots", mdb_strerror(rc));
        goto done;
    }
    /* each collection's share of each database's part of the budget */
    size_t n_coll = ss.ms_entries ? ss.ms_entries : 1;
    size_t share = x.left / 3 / n_coll;
    if (share < 256)
        share = 256;
    MDB_val k, v;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        char name[INDEX_MAX_COLLECTION_BYTES + 1];
        size_t nl = k.mv_size < sizeof name - 1 ? k.mv_size : sizeof name - 1;
        memcpy(name, k.mv_data, nl);
        name[nl] = 0;
        struct CollRecord c;
        rep->collections++;
        if (nl != k.mv_size || index_validate_collection(name, NULL, 0)) {
            problem(&x, "a collection record has an invalid name");
            continue;
        }
        if (coll_record_decode(&v, &c)) {
            problem(&x, "collection \"%s\": malformed record", name);
            continue;
        }
        if (sample_collection(&x, &c, name, &sc, &sd, &sp, share)) {
            st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
            goto done;
        }
    }
    if (rc != MDB_NOTFOUND)
        problem(&x, "%s while reading the collection records", mdb_strerror(rc));
done:
    if (cur)
        mdb_cursor_close(cur);
    store_txn_abort(s, x.txn);
    free(x.buf);
    if (st)
        return st;
    if (rep->problems)
        return ret_fail(err, errlen, RET_ECORRUPT, "%llu problem(s) in a sample of the store; "
                        "first: %s", (unsigned long long)rep->problems, rep->first_problem);
    return RET_OK;
}

/* ---- checks in a child process ---- */

/* What the child writes to the pipe, once. */
struct ChildReport {
    uint32_t magic;
    int32_t status;
    struct StoreVerifyReport rep;
    char err[512];
};
#define CHILD_REPORT_MAGIC 0x5C4EC4u

static void child_run(const char *dir, const struct StoreOptions *opt, enum StoreCheckDepth depth,
                      const char *collection, int fd)
{
    struct ChildReport cr;
    memset(&cr, 0, sizeof cr);
    cr.magic = CHILD_REPORT_MAGIC;
    struct Store *s = NULL;
    cr.status = store_open(dir, opt, &s, cr.err, sizeof cr.err);
    if (cr.status == RET_OK)
        cr.status = depth == STORE_CHECK_FULL
                  ? store_verify(s, collection, &cr.rep, cr.err, sizeof cr.err)
                  : store_check_sample(s, 0, &cr.rep, cr.err, sizeof cr.err);
    store_close(&s);
    const char *p = (const char *)&cr;
    size_t left = sizeof cr;
    while (left) {
        ssize_t n = write(fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        p += n;
        left -= (size_t)n;
    }
    _exit(left ? 1 : 0);
}

/* Reads the child's report until end of file or the deadline (deadline 0: none). Returns the
 * bytes read, or -1 when the deadline passed. */
static ssize_t read_report(int fd, struct ChildReport *cr, double deadline)
{
    size_t got = 0;
    char sink[256];
    for (;;) {
        int wait_ms = -1;
        if (deadline > 0) {
            double left = deadline - now_s();
            if (left <= 0)
                return -1;
            wait_ms = (int)(left * 1000) + 1;
        }
        struct pollfd pfd = { .fd = fd, .events = POLLIN };
        int pr = poll(&pfd, 1, wait_ms);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0)
            return (ssize_t)got;
        if (pr == 0)
            continue;      /* the deadline is checked above */
        ssize_t n = got < sizeof *cr ? read(fd, (char *)cr + got, sizeof *cr - got)
                                     : read(fd, sink, sizeof sink);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return (ssize_t)got;
        if (got < sizeof *cr)
            got += (size_t)n;
    }
}

int store_check_isolated(const char *dir, const struct StoreOptions *opt,
                         enum StoreCheckDepth depth, const char *collection, double timeout_s,
                         struct StoreVerifyReport *rep, char *err, size_t errlen)
{
    memset(rep, 0, sizeof *rep);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC))
        return ret_fail(err, errlen, RET_EIO, "cannot check the store: pipe: %s", strerror(errno));
    fflush(NULL);          /* buffered output must not be written twice */
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        close(fds[0]);
        close(fds[1]);
        return ret_fail(err, errlen, RET_EIO, "cannot check the store: fork: %s", strerror(e));
    }
    if (pid == 0) {
        close(fds[0]);
        child_run(dir, opt, depth, collection, fds[1]);
    }
    close(fds[1]);
    struct ChildReport cr;
    memset(&cr, 0, sizeof cr);
    ssize_t got = read_report(fds[0], &cr, timeout_s > 0 ? now_s() + timeout_s : 0);
    close(fds[0]);
    if (got < 0)
        kill(pid, SIGKILL);
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR)
        ;
    if (got == (ssize_t)sizeof cr && cr.magic == CHILD_REPORT_MAGIC && WIFEXITED(ws) &&
        WEXITSTATUS(ws) == 0) {
        *rep = cr.rep;
        cr.err[sizeof cr.err - 1] = 0;
        if (cr.status)
            snprintf(err, errlen, "%s", cr.err);
        return cr.status;
    }
    rep->problems = 1;
    char *why = rep->first_problem;
    size_t cap = sizeof rep->first_problem;
    if (got < 0)
        snprintf(why, cap, "the check did not finish within %.0f s (a loop in the store's "
                 "B-tree?)", timeout_s);
    else if (WIFSIGNALED(ws) && WTERMSIG(ws) == SIGABRT)
        snprintf(why, cap, "the store's B-tree is damaged: LMDB aborted while reading it "
                 "(signal %d)", SIGABRT);
    else if (WIFSIGNALED(ws))
        snprintf(why, cap, "the store is damaged: reading it killed the checking process "
                 "(signal %d, %s)", WTERMSIG(ws), strsignal(WTERMSIG(ws)));
    else
        snprintf(why, cap, "the store is damaged: the checking process ended without a report "
                 "(exit status %d)", WIFEXITED(ws) ? WEXITSTATUS(ws) : -1);
    return ret_fail(err, errlen, RET_ECORRUPT, "%s", why);
}
