/* The task of the client-library benchmark (benches/libpmi/main.rs) and of the exchange benchmark
 * (benches/exchange/main.rs): each workload, spoken through the client chosen when it is built:
 *   -DCLIENT=1   the PMI-1 API (pmi.h), through whichever libpmi.so.0 the run path finds
 *   -DCLIENT=2   the PMI-2 API (pmi2.h), through whichever libpmi2.so.0 the run path finds (rpmi's, Slurm's)
 *   -DCLIENT=3   the PMIx API (pmix.h, OpenPMIx's libpmix): puts, a commit, fences (collecting data after puts)
 *   -DCLIENT=11  PMI-1 lines written and read on PMI_FD by hand, each answered before the next: the least a
 *                client can do, and what MPICH's own client sends
 *   -DCLIENT=12  PMI-2 frames written and read on PMI_FD by hand
 * The hand-written clients send the requests the libraries send for the same work, so that the difference is
 * what a library costs, not what it asks.
 *
 *   pmi_bench GETS
 * Every rank: a start-up (init, put its own key, fence, get every rank's key) then GETS gets after that fence
 * (rank (rank + i) % size's key), each phase closed by a fence so that rank 0's clock covers every rank.
 * Rank 0 prints one line:  startup_us=S gets_us=G startup_cpu_us=CS gets_cpu_us=CG lib=PATH
 * the wall-clock time of each phase and the CPU time the process spent in it (its own work and its system
 * calls, not its waits: what a client library adds shows there, undrowned by where the scheduler put whom),
 * and PATH the file the client library was loaded from (none for the hand-written clients).
 *
 *   pmi_bench exchange PUTS BYTES GETS FENCES
 * Every rank, once started and past a first fence: PUTS puts of BYTES bytes each and a fence that collects
 * them (the "put" phase), GETS gets of other ranks' keys, each checked, and a fence (the "get" phase), then
 * FENCES fences with nothing put. Rank 0 prints one line:
 *   put_us=P get_us=G exchange_us=E fence_us=F lib=PATH
 * the put phase, the get phase, both, and one empty fence (the mean of FENCES), in µs of wall-clock time.
 *
 *   pmi_bench load   returns at once, PMI untouched: what starting a process linked so costs */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int rank, size;

static void fail(const char *what)
{
    fprintf(stderr, "pmi_bench: rank %d: %s\n", rank, what);
    exit(1);
}

static double now_us(clockid_t clock)
{
    struct timespec t;
    clock_gettime(clock, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

#if CLIENT == 1
#include <pmi.h>
static char kvs[256];
static void start(void)
{
    int spawned = 0;
    if (PMI_Init(&spawned) != PMI_SUCCESS || PMI_Get_rank(&rank) != PMI_SUCCESS || PMI_Get_size(&size) != PMI_SUCCESS ||
        PMI_KVS_Get_my_name(kvs, sizeof kvs) != PMI_SUCCESS)
        fail("init");
}
static void put(const char *k, const char *v)
{
    if (PMI_KVS_Put(kvs, k, v) != PMI_SUCCESS || PMI_KVS_Commit(kvs) != PMI_SUCCESS)
        fail("put");
}
static void fence(void)
{
    if (PMI_Barrier() != PMI_SUCCESS)
        fail("barrier");
}
static void get(const char *k, int from, char *v, int n)
{
    (void)from;
    if (PMI_KVS_Get(kvs, k, v, n) != PMI_SUCCESS)
        fail("get");
}
static void finish(void)
{
    PMI_Finalize();
}
#define ENTRY ((void *)PMI_Init)

#elif CLIENT == 2
#include <pmi2.h>
static void start(void)
{
    int spawned = 0, appnum = 0;
    if (PMI2_Init(&spawned, &size, &rank, &appnum) != PMI2_SUCCESS)
        fail("init");
}
static void put(const char *k, const char *v)
{
    if (PMI2_KVS_Put(k, v) != PMI2_SUCCESS)
        fail("put");
}
static void fence(void)
{
    if (PMI2_KVS_Fence() != PMI2_SUCCESS)
        fail("fence");
}
static void get(const char *k, int from, char *v, int n)
{
    int len = 0;
    if (PMI2_KVS_Get(NULL, from, k, v, n, &len) != PMI2_SUCCESS)
        fail("get");
}
static void finish(void)
{
    PMI2_Finalize();
}
#define ENTRY ((void *)PMI2_Init)

#elif CLIENT == 3
#include <pmix.h>
#include <stdbool.h>
static pmix_proc_t me;
static int collect; /* the next fence collects the puts made since the last */
static void start(void)
{
    pmix_proc_t job;
    pmix_value_t *v = NULL;
    if (PMIx_Init(&me, NULL, 0) != PMIX_SUCCESS)
        fail("init");
    rank = (int)me.rank;
    PMIX_LOAD_PROCID(&job, me.nspace, PMIX_RANK_WILDCARD);
    if (PMIx_Get(&job, PMIX_JOB_SIZE, NULL, 0, &v) != PMIX_SUCCESS || v->type != PMIX_UINT32)
        fail("job size");
    size = (int)v->data.uint32;
    PMIX_VALUE_RELEASE(v);
}
static void put(const char *k, const char *v)
{
    pmix_value_t value;
    PMIX_VALUE_LOAD(&value, v, PMIX_STRING);
    if (PMIx_Put(PMIX_GLOBAL, k, &value) != PMIX_SUCCESS)
        fail("put");
    PMIX_VALUE_DESTRUCT(&value);
    collect = 1;
}
static void fence(void)
{
    pmix_info_t info;
    bool yes = true;
    if (collect && PMIx_Commit() != PMIX_SUCCESS)
        fail("commit");
    PMIX_INFO_LOAD(&info, PMIX_COLLECT_DATA, &yes, PMIX_BOOL);
    if (PMIx_Fence(NULL, 0, collect ? &info : NULL, collect ? 1 : 0) != PMIX_SUCCESS)
        fail("fence");
    PMIX_INFO_DESTRUCT(&info);
    collect = 0;
}
static void get(const char *k, int from, char *v, int n)
{
    pmix_proc_t p;
    pmix_value_t *value = NULL;
    PMIX_LOAD_PROCID(&p, me.nspace, (pmix_rank_t)from);
    if (PMIx_Get(&p, k, NULL, 0, &value) != PMIX_SUCCESS || value->type != PMIX_STRING)
        fail("get");
    snprintf(v, (size_t)n, "%s", value->data.string);
    PMIX_VALUE_RELEASE(value);
}
static void finish(void)
{
    PMIx_Finalize(NULL, 0);
}
#define ENTRY ((void *)PMIx_Init)

#elif CLIENT == 11 || CLIENT == 12
static int fd = -1;
static char reply[4096], kvs[256];

static void say(const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w <= 0)
            fail("write");
        s += w;
        n -= (size_t)w;
    }
}

/* Reads n bytes, or a line when n is 0 (PMI-1), through a buffer as any client would; the reply is
 * NUL-terminated, its newline dropped. */
static char in[8192];
static size_t in_at, in_len;
static void hear(size_t n)
{
    size_t got = 0;
    for (;;) {
        if (got + 1 >= sizeof reply)
            fail("reply too long");
        if (in_at == in_len) {
            ssize_t r = read(fd, in, sizeof in);
            if (r <= 0)
                fail("read");
            in_at = 0;
            in_len = (size_t)r;
        }
        reply[got++] = in[in_at++];
        if (n ? got == n : reply[got - 1] == '\n')
            break;
    }
    reply[n ? got : got - 1] = 0;
}

/* The value of `key` in the reply (up to `end`), copied to out. */
static void field(const char *key, char end, char *out, size_t n)
{
    char pat[64];
    snprintf(pat, sizeof pat, "%s=", key);
    char *p = strstr(reply, pat);
    if (!p)
        fail(reply);
    p += strlen(pat);
    size_t len = strcspn(p, end == ' ' ? " " : ";");
    if (len >= n)
        fail("field too long");
    memcpy(out, p, len);
    out[len] = 0;
}

#if CLIENT == 11
static void call(const char *line)
{
    say(line, strlen(line));
    hear(0);
    if (strstr(reply, "rc=") && !strstr(reply, "rc=0"))
        fail(reply);
}
static void start(void)
{
    char line[512];
    fd = atoi(getenv("PMI_FD"));
    rank = atoi(getenv("PMI_RANK"));
    size = atoi(getenv("PMI_SIZE"));
    const char *sub = getenv("RPMI_PMI_SUBVERSION");
    snprintf(line, sizeof line, "cmd=init pmi_version=1 pmi_subversion=%s\n", sub && atoi(sub) >= 2 ? "2" : "1");
    call(line);
    call("cmd=get_maxes\n");
    call("cmd=get_my_kvsname\n");
    field("kvsname", ' ', kvs, sizeof kvs);
}
static void put(const char *k, const char *v)
{
    char line[2048];
    snprintf(line, sizeof line, "cmd=put kvsname=%s key=%s value=%s\n", kvs, k, v);
    call(line);
}
static void fence(void)
{
    call("cmd=barrier_in\n");
}
static void get(const char *k, int from, char *v, int n)
{
    char line[512];
    (void)from;
    snprintf(line, sizeof line, "cmd=get kvsname=%s key=%s\n", kvs, k);
    call(line);
    field("value", ' ', v, (size_t)n);
}
static void finish(void)
{
    call("cmd=finalize\n");
}

#else
static void call(const char *body)
{
    char frame[2048];
    int n = snprintf(frame, sizeof frame, "%6zu%s", strlen(body), body);
    say(frame, (size_t)n);
    hear(6);
    size_t len = (size_t)atol(reply);
    hear(len);
    if (!strstr(reply, "rc=0;"))
        fail(reply);
}
static void start(void)
{
    char body[512];
    const char *job = getenv("PMI_JOBID");
    fd = atoi(getenv("PMI_FD"));
    const char *init = "cmd=init pmi_version=2 pmi_subversion=0\n";
    say(init, strlen(init));
    hear(0);
    snprintf(body, sizeof body, "cmd=fullinit;pmijobid=%s;pmirank=%s;threaded=FALSE;", job ? job : "",
             getenv("PMI_RANK"));
    call(body);
    char n[32];
    field("rank", ';', n, sizeof n);
    rank = atoi(n);
    field("size", ';', n, sizeof n);
    size = atoi(n);
    call("cmd=job-getid;");
    field("jobid", ';', kvs, sizeof kvs);
}
static void put(const char *k, const char *v)
{
    char body[2048];
    snprintf(body, sizeof body, "cmd=kvs-put;key=%s;value=%s;", k, v);
    call(body);
}
static void fence(void)
{
    call("cmd=kvs-fence;");
}
static void get(const char *k, int from, char *v, int n)
{
    char body[512];
    snprintf(body, sizeof body, "cmd=kvs-get;jobid=%s;srcid=%d;key=%s;", kvs, from, k);
    call(body);
    field("value", ';', v, (size_t)n);
}
static void finish(void)
{
    call("cmd=finalize;");
}
#endif

#else
#error "build with -DCLIENT=1, 2, 3, 11 or 12"
#endif

/* The file the client library was loaded from, or "none". */
static void library(char *lib)
{
    strcpy(lib, "none");
#ifdef ENTRY
    Dl_info info;
    if (!dladdr(ENTRY, &info) || !realpath(info.dli_fname, lib))
        fail("no library");
#endif
}

/* Rank r's key i, and the value of BYTES bytes it puts under it (no spaces: some servers cut at them). */
static void card(int r, int i, int bytes, char *key, size_t key_n, char *value)
{
    snprintf(key, key_n, "card-%d-%d", r, i);
    int n = snprintf(value, (size_t)bytes + 1, "rank-%d-card-%d-", r, i);
    for (int j = n; j < bytes; j++)
        value[j] = (char)('a' + (r + i + j) % 26);
    value[bytes] = 0;
}

static int exchange(int argc, char **argv)
{
    if (argc != 6)
        fail("usage: pmi_bench exchange PUTS BYTES GETS FENCES");
    int puts = atoi(argv[2]), bytes = atoi(argv[3]), gets = atoi(argv[4]), fences = atoi(argv[5]);
    if (puts < 1 || bytes < 16 || bytes > 1000 || gets < 0 || fences < 1)
        fail("PUTS >= 1, 16 <= BYTES <= 1000, GETS >= 0, FENCES >= 1");
    char key[64], value[1024], want[1024];
    start();
    fence();
    double t0 = now_us(CLOCK_MONOTONIC);
    for (int i = 0; i < puts; i++) {
        card(rank, i, bytes, key, sizeof key, value);
        put(key, value);
    }
    fence();
    double t1 = now_us(CLOCK_MONOTONIC);
    for (int i = 0; i < gets; i++) {
        int r = (rank + 1 + i) % size;
        card(r, i % puts, bytes, key, sizeof key, want);
        get(key, r, value, sizeof value);
        if (strcmp(value, want) != 0)
            fail(value);
    }
    fence();
    double t2 = now_us(CLOCK_MONOTONIC);
    for (int i = 0; i < fences; i++)
        fence();
    double t3 = now_us(CLOCK_MONOTONIC);
    char lib[PATH_MAX];
    library(lib);
    if (rank == 0)
        printf("put_us=%.1f get_us=%.1f exchange_us=%.1f fence_us=%.2f lib=%s\n", t1 - t0, t2 - t1, t2 - t0,
               (t3 - t2) / fences, lib);
    fflush(stdout);
    finish();
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "load") == 0)
        return 0;
    if (argc > 1 && strcmp(argv[1], "exchange") == 0)
        return exchange(argc, argv);
    int gets = argc > 1 ? atoi(argv[1]) : 1000;
    char key[64], value[1024], want[128];
    /* Every program that calls PMI has allocated before it (an MPI library sets itself up first): a process's
     * first malloc (glibc's heap set-up, a getrandom, a brk and their page faults) is not the PMI client's. */
    void *volatile heap = malloc(64); /* volatile: the compiler may not drop the pair */
    free(heap);
    /* Nor is its first snprintf (the C library's printf code run for the first time: some µs): a program has
     * formatted text before it calls PMI. Left to the start-up, it would fall inside every client's, in the
     * hand-written clients' init or at the first key below, and add the program's own cost to both sides of
     * each ratio. */
    snprintf(key, sizeof key, "key%d", argc);
    double t0 = now_us(CLOCK_MONOTONIC), c0 = now_us(CLOCK_PROCESS_CPUTIME_ID);
    start();
    snprintf(key, sizeof key, "key%d", rank);
    snprintf(value, sizeof value, "business-card-of-rank-%d", rank);
    put(key, value);
    fence();
    for (int r = 0; r < size; r++) {
        snprintf(key, sizeof key, "key%d", r);
        get(key, r, value, sizeof value);
        snprintf(want, sizeof want, "business-card-of-rank-%d", r);
        if (strcmp(value, want) != 0)
            fail(value);
    }
    fence();
    double t1 = now_us(CLOCK_MONOTONIC), c1 = now_us(CLOCK_PROCESS_CPUTIME_ID);
    for (int i = 0; i < gets; i++) {
        int r = (rank + i) % size;
        snprintf(key, sizeof key, "key%d", r);
        get(key, r, value, sizeof value);
    }
    fence();
    double t2 = now_us(CLOCK_MONOTONIC), c2 = now_us(CLOCK_PROCESS_CPUTIME_ID);
    char lib[PATH_MAX];
    library(lib);
    if (rank == 0)
        printf("startup_us=%.0f gets_us=%.0f startup_cpu_us=%.0f gets_cpu_us=%.0f lib=%s\n", t1 - t0, t2 - t1,
               c1 - c0, c2 - c1, lib);
    fflush(stdout);
    finish();
    return 0;
}
