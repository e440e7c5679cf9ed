/* diffrag-extract's sandbox (docs/security.md): resource limits, inherited by pdftotext,
 * pdftohtml and pdfinfo, and a seccomp filter, a deny list applied once the input is open: no socket may be
 * made, no file opened for writing, created, truncated, removed, renamed or linked, no
 * permissions or owners changed, no other process traced; without allow_exec no program
 * started either. A denied call fails with EPERM (the parsers see an error, not a kill). */
#include <errno.h>
#include <fcntl.h>
#include <seccomp.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "clients/extract/extract.h"

/* soft limit v, hard limit v + grace (processor time: SIGXCPU first, SIGKILL after grace s) */
static int limit(int res, rlim_t v, rlim_t grace, const char *what, char *err, size_t errlen)
{
    struct rlimit cur, want = { v, v + grace };
    if (getrlimit(res, &cur) == 0 && cur.rlim_max != RLIM_INFINITY && cur.rlim_max < v)
        want.rlim_cur = want.rlim_max = cur.rlim_max;
 /* already lower: keep it */
    if (setrlimit(res, &want)) {
        snprintf(err, errlen, "cannot limit %s: %s", what, strerror(errno));
        return -1;
    }
    return 0;
}

int sandbox_limits(const struct ExtractLimits *lim, char *err, size_t errlen)
{
    if (limit(RLIMIT_CORE, 0, 0, "core dumps", err, errlen) ||
        limit(RLIMIT_CPU, lim->cpu_seconds, 2, "processor time", err, errlen) ||
        limit(RLIMIT_FSIZE, (rlim_t)lim->max_output, 0, "the size of files written", err, errlen) ||
        limit(RLIMIT_NOFILE, 64, 0, "open files", err, errlen) ||
        limit(RLIMIT_NPROC, 4096, 0, "processes", err, errlen))
        return -1;
#if !defined(__SANITIZE_ADDRESS__)
    /* AddressSanitizer reserves terabytes of address space: a sanitizer build goes without */
    if (limit(RLIMIT_AS, (rlim_t)lim->max_memory, 0, "memory", err, errlen))
        return -1;
#endif
    return 0;
}

/* open(2)-style flags argument `arg` that asks for writing or creating. */
static int deny_write_flags(scmp_filter_ctx f, int nr, unsigned arg)
{
    static const int flags[] = { O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_APPEND, O_TMPFILE & ~O_DIRECTORY };
    for (size_t i = 0; i < sizeof flags / sizeof *flags; i++)
        if (seccomp_rule_add(f, SCMP_ACT_ERRNO(EPERM), nr, 1,
                             SCMP_CMP(arg, SCMP_CMP_MASKED_EQ, (scmp_datum_t)flags[i],
                                      (scmp_datum_t)flags[i])))
            return -1;
    return 0;
}

int sandbox_filter(int allow_exec, char *err, size_t errlen)
{
    static const int denied[] = {
        SCMP_SYS(socket), SCMP_SYS(socketpair), SCMP_SYS(connect), SCMP_SYS(bind),
        SCMP_SYS(listen), SCMP_SYS(accept), SCMP_SYS(accept4), SCMP_SYS(creat),
        SCMP_SYS(openat2), SCMP_SYS(open_by_handle_at), SCMP_SYS(name_to_handle_at),
        SCMP_SYS(truncate), SCMP_SYS(ftruncate), SCMP_SYS(fallocate),
        SCMP_SYS(unlink), SCMP_SYS(unlinkat), SCMP_SYS(rename), SCMP_SYS(renameat),
        SCMP_SYS(renameat2), SCMP_SYS(link), SCMP_SYS(linkat), SCMP_SYS(symlink),
        SCMP_SYS(symlinkat), SCMP_SYS(mkdir), SCMP_SYS(mkdirat), SCMP_SYS(rmdir),
        SCMP_SYS(mknod), SCMP_SYS(mknodat), SCMP_SYS(chmod), SCMP_SYS(fchmod),
        SCMP_SYS(fchmodat), SCMP_SYS(chown), SCMP_SYS(fchown), SCMP_SYS(lchown),
        SCMP_SYS(fchownat), SCMP_SYS(utimensat), SCMP_SYS(utimes), SCMP_SYS(utime),
        SCMP_SYS(futimesat), SCMP_SYS(setxattr), SCMP_SYS(lsetxattr), SCMP_SYS(fsetxattr),
        SCMP_SYS(removexattr), SCMP_SYS(lremovexattr), SCMP_SYS(fremovexattr),
#if !defined(__SANITIZE_ADDRESS__)
        /* LeakSanitizer stops the threads with ptrace to scan them at exit: a sanitizer build
         * keeps it (the tests' sanitizer pass runs this helper) */
        SCMP_SYS(ptrace),
#endif
        SCMP_SYS(process_vm_writev), SCMP_SYS(mount), SCMP_SYS(umount2),
        SCMP_SYS(chroot), SCMP_SYS(pivot_root), SCMP_SYS(io_uring_setup),
    };
    scmp_filter_ctx f = seccomp_init(SCMP_ACT_ALLOW); /* also sets no_new_privs */
    int rc = f ? 0 : -1;
    for (size_t i = 0; !rc && i < sizeof denied / sizeof *denied; i++)
        rc = seccomp_rule_add(f, SCMP_ACT_ERRNO(EPERM), denied[i], 0);
    if (!rc)
        rc = deny_write_flags(f, SCMP_SYS(open), 1);
    if (!rc)
        rc = deny_write_flags(f, SCMP_SYS(openat), 2);
    if (!rc && !allow_exec) {
        rc = seccomp_rule_add(f, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(execve), 0);
        if (!rc)
            rc = seccomp_rule_add(f, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(execveat), 0);
    }
    if (!rc)
        rc = seccomp_load(f);
    if (rc)
        snprintf(err, errlen, "cannot install the seccomp filter: %s",
                 strerror(rc < 0 ? -rc : EINVAL));
    if (f)
        seccomp_release(f);
    return rc ? -1 : 0;
}
