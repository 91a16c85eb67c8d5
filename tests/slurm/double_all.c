/* A user's shim for their own srun (LD_PRELOAD) that makes the plugin's collective root send every exchange
 * result twice. tests/slurm.rs uses it to check that a slurmstepd (root) takes a result only when a barrier
 * of its node waits for one, and otherwise drops srun and ends its step.
 *
 * On the thread named "rpmi-root" (the root), a send (Rust's TcpStream::write is libc's send) of a buffer
 * that is exactly one ALL frame (a u32 big-endian payload length, then the payload, whose first byte is the
 * kind, 0x81 for ALL) and went out whole is followed by a second send of the same bytes. The root writes each
 * frame from its start, so an ALL frame small enough to go out in one send (every frame of a small exchange)
 * is doubled; a frame sent in pieces passes through as it is. Everything else passes through (RTLD_NEXT). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define ALL 0x81

static ssize_t (*real_send)(int, const void *, size_t, int);

static int on_root_thread(void)
{
	char name[16] = "";

	return pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "rpmi-root") == 0;
}

/* Whether buf holds exactly one ALL frame. */
static int one_all_frame(const unsigned char *buf, size_t len)
{
	uint32_t payload;

	if (len < 5 || buf[4] != ALL)
		return 0;
	payload = (uint32_t)buf[0] << 24 | (uint32_t)buf[1] << 16 | (uint32_t)buf[2] << 8 | buf[3];
	return (size_t)payload + 4 == len;
}

/* Sends all of buf on the root's non-blocking socket, waiting for room as needed. */
static void send_whole(int fd, const unsigned char *buf, size_t len, int flags)
{
	struct pollfd p = { .fd = fd, .events = POLLOUT };

	while (len > 0) {
		ssize_t n = real_send(fd, buf, len, flags);

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

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
	ssize_t n;

	if (!real_send)
		real_send = (ssize_t(*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
	n = real_send(fd, buf, len, flags);
	if (n > 0 && (size_t)n == len && one_all_frame(buf, len) && on_root_thread()) {
		int saved = errno;

		send_whole(fd, buf, len, flags);
		errno = saved;
	}
	return n;
}
