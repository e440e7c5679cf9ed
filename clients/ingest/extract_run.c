/* The ingest's side of diffrag-extract (extract_run.h): finds the helper, runs it in a process
 * group of its own with the file as stdin, reads its stdout and stderr within the limits, kills
 * the group at the deadline, and turns an exit status or a signal into a reason. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clients/ingest/extract_run.h"
#include "text/docformat.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

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
    char errtext[2048];
    size_t elen = 0, cap = 0, n = 0, max = max_text + 65536 + PATH_MAX;
    char *out = NULL;
    int timed_out = 0, too_long = 0, open_fds = 2;
    struct pollfd fds[2] = { { po[0], POLLIN, 0 }, { pe[0], POLLIN, 0 } };
    double deadline = now_s() + timeout_s;
    while (open_fds && !too_long && !*oom) {
        double left = deadline - now_s();
        if (left <= 0) {
            timed_out = 1;
            break;
        }
        int k = poll(fds, 2, (int)(left * 1000) + 1);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            break;
        for (int i = 0; i < 2; i++) {
            if (fds[i].fd < 0 || !fds[i].revents)
                continue;
            char buf[65536];
            ssize_t r = read(fds[i].fd, buf, sizeof buf);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                close(fds[i].fd);
                fds[i].fd = -1;
                open_fds--;
            } else if (i == 1) {
                size_t take = (size_t)r < sizeof errtext - 1 - elen ? (size_t)r
                                                                   : sizeof errtext - 1 - elen;
                memcpy(errtext + elen, buf, take);
                elen += take;
            } else if (n + (size_t)r > max) {
                too_long = 1;
                break;
            } else {
                if (n + (size_t)r + 1 > cap) {
                    size_t nc = cap ? cap : 65536;
                    while (nc < n + (size_t)r + 1)
                        nc *= 2;
                    char *p = realloc(out, nc);
                    if (!p) {
                        *oom = 1;
                        break;
                    }
                    out = p;
                    cap = nc;
                }
                memcpy(out + n, buf, (size_t)r);
                n += (size_t)r;
                out[n] = 0;
            }
        }
    }
    errtext[elen] = 0;
    if (open_fds)
        kill(-pid, SIGKILL);
    for (int i = 0; i < 2; i++)
        if (fds[i].fd >= 0)
            close(fds[i].fd);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    kill(-pid, SIGKILL); /* anything it left behind */
    int rc = -1;
    if (*oom)
        snprintf(err, errlen, "out of memory");
    else if (timed_out)
        snprintf(err, errlen, "extracting its text took over %.0f s; stopped", timeout_s);
    else if (too_long)
        snprintf(err, errlen, "its text is over %.1f MiB, the most a document may have",
                 max_text / 1048576.0);
    else if (WIFSIGNALED(status) && WTERMSIG(status) == SIGXCPU)
        snprintf(err, errlen, "extracting its text ran out of processor time; stopped");
    else if (WIFSIGNALED(status))
        snprintf(err, errlen, EXTRACT_PROGRAM " crashed on it (%s): a damaged or hostile file?",
                 strsignal(WTERMSIG(status)));
    else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        docformat_helper_reason(errtext, err, errlen);
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
