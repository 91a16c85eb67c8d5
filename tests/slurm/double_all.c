/* A user's shim for their own srun (LD_PRELOAD) that makes the plugin's collective root send every exchange
 * result twice. tests/slurm.rs uses it to check that a slurmstepd (root) takes a result only when a barrier
 * of its node waits for one, and otherwise drops srun and ends its step.
 *
 * On the thread named "rpmi-root" (the root), a sendmsg of exactly one collective frame holding an ALL
 * (a u32 big-endian payload length and the kind COLLECTIVE, 0x88, in the first piece; the collective frame,
 * whose first byte is 0x81 for ALL, in the second) that went out whole is followed by a second sendmsg of the
 * same bytes. The root writes each frame from its start, so an ALL small enough to go out in one call (every
 * result of a small exchange) is doubled; a frame sent in pieces passes through as it is. Everything else
 * passes through (RTLD_NEXT). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define COLLECTIVE 0x88
#define ALL 0x81

static ssize_t (*real_sendmsg)(int, const struct msghdr *, int);

static int on_root_thread(void)
{
	char name[16] = "";

	return pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "rpmi-root") == 0;
}

/* Whether msg holds exactly one collective frame carrying an ALL, len bytes in all. */
static int one_all_frame(const struct msghdr *msg, size_t len)
{
	const unsigned char *head, *body;
	uint32_t payload;

	if (msg->msg_iovlen != 2 || msg->msg_iov[0].iov_len != 5 || msg->msg_iov[1].iov_len < 1)
		return 0;
	head = msg->msg_iov[0].iov_base;
	body = msg->msg_iov[1].iov_base;
	if (head[4] != COLLECTIVE || body[0] != ALL)
		return 0;
	payload = (uint32_t)head[0] << 24 | (uint32_t)head[1] << 16 | (uint32_t)head[2] << 8 | head[3];
	return (size_t)payload + 4 == len;
}

/* Sends all of msg's bytes again on the root's non-blocking socket, waiting for room as needed. */
static void send_again(int fd, const struct msghdr *msg, int flags)
{
	struct pollfd p = { .fd = fd, .events = POLLOUT };
	size_t i;

	for (i = 0; i < msg->msg_iovlen; i++) {
		const unsigned char *buf = msg->msg_iov[i].iov_base;
		size_t len = msg->msg_iov[i].iov_len;

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
	if (n > 0 && (size_t)n == len && one_all_frame(msg, len) && on_root_thread()) {
		int saved = errno;

		send_again(fd, msg, flags);
		errno = saved;
	}
	return n;
}
