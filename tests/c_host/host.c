/* host.c: a minimal job-shell host for rpmi, written in plain C99 against plugin-spec/rpmi_plugin.h alone.
 *
 * It is the proof that a C resource manager can use the header as written: it loads the plugin with dlopen,
 * runs N tasks of PROGRAM over M virtual nodes (one plugin instance per node, ranks dealt in blocks), does
 * the collective between the nodes in-process, and ends the job when a task aborts or fails.
 *
 *   host [--event-loop] [--nodes M] -n N PLUGIN.so PROGRAM [ARGS...]
 *   host --check-errors PLUGIN.so
 *
 * Thread mode (the default) lets each instance run its own progress thread; the main thread only reaps
 * tasks. --event-loop gives the plugin a watch_fd callback instead: the main thread polls every instance's
 * fd and a SIGCHLD self-pipe, and calls progress() and reaps tasks in one loop.
 *
 * --check-errors feeds the plugin bad input and checks that the documented error codes come back.
 *
 * Exit status: the code of an abort if the job was aborted, else the first failing task's (128+signal for a
 * task killed by a signal), else 0. The host's own failures exit 2 (bad usage) or 1. At the end of a job it
 * says on which threads the plugin called collective, abort and log: the main thread (which reaps tasks, and
 * in event-loop mode calls progress and destroy) or others (the plugin's progress threads).
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static const char usage[] = "usage: host [--event-loop] [--nodes M] -n N PLUGIN.so PROGRAM [ARGS...]\n"
                            "       host --check-errors PLUGIN.so\n";

/* The plugin's table, for the life of the process. */
static const rpmi_plugin *plugin;

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
    if (t->struct_size < sizeof(rpmi_plugin))
        die("%s: its plugin table has %u bytes, this host needs %zu", path, (unsigned)t->struct_size,
            sizeof(rpmi_plugin));
    if (!t->create || !t->task_init || !t->task_exec || !t->task_forked || !t->task_exit || !t->progress ||
        !t->collective_complete || !t->service_complete || !t->destroy)
        die("%s: its plugin table lacks functions of ABI version %d", path, RPMI_ABI_VERSION);
    plugin = t;
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

struct task {
    uint32_t node, local;
    pid_t pid; /* 0: not started, or reaped */
};

static struct {
    pthread_mutex_t lock; /* guards everything below that other threads touch */
    struct node *nodes;
    uint32_t nnodes;
    uint32_t contributions; /* nodes that have contributed to the collective in progress */
    struct task *tasks;
    uint32_t ntasks;
    int ending;     /* the job is ending: no more tasks start, every task is killed */
    int aborted;    /* an abort came; abort_code is the job's exit status */
    int abort_code;
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

/* How many callbacks (collective, abort, log) ran on the main thread, and on others. */
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

/* With job.lock held: end the job, killing every task. A task not yet reaped is at worst a zombie, whose pid
 * cannot have been reused (tasks are reaped under the lock). */
static void end_job_locked(void) {
    job.ending = 1;
    for (uint32_t r = 0; r < job.ntasks; r++)
        if (job.tasks[r].pid > 0)
            kill(job.tasks[r].pid, SIGKILL);
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

static rpmi_host_ops host_ops(struct node *node, int event_loop) {
    rpmi_host_ops ops;
    memset(&ops, 0, sizeof ops); /* publish, unpublish, lookup and spawn: not supported */
    ops.struct_size = sizeof ops;
    ops.abi_version = RPMI_ABI_VERSION;
    ops.host_data = node;
    ops.collective = on_collective;
    ops.abort = on_abort;
    ops.log = on_log;
    ops.watch_fd = event_loop ? on_watch_fd : NULL;
    return ops;
}

/* ---------------------------------------------------------------------------------------------------------
 * Starting tasks. */

/* PROGRAM as execve wants it: found on PATH now, so that the child, a fork of a multi-threaded process,
 * only has to call async-signal-safe functions. */
static char *find_program(const char *name) {
    if (strchr(name, '/'))
        return strdup(name);
    const char *path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/local/bin:/usr/bin:/bin";
    size_t nlen = strlen(name);
    for (const char *p = path;; p++) {
        const char *end = strchr(p, ':');
        size_t dlen = end ? (size_t)(end - p) : strlen(p);
        char *candidate = xcalloc(dlen + nlen + 3, 1);
        snprintf(candidate, dlen + nlen + 3, "%.*s%s%s", (int)dlen, p, dlen ? "/" : "./", name);
        struct stat st;
        if (stat(candidate, &st) == 0 && S_ISREG(st.st_mode) && access(candidate, X_OK) == 0)
            return candidate;
        free(candidate);
        if (!end)
            return NULL;
        p = end;
    }
}

/* The task's environment: the host's, with the plugin's "NAME=value" strings added or replacing. The
 * strings are borrowed (from environ and the plugin's rpmi_task_env); only the array is allocated. */
static char **task_environment(const rpmi_task_env *env) {
    size_t n = 0;
    while (environ[n])
        n++;
    char **envp = xcalloc(n + env->env_count + 1, sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(environ[i], '=');
        size_t name_len = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
        int replaced = 0;
        for (size_t j = 0; j < env->env_count && !replaced; j++)
            replaced = strncmp(env->env[j], environ[i], name_len) == 0 && env->env[j][name_len] == '=';
        if (!replaced)
            envp[k++] = environ[i];
    }
    for (size_t j = 0; j < env->env_count; j++)
        envp[k++] = (char *)env->env[j];
    envp[k] = NULL;
    return envp;
}

/* In the child: write a message with async-signal-safe calls only. */
static void child_say(const char *a, const char *b) {
    ssize_t ignored = write(2, a, strlen(a));
    ignored = write(2, b, strlen(b));
    ignored = write(2, "\n", 1);
    (void)ignored;
}

/* Starts rank `rank`: task_init, fork, task_exec and execve in the child, task_forked in the parent.
 * Returns 0 if the task runs (if task_forked failed, the job is ending), or -1 after saying why it does not. */
static int start_task(uint32_t rank, const char *program, char **argv) {
    struct task *t = &job.tasks[rank];
    rpmi_instance *instance = job.nodes[t->node].instance;
    rpmi_task_env env;
    memset(&env, 0, sizeof env);
    env.struct_size = sizeof env;
    env.child_fd = -1;
    int rc = plugin->task_init(instance, t->local, &env);
    if (rc != RPMI_OK) {
        fprintf(stderr, "host: task_init for rank %u failed: %s (%d)\n", (unsigned)rank, code_name(rc), rc);
        return -1;
    }
    if (env.env_count && !env.env) {
        fprintf(stderr, "host: task_init for rank %u gave %zu variables but no array\n", (unsigned)rank,
                env.env_count);
        return -1;
    }
    char **envp = task_environment(&env);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (plugin->task_exec(instance, t->local) != RPMI_OK) {
            child_say("host: task_exec failed; not starting ", program);
            _exit(127);
        }
        execve(program, argv, envp);
        child_say("host: cannot execute ", program);
        _exit(127);
    }
    int fork_errno = errno;
    free(envp);
    /* Parent: the host's copy of the task's end is closed whether or not the fork worked. */
    rc = plugin->task_forked(instance, t->local);
    if (rc != RPMI_OK)
        fprintf(stderr, "host: task_forked for rank %u failed: %s (%d)\n", (unsigned)rank, code_name(rc), rc);
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

/* Reaps `pid` (known to have exited) and tells its instance. */
static void reap(pid_t pid) {
    int status = 0;
    lock();
    pid_t got = waitpid(pid, &status, 0);
    uint32_t rank = job.ntasks;
    if (got == pid) {
        for (uint32_t r = 0; r < job.ntasks; r++) {
            if (job.tasks[r].pid == pid) {
                job.tasks[r].pid = 0;
                rank = r;
            }
        }
    }
    int ending = job.ending;
    unlock();
    if (got != pid) {
        fprintf(stderr, "host: waitpid(%ld): %s\n", (long)pid, strerror(errno));
        return;
    }
    if (rank == job.ntasks)
        return; /* not a task of ours */
    tasks_left--;
    struct task *t = &job.tasks[rank];
    int rc = plugin->task_exit(job.nodes[t->node].instance, t->local, status);
    if (rc != RPMI_OK)
        fprintf(stderr, "host: task_exit for rank %u failed: %s (%d)\n", (unsigned)rank, code_name(rc), rc);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
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

static int run_job(int event_loop_mode, uint32_t n, uint32_t nnodes, const char *plugin_path, char **program_argv) {
    load_plugin(plugin_path);
    char *program = find_program(program_argv[0]);
    if (!program)
        die("%s: not found on PATH", program_argv[0]);

    /* Ranks over nodes in blocks, as even as can be, the first nodes taking one more. */
    job.nnodes = nnodes;
    job.ntasks = n;
    job.nodes = xcalloc(nnodes, sizeof *job.nodes);
    job.tasks = xcalloc(n, sizeof *job.tasks);
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
            job.tasks[rank] = (struct task){.node = i, .local = l, .pid = 0};
        }
    }

    char hostname[256];
    if (gethostname(hostname, sizeof hostname) != 0)
        strcpy(hostname, "localhost");
    hostname[sizeof hostname - 1] = '\0';
    const char **hostnames = xcalloc(nnodes, sizeof *hostnames);
    for (uint32_t i = 0; i < nnodes; i++)
        hostnames[i] = hostname;
    char job_id[32];
    snprintf(job_id, sizeof job_id, "chost%ld", (long)getpid());

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
        info.options_json = NULL;
        info.appnum = 0;
        info.universe_size = 0;
        info.spawned = 0;
        rpmi_host_ops ops = host_ops(nd, event_loop_mode);
        rpmi_instance *instance = NULL;
        char err[512] = "";
        int rc = plugin->create(&info, &ops, &instance, err, sizeof err);
        if (rc != RPMI_OK)
            die("create for node %u failed: %s (%d): %s", (unsigned)i, code_name(rc), rc, err);
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
        if (start_task(rank, program, program_argv) != 0) {
            if (first_failure == 0)
                first_failure = 1;
            lock();
            end_job_locked();
            unlock();
            break;
        }
        tasks_left++;
    }

    if (event_loop_mode)
        event_loop();
    else
        wait_thread_mode();

    for (uint32_t i = 0; i < nnodes; i++)
        plugin->destroy(job.nodes[i].instance);
    fprintf(stderr, "host: callbacks on the main thread: %lu, on other threads: %lu\n", callbacks_on_main,
            callbacks_elsewhere);

    int status = job.aborted ? job.abort_code : first_failure;
    for (uint32_t i = 0; i < nnodes; i++) {
        free(job.nodes[i].local_ranks);
        free(job.nodes[i].data);
    }
    free(job.nodes);
    free(job.tasks);
    free(task_map);
    free(hostnames);
    free(program);
    return status;
}

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
    uint32_t n = 0, nnodes = 1;
    int i = 1;
    main_thread = pthread_self();
    if (argc == 3 && strcmp(argv[1], "--check-errors") == 0)
        return check_errors(argv[2]);
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (strcmp(argv[i], "--event-loop") == 0) {
            event_loop_mode = 1;
        } else if (strcmp(argv[i], "--nodes") == 0) {
            nnodes = count_arg("--nodes", i + 1 < argc ? argv[++i] : NULL);
        } else if (strcmp(argv[i], "-n") == 0) {
            n = count_arg("-n", i + 1 < argc ? argv[++i] : NULL);
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            fputs(usage, stdout);
            return 0;
        } else {
            fprintf(stderr, "host: unknown option '%s'\n%s", argv[i], usage);
            return 2;
        }
    }
    if (n == 0 || argc - i < 2) {
        fputs(usage, stderr);
        return 2;
    }
    if (nnodes > n) {
        fprintf(stderr, "host: %u tasks cannot fill %u nodes\n", (unsigned)n, (unsigned)nnodes);
        return 2;
    }
    return run_job(event_loop_mode, n, nnodes, argv[i], argv + i + 1) & 0xff;
}
