/* host.c: a minimal job-shell host for rpmi, written in plain C99 against plugin-spec/rpmi_plugin.h alone.
 *
 * It is the proof that a C resource manager can use the header as written: it loads the plugin with dlopen,
 * runs N tasks of PROGRAM over M virtual nodes (one plugin instance per node, ranks dealt in blocks), does
 * the collective between the nodes in-process, and ends the job when a task aborts or fails.
 *
 *   host [--event-loop] [--attach] [--nodes M] -n N PLUGIN.so PROGRAM [ARGS...]
 *   host --check-errors PLUGIN.so
 *
 * Thread mode (the default) lets each instance run its own progress thread; the main thread only reaps
 * tasks. --event-loop gives the plugin a watch_fd callback instead: the main thread polls every instance's
 * fd and a SIGCHLD self-pipe, and calls progress() and reaps tasks in one loop.
 *
 * --attach (ABI revision 4) makes each task's connection itself, as a job shell whose tasks keep only the
 * host's own fds would: task_env instead of task_init, a socketpair of the host's whose end the task inherits
 * as PMI_FD, and the other end handed to the plugin with task_attach once the task is forked.
 *
 * --shells (ABI revision 5) lets the plugin run the exchanges among the nodes: the host only carries each
 * message one instance sends another (shell_send) to that instance (shell_message), in this process. Without
 * it, the host does the collective itself (below), and serves no group barrier, so clients get PMI 1.1.
 *
 * RPMI_HOST_OPTIONS, if set, is the options' JSON every instance is created with.
 *
 * --check-errors feeds the plugin bad input and checks that the documented error codes come back.
 *
 * Spawn (PMI_Spawn_multiple; only when built against a header of revision 2 or later, and only with a plugin
 * of revision 2 or later). The spawn callback reads the request's JSON, and checks it: every program must be
 * found and executable as exec would find it (a name with a '/' is a path, others are looked for in the
 * command's "path" info, else PATH; both from its "wdir" info, where its tasks start, with PATH set to
 * "path"). If one is not, no process starts and every process's code is -1 (MPICH's spawner waits for its
 * children unless every code is an error). A "host" info naming another machine than this one is refused
 * with a message, as is a malformed request; other info keys are ignored. Otherwise the spawned job is run by
 * a new host process, this program started again (/proc/self/exe, same mode and plugin, at most as many
 * nodes as this job) as
 *
 *   host [--event-loop] --nodes M --spawned FD PLUGIN.so
 *
 * FD is one end of a socketpair, the other end kept by the spawning host. Over it the spawning host sends
 * "UNIVERSE LENGTH\n" and the request itself; the spawned host runs one application per command, every
 * instance created with spawned = 1, the preputs of all commands and each command's index as its ranks'
 * appnum, and answers "ok\n" once every task has started (else a line saying why, which the spawning host
 * passes on as its refusal). Only then is the spawn answered, with 0 for every process. The callback answers
 * before it returns, so it waits for that word: the time a host takes to start its tasks, during which the
 * instance (in event-loop mode, the loop) serves no one else.
 *
 * The jobs' ends are tied through that socket and the hosts' wait statuses:
 *  - a spawned job that fails (its host exits non-zero) ends the spawning job (its tasks are killed), and a
 *    job that ends on a failure shuts down its side of every spawned host's socket: at end-of-file a spawned
 *    host ends its own job (exit status 1 if nothing else failed). A spawning host that dies is seen the
 *    same way.
 *  - a host waits for every host it spawned before it exits. Its exit status is that of the job that began
 *    to fail first: each host notes when its job began to end (CLOCK_MONOTONIC) and a spawned host sends
 *    "STATUS WHEN\n" just before it exits; so a spawned job's abort is reported, not the failures of the
 *    spawning job's tasks that it caused. Without failures it is 0.
 * A spawned host watches its socket on a thread of its own, in both modes, since it must notice the end of
 * the spawning job while it waits for its tasks and for the hosts it spawned in turn.
 *
 * Exit status: that of the job that began to fail first, this one or one it spawned (see above); this job's
 * own is the code of an abort if it was aborted, else the first failing task's (128+signal for a task killed
 * by a signal), else 0. The host's own failures exit 2 (bad usage) or 1. At the end of a job it says on which
 * threads the plugin called collective, abort, log and spawn: the main thread (which reaps tasks, and in
 * event-loop mode calls progress and destroy) or others (the plugin's progress threads).
 *
 * Build: cc -std=c99 -Wall -Wextra -Werror -D_GNU_SOURCE -I plugin-spec tests/c_host/host.c -ldl -lpthread
 */
#include "rpmi_plugin.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static const char usage[] = "usage: host [--event-loop] [--attach] [--shells] [--nodes M] -n N PLUGIN.so PROGRAM [ARGS...]\n"
                            "       host --check-errors PLUGIN.so\n";

/* The plugin's table, for the life of the process, and the revision of the ABI it serves. */
static const rpmi_plugin *plugin;
#ifdef RPMI_ABI_REVISION
static uint32_t plugin_revision = 1;
#endif

static pthread_t main_thread;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("host: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        die("out of memory");
    return p;
}

static const char *code_name(int rc) {
    switch (rc) {
    case RPMI_OK: return "RPMI_OK";
    case RPMI_ERR_INVALID: return "RPMI_ERR_INVALID";
    case RPMI_ERR_VERSION: return "RPMI_ERR_VERSION";
    case RPMI_ERR_OPTION: return "RPMI_ERR_OPTION";
    case RPMI_ERR_SYSTEM: return "RPMI_ERR_SYSTEM";
    case RPMI_ERR_STATE: return "RPMI_ERR_STATE";
    case RPMI_ERR_INTERNAL: return "RPMI_ERR_INTERNAL";
    default: return "an unknown code";
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Loading the plugin. */

static void load_plugin(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        die("cannot load the plugin: %s", dlerror());
    /* dlsym returns an object pointer; POSIX guarantees it converts to a function pointer. Going through
     * memcpy keeps -Wpedantic quiet as well. */
    void *sym = dlsym(lib, "rpmi_plugin_entry");
    if (!sym)
        die("%s is not an rpmi plugin: %s", path, dlerror());
    const rpmi_plugin *(*entry)(void);
    memcpy(&entry, &sym, sizeof entry);
    const rpmi_plugin *t = entry();
    if (!t)
        die("%s: rpmi_plugin_entry returned NULL", path);
    if (t->abi_version != RPMI_ABI_VERSION)
        die("%s speaks plugin ABI version %u, this host speaks %d", path, (unsigned)t->abi_version, RPMI_ABI_VERSION);
    /* Revision 1's table ends with destroy; a later revision's fields are read only if the table has them. */
    size_t needed = offsetof(rpmi_plugin, destroy) + sizeof t->destroy;
    if (t->struct_size < needed)
        die("%s: its plugin table has %u bytes, this host needs %zu", path, (unsigned)t->struct_size, needed);
    if (!t->create || !t->task_init || !t->task_exec || !t->task_forked || !t->task_exit || !t->progress ||
        !t->collective_complete || !t->service_complete || !t->destroy)
        die("%s: its plugin table lacks functions of ABI version %d", path, RPMI_ABI_VERSION);
    plugin = t;
#ifdef RPMI_ABI_REVISION
    if (t->struct_size >= offsetof(rpmi_plugin, abi_revision) + sizeof t->abi_revision)
        plugin_revision = t->abi_revision;
#endif
}

/* ---------------------------------------------------------------------------------------------------------
 * The job: nodes (one plugin instance each), tasks, the collective between the nodes, ending the job. */

struct node {
    uint32_t index;
    rpmi_instance *instance; /* set under job.lock */
    int watch;               /* event-loop mode: the fd watch_fd gave, else -1 */
    uint32_t *local_ranks;
    uint32_t local_count;
    /* This node's contribution to the collective in progress. */
    int contributed;
    uint8_t *data;
    size_t len;
};

/* One application of the job: a run of ranks that start the same program (a spawned job has one per
 * command). Made and freed by main, or (a spawned job) by plan_spawn and free_plan. */
struct app {
    uint32_t n;     /* ranks */
    char **argv;    /* NULL-terminated, argv[0] as given */
    char *exec;     /* what execve runs: found beforehand, relative to wdir if that is set */
    const char *wdir; /* where the tasks start (a spawn's "wdir" info); NULL: the host's directory */
    char *path_env; /* "PATH=..." for the tasks (a spawn's "path" info); NULL: the host's */
};

struct task {
    uint32_t node, local;
    uint32_t app; /* index in job.apps */
    pid_t pid;    /* 0: not started, or reaped */
};

/* A host this one started for a spawned job (see the header comment). */
struct spawned {
    pid_t pid; /* 0 once reaped */
    int code;  /* once reaped: its exit status (128+signal if killed) */
    int fd;    /* our end of its socket, once it said its tasks started (its end is tied to ours); else -1 */
    int told;  /* its socket was shut down: its job must end */
};

static struct {
    pthread_mutex_t lock; /* guards everything below that other threads touch */
    struct node *nodes;
    uint32_t nnodes;
    uint32_t contributions; /* nodes that have contributed to the collective in progress */
    struct app *apps;       /* set up before any task starts; read by the main thread only */
    uint32_t napps;
    struct task *tasks;
    uint32_t ntasks;
    int ending;     /* the job is ending: no more tasks start, every task is killed */
    int aborted;    /* an abort came; abort_code is the job's exit status */
    int abort_code;
    unsigned long long began; /* when the job began to end (now_ns) */
    struct spawned *spawned;  /* the hosts of spawned jobs, reaped or not */
    uint32_t nspawned, spawned_running;
    int spawn_failure;              /* the exit status of the spawned job that began to fail first; 0: none */
    unsigned long long spawn_began; /* when it began to fail */
    int spawner_lost;               /* a spawned host: the spawning job ended, so this one did */
    int done;                       /* the job's status is settled: nothing may end it any more */
} job = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void lock(void) {
    int e = pthread_mutex_lock(&job.lock);
    if (e)
        die("pthread_mutex_lock: %s", strerror(e));
}

static void unlock(void) {
    int e = pthread_mutex_unlock(&job.lock);
    if (e)
        die("pthread_mutex_unlock: %s", strerror(e));
}

/* CLOCK_MONOTONIC in nanoseconds: one clock for every process of the machine, so that hosts can compare when
 * their jobs began to fail. */
static unsigned long long now_ns(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        die("clock_gettime: %s", strerror(errno));
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* How many callbacks (collective, abort, log, spawn) ran on the main thread, and on others. */
static pthread_mutex_t threads_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long callbacks_on_main, callbacks_elsewhere;

static void count_callback_thread(void) {
    pthread_mutex_lock(&threads_lock);
    if (pthread_equal(pthread_self(), main_thread))
        callbacks_on_main++;
    else
        callbacks_elsewhere++;
    pthread_mutex_unlock(&threads_lock);
}

/* With job.lock held: end the job, killing every task, and every job it spawned (end-of-file on their
 * socket tells their host). A task not yet reaped is at worst a zombie, whose pid cannot have been reused
 * (tasks are reaped under the lock). */
static void end_job_locked(void) {
    if (!job.ending)
        job.began = now_ns();
    job.ending = 1;
    for (uint32_t r = 0; r < job.ntasks; r++)
        if (job.tasks[r].pid > 0)
            kill(job.tasks[r].pid, SIGKILL);
    for (uint32_t i = 0; i < job.nspawned; i++) {
        struct spawned *sp = &job.spawned[i];
        if (sp->pid > 0 && sp->fd >= 0 && !sp->told) {
            sp->told = 1;
            if (shutdown(sp->fd, SHUT_WR) != 0)
                fprintf(stderr, "host: shutdown of the socket of spawned host %ld: %s\n", (long)sp->pid,
                        strerror(errno));
        }
    }
}

/* The exit status a wait status stands for: 128+signal for a process killed by a signal. */
static int wait_code(int status) {
    return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
}

/* With job.lock held: the spawned host `sp`, started and reaped, has ended. Its last words on the socket say
 * when its job began to fail; a failure ends this job too. */
static void spawned_ended_locked(struct spawned *sp) {
    char said[64];
    unsigned long long began = 0;
    int status;
    ssize_t got = recv(sp->fd, said, sizeof said - 1, MSG_DONTWAIT);
    if (got > 0) {
        said[got] = '\0';
        if (sscanf(said, "%d %llu", &status, &began) != 2)
            began = 0;
    }
    if (close(sp->fd) != 0)
        fprintf(stderr, "host: close: %s\n", strerror(errno));
    sp->fd = -1;
    if (sp->code == 0)
        return;
    if (began == 0) /* it died without a word: it failed now */
        began = now_ns();
    fprintf(stderr, "host: a spawned job failed: its host exited with status %d; ending this job\n", sp->code);
    if (!job.spawn_failure || began < job.spawn_began) {
        job.spawn_failure = sp->code;
        job.spawn_began = began;
    }
    end_job_locked();
}

/* With job.lock held, once waitpid reaped `pid` with `status`: if it is the host of a spawned job, note it. */
static void spawned_exited_locked(pid_t pid, int status) {
    for (uint32_t i = 0; i < job.nspawned; i++) {
        struct spawned *sp = &job.spawned[i];
        if (sp->pid != pid)
            continue;
        sp->pid = 0;
        sp->code = wait_code(status);
        job.spawned_running--;
        if (sp->fd >= 0) /* else it never started its tasks: the spawn failed, its status does not count */
            spawned_ended_locked(sp);
        return;
    }
}

/* rpmi_host_ops.collective: an allgather across the nodes of this process. The last node to contribute
 * completes the collective on every node (the header allows it from within the callback). */
static int on_collective(void *host_data, rpmi_instance *instance, const uint8_t *data, size_t len) {
    struct node *node = host_data;
    uint32_t n = job.nnodes; /* fixed once the job is set up */
    (void)instance;
    count_callback_thread();
    /* Everything the last contributor needs, allocated before anything is shared. */
    uint8_t *copy = malloc(len ? len : 1);
    rpmi_buf *parts = calloc(n, sizeof *parts);
    rpmi_instance **instances = calloc(n, sizeof *instances);
    uint8_t **owned = calloc(n, sizeof *owned);
    int rc = RPMI_OK;
    if (!copy || !parts || !instances || !owned) {
        /* Fail this shell's barrier now and end the job, so that no other shell waits for this one. */
        fprintf(stderr, "host: out of memory in the collective of node %u; ending the job\n", (unsigned)node->index);
        lock();
        end_job_locked();
        unlock();
        rc = RPMI_ERR_SYSTEM;
        goto out;
    }
    if (len)
        memcpy(copy, data, len);

    lock();
    if (node->contributed) {
        unlock();
        fprintf(stderr, "host: node %u started a second collective before its first completed\n",
                (unsigned)node->index);
        rc = RPMI_ERR_STATE;
        goto out;
    }
    node->contributed = 1;
    node->data = copy;
    node->len = len;
    copy = NULL; /* the node holds it now */
    if (++job.contributions < n) {
        unlock();
        goto out;
    }
    /* The last one: take every contribution, so that the next collective starts afresh even while this one
     * is still being completed. */
    for (uint32_t i = 0; i < n; i++) {
        struct node *nd = &job.nodes[i];
        parts[i] = (rpmi_buf){.data = nd->data, .len = nd->len};
        instances[i] = nd->instance;
        owned[i] = nd->data;
        nd->contributed = 0;
        nd->data = NULL;
        nd->len = 0;
    }
    job.contributions = 0;
    unlock();

    for (uint32_t i = 0; i < n; i++) {
        int c = plugin->collective_complete(instances[i], RPMI_OK, parts, n, NULL);
        if (c != RPMI_OK)
            fprintf(stderr, "host: collective_complete on node %u failed: %s (%d)\n", (unsigned)i, code_name(c), c);
    }
    for (uint32_t i = 0; i < n; i++)
        free(owned[i]);
out:
    free(copy);
    free(owned);
    free(instances);
    free(parts);
    return rc;
}

static const char *reason_name(int32_t reason) {
    switch (reason) {
    case RPMI_ABORT_CALLED: return "PMI_Abort";
    case RPMI_ABORT_PROTOCOL: return "a PMI protocol error";
    case RPMI_ABORT_TASK_LOST: return "a lost task";
#if defined(RPMI_ABI_REVISION) && RPMI_ABI_REVISION >= 5
    case RPMI_ABORT_SHELL: return "another node";
#endif
    default: return "an unknown reason";
    }
}

/* rpmi_host_ops.abort: say why, keep the first abort's exit code, kill every task. */
static void on_abort(void *host_data, uint32_t rank, int32_t exit_code, int32_t reason, const char *message,
                     size_t len) {
    (void)host_data;
    count_callback_thread();
    lock();
    if (reason == RPMI_ABORT_CALLED)
        fprintf(stderr, "host: rank %u called PMI_Abort with exit code %d: ", (unsigned)rank, (int)exit_code);
    else
        fprintf(stderr, "host: rank %u ended the job (%s), exit code %d: ", (unsigned)rank, reason_name(reason),
                (int)exit_code);
    if (message && len)
        fwrite(message, 1, len, stderr);
    fputc('\n', stderr);
    if (!job.aborted) {
        job.aborted = 1;
        job.abort_code = exit_code;
    }
    end_job_locked();
    unlock();
}

/* rpmi_host_ops.log: warnings and errors go to stderr. */
static void on_log(void *host_data, int32_t level, const char *message, size_t len) {
    struct node *node = host_data;
    count_callback_thread();
    if (level > RPMI_LOG_WARN)
        return;
    lock(); /* one line at a time */
    fprintf(stderr, "host: node %u: %s: ", (unsigned)node->index, level == RPMI_LOG_ERROR ? "error" : "warning");
    if (message && len)
        fwrite(message, 1, len, stderr);
    fputc('\n', stderr);
    unlock();
}

/* rpmi_host_ops.watch_fd (event-loop mode only): called during create, before it returns the instance. */
static int on_watch_fd(void *host_data, rpmi_instance *instance, int fd) {
    struct node *node = host_data;
    if (fd < 0)
        return RPMI_ERR_INVALID;
    lock();
    node->watch = fd;
    node->instance = instance;
    unlock();
    return RPMI_OK;
}

#ifdef RPMI_ABI_REVISION
static int on_spawn(void *host_data, rpmi_instance *instance, uint32_t task, const char *request_json, size_t len);
#endif

#if defined(RPMI_ABI_REVISION) && RPMI_ABI_REVISION >= 5
#define CAN_CARRY 1
/* --shells: the plugin runs the exchanges among the nodes, and the host carries its messages. */
static int carry;
/* Held to read while a message is handed to an instance, and to write when the host stops carrying them
 * (the job is over, and its instances are about to be destroyed). */
static pthread_rwlock_t carry_lock = PTHREAD_RWLOCK_INITIALIZER;
static int carry_stopped;

/* rpmi_host_ops.shell_send: the message goes straight to the instance of node `shell`, which only queues it
 * (so this may run on any node's thread, and call into another instance). */
static int on_shell_send(void *host_data, rpmi_instance *instance, uint32_t shell, uint8_t kind,
                         const uint8_t *message, size_t len) {
    struct node *node = host_data;
    (void)instance;
    count_callback_thread();
    lock();
    rpmi_instance *to = shell < job.nnodes && shell != node->index ? job.nodes[shell].instance : NULL;
    unlock();
    if (!to)
        return RPMI_ERR_INVALID;
    pthread_rwlock_rdlock(&carry_lock);
    /* Once the job is over, the last goodbyes have nobody left to hear them. */
    int rc = carry_stopped ? RPMI_OK : plugin->shell_message(to, node->index, kind, message, len);
    pthread_rwlock_unlock(&carry_lock);
    return rc;
}
#else
#define CAN_CARRY 0
#endif

static rpmi_host_ops host_ops(struct node *node, int event_loop) {
    rpmi_host_ops ops;
    memset(&ops, 0, sizeof ops); /* publish, unpublish and lookup: not supported */
    ops.struct_size = sizeof ops;
    ops.abi_version = RPMI_ABI_VERSION;
    ops.host_data = node;
    ops.collective = on_collective;
    ops.abort = on_abort;
    ops.log = on_log;
    ops.watch_fd = event_loop ? on_watch_fd : NULL;
#ifdef RPMI_ABI_REVISION
    /* A spawned job needs a plugin that takes its preputs and appnums. */
    ops.spawn = plugin_revision >= 2 ? on_spawn : NULL;
#endif
#if CAN_CARRY
    if (carry) {
        ops.collective = NULL;
        ops.shell_send = on_shell_send;
    }
#endif
    return ops;
}

/* ---------------------------------------------------------------------------------------------------------
 * Starting tasks. */

/* Whether `file` (from `wdir` if it is relative and wdir is set) is an executable regular file. */
static int executable(const char *file, const char *wdir) {
    char *joined = NULL;
    if (wdir && file[0] != '/') {
        size_t size = strlen(wdir) + strlen(file) + 2;
        joined = xcalloc(size, 1);
        snprintf(joined, size, "%s/%s", wdir, file);
        file = joined;
    }
    struct stat st;
    int ok = stat(file, &st) == 0 && S_ISREG(st.st_mode) && access(file, X_OK) == 0;
    free(joined);
    return ok;
}

/* The program `name` as execve wants it, found now, so that the child, a fork of a multi-threaded process,
 * only has to call async-signal-safe functions. As exec finds it: a name with a '/' is a path, others are
 * looked for in `path` (NULL: PATH). With `wdir`, where the task starts, relative paths are checked from
 * there and the result stays relative to it. NULL: not found, or not executable. */
static char *find_program(const char *name, const char *wdir, const char *path) {
    if (!*name)
        return NULL;
    if (strchr(name, '/')) {
        if (!executable(name, wdir))
            return NULL;
        char *copy = xcalloc(strlen(name) + 1, 1);
        return strcpy(copy, name);
    }
    if (!path)
        path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/local/bin:/usr/bin:/bin";
    size_t nlen = strlen(name);
    for (const char *p = path;; p++) {
        const char *end = strchr(p, ':');
        size_t dlen = end ? (size_t)(end - p) : strlen(p);
        char *candidate = xcalloc(dlen + nlen + 3, 1);
        snprintf(candidate, dlen + nlen + 3, "%.*s%s%s", (int)dlen, p, dlen ? "/" : "./", name);
        if (executable(candidate, wdir))
            return candidate;
        free(candidate);
        if (!end)
            return NULL;
        p = end;
    }
}

/* Whether the environment entry `entry` sets the variable that the "NAME=value" string `var` sets. */
static int same_variable(const char *entry, const char *var) {
    const char *eq = strchr(var, '=');
    size_t name_len = eq ? (size_t)(eq - var) : strlen(var);
    return strncmp(entry, var, name_len) == 0 && entry[name_len] == '=';
}

/* The task's environment: the host's, with the plugin's "NAME=value" strings and `extra` (NULL, or one more
 * such string) added or replacing. The strings are borrowed; only the array is allocated. */
static char **task_environment(const rpmi_task_env *env, char **extra, size_t nextra) {
    size_t n = 0;
    while (environ[n])
        n++;
    char **envp = xcalloc(n + env->env_count + nextra + 1, sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int replaced = 0;
        for (size_t j = 0; j < nextra && !replaced; j++)
            replaced = extra[j] && same_variable(environ[i], extra[j]);
        for (size_t j = 0; j < env->env_count && !replaced; j++)
            replaced = same_variable(environ[i], env->env[j]);
        if (!replaced)
            envp[k++] = environ[i];
    }
    for (size_t j = 0; j < env->env_count; j++)
        envp[k++] = (char *)env->env[j];
    for (size_t j = 0; j < nextra; j++)
        if (extra[j])
            envp[k++] = extra[j];
    envp[k] = NULL;
    return envp;
}

/* --attach: the host makes every task's connection and hands its end over (ABI revision 4). */
#if defined(RPMI_ABI_REVISION) && RPMI_ABI_REVISION >= 4
#define CAN_ATTACH 1
#else
#define CAN_ATTACH 0
#endif
static int attach;

/* In the child: write a message with async-signal-safe calls only. */
static void child_say(const char *a, const char *b) {
    ssize_t ignored = write(2, a, strlen(a));
    ignored = write(2, b, strlen(b));
    ignored = write(2, "\n", 1);
    (void)ignored;
}

/* Starts rank `rank`: task_init, fork, task_exec and execve in the child, task_forked in the parent (with
 * --attach: task_env, the host's own socketpair, its end kept open across execve in the child, task_attach
 * in the parent). Returns 0 if the task runs (if task_forked or task_attach failed, the job is ending), or -1
 * after saying why it does not. */
static int start_task(uint32_t rank) {
    struct task *t = &job.tasks[rank];
    const struct app *app = &job.apps[t->app];
    rpmi_instance *instance = job.nodes[t->node].instance;
    rpmi_task_env env;
    memset(&env, 0, sizeof env);
    env.struct_size = sizeof env;
    env.child_fd = -1;
    int pair[2] = {-1, -1}, rc;
    char pmi_fd[32] = "";
#if CAN_ATTACH
    if (attach) {
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) < 0) {
            fprintf(stderr, "host: socketpair for rank %u: %s\n", (unsigned)rank, strerror(errno));
            return -1;
        }
        snprintf(pmi_fd, sizeof pmi_fd, "PMI_FD=%d", pair[1]);
        rc = plugin->task_env(instance, t->local, &env);
    } else
#endif
        rc = plugin->task_init(instance, t->local, &env);
    if (rc != RPMI_OK) {
        fprintf(stderr, "host: task_%s for rank %u failed: %s (%d)\n", attach ? "env" : "init", (unsigned)rank,
                code_name(rc), rc);
        if (attach) {
            close(pair[0]);
            close(pair[1]);
        }
        return -1;
    }
    if (env.env_count && !env.env) {
        fprintf(stderr, "host: task_init for rank %u gave %zu variables but no array\n", (unsigned)rank,
                env.env_count);
        return -1;
    }
    char *extra[] = {app->path_env, pmi_fd[0] ? pmi_fd : NULL};
    char **envp = task_environment(&env, extra, 2);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (attach ? fcntl(pair[1], F_SETFD, 0) < 0 : plugin->task_exec(instance, t->local) != RPMI_OK) {
            child_say("host: the task's connection cannot be kept; not starting ", app->exec);
            _exit(127);
        }
        if (app->wdir && chdir(app->wdir) != 0) {
            child_say("host: cannot change to the directory ", app->wdir);
            _exit(127);
        }
        execve(app->exec, app->argv, envp);
        child_say("host: cannot execute ", app->exec);
        _exit(127);
    }
    int fork_errno = errno;
    free(envp);
    /* Parent: the host's copy of the task's end is closed whether or not the fork worked. */
#if CAN_ATTACH
    if (attach) {
        close(pair[1]);
        rc = plugin->task_attach(instance, t->local, pair[0]); /* the plugin's from now on */
        if (rc != RPMI_OK)
            fprintf(stderr, "host: task_attach for rank %u failed: %s (%d)\n", (unsigned)rank, code_name(rc), rc);
    } else
#endif
    {
        rc = plugin->task_forked(instance, t->local);
        if (rc != RPMI_OK)
            fprintf(stderr, "host: task_forked for rank %u failed: %s (%d)\n", (unsigned)rank, code_name(rc), rc);
    }
    if (pid < 0) {
        fprintf(stderr, "host: fork for rank %u: %s\n", (unsigned)rank, strerror(fork_errno));
        return -1;
    }
    lock();
    t->pid = pid;
    if (job.ending || rc != RPMI_OK) /* an abort came while it was being started, or task_forked failed */
        end_job_locked();
    unlock();
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * Reaping tasks. */

static uint32_t tasks_left;
static int first_failure; /* the first failing task's exit code; 0: none */

/* Reaps `pid` (known to have exited): a task, whose instance is told, or the host of a spawned job. */
static void reap(pid_t pid) {
    int status = 0;
    lock();
    pid_t got = waitpid(pid, &status, 0);
    int wait_errno = errno;
    uint32_t rank = job.ntasks;
    if (got == pid) {
        for (uint32_t r = 0; r < job.ntasks; r++) {
            if (job.tasks[r].pid == pid) {
                job.tasks[r].pid = 0;
                rank = r;
            }
        }
        if (rank == job.ntasks)
            spawned_exited_locked(pid, status);
    }
    int ending = job.ending;
    unlock();
    if (got != pid) {
        fprintf(stderr, "host: waitpid(%ld): %s\n", (long)pid, strerror(wait_errno));
        return;
    }
    if (rank == job.ntasks)
        return; /* not a task */
    tasks_left--;
    struct task *t = &job.tasks[rank];
    int rc = plugin->task_exit(job.nodes[t->node].instance, t->local, status);
    if (rc != RPMI_OK)
        fprintf(stderr, "host: task_exit for rank %u failed: %s (%d)\n", (unsigned)rank, code_name(rc), rc);
    int code = wait_code(status);
    if (code != 0 && first_failure == 0 && !ending) {
        if (WIFSIGNALED(status))
            fprintf(stderr, "host: rank %u was killed by signal %d; ending the job\n", (unsigned)rank,
                    WTERMSIG(status));
        else
            fprintf(stderr, "host: rank %u exited with code %d; ending the job\n", (unsigned)rank, code);
        first_failure = code;
        lock();
        end_job_locked();
        unlock();
    }
}

/* Reaps one exited task, waiting for one if `block`. Returns 1 if it reaped one, 0 if none had exited, -1 if
 * there are no children left. The zombie is only looked at (WNOWAIT) until reap() takes it under the lock. */
static int reap_one(int block) {
    siginfo_t info;
    memset(&info, 0, sizeof info);
    if (waitid(P_ALL, 0, &info, WEXITED | WNOWAIT | (block ? 0 : WNOHANG)) < 0) {
        if (errno == EINTR)
            return 0;
        if (errno != ECHILD)
            fprintf(stderr, "host: waitid: %s\n", strerror(errno));
        return -1;
    }
    if (info.si_pid == 0)
        return 0;
    reap(info.si_pid);
    return 1;
}

/* Thread mode: each instance has its own progress thread; this one only reaps. */
static void wait_thread_mode(void) {
    while (tasks_left > 0)
        if (reap_one(1) < 0)
            break;
}

/* Once the instances are destroyed (no spawn can start any more): waits for the hosts of spawned jobs. */
static void wait_spawned(void) {
    for (;;) {
        lock();
        uint32_t running = job.spawned_running;
        unlock();
        if (running == 0 || reap_one(1) < 0)
            break;
    }
}

/* Event-loop mode: SIGCHLD writes to a pipe, so one poll() waits for the plugin and for tasks. */
static int sigchld_pipe[2] = {-1, -1};

static void on_sigchld(int sig) {
    int saved = errno;
    char c = (char)sig;
    ssize_t ignored = write(sigchld_pipe[1], &c, 1); /* non-blocking: a full pipe already wakes the loop */
    (void)ignored;
    errno = saved;
}

static void setup_sigchld(void) {
    if (pipe2(sigchld_pipe, O_CLOEXEC | O_NONBLOCK) < 0)
        die("pipe2: %s", strerror(errno));
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigchld;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGCHLD, &sa, NULL) < 0)
        die("sigaction(SIGCHLD): %s", strerror(errno));
}

/* Calls progress() on every node whose fd poll() found readable. A node whose progress fails is no longer
 * polled (poll() skips negative fds), and the job ends. */
static void progress_ready(struct pollfd *fds) {
    for (uint32_t i = 0; i < job.nnodes; i++) {
        if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLERR | POLLHUP)))
            continue;
        int rc = plugin->progress(job.nodes[i].instance);
        if (rc != RPMI_OK) {
            fprintf(stderr, "host: progress on node %u failed: %s (%d); ending the job\n", (unsigned)i,
                    code_name(rc), rc);
            fds[i].fd = -1;
            lock();
            end_job_locked();
            unlock();
        }
    }
}

static void event_loop(void) {
    uint32_t n = job.nnodes;
    struct pollfd *fds = xcalloc(n + 1, sizeof *fds);
    for (uint32_t i = 0; i < n; i++)
        fds[i] = (struct pollfd){.fd = job.nodes[i].watch, .events = POLLIN};
    fds[n] = (struct pollfd){.fd = sigchld_pipe[0], .events = POLLIN};
    while (tasks_left > 0) {
        /* Reap before sleeping: a SIGCHLD after this point still wakes poll() through the pipe. */
        int r;
        while ((r = reap_one(0)) > 0) {
        }
        if (r < 0 || tasks_left == 0)
            break;
        if (poll(fds, n + 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            die("poll: %s", strerror(errno));
        }
        if (fds[n].revents) {
            char buf[64];
            while (read(sigchld_pipe[0], buf, sizeof buf) > 0) {
            }
        }
        progress_ready(fds);
    }
    /* The tasks are gone; let the plugin take in what they said last (an abort, say) before destroy. */
    for (int rounds = 0; rounds < 1000; rounds++) {
        int ready = poll(fds, n, 0);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0)
            break;
        progress_ready(fds);
    }
    free(fds);
}

/* ---------------------------------------------------------------------------------------------------------
 * Talking to the host of a spawned job, or to the spawning one, on their socket. */

/* How this host runs, for the hosts it starts for spawned jobs. Set before any task starts. */
static struct {
    const char *argv0, *plugin_path;
    int event_loop;
    uint32_t nnodes;
    uint32_t universe; /* this job's: a job it spawns gets it */
    /* The main thread's signal mask, which a spawned host gets back: in thread mode it is forked by the
     * plugin's progress thread, which blocks every signal, and a mask survives exec. */
    sigset_t sigmask;
} self;

/* Writes all of `buf` (MSG_NOSIGNAL: a peer that has gone is an error, not a SIGPIPE). */
static int send_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t sent = send(fd, buf, len, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent <= 0)
            return -1;
        buf += sent;
        len -= (size_t)sent;
    }
    return 0;
}

static int send_line(int fd, const char *line) {
    return send_all(fd, line, strlen(line)) == 0 && send_all(fd, "\n", 1) == 0 ? 0 : -1;
}

static void close_fd(int fd) {
    if (close(fd) != 0)
        fprintf(stderr, "host: close(%d): %s\n", fd, strerror(errno));
}

#ifdef RPMI_ABI_REVISION
/* Reads one line (at most size - 1 bytes, newline dropped), a byte at a time so as to take nothing after it. */
static int read_line(int fd, char *line, size_t size) {
    size_t k = 0;
    for (;;) {
        char c;
        ssize_t got = read(fd, &c, 1);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0 || (c != '\n' && k + 1 >= size))
            return -1;
        if (c == '\n')
            break;
        line[k++] = c;
    }
    line[k] = '\0';
    return 0;
}

static int read_all(int fd, char *buf, size_t len) {
    while (len > 0) {
        ssize_t got = read(fd, buf, len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        buf += got;
        len -= (size_t)got;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * Spawn (revision 2 of the ABI): reading the request, checking it, starting a host for the spawned job. */

/* At most this many processes in one spawn: this host forks them all on this machine. */
#define SPAWN_PROCS_MAX 1024
/* At most this many preputs, as for rpmi_job_info (plugin-spec/README.md, section 9). */
#define SPAWN_PREPUTS_MAX 4096

/* The request, read for exactly the shape the header gives: {"commands":[{"args":[...],"execname":"...",
 * "infos":[["k","v"],...],"nprocs":N,"preputs":[["k","v"],...]},...]}, keys in any order, each at most once
 * (nprocs and execname required, an unknown key refused). The reader never reads past the end and never
 * recurses; a function returns -1 on malformed input (or no memory), and what was built so far is freed with
 * the request. */
struct command {
    uint32_t nprocs;
    char *execname;
    char **args, **infos, **preputs; /* NULL-terminated; infos and preputs are key, value, key, value... */
    size_t nargs, ninfos, npreputs;  /* strings in each */
};

struct request {
    struct command *commands;
    size_t ncommands;
};

struct json {
    const char *p, *end;
};

static void json_space(struct json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

/* Takes `c`, after white space, if it comes next. */
static int json_take(struct json *j, char c) {
    json_space(j);
    if (j->p == j->end || *j->p != c)
        return 0;
    j->p++;
    return 1;
}

static int json_hex4(const char *s, unsigned *out) {
    *out = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        *out = *out * 16 + (unsigned)d;
    }
    return 0;
}

/* A string, decoded into a new NUL-terminated one (bytes outside escapes are copied: UTF-8 stays UTF-8).
 * NULL if malformed, if it holds a NUL (no C string can carry it), or out of memory. */
static char *json_string(struct json *j) {
    if (!json_take(j, '"'))
        return NULL;
    /* Find the closing quote first: what it encloses is never shorter than what it decodes to. */
    const char *close = j->p;
    for (; close < j->end && *close != '"'; close++)
        if (*close == '\\' && ++close == j->end)
            return NULL;
    if (close == j->end)
        return NULL;
    char *out = malloc((size_t)(close - j->p) + 1), *o = out;
    if (!out)
        return NULL;
    while (j->p < close) {
        unsigned char c = (unsigned char)*j->p++;
        unsigned cp, low;
        if (c < 0x20)
            goto bad; /* control characters come escaped */
        if (c != '\\') {
            *o++ = (char)c;
            continue;
        }
        switch (*j->p++) { /* there is one: the scan above stepped over it */
        case '"': *o++ = '"'; continue;
        case '\\': *o++ = '\\'; continue;
        case '/': *o++ = '/'; continue;
        case 'b': *o++ = '\b'; continue;
        case 'f': *o++ = '\f'; continue;
        case 'n': *o++ = '\n'; continue;
        case 'r': *o++ = '\r'; continue;
        case 't': *o++ = '\t'; continue;
        case 'u': break;
        default: goto bad;
        }
        if (close - j->p < 4 || json_hex4(j->p, &cp) < 0 || cp == 0 || (cp >= 0xdc00 && cp <= 0xdfff))
            goto bad; /* a NUL, or a low surrogate alone */
        j->p += 4;
        if (cp >= 0xd800 && cp <= 0xdbff) { /* a high surrogate: its low one must follow */
            if (close - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || json_hex4(j->p + 2, &low) < 0 ||
                low < 0xdc00 || low > 0xdfff)
                goto bad;
            j->p += 6;
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
        }
        /* UTF-8: 6 bytes of escape make at most 3, 12 make 4. */
        if (cp < 0x80) {
            *o++ = (char)cp;
        } else if (cp < 0x800) {
            *o++ = (char)(0xc0 | cp >> 6);
            *o++ = (char)(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
            *o++ = (char)(0xe0 | cp >> 12);
            *o++ = (char)(0x80 | (cp >> 6 & 0x3f));
            *o++ = (char)(0x80 | (cp & 0x3f));
        } else {
            *o++ = (char)(0xf0 | cp >> 18);
            *o++ = (char)(0x80 | (cp >> 12 & 0x3f));
            *o++ = (char)(0x80 | (cp >> 6 & 0x3f));
            *o++ = (char)(0x80 | (cp & 0x3f));
        }
    }
    j->p = close + 1;
    *o = '\0';
    return out;
bad:
    free(out);
    return NULL;
}

/* A count: digits only (no sign, fraction or exponent), at most 9 of them. */
static int json_count(struct json *j, uint32_t *out) {
    int digits = 0;
    json_space(j);
    for (*out = 0; j->p < j->end && *j->p >= '0' && *j->p <= '9'; j->p++) {
        if (++digits > 9)
            return -1;
        *out = *out * 10 + (uint32_t)(*j->p - '0');
    }
    return digits ? 0 : -1;
}

/* Appends `s` to the NULL-terminated array *v of *n strings; -1 (freeing s) if s is NULL or memory is out. */
static int push(char ***v, size_t *n, char *s) {
    char **grown = *v;
    if (s && *n % 16 == 0)
        grown = *n < SIZE_MAX / sizeof *grown - 17 ? realloc(*v, (*n + 17) * sizeof *grown) : NULL;
    if (!s || !grown) {
        free(s);
        return -1;
    }
    *v = grown;
    grown[(*n)++] = s;
    grown[*n] = NULL;
    return 0;
}

static void free_strings(char **v, size_t n) {
    for (size_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

/* ["a","b",...], appended to *v. */
static int json_strings(struct json *j, char ***v, size_t *n) {
    if (!json_take(j, '['))
        return -1;
    if (json_take(j, ']'))
        return 0;
    do
        if (push(v, n, json_string(j)) < 0)
            return -1;
    while (json_take(j, ','));
    return json_take(j, ']') ? 0 : -1;
}

/* [["k","v"],...], appended to *v as k, v, k, v... */
static int json_pairs(struct json *j, char ***v, size_t *n) {
    if (!json_take(j, '['))
        return -1;
    if (json_take(j, ']'))
        return 0;
    do {
        size_t before = *n;
        if (json_strings(j, v, n) < 0 || *n - before != 2)
            return -1;
    } while (json_take(j, ','));
    return json_take(j, ']') ? 0 : -1;
}

static int json_command(struct json *j, struct command *c) {
    static const char *const keys[] = {"nprocs", "execname", "args", "infos", "preputs"};
    unsigned seen = 0;
    if (!json_take(j, '{'))
        return -1;
    do {
        char *key = json_string(j);
        unsigned k = 0;
        if (!key)
            return -1;
        while (k < 5 && strcmp(key, keys[k]) != 0)
            k++;
        free(key);
        if (k == 5 || (seen & 1u << k) || !json_take(j, ':'))
            return -1;
        seen |= 1u << k;
        int rc = k == 0   ? json_count(j, &c->nprocs)
                 : k == 1 ? ((c->execname = json_string(j)) ? 0 : -1)
                 : k == 2 ? json_strings(j, &c->args, &c->nargs)
                 : k == 3 ? json_pairs(j, &c->infos, &c->ninfos)
                          : json_pairs(j, &c->preputs, &c->npreputs);
        if (rc < 0)
            return -1;
    } while (json_take(j, ','));
    return json_take(j, '}') && (seen & 3) == 3 ? 0 : -1;
}

static void free_request(struct request *r) {
    for (size_t i = 0; i < r->ncommands; i++) {
        struct command *c = &r->commands[i];
        free(c->execname);
        free_strings(c->args, c->nargs);
        free_strings(c->infos, c->ninfos);
        free_strings(c->preputs, c->npreputs);
    }
    free(r->commands);
    memset(r, 0, sizeof *r);
}

static int read_request(const char *text, size_t len, struct request *r) {
    memset(r, 0, sizeof *r);
    if (!text)
        return -1;
    struct json j = {text, text + len};
    char *key = NULL;
    int ok = json_take(&j, '{') && (key = json_string(&j)) && strcmp(key, "commands") == 0 && json_take(&j, ':') &&
             json_take(&j, '[');
    free(key);
    if (!ok)
        return -1;
    if (!json_take(&j, ']')) {
        do {
            if (r->ncommands % 8 == 0) {
                struct command *grown = r->ncommands < SIZE_MAX / sizeof *grown - 8
                                            ? realloc(r->commands, (r->ncommands + 8) * sizeof *grown)
                                            : NULL;
                if (!grown)
                    return -1;
                memset(grown + r->ncommands, 0, 8 * sizeof *grown);
                r->commands = grown;
            }
            if (json_command(&j, &r->commands[r->ncommands++]) < 0)
                return -1;
        } while (json_take(&j, ','));
        if (!json_take(&j, ']'))
            return -1;
    }
    if (!json_take(&j, '}'))
        return -1;
    json_space(&j);
    return j.p == j.end ? 0 : -1;
}

static void free_app(struct app *a) {
    free(a->argv);
    free(a->exec);
    free(a->path_env);
}

/* A spawn as this host runs it: one application per command, the preputs of all commands. Its strings
 * belong to the request. */
struct plan {
    struct request request;
    struct app *apps;
    uint32_t napps, size;
    rpmi_keyval *preputs;
    uint32_t npreputs;
};

static void free_plan(struct plan *pl) {
    for (uint32_t i = 0; i < pl->napps; i++)
        free_app(&pl->apps[i]);
    free(pl->apps);
    free(pl->preputs);
    free_request(&pl->request);
}

enum { PLAN_OK, PLAN_REFUSED, PLAN_MISSING };

static int refuse(char *why, size_t whylen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whylen, fmt, ap);
    va_end(ap);
    return PLAN_REFUSED;
}

/* Whether a "host" info names this machine. */
static int this_machine(const char *host) {
    char here[256];
    if (gethostname(here, sizeof here) != 0)
        here[0] = '\0';
    here[sizeof here - 1] = '\0';
    return strcmp(host, "localhost") == 0 || strcmp(host, "127.0.0.1") == 0 || strcmp(host, here) == 0;
}

/* Reads and checks a spawn request into `pl` (free it with free_plan whatever comes back). PLAN_REFUSED: it
 * cannot be served; PLAN_MISSING: a program cannot start (not found or not executable, or its wdir is not a
 * directory). Either way `why` says why. */
static int plan_spawn(const char *json, size_t len, struct plan *pl, char *why, size_t whylen) {
    memset(pl, 0, sizeof *pl);
    struct request *rq = &pl->request;
    if (read_request(json, len, rq) != 0)
        return refuse(why, whylen, "the spawn request is not the JSON the plugin ABI specifies");
    size_t npairs = 0;
    for (size_t c = 0; c < rq->ncommands; c++)
        npairs += rq->commands[c].npreputs / 2;
    if (rq->ncommands == 0 || rq->ncommands > SPAWN_PROCS_MAX || npairs > SPAWN_PREPUTS_MAX)
        return refuse(why, whylen, "a spawn of %zu commands and %zu preputs", rq->ncommands, npairs);
    pl->apps = calloc(rq->ncommands, sizeof *pl->apps);
    pl->preputs = calloc(npairs ? npairs : 1, sizeof *pl->preputs);
    if (!pl->apps || !pl->preputs)
        return refuse(why, whylen, "out of memory");
    int missing = 0;
    for (size_t c = 0; c < rq->ncommands; c++) {
        const struct command *cmd = &rq->commands[c];
        struct app *a = &pl->apps[pl->napps++];
        const char *path = NULL;
        if (cmd->nprocs == 0 || cmd->nprocs > SPAWN_PROCS_MAX - pl->size || !cmd->execname[0])
            return refuse(why, whylen, "command %zu asks for %u processes of '%s'; this host spawns 1 to %d in all",
                          c, (unsigned)cmd->nprocs, cmd->execname, SPAWN_PROCS_MAX);
        a->n = cmd->nprocs;
        pl->size += cmd->nprocs;
        /* "wdir" and "path" as Hydra takes them, "host" only if it is this machine; others are ignored, as
         * MPI lets a process manager do. */
        for (size_t i = 0; i < cmd->ninfos; i += 2) {
            const char *key = cmd->infos[i], *value = cmd->infos[i + 1];
            if (strcmp(key, "wdir") == 0)
                a->wdir = value;
            else if (strcmp(key, "path") == 0)
                path = value;
            else if (strcmp(key, "host") == 0 && !this_machine(value))
                return refuse(why, whylen, "this host runs every task on this machine, not on '%s'", value);
        }
        a->argv = calloc(cmd->nargs + 2, sizeof *a->argv);
        a->path_env = path ? malloc(strlen(path) + sizeof "PATH=") : NULL;
        if (!a->argv || (path && !a->path_env))
            return refuse(why, whylen, "out of memory");
        if (path)
            strcat(strcpy(a->path_env, "PATH="), path);
        a->argv[0] = cmd->execname;
        for (size_t i = 0; i < cmd->nargs; i++)
            a->argv[i + 1] = cmd->args[i];
        struct stat st;
        const char *cannot = NULL;
        if (!missing && a->wdir && (stat(a->wdir, &st) != 0 || !S_ISDIR(st.st_mode)))
            cannot = "its wdir is not a directory";
        else if (!missing && !(a->exec = find_program(cmd->execname, a->wdir, path)))
            cannot = "not found, or not executable";
        if (cannot) {
            snprintf(why, whylen, "cannot start %s: %s", cmd->execname, cannot);
            missing = 1;
        }
        for (size_t i = 0; i < cmd->npreputs; i += 2) {
            const char *key = cmd->preputs[i], *value = cmd->preputs[i + 1];
            uint32_t k = 0;
            while (k < pl->npreputs && strcmp(pl->preputs[k].key, key) != 0)
                k++;
            if (k == pl->npreputs)
                pl->preputs[pl->npreputs++] = (rpmi_keyval){.key = key, .value = value};
            else if (strcmp(pl->preputs[k].value, value) != 0)
                return refuse(why, whylen, "the preput '%s' is given two values", key);
        }
    }
    return missing ? PLAN_MISSING : PLAN_OK;
}

/* Starts the host of a spawned job (see the header comment) and waits for its word. Returns 0 once it has
 * started every task, else -1 with why. */
static int start_spawned(const char *json, size_t len, uint32_t size, char *why, size_t whylen) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        snprintf(why, whylen, "socketpair: %s", strerror(errno));
        return -1;
    }
    char event_loop_opt[] = "--event-loop", nodes_opt[] = "--nodes", spawned_opt[] = "--spawned";
    char fd_arg[16], nodes_arg[16];
    snprintf(fd_arg, sizeof fd_arg, "%d", sv[1]);
    snprintf(nodes_arg, sizeof nodes_arg, "%u", (unsigned)(size < self.nnodes ? size : self.nnodes));
    char *argv[8];
    int k = 0;
    argv[k++] = (char *)self.argv0; /* execve takes char *const []; it changes nothing */
    if (self.event_loop)
        argv[k++] = event_loop_opt;
    argv[k++] = nodes_opt;
    argv[k++] = nodes_arg;
    argv[k++] = spawned_opt;
    argv[k++] = fd_arg;
    argv[k++] = (char *)self.plugin_path;
    argv[k] = NULL;

    /* Forked and noted under the lock: the main thread, which reaps, cannot take it for a stranger. */
    fflush(NULL);
    lock();
    struct spawned *grown = realloc(job.spawned, (job.nspawned + 1) * sizeof *grown);
    pid_t pid = -1;
    int fork_errno = ENOMEM;
    if (grown) {
        job.spawned = grown;
        pid = fork();
        fork_errno = errno;
    }
    if (pid == 0) {
        /* The child of a multi-threaded process: async-signal-safe calls only. */
        if (sigprocmask(SIG_SETMASK, &self.sigmask, NULL) == 0 && fcntl(sv[1], F_SETFD, 0) == 0)
            execve("/proc/self/exe", argv, environ);
        child_say("host: cannot start a host for a spawned job: exec /proc/self/exe failed", "");
        _exit(127);
    }
    uint32_t index = job.nspawned;
    if (pid > 0) {
        job.spawned[job.nspawned++] = (struct spawned){.pid = pid, .code = 0, .fd = -1, .told = 0};
        job.spawned_running++;
    }
    unlock();
    close_fd(sv[1]);
    if (pid < 0) {
        close_fd(sv[0]);
        snprintf(why, whylen, "fork: %s", strerror(fork_errno));
        return -1;
    }

    /* Its job, then its word: "ok" once every task has started, or why not. */
    char head[64], said[400];
    int hlen = snprintf(head, sizeof head, "%u %zu\n", (unsigned)self.universe, len);
    int heard = send_all(sv[0], head, (size_t)hlen) == 0 && send_all(sv[0], json, len) == 0 &&
                read_line(sv[0], said, sizeof said) == 0;
    int started = heard && strcmp(said, "ok") == 0;
    if (started) {
        lock();
        struct spawned *sp = &job.spawned[index];
        sp->fd = sv[0]; /* from now on its end is tied to this job's */
        if (sp->pid == 0)
            spawned_ended_locked(sp); /* it has ended already: its status counts now */
        else if (job.ending)
            end_job_locked(); /* this job is ending: shut its socket down */
        unlock();
        return 0;
    }
    close_fd(sv[0]); /* it ends, if it has not: its spawning side is gone */
    snprintf(why, whylen, "%s", heard ? said : "the host of the spawned job ended before it started its tasks");
    return -1;
}

/* rpmi_host_ops.spawn: answers at once, from this callback: every process -1 if a program cannot start, every
 * process 0 once a host of the spawned job has started them all, else a refusal with the reason. */
static int on_spawn(void *host_data, rpmi_instance *instance, uint32_t task, const char *request_json, size_t len) {
    struct node *node = host_data;
    char why[512] = "", codes[SPAWN_PROCS_MAX * 3] = "";
    struct plan pl;
    count_callback_thread();
    int rc = plan_spawn(request_json, len, &pl, why, sizeof why);
    uint32_t size = pl.size;
    free_plan(&pl);
    if (rc == PLAN_OK && start_spawned(request_json, len, size, why, sizeof why) != 0)
        rc = PLAN_REFUSED;
    int status = RPMI_OK;
    if (rc == PLAN_REFUSED) {
        fprintf(stderr, "host: node %u: a spawn is refused: %s\n", (unsigned)node->index, why);
        status = RPMI_ERR_INVALID;
    } else {
        if (rc == PLAN_MISSING)
            fprintf(stderr, "host: node %u: %s; the spawn fails\n", (unsigned)node->index, why);
        size_t k = 0;
        for (uint32_t i = 0; i < size; i++)
            k += (size_t)snprintf(codes + k, sizeof codes - k, "%s%s", i ? "," : "", rc == PLAN_OK ? "0" : "-1");
    }
    int done = plugin->service_complete(instance, task, status, status == RPMI_OK ? codes : why);
    if (done != RPMI_OK)
        fprintf(stderr, "host: service_complete for a spawn failed: %s (%d)\n", code_name(done), done);
    return RPMI_OK;
}
#endif /* RPMI_ABI_REVISION */

/* ---------------------------------------------------------------------------------------------------------
 * Running a job. */

static uint32_t count_arg(const char *flag, const char *v) {
    char *end;
    errno = 0;
    unsigned long n = v ? strtoul(v, &end, 10) : 0;
    if (!v || errno || *end || n == 0 || n > 1000000 || v[0] == '-') {
        fprintf(stderr, "host: %s takes a positive number, not '%s'\n%s", flag, v ? v : "", usage);
        exit(2);
    }
    return (uint32_t)n;
}

/* What to run: applications, whose ranks follow each other; and for a spawned job, what its spawner gave. */
struct job_spec {
    struct app *apps;
    uint32_t napps, size;
    uint32_t universe; /* 0: size */
    int spawner;       /* a spawned job: the socket to the spawning host; else -1 */
#ifdef RPMI_ABI_REVISION
    const rpmi_keyval *preputs;
    uint32_t npreputs;
#endif
};

static int run_job(int event_loop_mode, uint32_t nnodes, const struct job_spec *spec) {
    uint32_t n = spec->size;
    self.universe = spec->universe ? spec->universe : n;

    /* Ranks over nodes in blocks, as even as can be, the first nodes taking one more. */
    job.nnodes = nnodes;
    job.ntasks = n;
    job.apps = spec->apps;
    job.napps = spec->napps;
    job.nodes = xcalloc(nnodes, sizeof *job.nodes);
    job.tasks = xcalloc(n, sizeof *job.tasks);
    int32_t *appnums = xcalloc(n, sizeof *appnums);
    for (uint32_t a = 0, r = 0; a < spec->napps; a++)
        for (uint32_t k = 0; k < spec->apps[a].n && r < n; k++, r++)
            appnums[r] = (int32_t)(job.tasks[r].app = a);
    uint32_t *task_map = xcalloc(n, sizeof *task_map);
    uint32_t rank = 0;
    for (uint32_t i = 0; i < nnodes; i++) {
        struct node *nd = &job.nodes[i];
        nd->index = i;
        nd->watch = -1;
        nd->local_count = n / nnodes + (i < n % nnodes);
        nd->local_ranks = xcalloc(nd->local_count, sizeof *nd->local_ranks);
        for (uint32_t l = 0; l < nd->local_count; l++, rank++) {
            nd->local_ranks[l] = rank;
            task_map[rank] = i;
            job.tasks[rank].node = i;
            job.tasks[rank].local = l;
        }
    }

    char hostname[256];
    if (gethostname(hostname, sizeof hostname) != 0)
        strcpy(hostname, "localhost");
    hostname[sizeof hostname - 1] = '\0';
    const char **hostnames = xcalloc(nnodes, sizeof *hostnames);
    for (uint32_t i = 0; i < nnodes; i++)
        hostnames[i] = hostname;
    /* Unique over time, not only among live processes: MPICH names a job's shared memory after its KVS name,
     * and a job whose tasks were killed leaves it behind, for a later job of a reused pid to trip over. */
    char job_id[48];
    snprintf(job_id, sizeof job_id, "chost%ld-%llx", (long)getpid(), now_ns());

    if (event_loop_mode)
        setup_sigchld();

    for (uint32_t i = 0; i < nnodes; i++) {
        struct node *nd = &job.nodes[i];
        rpmi_job_info info;
        memset(&info, 0, sizeof info);
        info.struct_size = sizeof info;
        info.job_id = job_id;
        info.shell_index = i;
        info.shell_count = nnodes;
        info.size = n;
        info.task_map = task_map;
        info.local_ranks = nd->local_ranks;
        info.local_count = nd->local_count;
        info.hostnames = hostnames;
        info.options_json = getenv("RPMI_HOST_OPTIONS"); /* NULL: the defaults */
        info.appnum = 0;
        info.universe_size = spec->universe;
        info.spawned = spec->spawner >= 0;
#ifdef RPMI_ABI_REVISION
        info.appnums = appnums;
        info.preputs = spec->preputs;
        info.preput_count = spec->npreputs;
#endif
        rpmi_host_ops ops = host_ops(nd, event_loop_mode);
        rpmi_instance *instance = NULL;
        char err[512] = "";
        int rc = plugin->create(&info, &ops, &instance, err, sizeof err);
        if (rc != RPMI_OK) {
            char why[600];
            snprintf(why, sizeof why, "create for node %u failed: %s (%d): %s", (unsigned)i, code_name(rc), rc, err);
            if (spec->spawner >= 0) /* the spawn is refused with the reason */
                send_line(spec->spawner, why);
            die("%s", why);
        }
        if (!instance)
            die("create for node %u returned RPMI_OK but no instance", (unsigned)i);
        lock();
        int watched = nd->watch >= 0 && nd->instance == instance;
        nd->instance = instance;
        unlock();
        if (event_loop_mode && !watched)
            die("create for node %u did not call watch_fd with its instance", (unsigned)i);
    }

    tasks_left = 0;
    for (rank = 0; rank < n; rank++) {
        lock();
        int ending = job.ending;
        unlock();
        if (ending)
            break;
        if (start_task(rank) != 0) {
            if (first_failure == 0)
                first_failure = 1;
            lock();
            end_job_locked();
            unlock();
            break;
        }
        tasks_left++;
    }
    /* A spawned job: the spawn is answered once every task has started. If the spawning host has gone, the
     * thread watching its socket ends this job. */
    if (spec->spawner >= 0)
        send_line(spec->spawner, rank == n ? "ok" : "the host of the spawned job could not start all its tasks");

    if (event_loop_mode)
        event_loop();
    else
        wait_thread_mode();

#if CAN_CARRY
    pthread_rwlock_wrlock(&carry_lock);
    carry_stopped = 1;
    pthread_rwlock_unlock(&carry_lock);
#endif
    for (uint32_t i = 0; i < nnodes; i++)
        plugin->destroy(job.nodes[i].instance);
    fprintf(stderr, "host: callbacks on the main thread: %lu, on other threads: %lu\n", callbacks_on_main,
            callbacks_elsewhere);
    wait_spawned();

    /* The status of the job that began to fail first: this one's own, or one it spawned. */
    lock();
    job.done = 1;
    int status = job.aborted ? job.abort_code : first_failure ? first_failure : job.spawner_lost;
    unsigned long long began = job.began;
    if (job.spawn_failure && (status == 0 || job.spawn_began < began)) {
        status = job.spawn_failure;
        began = job.spawn_began;
    }
    unlock();
    if (spec->spawner >= 0) {
        char last[64];
        snprintf(last, sizeof last, "%d %llu", status, status ? began : 0ULL);
        send_line(spec->spawner, last); /* if the spawning host is gone, nobody asks */
    }

    for (uint32_t i = 0; i < nnodes; i++) {
        free(job.nodes[i].local_ranks);
        free(job.nodes[i].data);
    }
    for (uint32_t i = 0; i < job.nspawned; i++)
        if (job.spawned[i].fd >= 0)
            close_fd(job.spawned[i].fd);
    free(job.spawned);
    free(job.nodes);
    free(job.tasks);
    free(appnums);
    free(task_map);
    free(hostnames);
    return status;
}

#ifdef RPMI_ABI_REVISION
static int spawner_fd = -1;

/* A spawned host's thread: end-of-file on its socket means that the spawning job has ended (or its host has
 * died), so this job ends too. */
static void *watch_spawner(void *arg) {
    char c;
    (void)arg;
    while (read(spawner_fd, &c, 1) < 0 && errno == EINTR) {
    }
    lock();
    if (!job.done && !job.ending) {
        fprintf(stderr, "host: the job that spawned this one has ended; ending this one\n");
        job.spawner_lost = 1;
        end_job_locked();
    }
    unlock();
    return NULL;
}

/* --spawned FD: runs the job that the spawning host sends on FD (see start_spawned). */
static int run_spawned(int event_loop_mode, uint32_t nnodes, int fd) {
    /* Only this host may hold the socket: a task holding it would hide this host's end from the spawner. */
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) != 0)
        die("--spawned %d: %s", fd, strerror(errno));
    char head[64];
    unsigned universe = 0;
    size_t len = 0;
    if (read_line(fd, head, sizeof head) != 0 || sscanf(head, "%u %zu", &universe, &len) != 2 || len > (64u << 20))
        die("--spawned %d: no job came from the spawning host", fd);
    char *json = xcalloc(len + 1, 1);
    if (read_all(fd, json, len) != 0)
        die("--spawned %d: the spawning host sent part of a job", fd);
    struct plan pl;
    char why[512];
    if (plan_spawn(json, len, &pl, why, sizeof why) != PLAN_OK) {
        send_line(fd, why);
        die("a spawned job: %s", why);
    }
    spawner_fd = fd;
    pthread_t watcher;
    int e = pthread_create(&watcher, NULL, watch_spawner, NULL);
    if (e == 0)
        e = pthread_detach(watcher); /* never joined: it may be blocked in read when the job is done */
    if (e)
        die("cannot start the thread that watches the spawning host: %s", strerror(e));
    struct job_spec spec = {.apps = pl.apps,
                            .napps = pl.napps,
                            .size = pl.size,
                            .universe = universe,
                            .spawner = fd,
                            .preputs = pl.preputs,
                            .npreputs = pl.npreputs};
    int status = run_job(event_loop_mode, nnodes < pl.size ? nnodes : pl.size, &spec);
    free_plan(&pl);
    free(json);
    return status;
}
#endif

/* ---------------------------------------------------------------------------------------------------------
 * --check-errors: bad input must come back as the documented error codes. */

static int checks_failed;

static void check(int ok, const char *what, const char *detail) {
    printf("%s: %s%s%s\n", ok ? "ok" : "FAIL", what, detail && *detail ? " -- " : "", detail ? detail : "");
    fflush(stdout);
    if (!ok)
        checks_failed++;
}

/* Checks that `got` is `want`; detail names both, and the error text if there is one. */
static void check_code(const char *what, int got, int want, const char *err) {
    char detail[700];
    snprintf(detail, sizeof detail, "%s (%d)%s%s%s", code_name(got), got, err ? ": \"" : "", err ? err : "",
             err ? "\"" : "");
    if (got != want) {
        char d2[800];
        snprintf(d2, sizeof d2, "expected %s, got %s", code_name(want), detail);
        check(0, what, d2);
    } else {
        check(1, what, detail);
    }
}

/* A create that must fail with `want` and fill err (mentioning `needle`, if given). */
static void check_create_fails(const char *what, const rpmi_job_info *info, const rpmi_host_ops *ops, int want,
                               const char *needle) {
    rpmi_instance *instance = NULL;
    char err[512];
    memset(err, 'x', sizeof err);
    err[sizeof err - 1] = '\0';
    int rc = plugin->create(info, ops, &instance, err, sizeof err);
    int terminated = memchr(err, '\0', sizeof err) != NULL;
    int filled = rc != RPMI_OK && terminated && err[0] != '\0' && err[0] != 'x';
    check_code(what, rc, want, filled ? err : NULL);
    char label[256];
    snprintf(label, sizeof label, "  ... and the error text is filled%s%s%s", needle ? " and names '" : "",
             needle ? needle : "", needle ? "'" : "");
    check(filled && (!needle || strstr(err, needle)), label, NULL);
    if (rc == RPMI_OK && instance)
        plugin->destroy(instance);
}

static int stub_collective(void *host_data, rpmi_instance *instance, const uint8_t *data, size_t len) {
    (void)host_data, (void)instance, (void)data, (void)len;
    return RPMI_ERR_INVALID;
}

static pthread_mutex_t stub_lock = PTHREAD_MUTEX_INITIALIZER; /* guards what the stubs record */

/* What stub_abort saw: how many calls, the last exit code, and whether that call ran on the main thread. */
static int aborts, abort_code_seen, abort_on_main;

static void stub_abort(void *host_data, uint32_t rank, int32_t exit_code, int32_t reason, const char *message,
                       size_t len) {
    (void)host_data, (void)rank, (void)reason, (void)message, (void)len;
    pthread_mutex_lock(&stub_lock);
    aborts++;
    abort_code_seen = exit_code;
    abort_on_main = pthread_equal(pthread_self(), main_thread);
    pthread_mutex_unlock(&stub_lock);
}

/* The last message the plugin logged through the host on `log_thread` (a failing call logs its reason on the
 * thread that made it), for checking that failures say why. Messages on other threads are ignored. */
static pthread_t log_thread;
static char last_log[512];
static int32_t last_log_level;

static void stub_log(void *host_data, int32_t level, const char *message, size_t len) {
    (void)host_data;
    pthread_mutex_lock(&stub_lock);
    if (pthread_equal(pthread_self(), log_thread)) {
        if (len >= sizeof last_log)
            len = sizeof last_log - 1;
        if (message)
            memcpy(last_log, message, len);
        last_log[message ? len : 0] = '\0';
        last_log_level = level;
    }
    pthread_mutex_unlock(&stub_lock);
}

/* Keeps the log messages of the calling thread from now on, forgetting the last one. */
static void watch_log_of_this_thread(void) {
    pthread_mutex_lock(&stub_lock);
    log_thread = pthread_self();
    last_log[0] = '\0';
    last_log_level = 0;
    pthread_mutex_unlock(&stub_lock);
}

/* Whether an error reached the log callback on the watched thread since it was last asked; forgets it. */
static int error_logged(void) {
    pthread_mutex_lock(&stub_lock);
    int logged = last_log_level == RPMI_LOG_ERROR && last_log[0] != '\0';
    last_log[0] = '\0';
    last_log_level = 0;
    pthread_mutex_unlock(&stub_lock);
    return logged;
}

/* Checks that the last call's failure reached the log callback at error level. */
static void check_logged(void) {
    char seen[sizeof last_log];
    pthread_mutex_lock(&stub_lock);
    memcpy(seen, last_log, sizeof seen);
    pthread_mutex_unlock(&stub_lock);
    check(error_logged(), "  ... and its reason reached the log callback", seen);
}

/* A call that fails, made on a host thread of its own: its reason reaches log on that thread before the
 * call returns (the one callback a host's own thread sees, section 4 of the specification). */
struct failing_call {
    rpmi_instance *instance;
    int rc;
    int logged;
};

static void *fail_on_own_thread(void *arg) {
    struct failing_call *call = arg;
    watch_log_of_this_thread();
    call->rc = plugin->service_complete(call->instance, 0, RPMI_OK, NULL);
    call->logged = error_logged();
    return NULL;
}

/* A task whose last words are `cmd=abort exitcode=5` and which then leaves: the host writes them on the
 * task's end and closes it, instead of running a task, and destroys the instance without calling progress.
 * destroy serves what tasks wrote before they left, so the abort reaches the host: on the progress thread in
 * thread mode, inside destroy on the calling thread (here the main thread) in event-loop mode. */
static void check_last_words(const rpmi_job_info *job, const rpmi_host_ops *ops, int event_loop) {
    const char *mode = event_loop ? "event-loop mode" : "thread mode";
    char what[200], err[512] = "";
    rpmi_instance *inst = NULL;
    pthread_mutex_lock(&stub_lock);
    aborts = 0;
    abort_code_seen = 0;
    pthread_mutex_unlock(&stub_lock);
    int rc = plugin->create(job, ops, &inst, err, sizeof err);
    snprintf(what, sizeof what, "create for an abort as a task's last words (%s) -> RPMI_OK", mode);
    check_code(what, rc, RPMI_OK, rc == RPMI_OK ? NULL : err);
    if (rc != RPMI_OK || !inst)
        return;
    rpmi_task_env env;
    memset(&env, 0, sizeof env);
    env.struct_size = sizeof env;
    static const char line[] = "cmd=abort exitcode=5\n";
    int written = plugin->task_init(inst, 0, &env) == RPMI_OK &&
                  write(env.child_fd, line, sizeof line - 1) == (ssize_t)(sizeof line - 1);
    snprintf(what, sizeof what, "  ... task_init and the abort line written on the task's end (%s)", mode);
    check(written, what, NULL);
    plugin->task_forked(inst, 0); /* the task's end closes: it has left */
    plugin->destroy(inst);
    pthread_mutex_lock(&stub_lock);
    int ok = aborts == 1 && abort_code_seen == 5 && abort_on_main == event_loop;
    char detail[100];
    snprintf(detail, sizeof detail, "%d calls, exit code %d, %s the main thread", aborts, abort_code_seen,
             abort_on_main ? "on" : "not on");
    pthread_mutex_unlock(&stub_lock);
    snprintf(what, sizeof what, "  ... destroy served it: abort(exit code 5) on %s (%s)",
             event_loop ? "the thread calling destroy" : "the progress thread", mode);
    check(ok, what, detail);
}

static rpmi_instance *watched_instance;
static int watched_fd = -1;

static int stub_watch(void *host_data, rpmi_instance *instance, int fd) {
    (void)host_data;
    watched_instance = instance;
    watched_fd = fd;
    return RPMI_OK;
}

/* A host's callback may fail with any value but RPMI_OK. */
static int refusing_watch(void *host_data, rpmi_instance *instance, int fd) {
    (void)host_data, (void)instance, (void)fd;
    return -42;
}

static int check_errors(const char *plugin_path) {
    watch_log_of_this_thread();
    load_plugin(plugin_path);
    check(plugin->version != NULL, "the plugin table has a version string", plugin->version);

    /* A valid job: 2 ranks on one shell, and host callbacks for thread mode. */
    static const uint32_t map[2] = {0, 0};
    static const uint32_t locals[2] = {0, 1};
    static const char *const hosts[1] = {"localhost"};
    rpmi_job_info good;
    memset(&good, 0, sizeof good);
    good.struct_size = sizeof good;
    good.job_id = "check";
    good.shell_index = 0;
    good.shell_count = 1;
    good.size = 2;
    good.task_map = map;
    good.local_ranks = locals;
    good.local_count = 2;
    good.hostnames = hosts;
    rpmi_host_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.struct_size = sizeof ops;
    ops.abi_version = RPMI_ABI_VERSION;
    ops.collective = stub_collective;
    ops.abort = stub_abort;
    ops.log = stub_log;

    /* create */
    check_create_fails("create with a NULL job -> RPMI_ERR_INVALID", NULL, &ops, RPMI_ERR_INVALID, NULL);
    check_create_fails("create with NULL ops -> RPMI_ERR_INVALID", &good, NULL, RPMI_ERR_INVALID, NULL);
    {
        char err[64] = "";
        int rc = plugin->create(&good, &ops, NULL, err, sizeof err);
        check_code("create with a NULL instance pointer -> RPMI_ERR_INVALID", rc, RPMI_ERR_INVALID, err);
    }
    {
        rpmi_host_ops bad = ops;
        bad.abi_version = 999;
        check_create_fails("create with ops.abi_version 999 -> RPMI_ERR_VERSION", &good, &bad, RPMI_ERR_VERSION,
                           NULL);
    }
    {
        rpmi_host_ops bad = ops;
        bad.struct_size = 8;
        check_create_fails("create with ops.struct_size 8 -> RPMI_ERR_VERSION", &good, &bad, RPMI_ERR_VERSION, NULL);
    }
    {
        rpmi_job_info bad = good;
        bad.struct_size = 4;
        check_create_fails("create with job.struct_size 4 -> RPMI_ERR_VERSION", &bad, &ops, RPMI_ERR_VERSION, NULL);
    }
    {
        rpmi_job_info bad = good;
        bad.options_json = "{\"nope\":1}";
        check_create_fails("create with the unknown option 'nope' -> RPMI_ERR_OPTION", &bad, &ops, RPMI_ERR_OPTION,
                           "nope");
        bad.options_json = "{not json";
        check_create_fails("create with options that are not JSON -> RPMI_ERR_OPTION", &bad, &ops, RPMI_ERR_OPTION,
                           NULL);
    }
    {
        static const uint32_t outside[2] = {0, 5};
        rpmi_job_info bad = good;
        bad.task_map = outside;
        check_create_fails("create with task_map naming shell 5 of 1 -> RPMI_ERR_INVALID", &bad, &ops,
                           RPMI_ERR_INVALID, NULL);
    }
    {
        static const uint32_t split[2] = {0, 1};
        static const uint32_t elsewhere[1] = {1};
        static const char *const two_hosts[2] = {"a", "b"};
        rpmi_job_info bad = good;
        bad.shell_count = 2;
        bad.task_map = split;
        bad.hostnames = two_hosts;
        bad.local_ranks = elsewhere;
        bad.local_count = 1;
        check_create_fails("create with local rank 1, which task_map puts on shell 1, on shell 0 -> "
                           "RPMI_ERR_INVALID",
                           &bad, &ops, RPMI_ERR_INVALID, NULL);
    }
    {
        static const uint32_t only_first[1] = {0};
        rpmi_job_info bad = good;
        bad.local_ranks = only_first;
        bad.local_count = 1;
        check_create_fails("create with local_ranks missing rank 1, which task_map puts on this shell -> "
                           "RPMI_ERR_INVALID",
                           &bad, &ops, RPMI_ERR_INVALID, NULL);
        bad.local_count = 0;
        check_create_fails("create with local_count 0 -> RPMI_ERR_INVALID", &bad, &ops, RPMI_ERR_INVALID, NULL);
    }
    {
        rpmi_job_info bad = good;
        bad.job_id = "no spaces";
        check_create_fails("create with job_id 'no spaces' -> RPMI_ERR_INVALID", &bad, &ops, RPMI_ERR_INVALID,
                           NULL);
    }
    {
        rpmi_host_ops bad = ops;
        bad.collective = NULL;
        check_create_fails("create without the required collective callback -> RPMI_ERR_INVALID", &good, &bad,
                           RPMI_ERR_INVALID, NULL);
    }
    {
        rpmi_host_ops bad = ops;
        bad.watch_fd = refusing_watch;
        check_create_fails("create whose watch_fd fails (-42) -> RPMI_ERR_SYSTEM", &good, &bad, RPMI_ERR_SYSTEM,
                           NULL);
    }
    {
        /* errlen may be 0: nothing is written. A short buffer gets a truncated, terminated text. */
        char canary[4] = {'c', 'c', 'c', 'c'};
        int rc = plugin->create(NULL, &ops, NULL, canary, 0);
        check(rc == RPMI_ERR_INVALID && canary[0] == 'c', "create with errlen 0 -> an error, err untouched", NULL);
        char small[8];
        memset(small, 'x', sizeof small);
        rc = plugin->create(NULL, &ops, NULL, small, 5);
        check(rc == RPMI_ERR_INVALID && memchr(small, '\0', 5) != NULL && small[5] == 'x',
              "create with errlen 5 -> a text cut to 4 bytes and a NUL", NULL);
    }

    /* An instance in thread mode. */
    rpmi_instance *inst = NULL;
    char err[512] = "";
    int rc = plugin->create(&good, &ops, &inst, err, sizeof err);
    check_code("create with a valid job (thread mode) -> RPMI_OK", rc, RPMI_OK, rc == RPMI_OK ? NULL : err);
    if (rc == RPMI_OK && inst) {
        rpmi_task_env env;
        memset(&env, 0, sizeof env);
        check_code("task_init with env.struct_size 0 -> RPMI_ERR_VERSION", plugin->task_init(inst, 0, &env),
                   RPMI_ERR_VERSION, NULL);
        env.struct_size = sizeof env;
        check_code("task_init with a NULL env -> RPMI_ERR_INVALID", plugin->task_init(inst, 0, NULL),
                   RPMI_ERR_INVALID, NULL);
        check_code("task_init of local task 2 of 2 -> RPMI_ERR_INVALID", plugin->task_init(inst, 2, &env),
                   RPMI_ERR_INVALID, NULL);
        check_code("task_init of task 1 -> RPMI_OK", plugin->task_init(inst, 1, &env), RPMI_OK, NULL);
        {
            char want[64];
            int has_fd = 0, has_rank = 0, has_size = 0, has_jobid = 0;
            snprintf(want, sizeof want, "PMI_FD=%d", env.child_fd);
            for (size_t i = 0; env.env && i < env.env_count; i++) {
                has_fd |= strcmp(env.env[i], want) == 0;
                has_rank |= strcmp(env.env[i], "PMI_RANK=1") == 0;
                has_size |= strcmp(env.env[i], "PMI_SIZE=2") == 0;
                has_jobid |= strcmp(env.env[i], "PMI_JOBID=check") == 0;
            }
            check(env.child_fd >= 0 && has_fd && has_rank && has_size && has_jobid,
                  "  ... env holds PMI_FD=child_fd, PMI_RANK=1, PMI_SIZE=2, PMI_JOBID=check", NULL);
            int flags = env.child_fd >= 0 ? fcntl(env.child_fd, F_GETFD) : -1;
            check(flags >= 0 && (flags & FD_CLOEXEC), "  ... child_fd is close-on-exec in the host", NULL);
        }
        {
            /* In a child: task_exec lets the fd survive exec. */
            int fd = env.child_fd;
            fflush(NULL);
            pid_t pid = fork();
            if (pid == 0) {
                int ok = plugin->task_exec(inst, 1) == RPMI_OK;
                int flags = fcntl(fd, F_GETFD);
                _exit(ok && flags >= 0 && !(flags & FD_CLOEXEC) ? 0 : 1);
            }
            int status = -1;
            if (pid > 0)
                waitpid(pid, &status, 0);
            check(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "task_exec in a forked child -> RPMI_OK and child_fd no longer close-on-exec", NULL);
        }
        rpmi_task_env again;
        memset(&again, 0, sizeof again);
        again.struct_size = sizeof again;
        check_code("task_init of task 1 twice -> RPMI_ERR_STATE", plugin->task_init(inst, 1, &again), RPMI_ERR_STATE,
                   NULL);
#if CAN_ATTACH
        if (plugin_revision >= 4) {
            /* A connection the host makes: task_env, then task_attach, which takes the fd whatever it returns. */
            int sv[2];
            check_code("task_attach with a negative fd -> RPMI_ERR_INVALID", plugin->task_attach(inst, 0, -1),
                       RPMI_ERR_INVALID, NULL);
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
                check_code("task_attach before task_env -> RPMI_ERR_STATE", plugin->task_attach(inst, 0, sv[0]),
                           RPMI_ERR_STATE, NULL);
                check(fcntl(sv[0], F_GETFD) < 0 && errno == EBADF, "  ... and the fd is closed", NULL);
                close(sv[1]);
            }
            rpmi_task_env own;
            memset(&own, 0, sizeof own);
            own.struct_size = sizeof own;
            check_code("task_env of task 0 -> RPMI_OK", plugin->task_env(inst, 0, &own), RPMI_OK, NULL);
            int has_fd = 0;
            for (size_t i = 0; i < own.env_count; i++)
                has_fd |= strncmp(own.env[i], "PMI_FD=", 7) == 0;
            check(own.child_fd == -1 && !has_fd && own.env_count > 0, "  ... no fd made, no PMI_FD in env", NULL);
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
                check_code("task_attach of task 0 -> RPMI_OK", plugin->task_attach(inst, 0, sv[0]), RPMI_OK, NULL);
                close(sv[1]);
            }
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
                check_code("task_attach of task 0 twice -> RPMI_ERR_STATE", plugin->task_attach(inst, 0, sv[0]),
                           RPMI_ERR_STATE, NULL);
                close(sv[1]);
            }
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
                check_code("task_attach of task 5 -> RPMI_ERR_INVALID", plugin->task_attach(inst, 5, sv[0]),
                           RPMI_ERR_INVALID, NULL);
                close(sv[1]);
            }
        }
#endif
        check_code("task_forked of task 1 -> RPMI_OK", plugin->task_forked(inst, 1), RPMI_OK, NULL);
        last_log[0] = '\0';
        check_code("progress in thread mode -> RPMI_ERR_STATE", plugin->progress(inst), RPMI_ERR_STATE, NULL);
        check_logged();
        check_code("service_complete with no request pending -> RPMI_ERR_STATE",
                   plugin->service_complete(inst, 0, RPMI_OK, NULL), RPMI_ERR_STATE, NULL);
        check_logged();
        check_code("service_complete for local task 7 of 2 -> RPMI_ERR_INVALID",
                   plugin->service_complete(inst, 7, RPMI_OK, NULL), RPMI_ERR_INVALID, NULL);
        {
            struct failing_call call = {.instance = inst, .rc = RPMI_OK, .logged = 0};
            pthread_t helper;
            int started = pthread_create(&helper, NULL, fail_on_own_thread, &call) == 0;
            if (started)
                pthread_join(helper, NULL);
            watch_log_of_this_thread();
            check_code("service_complete with no request pending, on a host thread of its own -> RPMI_ERR_STATE",
                       started ? call.rc : RPMI_OK, RPMI_ERR_STATE, NULL);
            check(call.logged, "  ... and its reason reached log on that thread, before the call returned", NULL);
        }
        check_code("collective_complete with NULL parts but nparts 1 -> RPMI_ERR_INVALID",
                   plugin->collective_complete(inst, RPMI_OK, NULL, 1, NULL), RPMI_ERR_INVALID, NULL);
        check_code("task_exit of task 1 -> RPMI_OK", plugin->task_exit(inst, 1, 0), RPMI_OK, NULL);
        plugin->destroy(inst);
        check(1, "destroy returned", NULL);
    }

    /* An instance in event-loop mode: watch_fd comes during create, with the instance create returns. */
    {
        rpmi_host_ops ev = ops;
        ev.watch_fd = stub_watch;
        inst = NULL;
        rc = plugin->create(&good, &ev, &inst, err, sizeof err);
        check_code("create with watch_fd (event-loop mode) -> RPMI_OK", rc, RPMI_OK, rc == RPMI_OK ? NULL : err);
        if (rc == RPMI_OK && inst) {
            check(watched_fd >= 0 && watched_instance == inst, "  ... watch_fd was called with the instance and an fd",
                  NULL);
            check_code("progress in event-loop mode with nothing to do -> RPMI_OK", plugin->progress(inst), RPMI_OK,
                       NULL);
            plugin->destroy(inst);
        }
    }

    check_last_words(&good, &ops, 0);
    {
        rpmi_host_ops ev = ops;
        ev.watch_fd = stub_watch;
        check_last_words(&good, &ev, 1);
    }

    /* NULL instances. */
    {
        rpmi_task_env env;
        memset(&env, 0, sizeof env);
        env.struct_size = sizeof env;
        rpmi_buf part = {.data = NULL, .len = 0};
        check_code("task_init(NULL instance) -> RPMI_ERR_INVALID", plugin->task_init(NULL, 0, &env), RPMI_ERR_INVALID,
                   NULL);
        check_code("task_exec(NULL instance) -> RPMI_ERR_INVALID", plugin->task_exec(NULL, 0), RPMI_ERR_INVALID, NULL);
        check_code("task_forked(NULL instance) -> RPMI_ERR_INVALID", plugin->task_forked(NULL, 0), RPMI_ERR_INVALID,
                   NULL);
        check_code("task_exit(NULL instance) -> RPMI_ERR_INVALID", plugin->task_exit(NULL, 0, 0), RPMI_ERR_INVALID,
                   NULL);
        check_code("progress(NULL instance) -> RPMI_ERR_INVALID", plugin->progress(NULL), RPMI_ERR_INVALID, NULL);
        check_code("collective_complete(NULL instance) -> RPMI_ERR_INVALID",
                   plugin->collective_complete(NULL, RPMI_OK, &part, 1, NULL), RPMI_ERR_INVALID, NULL);
        check_code("service_complete(NULL instance) -> RPMI_ERR_INVALID",
                   plugin->service_complete(NULL, 0, RPMI_OK, NULL), RPMI_ERR_INVALID, NULL);
        plugin->destroy(NULL);
        check(1, "destroy(NULL instance) returned", NULL);
    }

    printf("%s: %d check%s failed\n", checks_failed ? "FAIL" : "ok", checks_failed, checks_failed == 1 ? "" : "s");
    return checks_failed ? 1 : 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * main */

int main(int argc, char **argv) {
    int event_loop_mode = 0;
    uint32_t n = 0, nnodes = 1, spawned = 0;
    int i = 1;
    main_thread = pthread_self();
    if (argc == 3 && strcmp(argv[1], "--check-errors") == 0)
        return check_errors(argv[2]);
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (strcmp(argv[i], "--event-loop") == 0) {
            event_loop_mode = 1;
#if CAN_ATTACH
        } else if (strcmp(argv[i], "--attach") == 0) {
            attach = 1;
#endif
#if CAN_CARRY
        } else if (strcmp(argv[i], "--shells") == 0) {
            carry = 1;
#endif
        } else if (strcmp(argv[i], "--nodes") == 0) {
            nnodes = count_arg("--nodes", i + 1 < argc ? argv[++i] : NULL);
        } else if (strcmp(argv[i], "-n") == 0) {
            n = count_arg("-n", i + 1 < argc ? argv[++i] : NULL);
#ifdef RPMI_ABI_REVISION
        } else if (strcmp(argv[i], "--spawned") == 0) { /* started by a host for a spawned job: the header */
            spawned = count_arg("--spawned", i + 1 < argc ? argv[++i] : NULL);
#endif
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            fputs(usage, stdout);
            return 0;
        } else {
            fprintf(stderr, "host: unknown option '%s'\n%s", argv[i], usage);
            return 2;
        }
    }
    self.argv0 = argv[0];
    self.event_loop = event_loop_mode;
    self.nnodes = nnodes;
    int e = pthread_sigmask(SIG_SETMASK, NULL, &self.sigmask);
    if (e)
        die("pthread_sigmask: %s", strerror(e));
#ifdef RPMI_ABI_REVISION
    if (spawned) {
        if (n || argc - i != 1) {
            fputs(usage, stderr);
            return 2;
        }
        self.plugin_path = argv[i];
        load_plugin(argv[i]);
        return run_spawned(event_loop_mode, nnodes, (int)spawned) & 0xff;
    }
#endif
    if (n == 0 || argc - i < 2 || spawned) {
        fputs(usage, stderr);
        return 2;
    }
    if (nnodes > n) {
        fprintf(stderr, "host: %u tasks cannot fill %u nodes\n", (unsigned)n, (unsigned)nnodes);
        return 2;
    }
    self.plugin_path = argv[i];
    load_plugin(argv[i]);
#if CAN_ATTACH
    if (attach && (plugin_revision < 4 || !plugin->task_env || !plugin->task_attach))
        die("--attach needs a plugin of ABI revision 4 or later (this one is revision %u)", (unsigned)plugin_revision);
#endif
#if CAN_CARRY
    if (carry && (plugin_revision < 5 || !plugin->shell_message))
        die("--shells needs a plugin of ABI revision 5 or later (this one is revision %u)", (unsigned)plugin_revision);
#endif
    struct app app;
    memset(&app, 0, sizeof app);
    app.n = n;
    app.exec = find_program(argv[i + 1], NULL, NULL);
    if (!app.exec)
        die("%s: not found, or not executable", argv[i + 1]);
    app.argv = argv + i + 1;
    struct job_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.apps = &app;
    spec.napps = 1;
    spec.size = n;
    spec.spawner = -1;
    int status = run_job(event_loop_mode, nnodes, &spec);
    free(app.exec);
    return status & 0xff;
}
