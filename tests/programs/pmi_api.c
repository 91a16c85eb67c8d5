/* Calls every function of the PMI-1 API (pmi.h, libpmi.so.0) the way a runtime does at start-up, and each
 * with the wrong arguments RFC 13 lists, checking every return code. Prints one line per rank:
 *   rank R of S: ok clique=N groups=G
 * and exits non-zero, naming the check, at the first one that fails. Four threads read the exchange at once,
 * after each of two barriers (each rank puts a key before each).
 *
 *
 *   pmi_api [alone | abort | spawn | groups | fork | exec | overlap | puts]
 *     alone: no launcher (a job of one); abort: rank 1 calls PMI_Abort(7, ...);
 *     spawn: rank 0 starts two tasks of this program with a preput `greeting`; each checks it and prints
 *     "child R of 2: ok", and each rank of the parent job "rank R of S: ok spawned";
 *   groups: two threads of each rank wait in two group barriers at once, entered in opposite orders on even
 *     and odd ranks, while a third reads the exchange; prints "rank R of S: ok groups";
 *   fork: each rank forks while another thread waits in a barrier (that rank 0 enters late); the child finds
 *     every call failing at once, and its PMI_Abort ends it alone; prints "rank R of S: ok fork";
 *   exec: puts its key, enters the barrier, gets every rank's, checks that the image of the key-value space
 *     is mapped and no fd of it open, finalizes and execs a shell that checks it holds neither, and prints
 *     "rank R of S: ok exec";
 *   overlap: 6 rounds of a put and a barrier, each entered while 4 threads read every earlier round's keys
 *     (the barrier's new image of the store comes while they read); prints "rank R of S: ok overlap";
 *   puts: puts a=1, b=2 and b=3, gets b (3), enters the barrier, gets a (1) ten times and finalizes, for a
 *     server that watches how they come (tests/libpmi.rs); prints "rank R of S: ok puts barrier=RC", RC the barrier's
 *     return code */
#include "check.h"
#include <pmi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char *kvsname;
static int size, val_max, rounds = 1;

/* Several threads reading the exchange at once, as an MPI_THREAD_MULTIPLE runtime may: the library serves
 * them one at a time, each its own answer. Every round's keys so far (keyR, then round2-R). */
static void *reader(void *arg)
{
    long id = (long)arg;
    char key[64], want[128], *value = malloc(val_max);
    for (int i = 0; i < 200; i++) {
        int r = (int)((id * 7 + i) % size);
        if (rounds > 1 && i % 2) {
            snprintf(key, sizeof key, "round2-%d", r);
            snprintf(want, sizeof want, "second-of-rank-%d", r);
        } else {
            snprintf(key, sizeof key, "key%d", r);
            snprintf(want, sizeof want, "value-of-rank-%d:%d", r, r * 7);
        }
        if (PMI_KVS_Get(kvsname, key, value, val_max) != PMI_SUCCESS || strcmp(value, want) != 0) {
            fprintf(stderr, "rank %d: thread %ld read '%s' for %s\n", rank, id, value, key);
            exit(1);
        }
    }
    free(value);
    return NULL;
}

/* What the modes below start from once PMI_Init has returned: the rank, the size, the key-value space's
 * name and the longest value; a buffer for a value. */
static char *session(void)
{
    int name_max = 0;
    CHECK(PMI_Get_rank(&rank), PMI_SUCCESS);
    CHECK(PMI_Get_size(&size), PMI_SUCCESS);
    CHECK(PMI_KVS_Get_name_length_max(&name_max), PMI_SUCCESS);
    CHECK(PMI_KVS_Get_value_length_max(&val_max), PMI_SUCCESS);
    kvsname = malloc(name_max);
    CHECK(PMI_KVS_Get_my_name(kvsname, name_max), PMI_SUCCESS);
    return malloc(val_max);
}

/* A task started by PMI_Spawn_multiple: the parent's preput is in its own key-value space. */
static int spawned_child(void)
{
    char *value = session();
    CHECK(PMI_KVS_Get(kvsname, "greeting", value, val_max), PMI_SUCCESS);
    EXPECT(size == 2 && strcmp(value, "hello-from-the-parent") == 0);
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    printf("child %d of %d: ok\n", rank, size);
    fflush(stdout);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    return 0;
}

/* Group barriers from several threads at once, as threaded MPICH has them: each waits for its own. */
static int entered[2];
static void *grouped(void *arg)
{
    long which = (long)arg;
    int *all = malloc(sizeof(int) * size);
    for (int r = 0; r < size; r++)
        all[r] = r;
    for (int round = 0; round < 20; round++) {
        char tag[32];
        /* Even ranks enter "a" first, odd ranks "b": each barrier ends only once the other is waited in. */
        if ((rank % 2 == 0) != (which == 0))
            while (__atomic_load_n(&entered[!which], __ATOMIC_SEQ_CST) <= round)
                ;
        snprintf(tag, sizeof tag, "%s%d", which == 0 ? "a" : "b", round);
        __atomic_add_fetch(&entered[which], 1, __ATOMIC_SEQ_CST);
        CHECK(PMI_Barrier_group(all, size, tag), PMI_SUCCESS);
    }
    free(all);
    return NULL;
}

static int groups_at_once(void)
{
    char key[64], *value = session();
    snprintf(key, sizeof key, "key%d", rank);
    snprintf(value, val_max, "value-of-rank-%d:%d", rank, rank * 7);
    CHECK(PMI_KVS_Put(kvsname, key, value), PMI_SUCCESS);
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    pthread_t threads[3];
    for (long t = 0; t < 2; t++)
        EXPECT(pthread_create(&threads[t], NULL, grouped, (void *)t) == 0);
    EXPECT(pthread_create(&threads[2], NULL, reader, (void *)2) == 0);
    for (int t = 0; t < 3; t++)
        pthread_join(threads[t], NULL);
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    printf("rank %d of %d: ok groups\n", rank, size);
    fflush(stdout);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    return 0;
}

/* Rank 0 spawns two tasks of this very program; every rank meets once it has. */
static int spawner(const char *self)
{
    CHECK(PMI_Get_rank(&rank), PMI_SUCCESS);
    CHECK(PMI_Get_size(&size), PMI_SUCCESS);
    if (rank == 0) {
        const char *cmds[1] = {self}, *args[] = {"child", NULL}, **argvs[1] = {args};
        int maxprocs[1] = {2}, info_sizes[1] = {0}, errors[2] = {-1, -1};
        char greeting[] = "hello-from-the-parent";
        PMI_keyval_t preput[1] = {{"greeting", greeting}};
        CHECK(PMI_Spawn_multiple(1, cmds, argvs, maxprocs, info_sizes, NULL, 1, preput, errors), PMI_SUCCESS);
        EXPECT(errors[0] == PMI_SUCCESS);
    }
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    printf("rank %d of %d: ok spawned\n", rank, size);
    fflush(stdout);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    return 0;
}

static void *barrier_thread(void *arg)
{
    (void)arg;
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    return NULL;
}

/* A fork while another thread is inside a call, which holds the library's lock (a barrier the other ranks
 * wait in until rank 0 enters it, late). The child may make no call: each fails at once, as before init (none
 * waits for the lock, which no thread of the child will let go, or speaks on the parent's connection);
 * PMI_Init fails; PMI_Abort ends the child alone, and the job goes on. */
static int fork_while_in_a_barrier(void)
{
    pthread_t in_barrier;
    int status = -1, initialized = -1, spawned = -1, value = -1;
    char name[256];
    pid_t child;
    CHECK(PMI_Get_rank(&rank), PMI_SUCCESS);
    CHECK(PMI_Get_size(&size), PMI_SUCCESS);
    if (rank == 0)
        usleep(500000); /* the other ranks fork meanwhile */
    EXPECT(pthread_create(&in_barrier, NULL, barrier_thread, NULL) == 0);
    usleep(50000); /* the barrier is then surely asked */
    fflush(NULL);
    child = fork();
    EXPECT(child >= 0);
    if (child == 0) {
        alarm(10); /* a call that waits for the lock ends the child */
        CHECK(PMI_Initialized(&initialized), PMI_SUCCESS);
        EXPECT(initialized == 0);
        CHECK(PMI_Get_rank(&value), PMI_ERR_INIT);
        CHECK(PMI_KVS_Get_my_name(name, sizeof name), PMI_ERR_INIT);
        CHECK(PMI_Barrier(), PMI_ERR_INIT);
        CHECK(PMI_Init(&spawned), PMI_FAIL);
        CHECK(PMI_Finalize(), PMI_ERR_INIT);
        PMI_Abort(3, "pmi_api: the child of a fork aborts on purpose");
        _exit(1);
    }
    EXPECT(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 3);
    pthread_join(in_barrier, NULL);
    CHECK(PMI_Barrier(), PMI_SUCCESS); /* the parent's session goes on */
    printf("rank %d of %d: ok fork\n", rank, size);
    fflush(stdout);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    return 0;
}

/* Whether any line of `path` (a /proc file, or the listing of a directory's links) names rpmi's image. */
static int names_image(const char *path)
{
    char command[256];
    snprintf(command, sizeof command, "ls -l %s 2>/dev/null | grep -q 'memfd:rpmi-kvs-image' || grep -qs "
                                      "'memfd:rpmi-kvs-image' %s", path, path);
    return system(command) == 0;
}

/* Gets through the image, then an exec that finds none of it. */
static int exec_after_gets(void)
{
    char key[64], *value = session();
    snprintf(key, sizeof key, "key%d", rank);
    CHECK(PMI_KVS_Put(kvsname, key, "v"), PMI_SUCCESS);
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    for (int i = 0; i < 20; i++) { /* past the gets the library sends to the server before it maps the image */
        snprintf(key, sizeof key, "key%d", i % size);
        CHECK(PMI_KVS_Get(kvsname, key, value, val_max), PMI_SUCCESS);
    }
    char self[64];
    snprintf(self, sizeof self, "/proc/%d/maps", (int)getpid());
    EXPECT(names_image(self));
    snprintf(self, sizeof self, "/proc/%d/fd/", (int)getpid());
    EXPECT(!names_image(self));
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    char script[256];
    snprintf(script, sizeof script,
             "if ls -l /proc/$$/fd/ | grep -q memfd: || grep -q memfd: /proc/$$/maps; then exit 1; fi; "
             "echo 'rank %d of %d: ok exec'", rank, size);
    execl("/bin/sh", "sh", "-c", script, (char *)NULL);
    return 1;
}

/* Readers inside gets while their rank enters the next barrier, whose image of the store replaces the one
 * they read: 6 rounds, in each every rank puts its key of the round and enters the barrier while 4 threads
 * read every earlier round's keys, each value checked. */
enum { OVERLAP_ROUNDS = 6 };
static int overlap_round;

static void *overlap_reader(void *arg)
{
    long id = (long)arg;
    char key[64], want[64], *value = malloc(val_max);
    for (int i = 0; i < 300; i++) {
        int round = (int)((id + i) % overlap_round), r = (int)((id * 5 + i) % size);
        snprintf(key, sizeof key, "overlap%d-%d", round, r);
        snprintf(want, sizeof want, "round-%d-of-rank-%d", round, r);
        if (PMI_KVS_Get(kvsname, key, value, val_max) != PMI_SUCCESS || strcmp(value, want) != 0) {
            fprintf(stderr, "rank %d: thread %ld read '%s' for %s\n", rank, id, value, key);
            exit(1);
        }
    }
    free(value);
    return NULL;
}

static int reads_across_barriers(void)
{
    char key[64], *value = session();
    for (overlap_round = 0; overlap_round < OVERLAP_ROUNDS; overlap_round++) {
        pthread_t threads[4];
        int readers = overlap_round > 0 ? 4 : 0;
        for (long t = 0; t < readers; t++)
            EXPECT(pthread_create(&threads[t], NULL, overlap_reader, (void *)t) == 0);
        snprintf(key, sizeof key, "overlap%d-%d", overlap_round, rank);
        snprintf(value, val_max, "round-%d-of-rank-%d", overlap_round, rank);
        CHECK(PMI_KVS_Put(kvsname, key, value), PMI_SUCCESS);
        CHECK(PMI_Barrier(), PMI_SUCCESS);
        for (int t = 0; t < readers; t++)
            pthread_join(threads[t], NULL);
    }
    printf("rank %d of %d: ok overlap\n", rank, size);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    return 0;
}

/* The puts of a start-up, a key put again and read back before the barrier, then the barrier. */
static int puts_then_barrier(void)
{
    char *value = session();
    CHECK(PMI_KVS_Put(kvsname, "a", "1"), PMI_SUCCESS);
    CHECK(PMI_KVS_Put(kvsname, "b", "2"), PMI_SUCCESS);
    CHECK(PMI_KVS_Put(kvsname, "b", "3"), PMI_SUCCESS);
    CHECK(PMI_KVS_Get(kvsname, "b", value, val_max), PMI_SUCCESS);
    EXPECT(strcmp(value, "3") == 0);
    int rc = PMI_Barrier();
    for (int i = 0; i < 10; i++) { /* past the gets a library sends to the server before it asks for an image */
        CHECK(PMI_KVS_Get(kvsname, "a", value, val_max), PMI_SUCCESS);
        EXPECT(strcmp(value, "1") == 0);
    }
    printf("rank %d of %d: ok puts barrier=%d\n", rank, size, rc);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    return 0;
}

int main(int argc, char **argv)
{
    int alone = argc > 1 && strcmp(argv[1], "alone") == 0;
    int abort_test = argc > 1 && strcmp(argv[1], "abort") == 0;
    int initialized = -1, spawned = -1, universe = 0, appnum = -1;
    int name_max = 0, key_max = 0, id_max = 0;
    char fds[FDS];

    open_fds(fds);
    /* Before PMI_Init. */
    CHECK(PMI_Initialized(&initialized), PMI_SUCCESS);
    EXPECT(initialized == 0);
    CHECK(PMI_Initialized(NULL), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Get_size(&size), PMI_ERR_INIT);
    CHECK(PMI_Barrier(), PMI_ERR_INIT);
    CHECK(PMI_Init(NULL), PMI_ERR_INVALID_ARG);

    CHECK(PMI_Init(&spawned), PMI_SUCCESS);
    expect_connection_close_on_exec(fds);
    if (spawned == 1)
        return spawned_child();
    if (argc > 1 && strcmp(argv[1], "spawn") == 0)
        return spawner(argv[0]);
    if (argc > 1 && strcmp(argv[1], "groups") == 0)
        return groups_at_once();
    if (argc > 1 && strcmp(argv[1], "fork") == 0)
        return fork_while_in_a_barrier();
    if (argc > 1 && strcmp(argv[1], "puts") == 0)
        return puts_then_barrier();
    if (argc > 1 && strcmp(argv[1], "exec") == 0)
        return exec_after_gets();
    if (argc > 1 && strcmp(argv[1], "overlap") == 0)
        return reads_across_barriers();
    EXPECT(spawned == 0);
    CHECK(PMI_Init(&spawned), PMI_SUCCESS); /* a second init is harmless */
    CHECK(PMI_Initialized(&initialized), PMI_SUCCESS);
    EXPECT(initialized == 1);

    CHECK(PMI_Get_rank(&rank), PMI_SUCCESS);
    CHECK(PMI_Get_size(&size), PMI_SUCCESS);
    CHECK(PMI_Get_universe_size(&universe), PMI_SUCCESS);
    CHECK(PMI_Get_appnum(&appnum), PMI_SUCCESS);
    /* -1: the server does not know (Hydra's universe, Slurm's --mpi=pmi2 appnum). */
    EXPECT(size >= 1 && rank >= 0 && rank < size && (universe >= size || universe == -1));
    EXPECT(appnum == 0 || appnum == -1);
    if (alone)
        EXPECT(size == 1 && rank == 0);
    CHECK(PMI_Get_rank(NULL), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Get_size(NULL), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Get_universe_size(NULL), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Get_appnum(NULL), PMI_ERR_INVALID_ARG);

    CHECK(PMI_KVS_Get_name_length_max(&name_max), PMI_SUCCESS);
    CHECK(PMI_KVS_Get_key_length_max(&key_max), PMI_SUCCESS);
    CHECK(PMI_KVS_Get_value_length_max(&val_max), PMI_SUCCESS);
    CHECK(PMI_Get_id_length_max(&id_max), PMI_SUCCESS);
    EXPECT(name_max > 16 && key_max > 16 && val_max > 64 && id_max == name_max);
    CHECK(PMI_KVS_Get_value_length_max(NULL), PMI_ERR_INVALID_ARG);

    kvsname = malloc(name_max);
    char *id = malloc(id_max), *domain = malloc(name_max);
    char *value = malloc(val_max), key[64];
    CHECK(PMI_KVS_Get_my_name(kvsname, name_max), PMI_SUCCESS);
    CHECK(PMI_Get_id(id, id_max), PMI_SUCCESS);
    CHECK(PMI_Get_kvs_domain_id(domain, name_max), PMI_SUCCESS);
    EXPECT(strlen(kvsname) > 0 && strcmp(kvsname, id) == 0 && strcmp(kvsname, domain) == 0);
    CHECK(PMI_KVS_Get_my_name(NULL, name_max), PMI_ERR_INVALID_ARG);
    CHECK(PMI_KVS_Get_my_name(kvsname, -1), PMI_ERR_INVALID_LENGTH);
    CHECK(PMI_KVS_Get_my_name(key, 1), PMI_ERR_INVALID_LENGTH);

    if (abort_test && rank == 1)
        PMI_Abort(7, "pmi_api: rank 1 aborts on purpose");

    /* The exchange: each rank puts a value, all meet, each reads every rank's (no spaces in values: Hydra cuts them). */
    snprintf(key, sizeof key, "key%d", rank);
    snprintf(value, val_max, "value-of-rank-%d:%d", rank, rank * 7);
    CHECK(PMI_KVS_Put(kvsname, key, value), PMI_SUCCESS);
    CHECK(PMI_KVS_Put("another_kvs", key, value), PMI_ERR_INVALID_KVS);
    CHECK(PMI_KVS_Put(kvsname, "a=b", value), PMI_ERR_INVALID_KEY);
    CHECK(PMI_KVS_Put(kvsname, NULL, value), PMI_ERR_INVALID_KEY);
    CHECK(PMI_KVS_Put(kvsname, key, "two\nlines"), PMI_ERR_INVALID_VAL);
    CHECK(PMI_KVS_Put(kvsname, key, "trailing "), PMI_ERR_INVALID_VAL); /* servers trim it */
    CHECK(PMI_KVS_Put(kvsname, key, ""), PMI_ERR_INVALID_VAL);
    CHECK(PMI_KVS_Put(kvsname, key, NULL), PMI_ERR_INVALID_VAL);
    CHECK(PMI_KVS_Commit(kvsname), PMI_SUCCESS);
    CHECK(PMI_KVS_Commit(NULL), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    for (int r = 0; r < size; r++) {
        char want[128];
        snprintf(key, sizeof key, "key%d", r);
        snprintf(want, sizeof want, "value-of-rank-%d:%d", r, r * 7);
        CHECK(PMI_KVS_Get(kvsname, key, value, val_max), PMI_SUCCESS);
        if (strcmp(value, want) != 0) {
            fprintf(stderr, "rank %d: %s is '%s', not '%s'\n", rank, key, value, want);
            return 1;
        }
    }
    pthread_t threads[4];
    for (long t = 0; t < 4; t++)
        EXPECT(pthread_create(&threads[t], NULL, reader, (void *)t) == 0);
    for (int t = 0; t < 4; t++)
        pthread_join(threads[t], NULL);
    /* A second round: a key of each rank's put after the first barrier, read by nobody before the second. */
    snprintf(key, sizeof key, "round2-%d", rank);
    snprintf(value, val_max, "second-of-rank-%d", rank);
    CHECK(PMI_KVS_Put(kvsname, key, value), PMI_SUCCESS);
    CHECK(PMI_Barrier(), PMI_SUCCESS);
    rounds = 2;
    for (long t = 0; t < 4; t++)
        EXPECT(pthread_create(&threads[t], NULL, reader, (void *)t) == 0);
    for (int t = 0; t < 4; t++)
        pthread_join(threads[t], NULL);
    CHECK(PMI_KVS_Get(kvsname, "key0", value, 3), PMI_ERR_INVALID_LENGTH);
    CHECK(PMI_KVS_Get(kvsname, "no_such_key", value, val_max), PMI_FAIL);
    CHECK(PMI_KVS_Get("another_kvs", "key0", value, val_max), PMI_ERR_INVALID_KVS);
    CHECK(PMI_KVS_Get(kvsname, "key0", NULL, val_max), PMI_ERR_INVALID_VAL);

    /* Who shares this node. */
    int clique = 0, in_clique = 0;
    CHECK(PMI_Get_clique_size(&clique), PMI_SUCCESS);
    EXPECT(clique >= 1 && clique <= size);
    int *ranks = malloc(sizeof(int) * clique);
    CHECK(PMI_Get_clique_ranks(ranks, clique), PMI_SUCCESS);
    for (int i = 0; i < clique; i++)
        in_clique |= ranks[i] == rank;
    EXPECT(in_clique);
    if (clique > 1)
        CHECK(PMI_Get_clique_ranks(ranks, clique - 1), PMI_ERR_INVALID_LENGTH);
    CHECK(PMI_Get_clique_ranks(NULL, clique), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Get_clique_size(NULL), PMI_ERR_INVALID_ARG);

    /* PMI 1.2's group barrier over every rank, where the server serves it. */
    int *all = malloc(sizeof(int) * size);
    for (int r = 0; r < size; r++)
        all[r] = size - 1 - r;
    int groups = PMI_Barrier_group(all, size, "pmi_api") == PMI_SUCCESS;
    CHECK(PMI_Barrier_group(NULL, size, "x"), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Barrier_group(all, 0, "x"), PMI_ERR_INVALID_ARG);
    all[0] = size;
    CHECK(PMI_Barrier_group(all, size, "x"), PMI_ERR_INVALID_ARG);

    /* Names: rank 0 publishes, every rank finds it, rank 0 takes it back. A job of one has no name service. */
    char port[256];
    if (alone) {
        CHECK(PMI_Publish_name("pmi_api_service", "port-0"), PMI_FAIL);
        CHECK(PMI_Lookup_name("pmi_api_service", port), PMI_FAIL);
    } else {
        if (rank == 0)
            CHECK(PMI_Publish_name("pmi_api_service", "port-0"), PMI_SUCCESS);
        CHECK(PMI_Barrier(), PMI_SUCCESS);
        CHECK(PMI_Lookup_name("pmi_api_service", port), PMI_SUCCESS);
        EXPECT(strcmp(port, "port-0") == 0);
        CHECK(PMI_Barrier(), PMI_SUCCESS);
        if (rank == 0)
            CHECK(PMI_Unpublish_name("pmi_api_service"), PMI_SUCCESS);
        CHECK(PMI_Barrier(), PMI_SUCCESS);
        CHECK(PMI_Lookup_name("pmi_api_service", port), PMI_FAIL);
    }
    CHECK(PMI_Publish_name(NULL, "p"), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Publish_name("s p", "p"), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Lookup_name("s", NULL), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Unpublish_name(NULL), PMI_ERR_INVALID_ARG);

    /* A spawn with wrong arguments fails before reaching the server. */
    const char *cmds[1] = {"true"};
    int maxprocs[1] = {1}, errors[1];
    CHECK(PMI_Spawn_multiple(0, cmds, NULL, maxprocs, NULL, NULL, 0, NULL, errors), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Spawn_multiple(1, NULL, NULL, maxprocs, NULL, NULL, 0, NULL, errors), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Spawn_multiple(1, cmds, NULL, maxprocs, NULL, NULL, 1, NULL, errors), PMI_ERR_INVALID_ARG);
    /* An argument that would become lines of the request's own. */
    const char *injected[] = {"x\nexecname=/bin/echo", NULL};
    const char **argvs[1] = {injected};
    CHECK(PMI_Spawn_multiple(1, cmds, argvs, maxprocs, NULL, NULL, 0, NULL, errors), PMI_ERR_INVALID_ARG);

    /* What RFC 13 leaves optional and the wire cannot serve. */
    PMI_keyval_t *kv = NULL;
    int n = 0, parsed = 0;
    CHECK(PMI_KVS_Create(key, sizeof key), PMI_FAIL);
    CHECK(PMI_KVS_Create(NULL, sizeof key), PMI_ERR_INVALID_ARG);
    CHECK(PMI_KVS_Destroy(kvsname), PMI_FAIL);
    CHECK(PMI_KVS_Iter_first(kvsname, key, sizeof key, value, val_max), PMI_FAIL);
    CHECK(PMI_KVS_Iter_next(kvsname, key, sizeof key, value, val_max), PMI_FAIL);
    CHECK(PMI_KVS_Iter_next(NULL, key, sizeof key, value, val_max), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Parse_option(argc, argv, &parsed, &kv, &n), PMI_FAIL);
    CHECK(PMI_Args_to_keyval(&argc, (char *(*)[])&argv, &kv, &n), PMI_FAIL);
    CHECK(PMI_Free_keyvals(kv, 0), PMI_ERR_INVALID_ARG);
    CHECK(PMI_Get_options(NULL, &n), PMI_ERR_INVALID_ARG);

    CHECK(PMI_Barrier(), PMI_SUCCESS);
    printf("rank %d of %d: ok clique=%d groups=%d\n", rank, size, clique, groups);
    fflush(stdout);
    CHECK(PMI_Finalize(), PMI_SUCCESS);
    CHECK(PMI_Initialized(&initialized), PMI_SUCCESS);
    EXPECT(initialized == 0);
    CHECK(PMI_Barrier(), PMI_ERR_INIT);
    CHECK(PMI_Init(&spawned), PMI_FAIL);
    return 0;
}
