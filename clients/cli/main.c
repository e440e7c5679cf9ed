/* diffrag: the command line over libdiffrag. Owns option parsing, the help of every
 * subcommand, exit codes, connecting (endpoint, timeouts, CurveZMQ keys) and Ctrl-C. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/cli/cli.h"
#include "text/json.h"
#include "text/termsafe.h"
#include "text/utf8.h"

volatile int cli_interrupted;
static DiffragClient *volatile sigint_client;

static const char *const GENERAL_HELP =
    "usage: diffrag [OPTIONS] COMMAND [ARGS]\n"
    "Ask diffragd questions over your documents, and manage its collections.\n"
    "\n"
    "commands:\n"
    "  ask QUESTION|-       answer a question from a collection and/or files\n"
    "  ingest PATH...       store files, folders and .jsonl in a collection\n"
    "  delete ID...         remove documents from a collection\n"
    "  drop COLLECTION      remove a collection and every document in it\n"
    "  get ID               print a stored document\n"
    "  ls                   list collections, or the documents of one (-c)\n"
    "  stats                the daemon's state, or a collection's statistics (-c)\n"
    "  ping                 check that the daemon answers\n"
    "  keygen               make a CurveZMQ key pair\n"
    "`diffrag COMMAND --help` describes each.\n"
    "\n"
    "options of every command:\n"
    "  -e, --endpoint EP    the daemon: tcp://HOST:PORT, ipc://PATH or inproc://NAME\n"
    "                       (default $DIFFRAG_ENDPOINT or " CLI_DEFAULT_ENDPOINT ")\n"
    "  -c, --collection C   collection (default \"" CLI_DEFAULT_COLLECTION "\" for ask, ingest,\n"
    "                       delete and get)\n"
    "      --json           print the daemon's reply as JSON, for scripts\n"
    "      --timeout S      longest wait for a reply, in seconds (default 30; 600 for ask)\n"
    "      --connect-timeout S  longest wait for a connection (default 5)\n"
    "      --server-key K   CurveZMQ: the daemon's public key, or a file holding it\n"
    "                       (default $DIFFRAG_SERVER_KEY)\n"
    "      --key FILE       CurveZMQ: this client's secret key file (default $DIFFRAG_KEY;\n"
    "                       without it a fresh key pair is used)\n"
    "  -h, --help           this help\n"
    "\n"
    "exit codes: 0 ok, 1 the daemon answered with an error, 2 usage error, 3 no connection,\n"
    "4 no reply in time, 5 malformed reply, 6 local error (a file, memory), 130 interrupted.\n";

struct Cmd {
    const char *name;
    int (*run)(const struct CliArgs *);
    const char *opts;   /* letters of the options it takes besides the common ones */
    int min_pos, max_pos;
    const char *help;
};

/* Option letters (short options and codes for long-only ones). */
enum {
    O_ENDPOINT = 'e', O_COLLECTION = 'c', O_HELP = 'h', O_DOC = 'd', O_QUIET = 'q', O_OUT = 'o',
    O_YES = 'y',
    O_JSON = 256, O_TIMEOUT, O_CONNECT_TIMEOUT, O_SERVER_KEY, O_KEY, O_DOC_ID, O_STREAM,
    O_MAX_TOKENS, O_TOP_K, O_MAX_CONTEXT, O_TEMPERATURE, O_TOP_P, O_SEED, O_STOP, O_DEADLINE,
    O_BATCH, O_PROGRESS, O_LIMIT, O_AFTER, O_FORCE, O_ORDER, O_UNSUPPORTED,
    O_ANSWER_MODE, O_SYNC, O_FLOOR,
};

/* Command-specific options, by a letter each in Cmd.opts. */
static const struct { char letter; int code; const char *name; } SPECIFIC[] = {
    { 'd', O_DOC, "--doc" }, { 'i', O_DOC_ID, "--doc-id" }, { 's', O_STREAM, "--stream" },
    { 'm', O_MAX_TOKENS, "--max-tokens" }, { 'k', O_TOP_K, "--top-k" },
    { 'x', O_MAX_CONTEXT, "--max-context-tokens" }, { 't', O_TEMPERATURE, "--temperature" },
    { 'p', O_TOP_P, "--top-p" }, { 'S', O_SEED, "--seed" }, { 'z', O_STOP, "--stop" },
    { 'D', O_DEADLINE, "--deadline" }, { 'b', O_BATCH, "--batch" },
    { 'P', O_PROGRESS, "--progress" }, { 'q', O_QUIET, "--quiet" }, { 'l', O_LIMIT, "--limit" },
    { 'a', O_AFTER, "--after" }, { 'o', O_OUT, "--out" }, { 'f', O_FORCE, "--force" },
    { 'y', O_YES, "--yes" }, { 'r', O_ORDER, "--order" },
    { 'u', O_UNSUPPORTED, "--unsupported" }, { 'Q', O_ANSWER_MODE, "--answer-mode" },
    { 'Y', O_SYNC, "--sync" }, { 'F', O_FLOOR, "--relevance-floor" },
};

static const struct Cmd CMDS[] = {
    { "ask", cmd_ask, "dismkxFtpSzDruQ", 1, 1,
      "usage: diffrag ask QUESTION|- [-c COLLECTION] [-d FILE]... [--stream] [--json]\n"
      "                  [--max-tokens N] [options]\n"
      "Answers QUESTION (\"-\": read it from stdin) from the collection, the files given\n"
      "with -d (sent inline, not stored), or both. Without -c and -d it asks the collection\n"
      "\"" CLI_DEFAULT_COLLECTION "\". Prints the answer, its sources and its grounding figures.\n"
      "  -d, --doc FILE           send FILE as an inline document (repeatable): text, or a\n"
      "                           PDF, DOCX or HTML file as its Markdown (diffrag-extract)\n"
      "      --doc-id ID          with -c: retrieve only from this document (repeatable)\n"
      "      --stream             print the answer as it is generated (--json: one JSON\n"
      "                           line per delta, then the reply)\n"
      "      --max-tokens N       tokens to generate at most\n"
      "      --top-k N            place at most N chunks (default: the budget decides)\n"
      "      --max-context-tokens N  prompt budget in tokens: how much of the documents is\n"
      "                           read (the daemon's default_context_tokens if not given)\n"
      "      --relevance-floor X  0..1: chunks scoring under X times the best one's are\n"
      "                           not read, whatever the budget (0: none dropped; the\n"
      "                           daemon's relevance_floor, 0.5 by default, if not given)\n"
      "      --temperature X      sampling temperature (default 0: greedy)\n"
      "      --top-p X            nucleus sampling\n"
      "      --seed N             sampling seed\n"
      "      --stop STR           stop generating before STR (repeatable)\n"
      "      --deadline S         the daemon's time budget in seconds\n"
      "      --order ORDER        rank: chunks best first (the daemon's default, or\n"
      "                           nearest where it has kv_reuse = 1); nearest: best last,\n"
      "                           next to the question; document: by document and position\n"
      "                           (questions over the same documents then share the cached\n"
      "                           prompt prefix)\n"
      "      --unsupported POLICY answer: never flag; mark: flag an answer the detector\n"
      "                           doubts (the daemon's default unless configured);\n"
      "                           decline: answer \"The documents do not say.\" instead\n"
      "                           when retrieval finds nothing, the detector flags the\n"
      "                           answer or the model refuses (its attempt is shown)\n"
      "      --answer-mode MODE   free: the model's own words (the daemon's default\n"
      "                           unless configured); quote: every word continues a\n"
      "                           verbatim span of the documents, each span printed\n"
      "                           with its source and byte range\n"
      "Ctrl-C cancels the query on the daemon and prints what was generated.\n" },
    { "ingest", cmd_ingest, "bPqY", 1, -1,
      "usage: diffrag ingest PATH... [-c COLLECTION] [--sync] [--batch N] [--progress|--quiet]\n"
      "Stores documents in the collection (created on first use; default \"" CLI_DEFAULT_COLLECTION "\").\n"
      "Folders are walked for .txt, .md, .jsonl, .pdf, .docx and .html files (hidden ones and\n"
      "links to folders left out); a file named on the command line is read whatever its name.\n"
      "A PDF, DOCX or HTML file (known by its content) becomes Markdown through\n"
      "diffrag-extract (beside diffrag, else on PATH; 60 s at most a file). Only regular files\n"
      "are read, text UTF-8 and at most 15 MiB (one request); others are skipped with a note\n"
      "(an error when named). A file becomes one document whose title is its own (HTML\n"
      "<title>, PDF or DOCX title), its first Markdown heading or its name, and whose id is\n"
      "the name of the folder it was found from, then its path inside it: notes/sub/a.md is\n"
      "\"notes/sub/a.md\" whether the folder is given as notes, /abs/notes or \".\" inside it;\n"
      "a file given directly keeps its folder's name (\"notes/a.txt\"). Each line of a .jsonl\n"
      "file is a document {\"id\", \"text\", \"title\"?, \"meta\"?}. An existing id is replaced\n"
      "unless the same text, title and metadata are stored under it already (unchanged: not\n"
      "stored again). The summary counts documents added, changed, unchanged and removed.\n"
      "A progress line goes to stderr while a long ingest runs.\n"
      "      --sync               PATHs are folders; after the ingest, remove the\n"
      "                           collection's documents whose ids lie under a folder's\n"
      "                           name (\"notes/...\") and whose files are gone from it\n"
      "      --batch N            documents per request (default 64; requests also stay\n"
      "                           under 4 MiB of text)\n"
      "      --progress           a progress line after every request\n"
      "  -q, --quiet              no progress line and no summary\n" },
    { "delete", cmd_delete, "", 1, -1,
      "usage: diffrag delete ID... [-c COLLECTION]\n"
      "Removes documents from the collection (ids not present are skipped).\n" },
    { "drop", cmd_drop, "y", 1, 1,
      "usage: diffrag drop COLLECTION [--yes] [--json]\n"
      "Removes the collection and every document in it, for good (a later ingest creates it\n"
      "anew). The collection is named by the argument, not by -c. On a terminal it first asks,\n"
      "showing how many documents the collection holds; declining keeps it and exits 0. When\n"
      "stdin is not a terminal (a script, a pipe) it refuses (exit 2) unless --yes is given.\n"
      "  -y, --yes                drop without asking\n" },
    { "get", cmd_get, "", 1, 1,
      "usage: diffrag get ID [-c COLLECTION] [--json]\n"
      "Prints the text of a stored document (--json: the document with its title, chunk\n"
      "count and meta).\n" },
    { "ls", cmd_ls, "la", 0, 0,
      "usage: diffrag ls [-c COLLECTION] [--limit N] [--after ID] [--json]\n"
      "Without -c: the collections. With -c: its documents (id, bytes, chunks, title) in id\n"
      "order, every page unless --limit.\n"
      "      --limit N            at most N documents\n"
      "      --after ID           start after this document id\n" },
    { "stats", cmd_stats, "", 0, 0,
      "usage: diffrag stats [-c COLLECTION] [--json]\n"
      "Without -c: the daemon (version, model, workers, queue, KV cache). With -c: the\n"
      "collection (documents, chunks, terms, bytes).\n" },
    { "ping", cmd_ping, "", 0, 0,
      "usage: diffrag ping [--json]\n"
      "Checks that the daemon answers, and prints its version, model and the round trip.\n" },
    { "keygen", cmd_keygen, "of", 0, 0,
      "usage: diffrag keygen [-o PREFIX] [--force] [--json]\n"
      "Makes a CurveZMQ key pair: PREFIX.pub (the public key, Z85 text) and PREFIX.key (the\n"
      "secret key, mode 0600). Default PREFIX: \"diffrag\". Give the daemon a key pair of its\n"
      "own and its clients its public key (--server-key); allow a client by its .pub file.\n"
      "  -o, --out PREFIX         where to write the two files\n"
      "      --force              replace existing files\n" },
};

static const char *const COMMON_HELP =
    "options of every command: -e/--endpoint EP, -c/--collection C, --json, --timeout S,\n"
    "--connect-timeout S, --server-key K, --key FILE, -h/--help (see `diffrag --help`).\n";

static const struct Cmd *find_cmd(const char *name)
{
    for (size_t i = 0; i < sizeof CMDS / sizeof CMDS[0]; i++)
        if (strcmp(CMDS[i].name, name) == 0)
            return &CMDS[i];
    return NULL;
}

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "diffrag%s%s: ", cmd ? " " : "", cmd ? cmd : "");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see `diffrag %s%s--help`)\n", cmd ? cmd : "", cmd ? " " : "");
    return CLI_EXIT_USAGE;
}

static int parse_int(const char *cmd, const char *opt, const char *s, long min, long max,
                     int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < min || v > max)
        return cli_usage_error(cmd, "%s wants an integer from %ld to %ld, not \"%s\"", opt, min,
                               max, s);
    *out = (int)v;
    return 0;
}

static int parse_double(const char *cmd, const char *opt, const char *s, double min, double max,
                        double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= min && v <= max))
        return cli_usage_error(cmd, "%s wants a number from %g to %g, not \"%s\"", opt, min, max, s);
    *out = v;
    return 0;
}

static int push(const char ***v, size_t *n, const char *s)
{
    const char **p = realloc(*v, (*n + 1) * sizeof *p);
    if (!p)
        return -1;
    p[(*n)++] = s;
    *v = p;
    return 0;
}

static void on_sigint(int sig)
{
    (void)sig;
    if (cli_interrupted) { /* a second Ctrl-C: stop waiting at all */
        signal(SIGINT, SIG_DFL);
    }
    cli_interrupted = 1;
    DiffragClient *c = sigint_client;
    if (c)
        diffrag_interrupt(c);
}

/* A key given as Z85 text, or as a file that holds it. */
static int resolve_key(const char *what, const char *arg, char key[41])
{
    char err[300];
    if (strlen(arg) == DIFFRAG_KEY_Z85_LEN) {
        char pub[41];
        /* diffrag_key_public accepts exactly the well-formed keys */
        if (diffrag_key_public(arg, pub) == DIFFRAG_OK) {
            memcpy(key, arg, 41);
            return 0;
        }
    }
    if (diffrag_key_read(arg, key, err, sizeof err)) {
        fprintf(stderr, "diffrag: %s: %s\n", what, err);
        return -1;
    }
    return 0;
}

int cli_connect(const struct CliArgs *a, DiffragClient **out)
{
    DiffragOptions o;
    char server[41], secret[41], err[512];
    diffrag_options_init(&o);
    if (a->timeout_ms)
        o.timeout_ms = o.query_timeout_ms = a->timeout_ms;
    if (a->connect_timeout_ms)
        o.connect_timeout_ms = a->connect_timeout_ms;
    if (a->server_key) {
        if (resolve_key("--server-key", a->server_key, server))
            return CLI_EXIT_USAGE;
        o.server_key = server;
    }
    if (a->key_file) {
        if (!a->server_key) {
            fprintf(stderr, "diffrag: --key needs --server-key (the daemon's public key)\n");
            return CLI_EXIT_USAGE;
        }
        if (diffrag_key_read(a->key_file, secret, err, sizeof err)) {
            fprintf(stderr, "diffrag: --key: %s\n", err);
            return CLI_EXIT_USAGE;
        }
        o.secret_key = secret;
    }
    int rc = diffrag_new(out, a->endpoint, &o, err, sizeof err);
    memset(secret, 0, sizeof secret);
    if (rc) {
        fprintf(stderr, "diffrag: %s\n", err);
        return rc == DIFFRAG_EINVAL ? CLI_EXIT_USAGE : CLI_EXIT_LOCAL;
    }
    sigint_client = *out;
    return CLI_EXIT_OK;
}

void cli_disconnect(DiffragClient **c)
{
    sigint_client = NULL;
    diffrag_destroy(c);
}

int cli_fail(const struct CliArgs *a, DiffragClient *c, int status)
{
    const char *msg = c ? diffrag_last_error(c) : diffrag_strerror(status);
    const char *code = c ? diffrag_last_error_code(c) : "";
    fprintf(stderr, "diffrag: %s\n", msg && *msg ? msg : diffrag_strerror(status));
    if (status == DIFFRAG_ECONNECT && !strstr(msg, "does not resolve"))
        fprintf(stderr, "diffrag: is diffragd running at %s? (`make run` starts one; "
                        "-e/--endpoint names another)\n", a->endpoint);
    if (a->json) {
        /* the daemon's own message, without the "code: " the library puts before it */
        size_t cl = strlen(code);
        if (status == DIFFRAG_ESERVER && cl && !strncmp(msg, code, cl) && !strncmp(msg + cl, ": ", 2))
            msg += cl + 2;
        struct JsonBuf b = { 0 };
        json_buf_puts(&b, "{\"ok\": false, \"error\": {\"code\": ");
        json_buf_string(&b, code, strlen(code));
        json_buf_puts(&b, ", \"message\": ");
        json_buf_string(&b, msg, strlen(msg));
        json_buf_puts(&b, "}}\n");
        if (!b.oom)
            fputs(b.p, stdout);
        json_buf_free(&b);
    }
    switch (status) {
    case DIFFRAG_ESERVER: return CLI_EXIT_SERVER;
    case DIFFRAG_EINVAL: return CLI_EXIT_USAGE;
    case DIFFRAG_ECONNECT: return CLI_EXIT_CONNECT;
    case DIFFRAG_ETIMEOUT: return CLI_EXIT_TIMEOUT;
    case DIFFRAG_EPROTOCOL: return CLI_EXIT_PROTOCOL;
    case DIFFRAG_EINTERRUPTED: return CLI_EXIT_INTERRUPTED;
    default: return CLI_EXIT_LOCAL;
    }
}

int cli_read_file(const char *path, char **out, size_t *len)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f)
        return -1;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    int rc = 0;
    while (buf) {
        if (n + 1 == cap) {
            char *p = cap > SIZE_MAX / 2 ? NULL : realloc(buf, cap * 2);
            if (!p) {
                free(buf);
                buf = NULL;
                errno = ENOMEM;
                break;
            }
            buf = p;
            cap *= 2;
        }
        size_t k = fread(buf + n, 1, cap - 1 - n, f);
        n += k;
        if (k == 0) {
            if (ferror(f)) {
                int e = errno;
                free(buf);
                buf = NULL;
                errno = e ? e : EIO;
            }
            break;
        }
    }
    if (f != stdin)
        fclose(f);
    if (!buf)
        return -1;
    buf[n] = 0;
    *out = buf;
    *len = n;
    return rc;
}

int cli_utf8_ok(const char *str, size_t n)
{
    return memchr(str, 0, n) == NULL && utf8_valid(str, n, NULL);
}

size_t cli_print_safe(const char *s, size_t len, int layout)
{
    static int tty = -1;
    if (tty < 0)
        tty = isatty(STDOUT_FILENO);
    if (!tty)
        return fwrite(s, 1, len, stdout);
    return term_write_escaped(stdout, s, len, layout ? TERM_KEEP_LAYOUT : 0);
}

void cli_print_padded(const char *s, size_t width)
{
    for (size_t n = cli_print_safe(s, strlen(s), 0); n < width; n++)
        putchar(' ');
}

static int specific_allowed(const struct Cmd *cmd, int code, const char **name)
{
    for (size_t i = 0; i < sizeof SPECIFIC / sizeof SPECIFIC[0]; i++) {
        if (SPECIFIC[i].code == code) {
            *name = SPECIFIC[i].name;
            return cmd && strchr(cmd->opts, SPECIFIC[i].letter) != NULL;
        }
    }
    return 1; /* a common option */
}

/* Parses the command line into *a and runs the command; every exit leaves what a owns for the
 * caller to free (main), usage errors included. */
static int cli_main(int argc, char **argv, struct CliArgs *a)
{
    static const struct option LONG[] = {
        { "endpoint", required_argument, NULL, O_ENDPOINT },
        { "collection", required_argument, NULL, O_COLLECTION },
        { "json", no_argument, NULL, O_JSON },
        { "timeout", required_argument, NULL, O_TIMEOUT },
        { "connect-timeout", required_argument, NULL, O_CONNECT_TIMEOUT },
        { "server-key", required_argument, NULL, O_SERVER_KEY },
        { "key", required_argument, NULL, O_KEY },
        { "help", no_argument, NULL, O_HELP },
        { "doc", required_argument, NULL, O_DOC },
        { "doc-id", required_argument, NULL, O_DOC_ID },
        { "stream", no_argument, NULL, O_STREAM },
        { "max-tokens", required_argument, NULL, O_MAX_TOKENS },
        { "top-k", required_argument, NULL, O_TOP_K },
        { "max-context-tokens", required_argument, NULL, O_MAX_CONTEXT },
        { "relevance-floor", required_argument, NULL, O_FLOOR },
        { "temperature", required_argument, NULL, O_TEMPERATURE },
        { "top-p", required_argument, NULL, O_TOP_P },
        { "seed", required_argument, NULL, O_SEED },
        { "stop", required_argument, NULL, O_STOP },
        { "deadline", required_argument, NULL, O_DEADLINE },
        { "order", required_argument, NULL, O_ORDER },
        { "unsupported", required_argument, NULL, O_UNSUPPORTED },
        { "answer-mode", required_argument, NULL, O_ANSWER_MODE },
        { "batch", required_argument, NULL, O_BATCH },
        { "progress", no_argument, NULL, O_PROGRESS },
        { "quiet", no_argument, NULL, O_QUIET },
        { "limit", required_argument, NULL, O_LIMIT },
        { "after", required_argument, NULL, O_AFTER },
        { "out", required_argument, NULL, O_OUT },
        { "force", no_argument, NULL, O_FORCE },
        { "yes", no_argument, NULL, O_YES },
        { "sync", no_argument, NULL, O_SYNC },
        { NULL, 0, NULL, 0 },
    };
    memset(a, 0, sizeof *a);
    a->endpoint = getenv("DIFFRAG_ENDPOINT");
    if (!a->endpoint || !*a->endpoint)
        a->endpoint = CLI_DEFAULT_ENDPOINT;
    a->server_key = getenv("DIFFRAG_SERVER_KEY");
    if (a->server_key && !*a->server_key)
        a->server_key = NULL;
    a->key_file = getenv("DIFFRAG_KEY");
    if (a->key_file && !*a->key_file)
        a->key_file = NULL;
    a->collection = CLI_DEFAULT_COLLECTION;
    a->batch = 64;

    /* The subcommand is the first argument that is not an option: find it first so that
     * options can be checked against it. */
    const struct Cmd *cmd = NULL;
    int help = 0, rc = 0;
    double secs;
    const char *cmd_name = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0)
            break;
        if (argv[i][0] != '-' || argv[i][1] == 0) {
            cmd_name = argv[i];
            break;
        }
        /* skip the value of a common option that takes one */
        if (!strchr(argv[i], '=') && (!strcmp(argv[i], "-e") || !strcmp(argv[i], "-c") ||
            !strcmp(argv[i], "--endpoint") || !strcmp(argv[i], "--collection") ||
            !strcmp(argv[i], "--timeout") || !strcmp(argv[i], "--connect-timeout") ||
            !strcmp(argv[i], "--server-key") || !strcmp(argv[i], "--key")))
            i++;
    }
    if (cmd_name) {
        cmd = find_cmd(cmd_name);
        if (!cmd)
            return cli_usage_error(NULL, "unknown command \"%s\"", cmd_name);
    }
    const char *cn = cmd ? cmd->name : NULL;
    int opt;
    opterr = 1;
    while ((opt = getopt_long(argc, argv, "e:c:hd:qo:y", LONG, NULL)) != -1) {
        const char *name = NULL;
        if (opt == '?')
            return cli_usage_error(cn, "bad option");
        if (!specific_allowed(cmd, opt, &name))
            return cli_usage_error(cn, "%s does not apply to %s", name,
                                   cmd ? cmd->name : "diffrag without a command");
        switch (opt) {
        case O_ENDPOINT: a->endpoint = optarg; break;
        case O_COLLECTION:
            a->collection = optarg;
            a->collection_given = 1;
            break;
        case O_JSON: a->json = 1; break;
        case O_HELP: help = 1; break;
        case O_TIMEOUT:
            if (parse_double(cn, "--timeout", optarg, 0.001, 86400, &secs))
                return CLI_EXIT_USAGE;
            a->timeout_ms = (int)(secs * 1000 + 0.5);
            break;
        case O_CONNECT_TIMEOUT:
            if (parse_double(cn, "--connect-timeout", optarg, 0.001, 86400, &secs))
                return CLI_EXIT_USAGE;
            a->connect_timeout_ms = (int)(secs * 1000 + 0.5);
            break;
        case O_SERVER_KEY: a->server_key = optarg; break;
        case O_KEY: a->key_file = optarg; break;
        case O_DOC: rc = push(&a->doc_files, &a->n_doc_files, optarg); break;
        case O_DOC_ID: rc = push(&a->doc_ids, &a->n_doc_ids, optarg); break;
        case O_STOP: rc = push(&a->stops, &a->n_stops, optarg); break;
        case O_STREAM: a->stream = 1; break;
        case O_MAX_TOKENS:
            if (parse_int(cn, "--max-tokens", optarg, 1, INT_MAX, &a->max_tokens))
                return CLI_EXIT_USAGE;
            break;
        case O_TOP_K:
            if (parse_int(cn, "--top-k", optarg, 1, INT_MAX, &a->top_k))
                return CLI_EXIT_USAGE;
            break;
        case O_MAX_CONTEXT:
            if (parse_int(cn, "--max-context-tokens", optarg, 1, INT_MAX, &a->max_context_tokens))
                return CLI_EXIT_USAGE;
            break;
        case O_FLOOR:
            if (parse_double(cn, "--relevance-floor", optarg, 0, 1, &a->relevance_floor))
                return CLI_EXIT_USAGE;
            a->relevance_floor_given = 1;
            break;
        case O_TEMPERATURE:
            if (parse_double(cn, "--temperature", optarg, 0, 10, &a->temperature))
                return CLI_EXIT_USAGE;
            break;
        case O_TOP_P:
            if (parse_double(cn, "--top-p", optarg, 1e-9, 1, &a->top_p))
                return CLI_EXIT_USAGE;
            break;
        case O_SEED: {
            char *end;
            errno = 0;
            a->seed = strtoull(optarg, &end, 10);
            if (errno || end == optarg || *end || optarg[0] == '-')
                return cli_usage_error(cn, "--seed wants a non-negative integer, not \"%s\"", optarg);
            break;
        }
        case O_DEADLINE:
            if (parse_double(cn, "--deadline", optarg, 0.001, 86400, &secs))
                return CLI_EXIT_USAGE;
            a->deadline_ms = (int)(secs * 1000 + 0.5);
            break;
        case O_ORDER:
            if (strcmp(optarg, "rank") && strcmp(optarg, "document") && strcmp(optarg, "nearest"))
                return cli_usage_error(cn, "--order wants rank, nearest or document, not \"%s\"",
                                       optarg);
            a->order = optarg;
            break;
        case O_UNSUPPORTED:
            if (strcmp(optarg, "answer") && strcmp(optarg, "mark") && strcmp(optarg, "decline"))
                return cli_usage_error(cn, "--unsupported wants answer, mark or decline, not "
                                       "\"%s\"", optarg);
            a->unsupported = optarg;
            break;
        case O_ANSWER_MODE:
            if (strcmp(optarg, "free") && strcmp(optarg, "quote"))
                return cli_usage_error(cn, "--answer-mode wants free or quote, not \"%s\"",
                                       optarg);
            a->answer_mode = optarg;
            break;
        case O_BATCH:
            if (parse_int(cn, "--batch", optarg, 1, 100000, &a->batch))
                return CLI_EXIT_USAGE;
            break;
        case O_PROGRESS: a->progress = 1; break;
        case O_QUIET: a->quiet = 1; break;
        case O_LIMIT:
            if (parse_int(cn, "--limit", optarg, 1, INT_MAX, &a->limit))
                return CLI_EXIT_USAGE;
            break;
        case O_AFTER: a->after = optarg; break;
        case O_OUT: a->out = optarg; break;
        case O_FORCE: a->force = 1; break;
        case O_YES: a->yes = 1; break;
        case O_SYNC: a->sync = 1; break;
        default:
            return cli_usage_error(cn, "bad option");
        }
        if (rc) {
            fprintf(stderr, "diffrag: out of memory\n");
            return CLI_EXIT_LOCAL;
        }
    }
    if (help) {
        if (cmd)
            printf("%s%s", cmd->help, COMMON_HELP);
        else
            fputs(GENERAL_HELP, stdout);
        return CLI_EXIT_OK;
    }
    if (!cmd) {
        fputs(GENERAL_HELP, stderr);
        return CLI_EXIT_USAGE;
    }
    /* getopt moved the operands to the end: the command, then its arguments */
    a->cmd = cmd->name;
    a->pos = argv + optind + 1;
    a->n_pos = (size_t)(argc - optind - 1);
    if ((int)a->n_pos < cmd->min_pos || (cmd->max_pos >= 0 && (int)a->n_pos > cmd->max_pos)) {
        fprintf(stderr, "%s", cmd->help);
        return cli_usage_error(cmd->name, "wrong number of arguments (%zu)", a->n_pos);
    }
    if (a->progress && a->quiet)
        return cli_usage_error(cmd->name, "--progress and --quiet exclude each other");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    return cmd->run(a);
}

int main(int argc, char **argv)
{
    struct CliArgs a;
    int rc = cli_main(argc, argv, &a);
    free(a.doc_files);
    free(a.doc_ids);
    free(a.stops);
    return rc;
}
