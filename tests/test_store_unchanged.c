/* Unchanged documents are not stored again (retriever/store.h, store_put_docs_report):
 * - a put of documents exactly as stored reports them unchanged, counts no token, allocates no
 *   chunk id and leaves every chunk where it was; a batch of only such documents commits
 *   nothing (the collection's figures and the file's contents stay);
 * - a changed text, title or metadata is a change: the document is replaced (new chunk ids),
 *   the search follows the new text and verify passes;
 * - a batch mixing new, changed and unchanged documents counts each kind and writes only the
 *   new and changed ones;
 * - a batch that is refused (one bad document) changes nothing and reports nothing. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/bm25.h"
#include "retriever/status.h"
#include "retriever/store.h"
#include "text/tokcount.h"
#include "tests/check.h"
#include "tests/store_util.h"

#define COLL "c"

static atomic_size_t counted; /* calls of the token counter: chunking happened */

static int count_words(void *ctx, const char *text, size_t len, size_t *n)
{
    (void)ctx;
    atomic_fetch_add(&counted, 1);
    size_t w = 0;
    for (size_t i = 0; i < len; i++)
        w += (i == 0 || text[i - 1] == ' ') && text[i] != ' ';
    *n = w;
    return 0;
}

static struct TokenCounter counter(void)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    tc.count = count_words;
    tc.count_ctx = NULL;
    return tc;
}

static const char *const TEXTS[] = {
    "The Danube flows through ten countries. It reaches the Black Sea in Romania.",
    "Mont Blanc is the highest peak of the Alps. The Matterhorn is famous for its shape.",
    "Paris is the capital of France. The Seine crosses it on its way to the sea.",
};

struct Figures { uint64_t docs, chunks; uint32_t next_chunk; uint32_t first[3]; };

static void figures(struct Store *s, struct Figures *f)
{
    static const char *const ids[] = { "danube", "alps", "paris" };
    struct StoreReader *r;
    struct StoreCollStats cs;
    char err[256];
    memset(f, 0, sizeof *f);
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK, "%s", err);
    CHECK(store_collection_stats(r, COLL, &cs, err, sizeof err) == RET_OK, "%s", err);
    f->docs = cs.n_docs;
    f->chunks = cs.n_chunks;
    f->next_chunk = cs.next_chunk_id;
    for (int i = 0; i < 3; i++) {
        struct StoreDocView v;
        f->first[i] = store_get_doc(r, COLL, ids[i], strlen(ids[i]), &v, err, sizeof err) == RET_OK
                          ? v.first_chunk : UINT32_MAX;
    }
    store_read_end(&r);
}

/* The doc id of the best hit for q ("" when none). */
static void top_hit(struct Store *s, const char *q, char *out, size_t cap)
{
    struct StoreReader *r;
    struct SearchOptions o;
    struct SearchHit h[4];
    size_t n = 0;
    char err[256];
    search_options_default(&o);
    o.k = 4;
    out[0] = 0;
    if (store_read_begin(s, &r, err, sizeof err))
        return;
    if (store_search(r, COLL, q, strlen(q), &o, h, 4, &n, NULL, err, sizeof err) == RET_OK && n)
        snprintf(out, cap, "%.*s", (int)h[0].doc_id_len, h[0].doc_id);
    store_read_end(&r);
}

static int put(struct Store *s, const struct StoreDoc *d, size_t n, struct StorePutReport *rep)
{
    struct TokenCounter tc = counter();
    char err[256];
    int st = store_put_docs_report(s, COLL, d, n, NULL, &tc, rep, err, sizeof err);
    if (st)
        fprintf(stderr, "put: %s\n", err);
    return st;
}

static int same_report(const struct StorePutReport *r, size_t a, size_t c, size_t u)
{
    return r->added == a && r->changed == c && r->unchanged == u;
}

static void test_unchanged(void)
{
    char *dir = temp_dir(), err[256], hit[64];
    struct Store *s;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "%s", err);
    struct StoreDoc d[3] = { mkdoc("danube", "Rivers", TEXTS[0]), mkdoc("alps", "Mountains", TEXTS[1]),
                             mkdoc("paris", NULL, TEXTS[2]) };
    struct StorePutReport rep;
    CHECK(put(s, d, 3, &rep) == RET_OK && same_report(&rep, 3, 0, 0), "first put: %zu %zu %zu",
          rep.added, rep.changed, rep.unchanged);
    struct Figures before, after;
    figures(s, &before);
    CHECK(before.docs == 3 && before.chunks >= 3, "%llu docs", (unsigned long long)before.docs);

    /* the same documents again: nothing chunked, nothing written */
    counted = 0;
    CHECK(put(s, d, 3, &rep) == RET_OK && same_report(&rep, 0, 0, 3), "again: %zu %zu %zu",
          rep.added, rep.changed, rep.unchanged);
    CHECK(counted == 0, "the unchanged documents were chunked again (%zu counts)", (size_t)counted);
    figures(s, &after);
    CHECK(memcmp(&before, &after, sizeof before) == 0, "the store changed: next chunk %u -> %u, "
          "danube's first chunk %u -> %u", before.next_chunk, after.next_chunk, before.first[0],
          after.first[0]);

    /* one text changed (a word), one title changed, one metadata added */
    char changed[256];
    snprintf(changed, sizeof changed, "%s", TEXTS[0]);
    memcpy(strstr(changed, "Black"), "Zebra", 5);
    struct StoreDoc e[3] = { mkdoc("danube", "Rivers", changed), mkdoc("alps", "Peaks", TEXTS[1]),
                             mkdoc("paris", NULL, TEXTS[2]) };
    e[2].meta = "\x81\xa1k\xa1v";   /* {"k": "v"} */
    e[2].meta_len = 5;
    counted = 0;
    CHECK(put(s, e, 3, &rep) == RET_OK && same_report(&rep, 0, 3, 0), "changed: %zu %zu %zu",
          rep.added, rep.changed, rep.unchanged);
    CHECK(counted > 0, "the changed documents were not chunked");
    figures(s, &after);
    for (int i = 0; i < 3; i++)
        CHECK(after.first[i] >= before.next_chunk, "document %d kept its old chunks (%u)", i,
              after.first[i]);
    CHECK(after.docs == 3 && after.chunks == before.chunks, "%llu docs, %llu chunks",
          (unsigned long long)after.docs, (unsigned long long)after.chunks);
    top_hit(s, "zebra", hit, sizeof hit);
    CHECK(strcmp(hit, "danube") == 0, "zebra finds \"%s\"", hit);
    top_hit(s, "black", hit, sizeof hit);
    CHECK(hit[0] == 0, "the old text is still found (\"%s\")", hit);
    struct StoreReader *r;
    struct StoreDocView v;
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK, "%s", err);
    CHECK(store_get_doc(r, COLL, "alps", 4, &v, err, sizeof err) == RET_OK &&
          v.title_len == 5 && memcmp(v.title, "Peaks", 5) == 0, "alps' title not replaced");
    CHECK(store_get_doc(r, COLL, "paris", 5, &v, err, sizeof err) == RET_OK && v.meta_len == 5,
          "paris' metadata not stored");
    store_read_end(&r);

    /* a mixed batch: one new, one changed back, one unchanged; the same metadata is the same */
    struct Figures mid = after;
    struct StoreDoc m[3] = { mkdoc("rome", NULL, "Rome lies on the Tiber."), d[0], e[2] };
    CHECK(put(s, m, 3, &rep) == RET_OK && same_report(&rep, 1, 1, 1),
          "mixed: %zu %zu %zu", rep.added, rep.changed, rep.unchanged);
    figures(s, &after);
    CHECK(after.docs == 4 && after.first[1] == mid.first[1] && after.first[2] == mid.first[2] &&
          after.first[0] >= mid.next_chunk, "mixed batch rewrote the wrong documents");
    top_hit(s, "black", hit, sizeof hit);
    CHECK(strcmp(hit, "danube") == 0, "black finds \"%s\"", hit);

    /* a refused batch reports nothing and changes nothing */
    mid = after;
    struct StoreDoc bad[2] = { mkdoc("danube", NULL, "A new text."), mkdoc("empty", NULL, " ") };
    rep.added = 7;
    CHECK(store_put_docs_report(s, COLL, bad, 2, NULL, NULL, &rep, err, sizeof err) == RET_EINPUT,
          "an empty text was taken");
    CHECK(same_report(&rep, 0, 0, 0), "a refused batch reported %zu added", rep.added);
    figures(s, &after);
    CHECK(memcmp(&mid, &after, sizeof mid) == 0, "a refused batch changed the store");

    struct StoreVerifyReport vr;
    CHECK(store_verify(s, NULL, &vr, err, sizeof err) == RET_OK && vr.problems == 0, "verify: %s",
          vr.first_problem);
    store_close(&s);
    rm_store(dir);
    free(dir);
}

int main(void)
{
    test_unchanged();
    return check_report("test_store_unchanged");
}
