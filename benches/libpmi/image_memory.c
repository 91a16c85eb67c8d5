/* What the node's image of the key-value space costs the tasks that map it (rpmi's libpmi.so.0 under rpmi's
 * server): every rank puts 8 values of 800 bytes, enters the barrier and gets one key of every rank (so the
 * library maps the image), waits 2 s for the others to map it too, then prints its mapping of the image from
 * /proc/self/smaps:
 *   rank R of N: image size=S kB rss=R kB pss=P kB
 * Pss shares each page among the processes that map it: the sum of Pss over the node's tasks is what the
 * image costs the node in all. Build and run (benches/results/README.md gives the figures):
 *   mkdir -p lib && cp target/release/libpmi.so lib/libpmi.so.0
 *   cc -O2 -Icrates/libpmi/include -o image_memory benches/libpmi/image_memory.c -Llib -l:libpmi.so.0 \
 *      -Wl,-rpath,$PWD/lib
 *   target/release/rpmi-run -n 64 ./image_memory */
#include <pmi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static long field(const char *line, const char *name)
{
    return strncmp(line, name, strlen(name)) == 0 ? atol(line + strlen(name)) : -1;
}

int main(void)
{
    int spawned, rank, size;
    char kvs[256], key[64], value[801], got[1024];
    if (PMI_Init(&spawned) != PMI_SUCCESS || PMI_Get_rank(&rank) != PMI_SUCCESS || PMI_Get_size(&size) != PMI_SUCCESS ||
        PMI_KVS_Get_my_name(kvs, sizeof kvs) != PMI_SUCCESS)
        return 1;
    for (int i = 0; i < 8; i++) {
        snprintf(key, sizeof key, "k-%d-%d", rank, i);
        memset(value, 'a' + i, 800);
        value[800] = 0;
        if (PMI_KVS_Put(kvs, key, value) != PMI_SUCCESS)
            return 1;
    }
    if (PMI_KVS_Commit(kvs) != PMI_SUCCESS || PMI_Barrier() != PMI_SUCCESS)
        return 1;
    for (int r = 0; r < size; r++) {
        snprintf(key, sizeof key, "k-%d-0", r);
        if (PMI_KVS_Get(kvs, key, got, sizeof got) != PMI_SUCCESS)
            return 1;
    }
    /* The next barrier unmaps the image: wait for the others to map it instead. */
    sleep(2);
    FILE *smaps = fopen("/proc/self/smaps", "r");
    if (!smaps)
        return 1;
    char line[512];
    int in = 0;
    long bytes = -1, rss = -1, pss = -1;
    while (fgets(line, sizeof line, smaps)) {
        if (strstr(line, "rpmi-kvs-image")) {
            in = 1;
        } else if (in && field(line, "Size:") >= 0) {
            bytes = field(line, "Size:");
        } else if (in && field(line, "Rss:") >= 0) {
            rss = field(line, "Rss:");
        } else if (in && field(line, "Pss:") >= 0) {
            pss = field(line, "Pss:");
            in = 0;
        }
    }
    fclose(smaps);
    printf("rank %d of %d: image size=%ld kB rss=%ld kB pss=%ld kB\n", rank, size, bytes, rss, pss);
    return PMI_Barrier() == PMI_SUCCESS && PMI_Finalize() == PMI_SUCCESS ? 0 : 1;
}
