/* The ingest's side of diffrag-extract (extract_run.h): finds the helper, runs it in a process
 * group of its own with the file as stdin, reads its stdout and stderr within the limits, kills
 * the group at the deadline, and turns an exit status or a signal into a reason. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clients/ingest/extract_run.h"
#include "text/docformat.h"

int extract_run(int fd, const char *path, size_t max_text, double timeout_s, char **title,
                char **text, size_t *text_len, int *oom, char *err, size_t errlen)
{
    char helper[PATH_MAX + 32], max_arg[32];
    docformat_helper_path(NULL, helper, sizeof helper);
    snprintf(max_arg, sizeof max_arg, "%zu", max_text);
    *oom = 0;
    *title = *text = NULL;
    *text_len = 0;
    int po[2] = { -1, -1 }, pe[2] = { -1, -1 };
    if (pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC)) {
        snprintf(err, errlen, "cannot run " EXTRACT_PROGRAM ": %s", strerror(errno));
        for (int i = 0; i < 2; i++) {
            if (po[i] >= 0) close(po[i]);
            if (pe[i] >= 0) close(pe[i]);
        }
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0); /* its own group: the deadline kills pdftotext with it */
        dup2(fd, 0);
        dup2(po[1], 1);
        dup2(pe[1], 2);
        char *argv[] = { helper, "--name", (char *)path, "--max-output", max_arg, "-", NULL };
        execvp(helper, argv);
        fprintf(stderr, EXTRACT_PROGRAM ": -: reading it needs " EXTRACT_PROGRAM ", which cannot "
                "be run (%s): install it beside this program or on PATH (make install-clients)\n",
                strerror(errno));
        _exit(127);
    }
    close(po[1]);
    close(pe[1]);
    if (pid < 0) {
        close(po[0]);
        close(pe[0]);
        snprintf(err, errlen, "cannot run " EXTRACT_PROGRAM ": %s", strerror(errno));
        return -1;
    }
    setpgid(pid, pid); /* also here: no window before the child's own call */
    struct HelperOutput h;
    docformat_drain(po[0], pe[0], timeout_s * 1e3, max_text + 65536 + PATH_MAX, &h);
    if (h.cut_short)
        kill(-pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    kill(-pid, SIGKILL); /* anything it left behind */
    int rc = -1;
    char *out = h.out;
    size_t n = h.out_len;
    *oom = h.oom;
    if (*oom)
        snprintf(err, errlen, "out of memory");
    else if (h.timed_out)
        snprintf(err, errlen, "extracting its text took over %.0f s; stopped", timeout_s);
    else if (h.too_long)
        snprintf(err, errlen, "its text is over %.1f MiB, the most a document may have",
                 max_text / 1048576.0);
    else if (WIFSIGNALED(status) && WTERMSIG(status) == SIGXCPU)
        snprintf(err, errlen, "extracting its text ran out of processor time; stopped");
    else if (WIFSIGNALED(status))
        snprintf(err, errlen, EXTRACT_PROGRAM " crashed on it (%s): a damaged or hostile file?",
                 strsignal(WTERMSIG(status)));
    else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        docformat_helper_reason(h.errtext, err, errlen);
    else if (n < 7 || strncmp(out, "title: ", 7) || !memchr(out, '\n', n))
        snprintf(err, errlen, EXTRACT_PROGRAM " wrote no \"title: \" line: a mismatched version?");
    else
        rc = 0;
    if (rc) {
        free(out);
        return -1;
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
        *oom = 1;
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}
