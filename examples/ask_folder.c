/* ask_folder: stores the .txt and .md files of a folder in a diffragd collection, then asks a
 * question over it, printing the answer as it is generated and the sources it rests on.
 *
 * The collection is COLLECTION, or "examples" when none is named. The daemon creates it on the
 * first ingest if it does not exist; a later run replaces the same documents (the id is the
 * file's name). `diffrag drop examples` removes it.
 *
 *   cc ask_folder.c $(pkg-config --cflags --libs diffrag) -o ask_folder
 *   ./ask_folder tcp://127.0.0.1:7400 examples "How long is the Rhine?" [COLLECTION]
 */
#define _POSIX_C_SOURCE 200809L /* strdup, opendir */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <diffrag.h>

#define MAX_FILES 256

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = 0;
    fclose(f);
    return s;
}

static int print_delta(void *user, const char *text, size_t len)
{
    (void)user;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0; /* non-zero would cancel the query */
}

int main(int argc, char **argv)
{
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s ENDPOINT FOLDER QUESTION [COLLECTION]\n", argv[0]);
        return 2;
    }
    const char *endpoint = argv[1], *folder = argv[2], *question = argv[3];
    const char *collection = argc == 5 ? argv[4] : "examples";

    /* the folder's text files, one document each, named by their file name */
    DiffragDoc docs[MAX_FILES];
    char *names[MAX_FILES];
    size_t n = 0;
    DIR *dir = opendir(folder);
    if (!dir) {
        perror(folder);
        return 1;
    }
    struct dirent *e;
    while ((e = readdir(dir)) && n < MAX_FILES) {
        size_t len = strlen(e->d_name);
        if (len < 4 || (strcmp(e->d_name + len - 4, ".txt") && strcmp(e->d_name + len - 3, ".md")))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", folder, e->d_name);
        char *text = read_file(path);
        if (!text || !*text) {
            free(text);
            continue;
        }
        names[n] = strdup(e->d_name); /* the id must outlive the directory entry */
        docs[n] = (DiffragDoc){ .id = names[n], .title = names[n], .text = text };
        n++;
    }
    closedir(dir);

    DiffragClient *c = NULL;
    char err[512];
    if (diffrag_new(&c, endpoint, NULL, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int rc = 1;
    DiffragIngestResult *ingested = NULL;
    DiffragAnswer *a = NULL;
    if (diffrag_ingest(c, collection, docs, n, &ingested)) {
        fprintf(stderr, "ingest: %s\n", diffrag_last_error(c));
        goto out;
    }
    printf("stored %lld documents in the collection \"%s\" (created if it was not there); it "
           "holds %lld documents, %lld chunks\n", (long long)ingested->ingested, collection,
           (long long)ingested->docs, (long long)ingested->chunks);

    DiffragQuery q = { .question = question, .collection = collection, .max_tokens = 64 };
    if (diffrag_query(c, &q, print_delta, NULL, &a)) {
        fprintf(stderr, "\nquery: %s (%s)\n", diffrag_last_error(c), diffrag_last_error_code(c));
        goto out;
    }
    printf("\n\nsources:\n");
    for (size_t i = 0; i < a->n_citations; i++)
        printf("  [%lld] %s (score %.2f)\n", (long long)a->citations[i].marker,
               a->citations[i].doc_id, a->citations[i].score);
    printf("%lld tokens generated in %.0f ms\n", (long long)a->completion_tokens, a->total_ms);
    rc = 0;
out:
    diffrag_answer_free(&a);
    diffrag_ingest_result_free(&ingested);
    diffrag_destroy(&c);
    for (size_t i = 0; i < n; i++) {
        free((char *)docs[i].text);
        free(names[i]);
    }
    return rc;
}
