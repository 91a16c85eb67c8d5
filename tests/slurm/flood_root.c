/* A user's shim for their own srun (LD_PRELOAD) that floods every slurmstepd it admits with valid frames:
 * once the plugin's collective root (the thread named "rpmi-root") has sent a stepd its WELCOME, a thread
 * of the shim's own writes PARENT_DONE frames (a u32 big-endian payload length of 1, then the kind 0x87) on
 * that connection without pause, each frame whole, until the connection fails. tests/slurm.rs uses it to
 * check that what a stepd holds of its srun's frames stays bounded.
 *
 * The WELCOME is the root's write of exactly one frame whose payload starts with the kind 0x85; the root
 * sends nothing more to a stepd whose tasks never enter a barrier, so the flood's frames are the only ones
 * on the connection after it. Everything else passes through (RTLD_NEXT). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define WELCOME 0x85
#define PARENT_DONE 0x87

static ssize_t (*real_sendmsg)(int, const struct msghdr *, int);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_send)(int, const void *, size_t, int);

static int on_root_thread(void)
{
	char name[16] = "";

	return pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "rpmi-root") == 0;
}

static void *flood(void *arg)
{
	int fd = (int)(intptr_t)arg;
	static const unsigned char frame[5] = { 0, 0, 0, 1, PARENT_DONE };
	unsigned char buf[5 * 13107];
	struct pollfd p = { .fd = fd, .events = POLLOUT };
	size_t i, at = 0;

	for (i = 0; i < sizeof buf; i += 5)
		memcpy(buf + i, frame, 5);
	for (;;) {
		ssize_t n = send(fd, buf + at, sizeof buf - at, MSG_NOSIGNAL);

		if (n > 0) {
			at = (at + (size_t)n) % sizeof buf;
		} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			poll(&p, 1, 1000);
		} else if (!(n < 0 && errno == EINTR)) {
			close(fd);
			return NULL;
		}
	}
}

/* After a WELCOME of `len` bytes starting at `head` went out whole on fd: starts the flood on a copy of it. */
static void after(int fd, const unsigned char *head, size_t head_len, ssize_t sent, size_t len)
{
	pthread_t t;
	int copy;

	if (!on_root_thread() || sent < 0 || (size_t)sent != len || head_len < 5 || head[4] != WELCOME)
		return;
	copy = dup(fd);
	if (copy >= 0 && pthread_create(&t, NULL, flood, (void *)(intptr_t)copy) == 0)
		pthread_detach(t);
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	size_t len = 0, i;
	ssize_t n;

	if (!real_sendmsg)
		real_sendmsg = dlsym(RTLD_NEXT, "sendmsg");
	n = real_sendmsg(fd, msg, flags);
	for (i = 0; i < msg->msg_iovlen; i++)
		len += msg->msg_iov[i].iov_len;
	if (msg->msg_iovlen > 0)
		after(fd, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, n, len);
	return n;
}

ssize_t write(int fd, const void *buf, size_t len)
{
	ssize_t n;

	if (!real_write)
		real_write = dlsym(RTLD_NEXT, "write");
	n = real_write(fd, buf, len);
	after(fd, buf, len, n, len);
	return n;
}

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
	ssize_t n;

	if (!real_send)
		real_send = dlsym(RTLD_NEXT, "send");
	n = real_send(fd, buf, len, flags);
	after(fd, buf, len, n, len);
	return n;
}
