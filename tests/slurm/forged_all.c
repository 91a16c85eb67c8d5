/* A user's shim for their own srun (LD_PRELOAD) that makes the plugin's side of srun send a result of an
 * exchange it took no part in. srun sends no exchange results (every exchange turns at node 0, the tree's
 * top); tests/slurm.rs uses the shim to check that a slurmstepd refuses one from srun, drops srun and ends
 * its step.
 *
 * On the thread named "rpmi-root" (srun's side), a sendmsg that sent a whole PARENT frame (a u32 big-endian
 * payload length, then the kind PARENT, 0x86: srun tells a node below node 0 where its parent listens) is
 * followed by a made-up ALL of exchange 0 with no parts: the COLLECTIVE kind (0x88), then ALL (0x81), the
 * exchange and the count (u32s, big-endian, both 0). Everything else passes through (RTLD_NEXT). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define PARENT 0x86

static ssize_t (*real_sendmsg)(int, const struct msghdr *, int);

static int on_root_thread(void)
{
	char name[16] = "";

	return pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "rpmi-root") == 0;
}

/* Whether msg, len bytes in all, is one whole PARENT frame. */
static int one_parent_frame(const struct msghdr *msg, size_t len)
{
	unsigned char frame[5];
	size_t i, at = 0;

	for (i = 0; i < msg->msg_iovlen && at < sizeof frame; i++) {
		size_t take = msg->msg_iov[i].iov_len;

		if (take > sizeof frame - at)
			take = sizeof frame - at;
		memcpy(frame + at, msg->msg_iov[i].iov_base, take);
		at += take;
	}
	if (at < sizeof frame || frame[4] != PARENT)
		return 0;
	return ((size_t)frame[0] << 24 | (size_t)frame[1] << 16 | (size_t)frame[2] << 8 | frame[3]) + 4 == len;
}

/* Sends the made-up result on srun's non-blocking socket, waiting for room as needed. */
static void send_result(int fd, int flags)
{
	static const unsigned char all[] = { 0, 0, 0, 10, 0x88, 0x81, 0, 0, 0, 0, 0, 0, 0, 0 };
	struct pollfd p = { .fd = fd, .events = POLLOUT };
	const unsigned char *buf = all;
	size_t len = sizeof all;

	while (len > 0) {
		struct iovec one = { .iov_base = (void *)buf, .iov_len = len };
		struct msghdr m = { .msg_iov = &one, .msg_iovlen = 1 };
		ssize_t n = real_sendmsg(fd, &m, flags);

		if (n > 0) {
			buf += n;
			len -= n;
		} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			poll(&p, 1, 1000);
		} else if (!(n < 0 && errno == EINTR)) {
			return;
		}
	}
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	ssize_t n;
	size_t len = 0, i;

	if (!real_sendmsg)
		real_sendmsg = (ssize_t(*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
	n = real_sendmsg(fd, msg, flags);
	for (i = 0; i < msg->msg_iovlen; i++)
		len += msg->msg_iov[i].iov_len;
	if (n > 0 && (size_t)n == len && one_parent_frame(msg, len) && on_root_thread()) {
		int saved = errno;

		send_result(fd, flags);
		errno = saved;
	}
	return n;
}
