/* bench_retriever: ingest throughput and top-10 search latency of the diffrag store, side by
 * side with SQLite FTS5's bm25() on the same corpus and queries. Corpora of about 10K and 100K
 * chunks are built by sampling and recombining sentences of the shared SQuAD passages; the
 * queries are the SQuAD questions. Both engines index the same chunks (title + chunk text),
 * commit in the same batches with their default durability (LMDB sync, SQLite synchronous=FULL),
 * stem with Porter/Snowball and rank with BM25; latencies include query analysis and a read
 * transaction per query. Run through `make bench-retriever`. */
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "retriever/bm25.h"
#include "retriever/chunker.h"
#include "text/json.h"
#include "retriever/status.h"
#include "retriever/store.h"
#include "model/tokcount_model.h"
#include "text/tokcount.h"

#define BATCH_BYTES (4u << 20) /* text per transaction, both engines (the CLI's default too) */
#define WARMUP 30 /* untimed queries first, on each engine */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x853C49E6748FEA9Bull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

struct Str { char *p; size_t len; };
struct StrList { struct Str *v; size_t n, cap; };

static int push(struct StrList *l, const char *p, size_t len)
{
    if (l->n == l->cap) {
        size_t c = l->cap ? l->cap * 2 : 1024;
        struct Str *v = realloc(l->v, c * sizeof *v);
        if (!v)
            return -1;
        l->v = v;
        l->cap = c;
    }
    l->v[l->n].p = strndup(p, len);
    l->v[l->n].len = len;
    return l->v[l->n++].p ? 0 : -1;
}

/* Read string fields `keys` of each JSON line; `skip_key` set to "true" skips the line. */
static int read_jsonl(const char *path, const char *const *keys, size_t n_keys, struct StrList *out,
                      const char *must_be_false)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0) {
        if (must_be_false && strstr(line, must_be_false))
            continue;
        char *v[4];
        size_t vl[4];
        if (json_object_strings(line, (size_t)len, keys, n_keys, v, vl, NULL, 0) == RET_OK) {
            for (size_t i = 0; i < n_keys; i++) {
                push(&out[i], v[i] ? v[i] : "", v[i] ? vl[i] : 0);
                free(v[i]);
            }
        }
    }
    free(line);
    fclose(f);
    return 0;
}

struct Corpus {
    struct StrList ids, titles, texts;
    size_t bytes;
};

static void corpus_free(struct Corpus *c)
{
    struct StrList *ls[] = { &c->ids, &c->titles, &c->texts };
    for (int k = 0; k < 3; k++) {
        for (size_t i = 0; i < ls[k]->n; i++)
            free(ls[k]->v[i].p);
        free(ls[k]->v);
    }
    memset(c, 0, sizeof *c);
}

/* Documents of 500..1100 bytes of randomly drawn sentences (about one 256-token chunk each). */
static void build_corpus(struct Corpus *c, size_t n_docs, const struct StrList *sents, const struct StrList *sent_title)
{
    char *buf = malloc(4096);
    for (size_t d = 0; d < n_docs; d++) {
        size_t target = 500 + rnd() % 600, len = 0;
        size_t first = rnd() % sents->n;
        while (len < target) {
            const struct Str *s = &sents->v[len ? rnd() % sents->n : first];
            if (len + s->len + 2 > 4096)
                break;
            if (len)
                buf[len++] = ' ';
            memcpy(buf + len, s->p, s->len);
            len += s->len;
        }
        char id[32];
        int il = snprintf(id, sizeof id, "s%zu", d);
        push(&c->ids, id, (size_t)il);
        push(&c->titles, sent_title->v[first].p, sent_title->v[first].len);
        push(&c->texts, buf, len);
        c->bytes += len;
    }
    free(buf);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, size_t n, double p)
{
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)ceil(p * (double)n) - 1;
    return v[i < n ? i : n - 1];
}

struct Result {
    size_t docs, chunks;
    double mb;
    double ingest_s, ingest_mbps, ingest_dps;
    double p50_ms, p99_ms, mean_ms;
    double hits_per_query;
};

static void rm_dir(const char *dir)
{
    char p[1024];
    const char *files[] = { "data.mdb", "lock.mdb", "fts.db", "fts.db-journal" };
    for (size_t i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(dir);
}

static int bench_diffrag(const char *dir, const struct Corpus *c, const struct TokenCounter *tc,
                         const struct StrList *queries, struct Result *r, sqlite3 *fts_out)
{
    struct Store *s;
    char err[512];
    if (store_open(dir, NULL, &s, err, sizeof err)) {
        fprintf(stderr, "store_open: %s\n", err);
        return -1;
    }
    size_t n = c->ids.n;
    struct StoreDoc *docs = calloc(n, sizeof *docs);
    double t0 = now_s();
    for (size_t i = 0; i < n;) {
        size_t m = 0, bytes = 0;
        while (i + m < n && bytes < BATCH_BYTES) {
            size_t k = i + m++;
            docs[m - 1] = (struct StoreDoc){ c->ids.v[k].p, c->ids.v[k].len, c->texts.v[k].p, c->texts.v[k].len,
                                             c->titles.v[k].p, c->titles.v[k].len, NULL, 0 };
            bytes += c->texts.v[k].len;
        }
        if (store_put_docs(s, "bench", docs, m, NULL, tc, err, sizeof err)) {
            fprintf(stderr, "store_put_docs: %s\n", err);
            return -1;
        }
        i += m;
    }
    r->ingest_s = now_s() - t0;
    free(docs);
    r->docs = n;
    r->mb = (double)c->bytes / 1e6;
    r->ingest_mbps = r->mb / r->ingest_s;
    r->ingest_dps = (double)n / r->ingest_s;
    struct StoreReader *rd;
    struct StoreCollStats cs;
    store_read_begin(s, &rd, err, sizeof err);
    store_collection_stats(rd, "bench", &cs, err, sizeof err);
    r->chunks = cs.n_chunks;
    /* Hand the very same chunks (title + chunk text) to FTS5, in the same batches. */
    if (fts_out) {
        sqlite3_stmt *ins;
        sqlite3_prepare_v2(fts_out, "INSERT INTO chunks(rowid, title, body) VALUES (?, ?, ?)", -1, &ins, NULL);
        size_t in_batch = 0;
        sqlite3_exec(fts_out, "BEGIN", NULL, NULL, NULL);
        for (uint32_t id = 0; id < cs.next_chunk_id; id++) {
            struct StoreChunkView cv;
            if (store_get_chunk(rd, "bench", id, &cv, NULL, 0))
                continue;
            struct StoreDocView dv;
            store_get_doc(rd, "bench", cv.doc_id, cv.doc_id_len, &dv, NULL, 0);
            sqlite3_bind_int64(ins, 1, id);
            sqlite3_bind_text(ins, 2, dv.title, (int)dv.title_len, SQLITE_STATIC);
            sqlite3_bind_text(ins, 3, dv.text + cv.byte_start, (int)(cv.byte_end - cv.byte_start), SQLITE_STATIC);
            if (sqlite3_step(ins) != SQLITE_DONE) {
                fprintf(stderr, "fts insert: %s\n", sqlite3_errmsg(fts_out));
                return -1;
            }
            sqlite3_reset(ins);
            in_batch += cv.byte_end - cv.byte_start;
            if (in_batch >= BATCH_BYTES) {
                sqlite3_exec(fts_out, "COMMIT; BEGIN", NULL, NULL, NULL);
                in_batch = 0;
            }
        }
        sqlite3_exec(fts_out, "COMMIT", NULL, NULL, NULL);
        sqlite3_finalize(ins);
    }
    store_read_end(&rd);

    size_t nq = queries->n;
    double *lat = malloc(nq * sizeof *lat);
    struct SearchHit hits[10];
    struct SearchOptions o;
    search_options_default(&o);
    o.k = 10;
    size_t total_hits = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (size_t q = 0; q < nq; q++) {
            if (pass == 0 && q >= WARMUP)
                break; /* warm-up */
            double q0 = now_s();
            size_t nh;
            store_read_begin(s, &rd, err, sizeof err);
            if (store_search(rd, "bench", queries->v[q].p, queries->v[q].len, &o, hits, 10, &nh, NULL, err, sizeof err)) {
                fprintf(stderr, "search: %s\n", err);
                return -1;
            }
            store_read_end(&rd);
            if (pass == 1) {
                lat[q] = (now_s() - q0) * 1e3;
                total_hits += nh;
            }
        }
    }
    double sum = 0;
    for (size_t q = 0; q < nq; q++)
        sum += lat[q];
    r->mean_ms = sum / (double)nq;
    r->p50_ms = pct(lat, nq, 0.50);
    r->p99_ms = pct(lat, nq, 0.99);
    r->hits_per_query = (double)total_hits / (double)nq;
    free(lat);
    store_close(&s);
    return 0;
}

/* FTS5 query: every word of the question as a quoted term, OR'ed (a disjunctive query like
 * BM25 in diffrag). */
static void fts_query(const char *q, size_t len, char *out, size_t cap)
{
    size_t o = 0, i = 0;
    out[0] = 0;
    while (i < len) {
        while (i < len && !((unsigned char)q[i] >= 0x80 || (q[i] >= '0' && q[i] <= '9') ||
                            (q[i] >= 'a' && q[i] <= 'z') || (q[i] >= 'A' && q[i] <= 'Z')))
            i++;
        size_t s = i;
        while (i < len && ((unsigned char)q[i] >= 0x80 || (q[i] >= '0' && q[i] <= '9') ||
                           (q[i] >= 'a' && q[i] <= 'z') || (q[i] >= 'A' && q[i] <= 'Z')))
            i++;
        if (i > s && o + (i - s) + 8 < cap) {
            o += (size_t)snprintf(out + o, cap - o, "%s\"%.*s\"", o ? " OR " : "", (int)(i - s), q + s);
        }
    }
}

static int bench_fts(sqlite3 *db, const struct StrList *queries, struct Result *r)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT rowid, bm25(chunks) FROM chunks WHERE chunks MATCH ? "
                               "ORDER BY rank LIMIT 10", -1, &st, NULL) != SQLITE_OK) {
        fprintf(stderr, "fts prepare: %s\n", sqlite3_errmsg(db));
        return -1;
    }
    size_t nq = queries->n, total_hits = 0;
    double *lat = malloc(nq * sizeof *lat);
    char qbuf[8192];
    for (int pass = 0; pass < 2; pass++) {
        for (size_t q = 0; q < nq; q++) {
            if (pass == 0 && q >= WARMUP)
                break;
            double q0 = now_s();
            fts_query(queries->v[q].p, queries->v[q].len, qbuf, sizeof qbuf);
            sqlite3_bind_text(st, 1, qbuf, -1, SQLITE_STATIC);
            size_t nh = 0;
            int rc;
            while ((rc = sqlite3_step(st)) == SQLITE_ROW)
                nh++;
            if (rc != SQLITE_DONE) {
                fprintf(stderr, "fts query \"%s\": %s\n", qbuf, sqlite3_errmsg(db));
                return -1;
            }
            sqlite3_reset(st);
            if (pass == 1) {
                lat[q] = (now_s() - q0) * 1e3;
                total_hits += nh;
            }
        }
    }
    sqlite3_finalize(st);
    double sum = 0;
    for (size_t q = 0; q < nq; q++)
        sum += lat[q];
    r->mean_ms = sum / (double)nq;
    r->p50_ms = pct(lat, nq, 0.50);
    r->p99_ms = pct(lat, nq, 0.99);
    r->hits_per_query = (double)total_hits / (double)nq;
    free(lat);
    return 0;
}

/* FTS5 ingest of the corpus documents themselves (title + whole text), batched like diffrag. */
static int fts_ingest_docs(sqlite3 *db, const struct Corpus *c, struct Result *r)
{
    sqlite3_stmt *ins;
    sqlite3_prepare_v2(db, "INSERT INTO docs(title, body) VALUES (?, ?)", -1, &ins, NULL);
    double t0 = now_s();
    size_t in_batch = 0;
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    for (size_t i = 0; i < c->ids.n; i++) {
        sqlite3_bind_text(ins, 1, c->titles.v[i].p, (int)c->titles.v[i].len, SQLITE_STATIC);
        sqlite3_bind_text(ins, 2, c->texts.v[i].p, (int)c->texts.v[i].len, SQLITE_STATIC);
        if (sqlite3_step(ins) != SQLITE_DONE)
            return -1;
        sqlite3_reset(ins);
        in_batch += c->texts.v[i].len;
        if (in_batch >= BATCH_BYTES) {
            sqlite3_exec(db, "COMMIT; BEGIN", NULL, NULL, NULL);
            in_batch = 0;
        }
    }
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_finalize(ins);
    r->ingest_s = now_s() - t0;
    r->docs = c->ids.n;
    r->mb = (double)c->bytes / 1e6;
    r->ingest_mbps = r->mb / r->ingest_s;
    r->ingest_dps = (double)c->ids.n / r->ingest_s;
    return 0;
}

int main(int argc, char **argv)
{
    const char *passages = "build/data/squad2/passages.jsonl";   /* tools/squad_data.py unpacks */
    const char *questions = "build/data/squad2/questions.jsonl";
    const char *model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *tmp = "/tmp";
    size_t sizes[4] = { 10000, 100000 }, n_sizes = 2;
    int approx = 0;
    size_t max_queries = 300;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--passages") && i + 1 < argc) passages = argv[++i];
        else if (!strcmp(argv[i], "--questions") && i + 1 < argc) questions = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--tmp") && i + 1 < argc) tmp = argv[++i];
        else if (!strcmp(argv[i], "--approx-tokens")) approx = 1;
        else if (!strcmp(argv[i], "--max-queries") && i + 1 < argc) max_queries = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
            n_sizes = 0;
            for (char *p = argv[++i]; *p && n_sizes < 4; p++) {
                sizes[n_sizes++] = strtoul(p, &p, 10);
                if (!*p)
                    break;
            }
        } else {
            fprintf(stderr, "usage: bench_retriever [--passages F] [--questions F] [--model F | --approx-tokens] "
                            "[--sizes 10000,100000] [--max-queries N (above 20K chunks; default 300)] [--tmp DIR]\n");
            return 2;
        }
    }
    struct TokenCounter tc;
    struct GgufFile *g = NULL;
    struct Tokenizer *tok = NULL;
    struct TokCountModel *cache = NULL;
    char err[512];
    if (approx) {
        tokcount_simple(&tc);
    } else {
        if (gguf_open(model, &g, err, sizeof err) || tok_load_gguf(g, &tok, err, sizeof err)) {
            fprintf(stderr, "bench_retriever: tokenizer: %s (or pass --approx-tokens)\n", err);
            return 1;
        }
        if (tokcount_model_new(tok, &cache))
            return 1;
        tokcount_model_counter(cache, &tc);
    }
    static const char *const pkeys[] = { "title", "text" };
    struct StrList pl[2] = { { 0 } }, ql[1] = { { 0 } };
    if (read_jsonl(passages, pkeys, 2, pl, NULL))
        return 1;
    static const char *const qkeys[] = { "question" };
    if (read_jsonl(questions, qkeys, 1, ql, "\"is_impossible\": true"))
        return 1;
    /* Sentence pool. */
    struct StrList sents = { 0 }, sent_title = { 0 };
    for (size_t i = 0; i < pl[1].n; i++) {
        size_t *st, n;
        uint8_t *para;
        chunk_sentences(pl[1].v[i].p, pl[1].v[i].len, &st, &para, &n);
        for (size_t j = 0; j < n; j++) {
            size_t e = j + 1 < n ? st[j + 1] : pl[1].v[i].len;
            while (e > st[j] && (pl[1].v[i].p[e - 1] == ' ' || pl[1].v[i].p[e - 1] == '\n'))
                e--;
            push(&sents, pl[1].v[i].p + st[j], e - st[j]);
            push(&sent_title, pl[0].v[i].p, pl[0].v[i].len);
        }
        free(st);
        free(para);
    }
    printf("bench_retriever: %zu passages -> %zu sentences; %zu queries (answerable SQuAD questions); "
           "token counts: %s; transactions of %u MiB of text; SQLite %s\n",
           pl[1].n, sents.n, ql[0].n, approx ? "approximate" : model, BATCH_BYTES >> 20, sqlite3_libversion());
    struct Result rd[4], rf[4], rfi[4];
    for (size_t si = 0; si < n_sizes; si++) {
        struct Corpus c;
        memset(&c, 0, sizeof c);
        build_corpus(&c, sizes[si], &sents, &sent_title);
        char dir[512];
        snprintf(dir, sizeof dir, "%s/bench-retriever-%d-%zu", tmp, (int)getpid(), sizes[si]);
        mkdir(dir, 0755);
        char fts_path[600];
        snprintf(fts_path, sizeof fts_path, "%s/fts.db", dir);
        sqlite3 *db;
        if (sqlite3_open(fts_path, &db) != SQLITE_OK)
            return 1;
        /* Stemming on both sides: Porter in FTS5, Snowball English in diffrag. */
        if (sqlite3_exec(db, "PRAGMA synchronous=FULL;"
                             "CREATE VIRTUAL TABLE chunks USING fts5(title, body, tokenize='porter unicode61');"
                             "CREATE VIRTUAL TABLE docs USING fts5(title, body, tokenize='porter unicode61');",
                         NULL, NULL, NULL) != SQLITE_OK) {
            fprintf(stderr, "fts5: %s\n", sqlite3_errmsg(db));
            return 1;
        }
        printf("\ncorpus %zu: %zu documents, %.1f MB of text\n", sizes[si], c.ids.n, (double)c.bytes / 1e6);
        fflush(stdout);
        /* FTS5 takes ~0.3 s a query at 100K chunks: time both engines on the first
         * max_queries questions there, on all of them below. */
        struct StrList qs = ql[0];
        if (sizes[si] > 20000 && qs.n > max_queries)
            qs.n = max_queries;
        if (bench_diffrag(dir, &c, &tc, &qs, &rd[si], db))
            return 1;
        if (fts_ingest_docs(db, &c, &rfi[si]) || bench_fts(db, &qs, &rf[si]))
            return 1;
        printf("  %zu queries timed on each engine (after %d untimed warm-up queries)\n", qs.n, WARMUP);
        rf[si].chunks = rd[si].chunks;
        printf("  diffrag: %zu chunks; ingest %.2f s = %.2f MB/s, %.0f docs/s; search p50 %.3f ms p99 %.3f ms "
               "mean %.3f ms (%.1f hits/query)\n", rd[si].chunks, rd[si].ingest_s, rd[si].ingest_mbps,
               rd[si].ingest_dps, rd[si].p50_ms, rd[si].p99_ms, rd[si].mean_ms, rd[si].hits_per_query);
        printf("  FTS5:    ingest %.2f s = %.2f MB/s, %.0f docs/s; search p50 %.3f ms p99 %.3f ms mean %.3f ms "
               "(%.1f hits/query)\n", rfi[si].ingest_s, rfi[si].ingest_mbps, rfi[si].ingest_dps, rf[si].p50_ms,
               rf[si].p99_ms, rf[si].mean_ms, rf[si].hits_per_query);
        fflush(stdout);
        sqlite3_close(db);
        rm_dir(dir);
        corpus_free(&c);
    }
    printf("\n%-10s %-8s %9s %9s %10s %10s %10s\n", "chunks", "engine", "MB/s", "docs/s", "p50 ms", "p99 ms", "mean ms");
    for (size_t si = 0; si < n_sizes; si++) {
        printf("%-10zu %-8s %9.2f %9.0f %10.3f %10.3f %10.3f\n", rd[si].chunks, "diffrag", rd[si].ingest_mbps,
               rd[si].ingest_dps, rd[si].p50_ms, rd[si].p99_ms, rd[si].mean_ms);
        printf("%-10zu %-8s %9.2f %9.0f %10.3f %10.3f %10.3f\n", rd[si].chunks, "FTS5", rfi[si].ingest_mbps,
               rfi[si].ingest_dps, rf[si].p50_ms, rf[si].p99_ms, rf[si].mean_ms);
        printf("%-10s %-8s %9.2fx %8.2fx %9.2fx %9.2fx %9.2fx   (FTS5 / diffrag for latency, diffrag / FTS5 "
               "for throughput)\n", "", "ratio", rd[si].ingest_mbps / rfi[si].ingest_mbps,
               rd[si].ingest_dps / rfi[si].ingest_dps, rf[si].p50_ms / rd[si].p50_ms, rf[si].p99_ms / rd[si].p99_ms,
               rf[si].mean_ms / rd[si].mean_ms);
    }
    int ok = 1;
    for (size_t si = 0; si < n_sizes; si++) {
        ok &= rd[si].p50_ms < rf[si].p50_ms && rd[si].ingest_mbps >= 5.0;
        if (sizes[si] >= 100000)
            ok &= rd[si].p50_ms <= 5.0;
    }
    printf("\ngoals (p50 <= 5 ms at 100K, faster than FTS5 at each size, ingest >= 5 MB/s): %s\n",
           ok ? "met" : "NOT met");
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < pl[k].n; i++)
            free(pl[k].v[i].p);
        free(pl[k].v);
    }
    tokcount_model_destroy(&cache);
    tok_destroy(&tok);
    gguf_close(&g);
    return 0;
}
