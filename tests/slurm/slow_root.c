/* A user's shim for their own srun (LD_PRELOAD) that makes the plugin's collective root a slow reader which
 * never lets go. tests/slurm.rs uses it to check that no srun can hold a slurmstepd (root) past its step.
 *
 * On the thread named "rpmi-root" (the root), every read of a connection (Rust's TcpStream::read is libc's
 * recv) past its first FREE_BYTES bytes (the handshake) first sleeps PAUSE_MS and then takes at most
 * READ_MAX bytes. When the root closes such a connection (srun is done with the step), it stays open instead
 * and a thread of the shim goes on reading it the same way; srun does not exit while any such connection is
 * open (for HOLD_S seconds at most): as if the user's srun kept the connections and read a little now and
 * then for ever. Everything else passes through (RTLD_NEXT).
 *
 * READ_MAX is not one byte: a receiver opens a closed window again only once a whole segment is free (64 KiB
 * on loopback), so single bytes would never let a blocked writer write anything more. A KiB every 200 ms
 * does, every few seconds, so a blocking write whose timeout starts again at each partial write never times
 * out. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FREE_BYTES 256
#define PAUSE_MS 200
#define READ_MAX 1024
#define HOLD_S 600
#define FDS 65536

/* Bytes read so far on each fd the root accepted. */
static unsigned long taken[FDS];
/* Connections still read by the shim after the root closed them. */
static int lingering;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gone = PTHREAD_COND_INITIALIZER;

static ssize_t (*real_recv)(int, void *, size_t, int);
static int (*real_close)(int);

static void find_real(void)
{
	if (!real_recv)
		real_recv = (ssize_t(*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
	if (!real_close)
		real_close = (int (*)(int))dlsym(RTLD_NEXT, "close");
}

static int on_root_thread(void)
{
	char name[16] = "";

	return pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "rpmi-root") == 0;
}

/* Sleeps the pause; returns how many bytes the next read may take (at most len). */
static size_t slow_down(size_t len)
{
	struct timespec pause = { PAUSE_MS / 1000, (PAUSE_MS % 1000) * 1000000L };

	nanosleep(&pause, NULL);
	return len > READ_MAX ? READ_MAX : len;
}

ssize_t recv(int fd, void *buf, size_t len, int flags)
{
	ssize_t n;

	find_real();
	if (fd < 0 || fd >= FDS || len == 0 || !on_root_thread())
		return real_recv(fd, buf, len, flags);
	if (taken[fd] >= FREE_BYTES)
		len = slow_down(len);
	else if (len > FREE_BYTES - taken[fd])
		len = FREE_BYTES - taken[fd];
	n = real_recv(fd, buf, len, flags);
	if (n > 0)
		taken[fd] += n;
	return n;
}

/* A new connection on a reused fd starts with its handshake again. */
int accept4(int fd, struct sockaddr *addr, socklen_t *addrlen, int flags)
{
	static int (*real)(int, struct sockaddr *, socklen_t *, int);
	int c;

	if (!real)
		real = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
	c = real(fd, addr, addrlen, flags);
	if (c >= 0 && c < FDS)
		taken[c] = 0;
	return c;
}

/* Reads a connection the root let go, slowly, until its peer closes it. */
static void *linger(void *arg)
{
	int fd = (int)(long)arg;
	char buf[65536];

	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
	while (real_recv(fd, buf, slow_down(sizeof buf), 0) > 0)
		;
	real_close(fd);
	pthread_mutex_lock(&lock);
	lingering--;
	pthread_cond_broadcast(&gone);
	pthread_mutex_unlock(&lock);
	return NULL;
}

int close(int fd)
{
	pthread_t t;

	find_real();
	if (fd < 0 || fd >= FDS || taken[fd] < FREE_BYTES || !on_root_thread())
		return real_close(fd);
	taken[fd] = 0;
	pthread_mutex_lock(&lock);
	lingering++;
	pthread_mutex_unlock(&lock);
	if (pthread_create(&t, NULL, linger, (void *)(long)fd) != 0) {
		pthread_mutex_lock(&lock);
		lingering--;
		pthread_mutex_unlock(&lock);
		return real_close(fd);
	}
	pthread_detach(t);
	return 0;
}

/* srun exits only once every connection the shim reads has been closed by its peer. */
static void hold_exit(void)
{
	struct timespec until;

	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += HOLD_S;
	pthread_mutex_lock(&lock);
	while (lingering > 0 && pthread_cond_timedwait(&gone, &lock, &until) == 0)
		;
	pthread_mutex_unlock(&lock);
}

__attribute__((constructor)) static void set_up(void)
{
	find_real();
	atexit(hold_exit);
}
