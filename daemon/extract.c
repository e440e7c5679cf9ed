/* Running diffrag-extract from the daemon (extract.h): the helper's path, a memory file with
 * the bytes as its stdin, posix_spawn into a process group of its own with default signals,
 * its stdout and stderr read within the limits until the deadline, then the group killed and
 * the child reaped; and its exit status turned into a reason. */
#include "daemon/extract.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* diffrag-extract's exit statuses (docs/cli.md) */
enum { HX_BAD = 1, HX_USAGE = 2, HX_TOOL = 3, HX_LIMIT = 4, HX_NOMEM = 5 };

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The child: stdin the memory file, stdout and stderr the pipes, nothing else open, its own
 * process group, no signal blocked or ignored. 0 with *pid, or an errno. */
static int spawn(const char *helper, char *const argv[], int in, int out, int errfd, pid_t *pid)
{
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    if (posix_spawn_file_actions_init(&fa))
        return ENOMEM;
    if (posix_spawnattr_init(&at)) {
        posix_spawn_file_actions_destroy(&fa);
        return ENOMEM;
    }
    sigset_t none, def;
    sigemptyset(&none);
    sigemptyset(&def);
    int sigs[] = { SIGPIPE, SIGCHLD, SIGHUP, SIGINT, SIGTERM, SIGQUIT, SIGXCPU, SIGXFSZ, SIGUSR1,
                   SIGUSR2 };
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        sigaddset(&def, sigs[i]);
    int rc = posix_spawn_file_actions_adddup2(&fa, in, 0) ||
             posix_spawn_file_actions_adddup2(&fa, out, 1) ||
             posix_spawn_file_actions_adddup2(&fa, errfd, 2) ||
             posix_spawn_file_actions_addclosefrom_np(&fa, 3) ||
             posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
                                               POSIX_SPAWN_SETSIGDEF) ||
             posix_spawnattr_setpgroup(&at, 0) || posix_spawnattr_setsigmask(&at, &none) ||
             posix_spawnattr_setsigdefault(&at, &def)
                 ? ENOMEM
                 : posix_spawnp(pid, helper, &fa, &at, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    return rc;
}

enum DextractFail dextract_run(const struct DextractOpts *o, const void *bytes, size_t len,
                               const char *name, char **title, char **text, size_t *text_len,
                               char *err, size_t errlen)
{
    char helper[PATH_MAX + 32], max_arg[32];
    docformat_helper_path(o->helper, helper, sizeof helper);
    snprintf(max_arg, sizeof max_arg, "%zu", o->max_text);
    *title = *text = NULL;
    *text_len = 0;
    int mf = memfd_create("diffrag-ingest", MFD_CLOEXEC);
    if (mf < 0 || write_all(mf, bytes, len) || lseek(mf, 0, SEEK_SET) != 0) {
        int e = errno;
        if (mf >= 0)
            close(mf);
        snprintf(err, errlen, "cannot hold the file for " DEXTRACT_PROGRAM ": %s", strerror(e));
        return e == ENOMEM ? DEXTRACT_ENOMEM : DEXTRACT_EHELPER;
    }
    int po[2] = { -1, -1 }, pe[2] = { -1, -1 };
    if (pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC)) {
        snprintf(err, errlen, "cannot run " DEXTRACT_PROGRAM ": %s", strerror(errno));
        for (int i = 0; i < 2; i++) {
            if (po[i] >= 0) close(po[i]);
            if (pe[i] >= 0) close(pe[i]);
        }
        close(mf);
        return DEXTRACT_EHELPER;
    }
    char *argv[] = { helper, "--name", (char *)name, "--max-output", max_arg, "-", NULL };
    pid_t pid = -1;
    int se = spawn(helper, argv, mf, po[1], pe[1], &pid);
    close(mf);
    close(po[1]);
    close(pe[1]);
    if (se) {
        close(po[0]);
        close(pe[0]);
        if (o->helper && o->helper[0])
            snprintf(err, errlen, DEXTRACT_PROGRAM " (extract_helper = %s) cannot be run: %s",
                     helper, strerror(se));
        else
            snprintf(err, errlen, DEXTRACT_PROGRAM " cannot be run (%s): install it beside "
                     "diffragd or on PATH, or set extract_helper", strerror(se));
        return se == ENOMEM ? DEXTRACT_ENOMEM : DEXTRACT_EHELPER;
    }
    struct HelperOutput h;
    docformat_drain(po[0], pe[0], (double)o->timeout_ms, o->max_text + 65536 + PATH_MAX, &h);
    kill(-pid, SIGKILL); /* the helper and pdftotext, when anything is left */
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    kill(-pid, SIGKILL);
    enum DextractFail rc = DEXTRACT_EDOC;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    char *out = h.out, *errtext = h.errtext;
    size_t n = h.out_len;
    if (h.oom) {
        rc = DEXTRACT_ENOMEM;
        snprintf(err, errlen, "out of memory");
    } else if (h.timed_out) {
        if (o->limit_ms > o->timeout_ms)
            snprintf(err, errlen, "extracting its text took over the %ld ms left of the "
                     "request's %ld ms (extract_timeout_ms, for its files together); stopped",
                     o->timeout_ms, o->limit_ms);
        else
            snprintf(err, errlen, "extracting its text took over %ld ms (extract_timeout_ms); "
                     "stopped", o->timeout_ms);
    } else if (h.too_long) {
        snprintf(err, errlen, "its text is over %.1f MiB, the most a document may have",
                 o->max_text / 1048576.0);
    } else if (WIFSIGNALED(status) && WTERMSIG(status) == SIGXCPU) {
        snprintf(err, errlen, "extracting its text ran out of processor time; stopped");
    } else if (WIFSIGNALED(status)) {
        snprintf(err, errlen, DEXTRACT_PROGRAM " crashed on it (%s): a damaged or hostile file?",
                 strsignal(WTERMSIG(status)));
    } else if (code == HX_BAD || code == HX_LIMIT) {
        docformat_helper_reason(errtext, err, errlen);
    } else if (code != 0) {
        char why[512];
        docformat_helper_reason(errtext, why, sizeof why);
        rc = code == HX_NOMEM ? DEXTRACT_ENOMEM : DEXTRACT_EHELPER;
        snprintf(err, errlen, DEXTRACT_PROGRAM " failed (exit status %d): %s", code, why);
    } else if (n < 7 || strncmp(out, "title: ", 7) || !memchr(out, '\n', n)) {
        rc = DEXTRACT_EHELPER;
        snprintf(err, errlen, DEXTRACT_PROGRAM " wrote no \"title: \" line: a mismatched "
                 "version?");
    } else {
        rc = DEXTRACT_OK;
    }
    if (rc != DEXTRACT_OK) {
        free(out);
        return rc;
    }
    char *nl = memchr(out, '\n', n);
    size_t body = (size_t)(nl + 1 - out);
    *title = strndup(out + 7, (size_t)(nl - out) - 7);
    memmove(out, out + body, n - body + 1);
    *text = out;
    *text_len = n - body;
    if (!*title) {
        free(out);
        *text = NULL;
        snprintf(err, errlen, "out of memory");
        return DEXTRACT_ENOMEM;
    }
    return DEXTRACT_OK;
}
