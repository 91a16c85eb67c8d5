/* What a task can do with the image of its node's key-value space that rpmi's server sends (get_kvs_image,
 * rpmi=2): written on the wire by hand, so that the task holds the memory file itself. Each rank puts a key,
 * enters the barrier, asks for the image with recvmsg and checks that
 *   - the file came, sealed against writing, growing, shrinking and new seals, as long as announced;
 *   - it cannot be written: not by write, ftruncate, a shared writable mapping, mprotect of a read-only one,
 *     or the file opened again through /proc/self/fd for writing;
 *   - its bytes hold the image's magic and this rank's key;
 *   - a process of another user (the child, as nobody) cannot open it through /proc of the task or of its
 *     parent (the server, under rpmi-run);
 * then puts a second key, enters a second barrier and asks again: the new file holds the new key, and the
 * first, still mapped, is as it was (a newer image never changes an older one that a task reads); a third
 * barrier with no put brings the second file again. Prints
 *   rank R of S: ok image files=I1,I2
 * I1 and I2 the two files' inode numbers (one file per node and fence: the node's tasks print the same), and
 * finalizes. Run as root (for the child's setuid). */
#define _GNU_SOURCE
#include "check.h"
#include "wire.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void)
{
    char buf[512], kvs[256];
    int size = start(2, kvs, sizeof kvs);
    snprintf(buf, sizeof buf, "cmd=put kvsname=%s key=image-key-%d value=image-value-%d\ncmd=barrier_in\n", kvs, rank, rank);
    say(buf);
    EXPECT(hear() < 0 && strstr(line, "cmd=put_result rc=0"));
    EXPECT(hear() < 0 && strstr(line, "cmd=barrier_out rc=0"));

    say("cmd=get_kvs_image\n");
    int file = hear();
    EXPECT(strstr(line, "cmd=kvs_image rc=0") != NULL && file >= 0);
    long bytes = field("bytes");
    struct stat st;
    EXPECT(fstat(file, &st) == 0 && st.st_size == bytes);
    int seals = fcntl(file, F_GET_SEALS);
    EXPECT(seals == (F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL));
    EXPECT(fcntl(file, F_GETFD) & FD_CLOEXEC);

    /* Not writable, whichever way. */
    EXPECT(write(file, "x", 1) < 0 && errno == EPERM);
    EXPECT(pwrite(file, "x", 1, 0) < 0 && errno == EPERM);
    EXPECT(ftruncate(file, 0) < 0 && errno == EPERM);
    EXPECT(ftruncate(file, bytes + 4096) < 0 && errno == EPERM);
    EXPECT(fcntl(file, F_ADD_SEALS, 0) < 0 && errno == EPERM); /* no seal can be taken off or added */
    EXPECT(mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file, 0) == MAP_FAILED && errno == EPERM);
    char *image = mmap(NULL, (size_t)bytes, PROT_READ, MAP_SHARED, file, 0);
    EXPECT(image != MAP_FAILED);
    EXPECT(mprotect(image, (size_t)bytes, PROT_READ | PROT_WRITE) < 0 && errno == EACCES);
    char again[64];
    snprintf(again, sizeof again, "/proc/self/fd/%d", file);
    int reopened = open(again, O_RDWR);
    EXPECT(reopened < 0 || (write(reopened, "x", 1) < 0 && errno == EPERM));

    /* What it holds. */
    EXPECT(memcmp(image, "RPMIKVS\001", 8) == 0);
    snprintf(buf, sizeof buf, "image-key-%d", rank);
    EXPECT(memmem(image, (size_t)bytes, buf, strlen(buf)) != NULL);

    /* Another user reaches it neither through the task nor through its server. */
    others_cannot_open(getpid());
    others_cannot_open(getppid());

    /* The next fence's image, beside the first. */
    char *first = malloc((size_t)bytes);
    EXPECT(first != NULL);
    memcpy(first, image, (size_t)bytes);
    snprintf(buf, sizeof buf, "cmd=put kvsname=%s key=second-key-%d value=second-value-%d\ncmd=barrier_in\n", kvs, rank,
             rank);
    say(buf);
    EXPECT(hear() < 0 && strstr(line, "cmd=put_result rc=0"));
    EXPECT(hear() < 0 && strstr(line, "cmd=barrier_out rc=0"));
    say("cmd=get_kvs_image\n");
    int second = hear();
    EXPECT(strstr(line, "cmd=kvs_image rc=0") != NULL && second >= 0 && field("fence") == 2);
    long bytes2 = field("bytes");
    struct stat st2;
    EXPECT(fstat(second, &st2) == 0 && st2.st_size == bytes2 && st2.st_ino != st.st_ino);
    char *image2 = mmap(NULL, (size_t)bytes2, PROT_READ, MAP_SHARED, second, 0);
    EXPECT(image2 != MAP_FAILED);
    snprintf(buf, sizeof buf, "second-key-%d", rank);
    EXPECT(memmem(image2, (size_t)bytes2, buf, strlen(buf)) != NULL);
    EXPECT(memcmp(first, image, (size_t)bytes) == 0);

    /* A fence that brings no key makes no new image: the second is sent again. */
    say("cmd=barrier_in\n");
    EXPECT(hear() < 0 && strstr(line, "cmd=barrier_out rc=0"));
    say("cmd=get_kvs_image\n");
    int third = hear();
    EXPECT(strstr(line, "cmd=kvs_image rc=0") != NULL && third >= 0 && field("fence") == 2 && field("bytes") == bytes2);
    struct stat st3;
    EXPECT(fstat(third, &st3) == 0 && st3.st_ino == st2.st_ino);

    printf("rank %d of %d: ok image files=%lu,%lu\n", rank, size, (unsigned long)st.st_ino, (unsigned long)st2.st_ino);
    fflush(stdout);
    say("cmd=finalize\n");
    EXPECT(hear() < 0);
    return 0;
}
