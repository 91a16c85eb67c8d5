/* Calls every function of the PMI-2 API (pmi2.h, libpmi2.so.0) the way a runtime does at start-up, and each
 * with wrong arguments, checking every return code. Prints one line per rank:
 *   rank R of S: ok
 * and exits non-zero, naming the check, at the first one that fails. Four threads read the exchange at once.
 *
 *   pmi2_api [alone | abort | spawn | nodewait | nodenow | fork]
 *     alone: no launcher (a job of one); abort: rank 1 calls PMI2_Abort;
 *     spawn: rank 0 starts two tasks of this program with a preput `greeting`; each checks it and prints
 *     "child R of 2: ok", and each rank of the parent job "rank R of S: ok spawned";
 *     nodewait: on each rank one thread waits for a node attribute that the main thread puts after other
 *     calls (the last time, a fence), then gets another as it is now, 20 times; prints "rank R of S: ok
 *     nodewait";
 *     nodenow: on each rank one thread waits for a node attribute while the main thread gets another as it
 *     is now, then puts the first (under a server that does not echo thrid, another task must put it: see
 *     node_get_while_waiting); prints "rank R of S: ok nodenow";
 *     fork: each rank forks while another thread waits in a fence (that rank 0 enters late); the child finds
 *     every call failing at once, and its PMI2_Abort ends it alone; prints "rank R of S: ok fork";
 *     puts: puts a=1, b=2 and b=3, gets b (3), fences and finalizes, for a server that watches how they come
 *     (tests/libpmi.rs); prints "rank R of S: ok puts fence=RC", RC the fence's return code */
#include "check.h"
#include <pmi2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int size = 0;

static void want_of(int r, char *out, size_t n)
{
    snprintf(out, n, "value=of=%d:%d", r, r * 7); /* no ';': Slurm's --mpi=pmi2 cuts a value there */
}

static void *reader(void *arg)
{
    long id = (long)arg;
    char key[PMI2_MAX_KEYLEN], value[PMI2_MAX_VALLEN], want[128];
    for (int i = 0; i < 200; i++) {
        int r = (int)((id * 7 + i) % size), len = 0;
        snprintf(key, sizeof key, "key%d", r);
        want_of(r, want, sizeof want);
        if (PMI2_KVS_Get(NULL, PMI2_ID_NULL, key, value, sizeof value, &len) != PMI2_SUCCESS || strcmp(value, want) != 0) {
            fprintf(stderr, "rank %d: thread %ld read '%s' for %s\n", rank, id, value, key);
            exit(1);
        }
    }
    return NULL;
}

/* Waits for this rank's node attribute of round `arg`, and checks its value. */
static void *node_waiter(void *arg)
{
    long round = (long)arg;
    char key[PMI2_MAX_KEYLEN], value[PMI2_MAX_VALLEN], want[64];
    int found = 0;
    snprintf(key, sizeof key, "wait-%d-%ld", rank, round);
    snprintf(want, sizeof want, "put-%d-%ld", rank, round);
    if (PMI2_Info_GetNodeAttr(key, value, sizeof value, &found, 1) != PMI2_SUCCESS || !found ||
        strcmp(value, want) != 0) {
        fprintf(stderr, "rank %d: waited for %s, got found=%d '%s'\n", rank, key, found, found ? value : "");
        exit(1);
    }
    return NULL;
}

/* One thread waits for a node attribute while the main thread makes other calls, and then puts it: served
 * one at a time, the put would wait behind the wait for ever. A get of a node attribute as it is now comes
 * after the put: from a server that does not echo thrid (Slurm's) its answer would look like the wait's, so
 * the library holds it back until the wait is answered, which only the put does. */
static int node_wait_while_others_call(void)
{
    char key[PMI2_MAX_KEYLEN], value[PMI2_MAX_VALLEN];
    int found = -1, len = 0;
    snprintf(key, sizeof key, "key%d", rank);
    CHECK(PMI2_KVS_Put(key, "nodewait"), PMI2_SUCCESS);
    for (long round = 0; round < 20; round++) {
        pthread_t waiter;
        EXPECT(pthread_create(&waiter, NULL, node_waiter, (void *)round) == 0);
        if (round % 2)
            usleep(2000); /* the wait is then surely sent first */
        CHECK(PMI2_Job_GetId(value, sizeof value), PMI2_SUCCESS);
        if (round == 19)
            CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS); /* a fence too, while the wait is outstanding */
        snprintf(key, sizeof key, "wait-%d-%ld", rank, round);
        snprintf(value, sizeof value, "put-%d-%ld", rank, round);
        CHECK(PMI2_Info_PutNodeAttr(key, value), PMI2_SUCCESS);
        CHECK(PMI2_Info_GetNodeAttr("no_such_attr", value, sizeof value, &found, 0), PMI2_SUCCESS);
        EXPECT(found == 0);
        pthread_join(waiter, NULL);
    }
    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
    snprintf(key, sizeof key, "key%d", (rank + 1) % size);
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, key, value, sizeof value, &len), PMI2_SUCCESS);
    EXPECT(strcmp(value, "nodewait") == 0);
    printf("rank %d of %d: ok nodewait\n", rank, size);
    fflush(stdout);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    return 0;
}

/* One thread waits for a node attribute while the main thread gets another as it is now, and then puts the
 * first. From a server that does not echo thrid the two answers look alike, so the library holds the get back
 * until the wait is answered: there another task must put the attribute (tests/libpmi.rs's server does), or
 * the get waits for ever. */
static int node_get_while_waiting(void)
{
    char key[PMI2_MAX_KEYLEN], value[PMI2_MAX_VALLEN];
    int found = 0;
    pthread_t waiter;
    snprintf(key, sizeof key, "now-%d", rank);
    CHECK(PMI2_Info_PutNodeAttr(key, "now"), PMI2_SUCCESS);
    EXPECT(pthread_create(&waiter, NULL, node_waiter, (void *)0L) == 0);
    usleep(20000); /* the wait is then surely sent first */
    CHECK(PMI2_Info_GetNodeAttr(key, value, sizeof value, &found, 0), PMI2_SUCCESS);
    EXPECT(found == 1 && strcmp(value, "now") == 0);
    snprintf(key, sizeof key, "wait-%d-0", rank);
    snprintf(value, sizeof value, "put-%d-0", rank);
    CHECK(PMI2_Info_PutNodeAttr(key, value), PMI2_SUCCESS);
    pthread_join(waiter, NULL);
    printf("rank %d of %d: ok nodenow\n", rank, size);
    fflush(stdout);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    return 0;
}

static void *fence_thread(void *arg)
{
    (void)arg;
    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
    return NULL;
}

/* A fork while another thread is inside a call, which holds the library's lock (a fence the other ranks wait
 * in until rank 0 enters it, late). The child may make no call: each fails at once, as before init (none waits
 * for the lock, which no thread of the child will let go, or speaks on the parent's connection); PMI2_Init
 * fails; PMI2_Abort ends the child alone (with 1, as a failed check would: the child says on a pipe that its
 * checks held), and the job goes on. */
static int fork_while_in_a_fence(void)
{
    pthread_t in_fence;
    int status = -1, spawned = -1, s = -1, r = -1, appnum = -1, checked[2];
    char held = 0;
    pid_t child;
    if (rank == 0)
        usleep(500000); /* the other ranks fork meanwhile */
    EXPECT(pthread_create(&in_fence, NULL, fence_thread, NULL) == 0);
    usleep(50000); /* the fence is then surely asked */
    EXPECT(pipe(checked) == 0);
    fflush(NULL);
    child = fork();
    EXPECT(child >= 0);
    if (child == 0) {
        alarm(10); /* a call that waits for the lock ends the child */
        EXPECT(PMI2_Initialized() == 0);
        CHECK(PMI2_Job_GetRank(&r), PMI2_ERR_INIT);
        CHECK(PMI2_KVS_Put("from-the-child", "x"), PMI2_ERR_INIT);
        CHECK(PMI2_KVS_Fence(), PMI2_ERR_INIT);
        CHECK(PMI2_Init(&spawned, &s, &r, &appnum), PMI2_FAIL);
        CHECK(PMI2_Finalize(), PMI2_ERR_INIT);
        EXPECT(write(checked[1], "y", 1) == 1);
        PMI2_Abort(1, "pmi2_api: the child of a fork aborts on purpose");
        _exit(2);
    }
    close(checked[1]);
    EXPECT(read(checked[0], &held, 1) == 1 && held == 'y');
    EXPECT(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 1);
    pthread_join(in_fence, NULL);
    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS); /* the parent's session goes on */
    printf("rank %d of %d: ok fork\n", rank, size);
    fflush(stdout);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    return 0;
}

/* A task started by PMI2_Job_Spawn: the parent's preput is in its own key-value space. */
static int spawned_child(void)
{
    char value[PMI2_MAX_VALLEN];
    int len = 0;
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, "greeting", value, sizeof value, &len), PMI2_SUCCESS);
    EXPECT(size == 2 && strcmp(value, "hello-from-the-parent") == 0);
    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
    printf("child %d of %d: ok\n", rank, size);
    fflush(stdout);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    return 0;
}

/* Rank 0 spawns two tasks of this very program; every rank meets once it has. */
static int spawner(const char *self)
{
    if (rank == 0) {
        const char *cmds[1] = {self}, *args[] = {"child"}, **argvs[1] = {args};
        int argcs[1] = {1}, maxprocs[1] = {2}, info_sizes[1] = {0}, errors[2] = {-1, -1};
        char key[] = "greeting", greeting[] = "hello-from-the-parent", child_job[256] = "";
        struct MPID_Info preput = {0, 0, 0, NULL, key, greeting};
        const struct MPID_Info *preputs[1] = {&preput};
        CHECK(PMI2_Job_Spawn(1, cmds, argcs, argvs, maxprocs, info_sizes, NULL, 1, preputs, child_job,
                             sizeof child_job, errors),
              PMI2_SUCCESS);
        /* Hydra names the new job; rpmi's answer does not, and the id is left empty. */
        EXPECT(errors[0] == PMI2_SUCCESS);
    }
    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
    printf("rank %d of %d: ok spawned\n", rank, size);
    fflush(stdout);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    return 0;
}

/* The puts of a start-up, a key put again and read back before the fence, then the fence. */
static int puts_then_fence(void)
{
    char value[PMI2_MAX_VALLEN];
    int len = -1;
    CHECK(PMI2_KVS_Put("a", "1"), PMI2_SUCCESS);
    CHECK(PMI2_KVS_Put("b", "2"), PMI2_SUCCESS);
    CHECK(PMI2_KVS_Put("b", "3"), PMI2_SUCCESS);
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, "b", value, sizeof value, &len), PMI2_SUCCESS);
    EXPECT(strcmp(value, "3") == 0);
    int rc = PMI2_KVS_Fence();
    printf("rank %d of %d: ok puts fence=%d\n", rank, size, rc);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    return 0;
}

int main(int argc, char **argv)
{
    int alone = argc > 1 && strcmp(argv[1], "alone") == 0;
    int spawned = -1, appnum = -1, found = -1, len = -1, n = -1, ints[4];
    char jobid[256], key[PMI2_MAX_KEYLEN], value[PMI2_MAX_VALLEN], want[128], fds[FDS];

    open_fds(fds);
    EXPECT(PMI2_Initialized() == 0);
    CHECK(PMI2_KVS_Fence(), PMI2_ERR_INIT);
    CHECK(PMI2_Init(NULL, &size, &rank, &appnum), PMI2_ERR_INVALID_ARG);
    CHECK(PMI2_Init(&spawned, &size, &rank, &appnum), PMI2_SUCCESS);
    EXPECT(PMI2_Initialized() == 1);
    expect_connection_close_on_exec(fds);
    if (spawned == 1)
        return spawned_child();
    if (argc > 1 && strcmp(argv[1], "spawn") == 0)
        return spawner(argv[0]);
    if (argc > 1 && strcmp(argv[1], "nodewait") == 0)
        return node_wait_while_others_call();
    if (argc > 1 && strcmp(argv[1], "nodenow") == 0)
        return node_get_while_waiting();
    if (argc > 1 && strcmp(argv[1], "fork") == 0)
        return fork_while_in_a_fence();
    if (argc > 1 && strcmp(argv[1], "puts") == 0)
        return puts_then_fence();
    EXPECT(spawned == 0 && size >= 1 && rank >= 0 && rank < size && (appnum == 0 || appnum == -1));
    if (alone)
        EXPECT(size == 1 && rank == 0);
    int r2 = -1, s2 = -1;
    CHECK(PMI2_Job_GetRank(&r2), PMI2_SUCCESS);
    CHECK(PMI2_Info_GetSize(&s2), PMI2_SUCCESS);
    EXPECT(r2 == rank && s2 == size);
    CHECK(PMI2_Job_GetRank(NULL), PMI2_ERR_INVALID_ARG);
    CHECK(PMI2_Job_GetId(jobid, sizeof jobid), PMI2_SUCCESS);
    EXPECT(strlen(jobid) > 0);
    CHECK(PMI2_Job_GetId(jobid, 1), PMI2_ERR_INVALID_LENGTH);
    CHECK(PMI2_Job_GetId(NULL, 10), PMI2_ERR_INVALID_ARG);
    CHECK(PMI2_Job_GetId(jobid, sizeof jobid), PMI2_SUCCESS);

    if (argc > 1 && strcmp(argv[1], "abort") == 0 && rank == 1)
        PMI2_Abort(1, "pmi2_api: rank 1 aborts on purpose");

    /* The exchange. */
    snprintf(key, sizeof key, "key%d", rank);
    want_of(rank, want, sizeof want);
    CHECK(PMI2_KVS_Put(key, want), PMI2_SUCCESS);
    CHECK(PMI2_KVS_Put("a;b", want), PMI2_ERR_INVALID_KEY);
    CHECK(PMI2_KVS_Put(NULL, want), PMI2_ERR_INVALID_KEY);
    CHECK(PMI2_KVS_Put(key, "two\nlines"), PMI2_ERR_INVALID_VAL);
    /* A value need not be UTF-8 (nor ASCII): a frame carries any bytes but a line break. */
    static const char raw[] = "\xff\xc3\x28 not UTF-8 \x80";
    snprintf(key, sizeof key, "raw%d", rank);
    CHECK(PMI2_KVS_Put(key, raw), PMI2_SUCCESS);
    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, key, value, sizeof value, &len), PMI2_SUCCESS);
    EXPECT(len == (int)strlen(raw) && memcmp(value, raw, sizeof raw) == 0);
    for (int r = 0; r < size; r++) {
        snprintf(key, sizeof key, "key%d", r);
        want_of(r, want, sizeof want);
        CHECK(PMI2_KVS_Get(r % 2 ? jobid : NULL, r, key, value, sizeof value, &len), PMI2_SUCCESS);
        EXPECT(strcmp(value, want) == 0 && len == (int)strlen(want));
    }
    pthread_t threads[4];
    for (long t = 0; t < 4; t++)
        EXPECT(pthread_create(&threads[t], NULL, reader, (void *)t) == 0);
    for (int t = 0; t < 4; t++)
        pthread_join(threads[t], NULL);
    /* A value longer than the buffer is cut, its length said negative, as MPICH's and Slurm's clients do. */
    want_of(0, want, sizeof want);
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, "key0", value, 3, &len), PMI2_SUCCESS);
    EXPECT(strcmp(value, "va") == 0 && len == -(int)strlen(want));
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, "no_such_key", value, sizeof value, &len), PMI2_FAIL);
    CHECK(PMI2_KVS_Get(NULL, PMI2_ID_NULL, "key0", NULL, sizeof value, &len), PMI2_ERR_INVALID_ARG);

    /* Node attributes: this rank's own, a list of integers, and one nobody put. */
    snprintf(key, sizeof key, "attr%d", rank);
    CHECK(PMI2_Info_PutNodeAttr(key, "node value"), PMI2_SUCCESS);
    CHECK(PMI2_Info_GetNodeAttr(key, value, sizeof value, &found, 1), PMI2_SUCCESS);
    EXPECT(found == 1 && strcmp(value, "node value") == 0);
    CHECK(PMI2_Info_GetNodeAttr("no_such_attr", value, sizeof value, &found, 0), PMI2_SUCCESS);
    EXPECT(found == 0);
    snprintf(key, sizeof key, "ints%d", rank);
    CHECK(PMI2_Info_PutNodeAttr(key, "4,5,6"), PMI2_SUCCESS);
    CHECK(PMI2_Info_GetNodeAttrIntArray(key, ints, 4, &n, &found), PMI2_SUCCESS);
    EXPECT(found == 1 && n == 3 && ints[0] == 4 && ints[2] == 6);
    CHECK(PMI2_Info_GetNodeAttrIntArray(key, ints, 2, &n, &found), PMI2_SUCCESS); /* cut to the array */
    EXPECT(found == 1 && n == 2 && ints[1] == 5);
    CHECK(PMI2_Info_GetNodeAttr(key, NULL, 10, &found, 0), PMI2_ERR_INVALID_ARG);

    /* Job attributes. */
    CHECK(PMI2_Info_GetJobAttr("PMI_process_mapping", value, sizeof value, &found), PMI2_SUCCESS);
    EXPECT(found == 1 && strncmp(value, "(vector,", 8) == 0);
    /* Slurm's --mpi=pmi2 answers any name that sorts after its PMI_netinfo_of_task with the node's network
     * interfaces: this one sorts before. */
    CHECK(PMI2_Info_GetJobAttr("PMI_absent_attr", value, sizeof value, &found), PMI2_SUCCESS);
    EXPECT(found == 0);
    CHECK(PMI2_Info_GetJobAttrIntArray("universeSize", ints, 4, &n, &found), PMI2_SUCCESS);
    EXPECT(found == 0 || (n == 1 && ints[0] >= size));
    CHECK(PMI2_Info_GetJobAttr(NULL, value, sizeof value, &found), PMI2_ERR_INVALID_KEY);

    /* Names. A job of one has no name service. Hydra's PMI-2 fence is no barrier (its gets wait for the key
     * instead), so the ranks order the name calls by keys they put and get. */
    char port[256];
    if (alone) {
        CHECK(PMI2_Nameserv_publish("pmi2_api_service", NULL, "port-0"), PMI2_FAIL);
        CHECK(PMI2_Nameserv_lookup("pmi2_api_service", NULL, port, sizeof port), PMI2_FAIL);
    } else {
        if (rank == 0) {
            CHECK(PMI2_Nameserv_publish("pmi2_api_service", NULL, "port-0"), PMI2_SUCCESS);
            CHECK(PMI2_KVS_Put("published", "yes"), PMI2_SUCCESS);
        }
        CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
        CHECK(PMI2_KVS_Get(NULL, 0, "published", value, sizeof value, &len), PMI2_SUCCESS);
        CHECK(PMI2_Nameserv_lookup("pmi2_api_service", NULL, port, sizeof port), PMI2_SUCCESS);
        EXPECT(strcmp(port, "port-0") == 0);
        snprintf(key, sizeof key, "looked%d", rank);
        CHECK(PMI2_KVS_Put(key, "yes"), PMI2_SUCCESS);
        CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
        if (rank == 0) {
            for (int r = 0; r < size; r++) {
                snprintf(key, sizeof key, "looked%d", r);
                CHECK(PMI2_KVS_Get(NULL, r, key, value, sizeof value, &len), PMI2_SUCCESS);
            }
            CHECK(PMI2_Nameserv_unpublish("pmi2_api_service", NULL), PMI2_SUCCESS);
            CHECK(PMI2_KVS_Put("unpublished", "yes"), PMI2_SUCCESS);
        }
        CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
        CHECK(PMI2_KVS_Get(NULL, 0, "unpublished", value, sizeof value, &len), PMI2_SUCCESS);
        CHECK(PMI2_Nameserv_lookup("pmi2_api_service", NULL, port, sizeof port), PMI2_FAIL);
    }
    CHECK(PMI2_Nameserv_publish(NULL, NULL, "p"), PMI2_ERR_INVALID_ARG);
    CHECK(PMI2_Nameserv_lookup("s", NULL, NULL, 10), PMI2_ERR_INVALID_ARG);

    /* Not served, and a spawn with wrong arguments. */
    PMI2_Connect_comm_t conn;
    memset(&conn, 0, sizeof conn);
    CHECK(PMI2_Job_Connect(jobid, &conn), PMI2_FAIL);
    CHECK(PMI2_Job_Disconnect(jobid), PMI2_FAIL);
    CHECK(PMI2_Job_Connect(NULL, &conn), PMI2_ERR_INVALID_ARG);
    const char *cmds[1] = {"true"};
    int maxprocs[1] = {1}, argcs[1] = {0}, errors[1];
    CHECK(PMI2_Job_Spawn(0, cmds, argcs, NULL, maxprocs, NULL, NULL, 0, NULL, NULL, 0, errors), PMI2_ERR_INVALID_ARG);
    CHECK(PMI2_Job_Spawn(1, cmds, argcs, NULL, maxprocs, NULL, NULL, 1, NULL, NULL, 0, errors), PMI2_ERR_INVALID_ARG);
    /* A request longer than a frame can say is refused, not cut. */
    char *huge = malloc(1000001);
    memset(huge, 'x', 1000000);
    huge[1000000] = 0;
    const char *huge_argv[1] = {huge};
    const char **argvs[1] = {huge_argv};
    argcs[0] = 1;
    CHECK(PMI2_Job_Spawn(1, cmds, argcs, argvs, maxprocs, NULL, NULL, 0, NULL, NULL, 0, errors), PMI2_ERR_INVALID_ARG);
    free(huge);

    CHECK(PMI2_KVS_Fence(), PMI2_SUCCESS);
    printf("rank %d of %d: ok\n", rank, size);
    fflush(stdout);
    CHECK(PMI2_Finalize(), PMI2_SUCCESS);
    EXPECT(PMI2_Initialized() == 0);
    CHECK(PMI2_KVS_Fence(), PMI2_ERR_INIT);
    CHECK(PMI2_Init(&spawned, &size, &rank, &appnum), PMI2_FAIL);
    return 0;
}
