/* A store that cannot take a write for want of room: a map at its ceiling (max_map_size) gives
 * RET_EFULL with a message that says the map is full and what to do, and leaves the store as it
 * was. (A full disk is tests/faults/test_faults_disk.py: it needs a small filesystem.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"
#include "retriever/store.h"
#include "text/tokcount.h"
#include "tests/check.h"
#include "tests/store_util.h"

int main(void)
{
    char *dir = temp_dir();
    struct StoreOptions so;
    store_options_default(&so);
    so.map_size = so.max_map_size = (size_t)1 << 20;
    struct Store *s;
    char err[512];
    CHECK(store_open(dir, &so, &s, err, sizeof err) == RET_OK, "open: %s", err);
    struct TokenCounter tc;
    tokcount_simple(&tc);
    /* 64 KiB documents until one does not fit a 1 MiB map */
    size_t len = 64 << 10;
    char *text = malloc(len + 1);
    for (size_t i = 0; i < len; i++)
        text[i] = (i % 7 == 6) ? ' ' : (char)('a' + (i * 13) % 26);
    text[len] = 0;
    int st = RET_OK, stored = 0;
    for (int i = 0; i < 64 && st == RET_OK; i++) {
        char id[32];
        snprintf(id, sizeof id, "doc%02d", i);
        text[0] = (char)('a' + i % 26);
        struct StoreDoc d = mkdoc(id, NULL, text);
        st = store_put_docs(s, "c", &d, 1, NULL, &tc, err, sizeof err);
        stored += st == RET_OK;
    }
    printf("%d documents stored, then: %s (%s)\n", stored, ret_strerror(st), err);
    CHECK(stored >= 2 && st == RET_EFULL, "the write past the ceiling: %d %s", st, err);
    CHECK(strstr(err, "the store's map is full") && strstr(err, "max_map_size") &&
          strstr(err, "delete documents"), "message: %s", err);
    struct StoreReader *r;
    struct StoreCollStats cs;
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK, "read: %s", err);
    CHECK(store_collection_stats(r, "c", &cs, err, sizeof err) == RET_OK &&
          cs.n_docs == (uint64_t)stored, "documents held: %llu", (unsigned long long)cs.n_docs);
    store_read_end(&r);
    struct StoreVerifyReport rep;
    CHECK(store_verify(s, NULL, &rep, err, sizeof err) == RET_OK && rep.problems == 0,
          "verify: %s", rep.first_problem);
    free(text);
    store_close(&s);
    rm_store(dir);
    free(dir);
    return check_report("test_store_full");
}
