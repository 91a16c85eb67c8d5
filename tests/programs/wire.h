/* What the test programs that speak PMI-1 on the wire by hand and take the memory files rpmi's server sends
 * (kvs_image.c, node_barrier.c) share: the start (init and the kvsname), a line out, a line in with the fd
 * that came with it (recvmsg), a field of the line, and that another user cannot open a process's fds.
 * Include after check.h. */
#ifndef RPMI_TEST_WIRE_H
#define RPMI_TEST_WIRE_H

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static int fd = -1;
static char line[4096];

__attribute__((unused)) static void say(const char *s)
{
    EXPECT(write(fd, s, strlen(s)) == (ssize_t)strlen(s));
}

/* Reads one answer line into `line`, with recvmsg; the fd that came with it, or -1. */
__attribute__((unused)) static int hear(void)
{
    size_t got = 0;
    int file = -1;
    for (;;) {
        char c;
        union {
            struct cmsghdr h;
            char room[CMSG_SPACE(sizeof(int))];
        } control;
        struct iovec iov = {.iov_base = &c, .iov_len = 1};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = &control, .msg_controllen = sizeof control};
        ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
        EXPECT(n == 1);
        struct cmsghdr *h = CMSG_FIRSTHDR(&msg);
        if (h && h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS)
            memcpy(&file, CMSG_DATA(h), sizeof file);
        if (c == '\n')
            break;
        EXPECT(got + 1 < sizeof line);
        line[got++] = c;
    }
    line[got] = 0;
    return file;
}

/* The value of `key` in `line`, as a number. */
__attribute__((unused)) static long field(const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, " %s=", key);
    char *p = strstr(line, pat);
    EXPECT(p != NULL);
    return atol(p + strlen(pat));
}

/* In a child running as nobody: every fd of process `pid` that is the image cannot be opened. */
__attribute__((unused)) static void others_cannot_open(pid_t pid)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
    pid_t child = fork();
    EXPECT(child >= 0);
    if (child == 0) {
        if (setgid(65534) != 0 || setuid(65534) != 0)
            _exit(2);
        DIR *d = opendir(dir);
        if (d) { /* root's /proc/PID/fd is not even listable by another user; if it were, no fd opens */
            struct dirent *e;
            while ((e = readdir(d))) {
                char path[512];
                snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
                int f = open(path, O_RDONLY);
                if (f >= 0)
                    _exit(3);
            }
            closedir(d);
        }
        _exit(0);
    }
    int status = 0;
    EXPECT(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Takes the launcher's connection and rank from the environment, says init asking for revision `revision` of
 * rpmi's additions (which the answer must grant), and reads the job's kvsname into `kvs`: the job's size. */
__attribute__((unused)) static int start(int revision, char *kvs, size_t len)
{
    fd = atoi(getenv("PMI_FD"));
    rank = atoi(getenv("PMI_RANK"));
    char ask[96], granted[16];
    snprintf(ask, sizeof ask, "cmd=init pmi_version=1 pmi_subversion=1 rpmi=%d\n", revision);
    snprintf(granted, sizeof granted, " rpmi=%d", revision);
    say(ask);
    EXPECT(hear() < 0 && strstr(line, granted) != NULL);
    say("cmd=get_my_kvsname\n");
    EXPECT(hear() < 0);
    char *k = strstr(line, "kvsname=");
    EXPECT(k != NULL);
    snprintf(kvs, len, "%s", k + 8);
    return atoi(getenv("PMI_SIZE"));
}

#endif
