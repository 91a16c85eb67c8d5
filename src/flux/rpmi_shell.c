/* rpmi_shell.c: the Flux job-shell plugin that serves a job's PMI with rpmi. It loads librpmi.so through the
 * job-shell ABI (plugin-spec/rpmi_plugin.h) and knows nothing of rpmi beyond that header: the instance runs in
 * event-loop mode on the shell's reactor, and the plugin is its host.
 *
 * Enabled by `-o pmi=rpmi` (a comma-separated list; Flux's own PMI server is then off, and naming both is an
 * error, since both would set PMI_FD). `-o rpmi.KEY=VALUE` options go to rpmi (plugin-spec/README.md,
 * "Options").
 *
 * Connections. Flux closes every fd of a task but its own channels in the child, before the task.exec hook
 * runs, so a socketpair made by rpmi in task.init never reaches the task; and a Flux channel's other end is
 * Flux's, not an fd rpmi could serve. So each task connects itself: in task.exec (the child, just before
 * exec) it connects to a Unix socket this shell listens on, in a directory of its own that only the job's
 * user can enter, and the shell hands the accepted end to rpmi (ABI revision 4: task_env, task_attach), which
 * serves it in its own epoll like any connection it makes. The shell knows which task connected from the
 * peer's pid (SO_PEERCRED), which is the task's own. PMI_FD names a number the shell holds open, on
 * /dev/null, from task.init until the fork: no fd Flux makes for the task in between can take it, and in the
 * child, where Flux has closed it, the connection is moved there.
 *
 * The exchanges among the job's shells are rpmi's (ABI revision 5): its instances run the tree or Bruck's
 * allgather, PMI 1.2's group barriers and the failure reports themselves, and this plugin only carries their
 * messages from shell to shell, as requests without a response to the other shell's broker, where its shell
 * holds the job's service: the topic "rpmi-msg.FROM.KIND" names the sending shell and the message's kind, and
 * the payload is the message itself, so that a message goes out with the one copy Flux makes of it. Flux delivers the
 * messages of one sender to one service in order. Aborts go to shell 0 ("rpmi-abort"), which raises the job's
 * one exception: the tasks that die as the job is killed raise nothing of their own, and the exception names
 * the cause.
 *
 * Trust. Flux lets any user of the instance reach a shell's service, and a process of the job's user (a task
 * has FLUX_URI) sends with the same credentials as a shell, whatever its message says. What it cannot forge
 * is the end of its request's route stack: the broker it is connected to pushes its connection's uuid there,
 * after whatever the sender put, and the brokers on the way push theirs (flux-core's librouter/router.c,
 * connector_interthread.c, overlay.c). So a request's route stack equals that of another only if both came
 * over the same connection, and a shell knows another by the route of one request proven that shell's. Before
 * a shell's first message to another it knocks ("rpmi-knock", with a random challenge, which only the other
 * shell's service receives); the other sends it a random nonce and the challenge ("rpmi-hello", to the
 * claimed shell's broker, where only that shell holds the job's service), and it sends the nonce back
 * ("rpmi-join"): the request that carries it gives its route. Messages wait until the join is taken. A hello
 * is taken only with the challenge of this shell's knock, one join at a time, so a task can neither make a
 * shell send a join nor take one: a knock or hello it forges is refused, or sends a nonce only to the shell
 * the knock names. A message, an abort or (shell 0) a hold is taken
 * only over the route of the shell it claims to be from; any other is refused and logged, and is no concern of the
 * job. What a shell's messages say, rpmi checks. A shell that cannot be reached (its knock or join fails for
 * good, or Flux says it is lost) is reported to rpmi (shell_lost), which ends the job unless it said it was
 * done.
 *
 * Lifetimes. A shell stays open while messages wait for another shell's join, and shell 0 until every rank of
 * the job has left (rpmi's job_done): the other shells need its part of the tree, the group barriers and the
 * names it holds. A shell that spawned jobs stays open until each is clean, and shell 0 until every job the
 * other shells spawned is too (see "Spawn" below): the first job's shell 0, which holds the names of every
 * job spawned from it (see "Names across jobs"), outlives the whole launch.
 */
#define _GNU_SOURCE /* accept4, struct ucred */
#define FLUX_SHELL_PLUGIN_NAME "rpmi"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <flux/core.h>
#include <flux/idset.h>
#include <flux/shell.h>
#include <flux/taskmap.h>
#include <jansson.h>

#include "rpmi_plugin.h"

/* Where librpmi.so is; docker/flux.sh sets it to where it installs the library. */
#ifndef RPMI_LIBRARY
#define RPMI_LIBRARY "librpmi.so"
#endif

/* A hello's nonce: 128 random bits in hex. */
#define NONCE_LEN 33
/* How long a shell waits for another to answer the knock of a message or to take its join: a shell that has
 * just exited may leave a request unanswered, and the messages for it are then dropped (rpmi is told). */
#define REACH_TIMEOUT 10.0


struct task {
    flux_shell_task_t *task; /* NULL until task.init, and after task.exit */
    uint32_t local, rank;
    int reserved_fd; /* from task.init to task.fork: holds the number PMI_FD names (see task_exec) */
    int attached;    /* its connection is rpmi's */
};

/* A message waiting for its shell's join to be taken. */
struct queued {
    struct queued *next;
    size_t len;
    uint8_t kind;
    uint8_t bytes[];
};

/* Another shell of the job, as this one knows it. */
struct link {
    /* Its messages to this shell: */
    char nonce[NONCE_LEN];  /* sent in the hello, that only its join carries back */
    char challenge[NONCE_LEN]; /* sent in this shell's knock, that only its hello carries back */
    const flux_msg_t *join; /* its join: its route is the shell's */
    /* This shell's messages to it: */
    int knocked;         /* it was asked for a hello, which has not been answered with a join yet */
    int joining;         /* this shell's join is on its way to it */
    int joined;          /* it took this shell's join: messages go at once */
    int lost;            /* it cannot be reached: its messages are dropped */
    struct queued *head, *tail;
};

struct rpmi_flux {
    flux_shell_t *shell;
    flux_t *h;
    const rpmi_plugin *plugin;
    rpmi_instance *inst;
    flux_watcher_t *watch;
    /* Where the tasks connect, in a directory of this shell's own (mode 0700). */
    char socket_dir[96];
    struct sockaddr_un socket_addr;
    int listen_fd;
    flux_watcher_t *accept_w;
    char topic_prefix[128]; /* "<shell service>." */
    uint32_t rank, nshells, ntasks;
    int *broker_rank; /* by shell rank */
    struct link *links; /* by shell rank */
    struct task *tasks;
    uint32_t local_count;
    /* The task being started: the shell runs task.init, forks and runs task.fork for one task at a time. */
    struct task *starting;
    int failed; /* the job is ending: this shell raised, or sent shell 0, its one abort */
    int stopped; /* progress failed: the instance serves nothing more, and is not called again */
    int ending;  /* the shell is ending: the instance is being destroyed, and nothing new starts */
    int holding_job; /* shell 0: the shell stays open for the others until rpmi's job_done */
    /* Spawns: */
    struct spawn *spawns; /* the jobs this shell's tasks spawned, until each is clean */
    unsigned spawn_count, spawn_seq;
    flux_jobid_t id;     /* this job's */
    flux_jobid_t parent; /* a spawned job's spawner, else 0 */
    /* Where the names of the launch are (the first job's shell 0): a spawned job's requests go there. */
    char names_topic[160];
    int names_rank;
    struct name_request *names_waiting; /* shell 0 of the first job: requests from other jobs, until served */
    unsigned names_waiting_count;
    uint64_t names_seq;
    struct name_ask *names_asked; /* a spawned job: its tasks' requests, until answered */
    struct hold *holds; /* shell 0: the jobs the other shells spawned, followed until each is clean */
    unsigned hold_count;
    json_t *commands; /* a spawned job of several commands: each one's argv and process count */
    flux_future_t *parent_watch; /* shell 0 of a spawned job: the spawner's eventlog */
};

/* ---------------------------------------------------------------------------------------------------------
 * Failing the job. */

static void release_queue(struct rpmi_flux *ctx, uint32_t shell, int send);
static void cancel_unstarted(struct rpmi_flux *ctx, uint32_t task);
static void send_holds(struct rpmi_flux *ctx);

/* The other shells need nothing more of shell 0. */
static void release_job(struct rpmi_flux *ctx) {
    if (ctx->holding_job) {
        ctx->holding_job = 0;
        flux_shell_remove_completion_ref(ctx->shell, "rpmi-job");
    }
}

/* The job is ending: what waits for other shells is dropped, so that this shell may end. */
static void drop_queues(struct rpmi_flux *ctx) {
    for (uint32_t s = 0; ctx->links && s < ctx->nshells; s++)
        release_queue(ctx, s, 0);
    release_job(ctx);
    cancel_unstarted(ctx, UINT32_MAX);
}

/* Ends the job with a fatal exception (the shell's tasks are killed; the first exception is what Flux reports). */
static void fail_job(struct rpmi_flux *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail_job(struct rpmi_flux *ctx, const char *fmt, ...) {
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    shell_log_error("%s", text);
    if (!ctx->failed) {
        ctx->failed = 1;
        flux_shell_raise("exec", 0, "rpmi: %s", text);
        drop_queues(ctx);
    }
}

/* Fills `out` (NONCE_LEN bytes) with 128 random bits in hex; -1 if the system gives none. */
static int random_hex(char out[NONCE_LEN]) {
    uint8_t bytes[(NONCE_LEN - 1) / 2];
    if (getrandom(bytes, sizeof bytes, 0) != (ssize_t)sizeof bytes)
        return -1;
    for (size_t i = 0; i < sizeof bytes; i++)
        snprintf(out + 2 * i, 3, "%02x", bytes[i]);
    return 0;
}

/* Refuses a request that is not from whom it claims to be, and says so in the shell's log: the job goes on. */
static void refuse(struct rpmi_flux *ctx, const flux_msg_t *msg, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void refuse(struct rpmi_flux *ctx, const flux_msg_t *msg, int errnum, const char *fmt, ...) {
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (!flux_msg_is_noresponse(msg))
        flux_respond_error(ctx->h, msg, errnum, text);
    shell_log_error("shell %u refused %s", (unsigned)ctx->rank, text);
}

/* Did `msg` come over the connection `join` came over? Their whole route stacks are equal only then (see the
 * top of this file); a request without one names no sender, and is taken from no one. */
static int same_route(const flux_msg_t *msg, const flux_msg_t *join) {
    int n = flux_msg_route_count(msg);
    if (n < 0 || n != flux_msg_route_count(join))
        return 0;
    flux_msg_t *a = flux_msg_copy(msg, false), *b = flux_msg_copy(join, false);
    int same = a && b;
    for (; same && n > 0; n--) {
        const char *x = flux_msg_route_last(a), *y = flux_msg_route_last(b);
        same = x && y && strcmp(x, y) == 0 && flux_msg_route_delete_last(a) == 0 && flux_msg_route_delete_last(b) == 0;
    }
    flux_msg_destroy(a);
    flux_msg_destroy(b);
    return same;
}

/* Shell `shell`, if `msg` came over its route; else NULL and why. */
static struct link *sent_by(struct rpmi_flux *ctx, const flux_msg_t *msg, int64_t shell, const char **why) {
    struct link *l = shell >= 0 && shell < ctx->nshells && shell != ctx->rank ? &ctx->links[shell] : NULL;
    if (!l)
        *why = "not another shell of the job";
    else if (!l->join || !same_route(msg, l->join))
        *why = "not sent by that shell";
    else
        return l;
    return NULL;
}

static void topic(const struct rpmi_flux *ctx, char *out, size_t len, const char *name) {
    snprintf(out, len, "%s%s", ctx->topic_prefix, name);
}

/* ---------------------------------------------------------------------------------------------------------
 * Carrying rpmi's messages, and knowing who sent them. */

static void send_now(struct rpmi_flux *ctx, uint32_t shell, uint8_t kind, const uint8_t *bytes, size_t len) {
    char method[64], t[192];
    snprintf(method, sizeof method, "rpmi-msg.%u.%u", (unsigned)ctx->rank, (unsigned)kind);
    topic(ctx, t, sizeof t, method);
    flux_future_t *f = flux_rpc_raw(ctx->h, t, bytes, len, ctx->broker_rank[shell], FLUX_RPC_NORESPONSE);
    if (!f)
        fail_job(ctx, "shell %u cannot send shell %u a message: %s", (unsigned)ctx->rank, (unsigned)shell,
                 strerror(errno));
    flux_future_destroy(f);
}

struct join_ctx {
    struct rpmi_flux *ctx;
    uint32_t shell;
};

/* The messages that wait for shell `shell` go (`send`), or are dropped; the shell may end once none wait. */
static void release_queue(struct rpmi_flux *ctx, uint32_t shell, int send) {
    struct link *l = &ctx->links[shell];
    struct queued *q = l->head;
    if (!q)
        return;
    /* Taken off first: a send that fails ends the job, which drops every queue, this one included. */
    l->head = l->tail = NULL;
    for (struct queued *next; q; q = next) {
        next = q->next;
        if (send)
            send_now(ctx, shell, q->kind, q->bytes, q->len);
        free(q);
    }
    flux_shell_remove_completion_ref(ctx->shell, "rpmi-%u", (unsigned)shell);
}

/* Shell `shell` cannot be reached: what waited for it is dropped, and rpmi is told, which ends the job unless
 * that shell said it was done. */
static void lose(struct rpmi_flux *ctx, uint32_t shell, const char *why) {
    struct link *l = &ctx->links[shell];
    if (l->lost)
        return;
    l->lost = 1;
    shell_debug("shell %u cannot reach shell %u: %s", (unsigned)ctx->rank, (unsigned)shell, why);
    release_queue(ctx, shell, 0);
    if (ctx->inst)
        ctx->plugin->shell_lost(ctx->inst, shell);
}

static void knocked_cb(flux_future_t *f, void *arg) {
    struct join_ctx *j = arg;
    if (flux_future_get(f, NULL) < 0)
        lose(j->ctx, j->shell, future_strerror(f, errno));
    flux_future_destroy(f);
    free(j);
}

/* Asks shell `shell` for a hello, once, waiting at most `timeout` seconds (negative: as long as it takes) for
 * its answer. */
static void knock(struct rpmi_flux *ctx, uint32_t shell, double timeout) {
    struct link *l = &ctx->links[shell];
    if (l->knocked || l->joined || l->lost)
        return;
    l->knocked = 1;
    if (random_hex(l->challenge) < 0) {
        fail_job(ctx, "cannot make a challenge: %s", strerror(errno));
        return;
    }
    char t[192];
    topic(ctx, t, sizeof t, "rpmi-knock");
    struct join_ctx *j = malloc(sizeof *j);
    flux_future_t *f = j ? flux_rpc_pack(ctx->h, t, ctx->broker_rank[shell], 0, "{s:i s:s}", "shell", (int)ctx->rank,
                                         "challenge", l->challenge)
                         : NULL;
    /* The reactor's clock is brought up to date first: it may not have run since the shell started. */
    flux_reactor_now_update(flux_get_reactor(ctx->h));
    if (!f || flux_future_then(f, timeout, knocked_cb, j) < 0) {
        flux_future_destroy(f);
        free(j);
        fail_job(ctx, "shell %u cannot knock at shell %u: %s", (unsigned)ctx->rank, (unsigned)shell, strerror(errno));
        return;
    }
    *j = (struct join_ctx){.ctx = ctx, .shell = shell};
}

static void hello_sent_cb(flux_future_t *f, void *arg) {
    struct rpmi_flux *ctx = arg;
    if (flux_future_get(f, NULL) < 0)
        shell_debug("shell %u cannot send a hello: %s", (unsigned)ctx->rank, future_strerror(f, errno));
    flux_future_destroy(f);
}

/* rpmi_host_ops.shell_send: at once to a shell that took this one's join, else queued until it does. */
static int on_shell_send(void *host_data, rpmi_instance *instance, uint32_t shell, uint8_t kind,
                         const uint8_t *message, size_t len) {
    struct rpmi_flux *ctx = host_data;
    (void)instance;
    if (shell >= ctx->nshells || shell == ctx->rank || len > SIZE_MAX - sizeof(struct queued))
        return RPMI_ERR_INVALID;
    struct link *l = &ctx->links[shell];
    if (l->joined) {
        send_now(ctx, shell, kind, message, len);
        return RPMI_OK;
    }
    /* Once the job is ending, a shell not reached yet need not be; one lost takes nothing. A goodbye is not
     * worth waiting to reach a shell not reached yet: that shell may be ending too, and the wait would hold up
     * the job's end. */
    if (ctx->failed || l->lost || (kind & RPMI_SHELL_GOODBYE))
        return RPMI_OK;
    struct queued *q = malloc(sizeof *q + len);
    if (!q)
        return RPMI_ERR_SYSTEM;
    q->next = NULL;
    q->kind = kind;
    q->len = len;
    if (len)
        memcpy(q->bytes, message, len);
    /* The shell does not end while messages wait: a goodbye, or a rank's leaving, must reach the others. */
    if (l->tail)
        l->tail->next = q;
    else if (flux_shell_add_completion_ref(ctx->shell, "rpmi-%u", (unsigned)shell) >= 0)
        l->head = q;
    else {
        free(q);
        return RPMI_ERR_SYSTEM;
    }
    l->tail = q;
    knock(ctx, shell, REACH_TIMEOUT);
    return RPMI_OK;
}

/* The other shell took this one's join: what waited goes, in order. */
static void joined_cb(flux_future_t *f, void *arg) {
    struct join_ctx *j = arg;
    struct rpmi_flux *ctx = j->ctx;
    struct link *l = &ctx->links[j->shell];
    l->joining = 0;
    if (flux_future_get(f, NULL) == 0) {
        l->joined = 1;
        l->knocked = 0;
        release_queue(ctx, j->shell, 1);
        if (j->shell == 0)
            send_holds(ctx);
    } else {
        lose(ctx, j->shell, future_strerror(f, errno));
    }
    flux_future_destroy(f);
    free(j);
}

/* A knock: a shell asks for a hello. Who asks cannot be told from the request, so the nonce only goes to the
 * shell it names, at its broker. */
static void knock_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    const char *challenge;
    int shell;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        flux_respond_error(h, msg, EPERM, "only the job's owner may take part in its exchange");
        return;
    }
    if (flux_request_unpack(msg, NULL, "{s:i s:s}", "shell", &shell, "challenge", &challenge) < 0 || shell < 0 ||
        (uint32_t)shell >= ctx->nshells || (uint32_t)shell == ctx->rank || strlen(challenge) != NONCE_LEN - 1) {
        refuse(ctx, msg, EPROTO, "a malformed knock");
        return;
    }
    struct link *l = &ctx->links[shell];
    if (l->join) {
        refuse(ctx, msg, EEXIST, "a knock claiming to be from shell %d: it has joined already", shell);
        return;
    }
    flux_respond(h, msg, NULL);
    /* One nonce a shell until its join is taken; a knock forged in between only sends it to the shell it names,
     * with a challenge that shell did not make, and that shell refuses the hello. */
    if (!l->nonce[0] && random_hex(l->nonce) < 0) {
        fail_job(ctx, "cannot make a nonce: %s", strerror(errno));
        return;
    }
    char t[192];
    topic(ctx, t, sizeof t, "rpmi-hello");
    flux_future_t *f = flux_rpc_pack(h, t, ctx->broker_rank[shell], 0, "{s:i s:s s:s}", "shell", (int)ctx->rank,
                                     "nonce", l->nonce, "challenge", challenge);
    if (!f || flux_future_then(f, -1., hello_sent_cb, ctx) < 0) {
        flux_future_destroy(f);
        fail_job(ctx, "shell %u cannot send shell %d its hello: %s", (unsigned)ctx->rank, shell, strerror(errno));
    }
}

/* A hello, with a nonce for the shell it names: sent back to that shell's broker only. */
static void hello_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    const char *nonce, *challenge;
    int shell;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        flux_respond_error(h, msg, EPERM, "only the job's owner may take part in its exchange");
        return;
    }
    if (flux_request_unpack(msg, NULL, "{s:i s:s s:s}", "shell", &shell, "nonce", &nonce, "challenge", &challenge) < 0 ||
        shell < 0 || (uint32_t)shell >= ctx->nshells || (uint32_t)shell == ctx->rank) {
        refuse(ctx, msg, EPROTO, "a malformed hello");
        return;
    }
    struct link *l = &ctx->links[shell];
    if (!l->knocked || strcmp(challenge, l->challenge) != 0) {
        refuse(ctx, msg, EPERM, "a hello claiming to be from shell %d: %s", shell,
               l->knocked ? "not the challenge this shell knocked with" : "this shell did not knock there");
        return;
    }
    /* A join on its way answers this hello too: the first one the shell takes decides. */
    if (l->joining) {
        flux_respond(h, msg, NULL);
        return;
    }
    char t[192];
    topic(ctx, t, sizeof t, "rpmi-join");
    struct join_ctx *j = malloc(sizeof *j);
    flux_future_t *f = j ? flux_rpc_pack(h, t, ctx->broker_rank[shell], 0, "{s:i s:s}", "shell", (int)ctx->rank,
                                         "nonce", nonce)
                         : NULL;
    flux_reactor_now_update(flux_get_reactor(h));
    if (!f || flux_future_then(f, REACH_TIMEOUT, joined_cb, j) < 0) {
        int e = errno;
        flux_future_destroy(f);
        free(j);
        flux_respond_error(h, msg, e, NULL);
        fail_job(ctx, "shell %u cannot join shell %d: %s", (unsigned)ctx->rank, shell, strerror(e));
        return;
    }
    *j = (struct join_ctx){.ctx = ctx, .shell = (uint32_t)shell};
    l->joining = 1;
    flux_respond(h, msg, NULL);
}

/* A join: taken only with the nonce sent to that shell, once. Its route is the shell's from then on. */
static void join_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    const char *nonce;
    int shell;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        flux_respond_error(h, msg, EPERM, "only the job's owner may take part in its exchange");
        return;
    }
    if (flux_request_unpack(msg, NULL, "{s:i s:s}", "shell", &shell, "nonce", &nonce) < 0) {
        refuse(ctx, msg, EPROTO, "a malformed join");
        return;
    }
    struct link *l = shell >= 0 && (uint32_t)shell < ctx->nshells && (uint32_t)shell != ctx->rank ? &ctx->links[shell]
                                                                                                 : NULL;
    if (!l || l->join || !l->nonce[0] || strcmp(nonce, l->nonce) != 0) {
        refuse(ctx, msg, EPERM, "a join claiming to be from shell %d: %s", shell,
               !l ? "not another shell of the job" : l->join ? "it has joined already" : "not the nonce it was sent");
        return;
    }
    l->join = flux_msg_incref(msg);
    flux_respond(h, msg, NULL);
}

/* A message of another shell's rpmi, taken only over that shell's route. */
static void msg_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    const void *data = NULL;
    size_t n = 0;
    const char *why = NULL;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        if (!flux_msg_is_noresponse(msg))
            flux_respond_error(h, msg, EPERM, "only the job's owner may take part in its exchange");
        return;
    }
    const char *t = NULL;
    unsigned from = 0, kind = 0;
    int end = 0;
    size_t at = strlen(ctx->topic_prefix) + strlen("rpmi-msg.");
    if (flux_request_decode_raw(msg, &t, &data, &n) < 0 || strlen(t) <= at ||
        sscanf(t + at, "%u.%u%n", &from, &kind, &end) != 2 || t[at + (size_t)end] != '\0' || kind > UINT8_MAX) {
        refuse(ctx, msg, EPROTO, "a malformed message");
        return;
    }
    if (!sent_by(ctx, msg, from, &why)) {
        refuse(ctx, msg, EPERM, "a message claiming to be from shell %u: %s", (unsigned)from, why);
        return;
    }
    /* A message rpmi cannot take (over what it holds unread) ends the job in rpmi's words. */
    int rc = ctx->plugin->shell_message(ctx->inst, from, (uint8_t)kind, data, n);
    if (rc != RPMI_OK)
        shell_log_error("shell %u could not take shell %u's message (%d)", (unsigned)ctx->rank, (unsigned)from, rc);
    else if (!flux_msg_is_noresponse(msg))
        flux_respond(h, msg, NULL);
}

/* shell.post-init: every shell holds its services now (the shells have passed their first barrier); each
 * asks shell 0 for a hello, so that its aborts go there from the start. */
static int post_init(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    struct rpmi_flux *ctx = flux_plugin_aux_get(p, "rpmi");
    (void)topic;
    (void)args;
    (void)arg;
    /* Without a time limit: shell 0 answers once its loop runs, after every shell has started its tasks. */
    if (ctx && ctx->rank != 0)
        knock(ctx, 0, -1.);
    return 0;
}

/* shell.lost: Flux says another shell of the job failed (its node crashed, say). */
static int shell_lost_cb(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    struct rpmi_flux *ctx = flux_plugin_aux_get(p, "rpmi");
    int rank = -1;
    (void)topic;
    (void)arg;
    if (!ctx || flux_plugin_arg_unpack(args, FLUX_PLUGIN_ARG_IN, "{s:i}", "shell_rank", &rank) < 0 || rank < 0 ||
        (uint32_t)rank >= ctx->nshells || (uint32_t)rank == ctx->rank)
        return 0;
    lose(ctx, (uint32_t)rank, "Flux says it is lost");
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * rpmi's other host callbacks. */

/* Shell 0: every rank of the job has left; the other shells need nothing more of this one. */
static void on_job_done(void *host_data, rpmi_instance *instance) {
    (void)instance;
    release_job(host_data);
}

/* Raises the job's one exception for an abort. The job's exit status is the abort's code (as a wait status,
 * code << 8). */
static void raise_abort(struct rpmi_flux *ctx, uint32_t rank, int exit_code, int reason, const char *message,
                        size_t len) {
    int shown = len > 900 ? 900 : (int)len;
    if (ctx->failed)
        return;
    ctx->failed = 1;
    if (reason == RPMI_ABORT_CALLED)
        flux_shell_raise_exit_status((exit_code & 0xff) << 8, "rank %u called PMI_Abort(%d)%s%.*s", (unsigned)rank,
                                     exit_code, shown ? ": " : "", shown, message);
    else
        flux_shell_raise_exit_status((exit_code & 0xff) << 8, "rpmi: %.*s", shown, message);
    drop_queues(ctx);
}

/* An abort a shell sent on to shell 0 (its text, to raise here if shell 0 cannot be reached). */
struct abort_report {
    struct rpmi_flux *ctx;
    uint32_t rank;
    int exit_code, reason;
    size_t len;
    char message[];
};

static void abort_sent_cb(flux_future_t *f, void *arg) {
    struct abort_report *a = arg;
    if (flux_future_get(f, NULL) < 0) {
        a->ctx->failed = 0;
        raise_abort(a->ctx, a->rank, a->exit_code, a->reason, a->message, a->len);
    }
    flux_future_destroy(f);
    free(a);
}

/* Every shell's aborts go to shell 0, which raises the first: the tasks that die as the job is killed then
 * raise nothing of their own, and the job's one exception names the cause. A shell that shell 0 does not know
 * yet (none of its messages went there) raises its own. */
static void on_abort(void *host_data, uint32_t rank, int32_t exit_code, int32_t reason, const char *message,
                     size_t len) {
    struct rpmi_flux *ctx = host_data;
    char topic[192];
    if (ctx->failed)
        return;
    if (ctx->rank == 0 || !ctx->links[0].joined) {
        raise_abort(ctx, rank, exit_code, reason, message, len);
        return;
    }
    ctx->failed = 1;
    struct abort_report *a = malloc(sizeof *a + len + 1);
    flux_future_t *f = NULL;
    if (a) {
        *a = (struct abort_report){.ctx = ctx, .rank = rank, .exit_code = exit_code, .reason = reason, .len = len};
        memcpy(a->message, message, len);
        a->message[len] = '\0';
        snprintf(topic, sizeof topic, "%srpmi-abort", ctx->topic_prefix);
        f = flux_rpc_pack(ctx->h, topic, ctx->broker_rank[0], 0, "{s:i s:i s:i s:i s:s%}",
                          "shell", (int)ctx->rank, "rank", (int)rank, "exit_code", (int)exit_code, "reason",
                          (int)reason, "message", message, len);
    }
    if (!f || flux_future_then(f, -1., abort_sent_cb, a) < 0) {
        /* Not valid UTF-8, say, or no memory: raised here. */
        flux_future_destroy(f);
        free(a);
        ctx->failed = 0;
        raise_abort(ctx, rank, exit_code, reason, message, len);
    }
}

/* Shell 0: another shell's abort, taken only over that shell's route. */
static void abort_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    int shell, rank, exit_code, reason;
    const char *message, *why = NULL;
    size_t len;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        flux_respond_error(h, msg, EPERM, "only the job's owner may end it");
        return;
    }
    if (flux_request_unpack(msg, NULL, "{s:i s:i s:i s:i s:s%}", "shell", &shell, "rank", &rank, "exit_code",
                            &exit_code, "reason", &reason, "message", &message, &len) < 0 ||
        rank < 0 || (uint32_t)rank >= ctx->ntasks) {
        refuse(ctx, msg, EPROTO, "a malformed abort");
        return;
    }
    if (ctx->rank != 0 || !sent_by(ctx, msg, shell, &why)) {
        refuse(ctx, msg, EPERM, "an abort claiming to be from shell %d, for rank %d: %s", shell, rank,
               why ? why : "only shell 0 takes aborts");
        return;
    }
    on_abort(ctx, (uint32_t)rank, exit_code, reason, message, len);
    flux_respond(h, msg, NULL);
}

/* ---------------------------------------------------------------------------------------------------------
 * Spawn (PMI_Spawn_multiple, PMI2_Job_Spawn): the new processes are a Flux job of the same instance, submitted
 * by the spawning task's shell as the user's `flux submit` would be. The job runs with the spawner's shell
 * options (`-o rpmi` ones included), in its environment and working directory (or the `wdir` info), and
 * `-o rpmi-spawned` tells its shells the preputs, which job spawned it, where the launch's names are and, for
 * several commands, each one's argv and process count (each rank runs its own, its index the rank's appnum). The task's spawn is answered, every
 * process started, once the new job's shells say every task started (shell.start); a job refused or failing
 * before then (a program that cannot be executed) fails the spawn with Flux's words, and the spawner goes on.
 * Ends are tied: the spawner's shell watches each spawned job until it is clean (holding itself open
 * meanwhile) and ends its own job if that one fails or ends with a non-zero status; shell 0 of a spawned job
 * watches its spawner and ends its job if the spawner fails or ends first. Everything here is the user's
 * own: the jobs are submitted with the user's credentials, and Flux lets a user watch and end only their own. */

/* The most spawned jobs one shell has running at once (srun --mpi=rpmi: steps a step has spawned). */
#define SPAWNS_MAX 128

struct spawn {
    struct spawn *next;
    struct rpmi_flux *ctx;
    uint32_t task, nprocs;
    int answered, started; /* started: answered that every process started */
    int cancelled;         /* nobody waits for it any more: cancelled once it has an id */
    int finished, status;  /* its finish, seen before its processes were seen to start */
    int held;              /* this job's shell 0 was told of it (see send_holds) */
    flux_jobid_t id;
    char id_text[64];
    char ref[32]; /* the completion reference that holds the shell open until the job is clean */
    char failure[768]; /* why it failed, once an exception said so */
    flux_future_t *submitted, *events, *exec_events, *cancel;
};

/* Answers the task's spawn; a failure is told in the job's log too (MPI may not show the message). */
static void spawn_answer(struct spawn *sp, int status, const char *result) {
    if (sp->answered)
        return;
    sp->answered = 1;
    if (status != RPMI_OK)
        shell_log_error("rank %u's spawn failed: %s", (unsigned)sp->ctx->tasks[sp->task].rank, result);
    sp->ctx->plugin->service_complete(sp->ctx->inst, sp->task, status, result);
}

static void release_spawn_ref(struct spawn *sp) {
    if (sp->ref[0])
        flux_shell_remove_completion_ref(sp->ctx->shell, "%s", sp->ref);
    sp->ref[0] = '\0';
}

static void spawn_free(struct spawn *sp) {
    struct rpmi_flux *ctx = sp->ctx;
    for (struct spawn **at = &ctx->spawns; *at; at = &(*at)->next)
        if (*at == sp) {
            *at = sp->next;
            break;
        }
    ctx->spawn_count--;
    for (flux_future_t **w = (flux_future_t *[]){sp->events, sp->exec_events}, **end = w + 2; w < end; w++) {
        if (*w)
            (void)flux_job_event_watch_cancel(*w);
        flux_future_destroy(*w);
    }
    flux_future_destroy(sp->submitted);
    flux_future_destroy(sp->cancel);
    release_spawn_ref(sp);
    free(sp);
}

static void cancel_spawn(struct spawn *sp) {
    if (sp->id && !sp->cancel)
        sp->cancel = flux_job_cancel(sp->ctx->h, sp->id, "rpmi: the task that spawned it is gone");
}

/* The spawns of local task `task` (UINT32_MAX: of every task) whose processes have not started are cancelled:
 * nobody waits for them any more, and one still queued would hold this shell open (it waits for the end of
 * every job it spawned) and run later for nothing. */
static void cancel_unstarted(struct rpmi_flux *ctx, uint32_t task) {
    for (struct spawn *sp = ctx->spawns; sp; sp = sp->next) {
        if (!sp->started && (task == UINT32_MAX || sp->task == task)) {
            sp->cancelled = 1;
            cancel_spawn(sp);
        }
    }
}

/* A job tied to this one failed: this one ends too, with that job's exit status (its abort's code, say). */
static void tie_failure(struct rpmi_flux *ctx, int wait_status, const char *why) {
    if (ctx->failed)
        return;
    ctx->failed = 1;
    shell_log_error("%s", why);
    flux_shell_raise_exit_status(wait_status ? wait_status : 1 << 8, "rpmi: %s", why);
    drop_queues(ctx);
}

/* "0,0,...": every process started. */
static char *all_started(uint32_t nprocs) {
    char *codes = malloc(2 * (size_t)nprocs);
    if (!codes)
        return NULL;
    for (uint32_t i = 0; i < nprocs; i++) {
        codes[2 * i] = '0';
        codes[2 * i + 1] = i + 1 < nprocs ? ',' : '\0';
    }
    return codes;
}

/* The spawned job's eventlog, event by event, until it is clean. */
/* One event of a watched eventlog, parsed; NULL once the stream ended (the future is then destroyed). */
static json_t *next_event(flux_future_t **watch, const char **name) {
    const char *event;
    json_t *o;
    if (flux_job_event_watch_get(*watch, &event) < 0) {
        flux_future_destroy(*watch);
        *watch = NULL;
        return NULL;
    }
    if (!(o = json_loads(event, 0, NULL)) || json_unpack(o, "{s:s}", "name", name) < 0)
        *name = "";
    flux_future_reset(*watch);
    return o ? o : json_null();
}

/* Both of a spawned job's eventlogs have ended: it is clean (or cannot be followed). */
static void spawn_followed(struct spawn *sp) {
    if (sp->events || sp->exec_events)
        return;
    if (!sp->answered)
        spawn_answer(sp, RPMI_ERR_SYSTEM, "the spawned job ended before its processes started");
    spawn_free(sp);
}

/* The spawned job's exec eventlog: its shells post shell.start once every task has started (a program that
 * cannot be executed fails the job before it). */
static void spawn_exec_cb(flux_future_t *f, void *arg) {
    struct spawn *sp = arg;
    const char *name;
    (void)f;
    json_t *o = next_event(&sp->exec_events, &name);
    if (!o) {
        spawn_followed(sp);
        return;
    }
    if (strcmp(name, "shell.start") == 0 && !sp->answered && sp->finished && sp->status != 0) {
        char why[256];
        snprintf(why, sizeof why, "the spawned job %s ended with wait status %d as it started", sp->id_text,
                 sp->status);
        spawn_answer(sp, RPMI_ERR_SYSTEM, why);
    } else if (strcmp(name, "shell.start") == 0 && !sp->answered) {
        char *codes = all_started(sp->nprocs);
        spawn_answer(sp, codes ? RPMI_OK : RPMI_ERR_SYSTEM, codes);
        sp->started = codes != NULL;
        free(codes);
        shell_debug("spawned job %s started (%u processes)", sp->id_text, (unsigned)sp->nprocs);
    }
    json_decref(o);
}

/* The spawned job's main eventlog, until it is clean. */
static void spawn_event_cb(flux_future_t *f, void *arg) {
    struct spawn *sp = arg;
    const char *name, *type = "", *note = "";
    int severity = -1, status = 0;
    (void)f;
    json_t *o = next_event(&sp->events, &name);
    if (!o) {
        spawn_followed(sp);
        return;
    }
    (void)json_unpack(o, "{s:{s?s s?s s?i s?i}}", "context", "type", &type, "note", &note, "severity", &severity,
                      "status", &status);
    if (strcmp(name, "exception") == 0 && severity == 0) {
        /* Before its processes started, the spawn fails (MPI returns the error to the spawner); after, the
         * spawner's job ends at the spawned one's finish, with its exit status, which follows at once. */
        snprintf(sp->failure, sizeof sp->failure, "the spawned job %s failed: %s: %s", sp->id_text, type, note);
        spawn_answer(sp, RPMI_ERR_SYSTEM, sp->failure);
    } else if (strcmp(name, "finish") == 0 && !sp->answered) {
        /* The two eventlogs come in no set order: shell.start may still be on its way. */
        sp->finished = 1;
        sp->status = status;
    } else if (strcmp(name, "finish") == 0 && sp->started && (status != 0 || sp->failure[0])) {
        if (!sp->failure[0])
            snprintf(sp->failure, sizeof sp->failure, "the spawned job %s ended with wait status %d", sp->id_text,
                     status);
        tie_failure(sp->ctx, status, sp->failure);
    } else if (strcmp(name, "clean") == 0) {
        /* The streams end next; the shell need not wait for that. */
        release_spawn_ref(sp);
    }
    json_decref(o);
}

/* A job's shell 0 stays open until every job its other shells spawned is clean: it holds the job's part of the
 * exchanges and, in the first job, the launch's names, and Flux fails a job whose other shells outlive its shell 0
 * by exec.shell-exit-timeout. A shell that spawns names the job to its shell 0 ("rpmi-hold", taken only over
 * that shell's route), which follows the job's eventlog itself, so that a shell that dies without a word holds
 * nothing open. Every job of a launch is then outlived by the shell 0 of the job that spawned it, and the first
 * job's by none. Shell 0 follows at most HOLDS_MAX jobs. */
#define HOLDS_MAX 1024

struct hold {
    struct hold *next;
    struct rpmi_flux *ctx;
    flux_future_t *events;
    int released;
};

static void hold_release(struct hold *hd) {
    if (hd->released)
        return;
    hd->released = 1;
    if (--hd->ctx->hold_count == 0)
        flux_shell_remove_completion_ref(hd->ctx->shell, "rpmi-holds");
}

static void hold_free(struct hold *hd) {
    for (struct hold **at = &hd->ctx->holds; *at; at = &(*at)->next)
        if (*at == hd) {
            *at = hd->next;
            break;
        }
    hold_release(hd);
    if (hd->events)
        (void)flux_job_event_watch_cancel(hd->events);
    flux_future_destroy(hd->events);
    free(hd);
}

static void hold_event_cb(flux_future_t *f, void *arg) {
    struct hold *hd = arg;
    const char *name;
    (void)f;
    json_t *o = next_event(&hd->events, &name);
    if (!o) {
        hold_free(hd);
        return;
    }
    if (strcmp(name, "clean") == 0)
        hold_release(hd);
    json_decref(o);
}

/* Shell 0: another shell of this job spawned job `id`. */
static void hold_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    struct hold *hd;
    json_int_t id = 0;
    int shell = -1;
    const char *why = NULL;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        flux_respond_error(h, msg, EPERM, "only the job's owner may hold its shell 0");
        return;
    }
    if (flux_request_unpack(msg, NULL, "{s:i s:I}", "shell", &shell, "hold", &id) < 0 || id <= 0 ||
        (flux_jobid_t)id == ctx->id) {
        refuse(ctx, msg, EPROTO, "a malformed hold");
        return;
    }
    if (ctx->rank != 0 || !sent_by(ctx, msg, shell, &why)) {
        refuse(ctx, msg, EPERM, "a hold claiming to be from shell %d: %s", shell,
               why ? why : "only shell 0 takes holds");
        return;
    }
    if (ctx->hold_count >= HOLDS_MAX) {
        flux_respond_error(h, msg, EAGAIN, "shell 0 already follows as many spawned jobs as it may");
        return;
    }
    if (!(hd = calloc(1, sizeof *hd))) {
        flux_respond_error(h, msg, ENOMEM, NULL);
        return;
    }
    *hd = (struct hold){.next = ctx->holds, .ctx = ctx};
    ctx->holds = hd;
    if (ctx->hold_count++ == 0 && flux_shell_add_completion_ref(ctx->shell, "rpmi-holds") < 0)
        shell_log_errno("cannot hold shell 0 open for the spawned jobs");
    if (!(hd->events = flux_job_event_watch(h, (flux_jobid_t)id, "eventlog", 0)) ||
        flux_future_then(hd->events, -1., hold_event_cb, hd) < 0) {
        flux_respond_error(h, msg, errno ? errno : ENOMEM, "cannot follow that job");
        hold_free(hd);
        return;
    }
    flux_respond(h, msg, NULL);
}

static void hold_sent_cb(flux_future_t *f, void *arg) {
    struct rpmi_flux *ctx = arg;
    if (flux_future_get(f, NULL) < 0)
        shell_log_error("shell 0 may end before a job shell %u spawned: %s", (unsigned)ctx->rank,
                        future_strerror(f, errno));
    flux_future_destroy(f);
}

/* Tells shell 0 of the jobs this shell spawned, once shell 0 took this shell's join (its route is what shell 0
 * trusts). Shell 0's own spawns hold it open already. */
static void send_holds(struct rpmi_flux *ctx) {
    char t[192];
    if (ctx->rank == 0 || !ctx->links[0].joined)
        return;
    topic(ctx, t, sizeof t, "rpmi-hold");
    for (struct spawn *sp = ctx->spawns; sp; sp = sp->next) {
        if (!sp->id || sp->held)
            continue;
        sp->held = 1;
        flux_future_t *f = flux_rpc_pack(ctx->h, t, ctx->broker_rank[0], 0, "{s:i s:I}", "shell", (int)ctx->rank,
                                         "hold", (json_int_t)sp->id);
        if (!f || flux_future_then(f, -1., hold_sent_cb, ctx) < 0) {
            shell_log_errno("shell 0 may end before a job shell %u spawned", (unsigned)ctx->rank);
            flux_future_destroy(f);
        }
    }
}

static void spawn_submitted_cb(flux_future_t *f, void *arg) {
    struct spawn *sp = arg;
    char why[512];
    if (flux_job_submit_get_id(f, &sp->id) < 0) {
        const char *error = flux_future_error_string(f);
        snprintf(why, sizeof why, "Flux refused the spawned job: %s", error ? error : strerror(errno));
        spawn_answer(sp, RPMI_ERR_SYSTEM, why);
        spawn_free(sp);
        return;
    }
    if (flux_job_id_encode(sp->id, "f58", sp->id_text, sizeof sp->id_text) < 0)
        snprintf(sp->id_text, sizeof sp->id_text, "%ju", (uintmax_t)sp->id);
    shell_debug("rank %u spawned job %s", (unsigned)sp->ctx->tasks[sp->task].rank, sp->id_text);
    if (sp->cancelled)
        cancel_spawn(sp);
    if (!(sp->events = flux_job_event_watch(sp->ctx->h, sp->id, "eventlog", 0)) ||
        flux_future_then(sp->events, -1., spawn_event_cb, sp) < 0 ||
        !(sp->exec_events = flux_job_event_watch(sp->ctx->h, sp->id, "guest.exec.eventlog", 0)) ||
        flux_future_then(sp->exec_events, -1., spawn_exec_cb, sp) < 0) {
        snprintf(why, sizeof why, "cannot follow the spawned job %s: %s", sp->id_text, strerror(errno));
        spawn_answer(sp, RPMI_ERR_SYSTEM, why);
        flux_future_destroy(flux_job_cancel(sp->ctx->h, sp->id, "rpmi: its spawner cannot follow it"));
        spawn_free(sp);
        return;
    }
    send_holds(sp->ctx);
}

/* A spawn request's command `cmd` as argv (a new array: the program, then its arguments), or NULL. */
static json_t *command_argv(json_t *cmd) {
    const char *execname = NULL;
    json_t *args = NULL, *argv, *arg;
    size_t i;
    if (json_unpack(cmd, "{s:s s:o}", "execname", &execname, "args", &args) < 0 || !json_is_array(args) ||
        !(argv = json_pack("[s]", execname)))
        return NULL;
    json_array_foreach(args, i, arg) {
        if (!json_is_string(arg) || json_array_append(argv, arg) < 0) {
            json_decref(argv);
            return NULL;
        }
    }
    return argv;
}

/* The new job's jobspec for the request's `commands` (`nprocs` processes in all), or NULL with `why` said. One
 * job runs every command: it is submitted with the first command's, and with several, -o rpmi-spawned lists
 * each command's argv and process count, which the new job's shells give each task (task_init). */
static char *spawn_jobspec(struct rpmi_flux *ctx, json_t *commands, uint32_t nprocs, char *why, size_t why_len) {
    const char *cwd = NULL, *wdir = NULL;
    json_t *js = NULL, *env = NULL, *options = NULL, *value, *cmd, *pair;
    json_t *preputs = json_array(), *seen = json_object(), *listed = json_array(), *argv = NULL;
    char **cargv = NULL, **envp = NULL, *encoded = NULL;
    flux_jobspec1_t *spec = NULL;
    size_t i, j, n = 0;
    const char *key;
    if (!preputs || !seen || !listed)
        goto nomem;
    /* Every command's preputs go to the whole job; the commands share one working directory. */
    json_array_foreach(commands, i, cmd) {
        json_t *p = NULL, *infos = NULL, *one = command_argv(cmd);
        json_int_t count = 0;
        if (!one || json_unpack(cmd, "{s:I s:o s:o}", "nprocs", &count, "preputs", &p, "infos", &infos) < 0 ||
            !json_is_array(p) || !json_is_array(infos)) {
            json_decref(one);
            snprintf(why, why_len, "a malformed spawn request");
            goto done;
        }
        if (json_array_append_new(listed, json_pack("{s:I s:o}", "nprocs", count, "argv", one)) < 0)
            goto nomem;
        /* Each key once: the commands' preputs agree (rpmi checked), and each command carries them all. */
        json_array_foreach(p, j, pair) {
            const char *k = json_string_value(json_array_get(pair, 0));
            if (k && !json_object_get(seen, k) &&
                (json_object_set_new(seen, k, json_true()) < 0 || json_array_append(preputs, pair) < 0))
                goto nomem;
        }
        json_array_foreach(infos, j, pair) {
            const char *k, *v;
            if (json_unpack(pair, "[ss]", &k, &v) < 0 || strcmp(k, "wdir") != 0)
                continue;
            if (wdir && strcmp(wdir, v) != 0) {
                snprintf(why, why_len, "commands of one spawn in different directories: under Flux they are one job");
                goto done;
            }
            wdir = v;
        }
    }
    /* The spawner's own environment and working directory, as its job was submitted. */
    if (flux_shell_info_unpack(ctx->shell, "{s:o}", "jobspec", &js) == 0)
        (void)json_unpack(js, "{s:{s:{s?o s?s s?{s?o}}}}", "attributes", "system", "environment", &env, "cwd", &cwd,
                          "shell", "options", &options);
    argv = json_object_get(json_array_get(listed, 0), "argv");
    cargv = calloc(json_array_size(argv) + 1, sizeof *cargv);
    envp = calloc((json_is_object(env) ? json_object_size(env) : 0) + 1, sizeof *envp);
    if (!cargv || !envp)
        goto nomem;
    json_array_foreach(argv, i, value)
        cargv[i] = (char *)json_string_value(value);
    if (json_is_object(env))
        json_object_foreach(env, key, value) {
            if (json_is_string(value) && asprintf(&envp[n], "%s=%s", key, json_string_value(value)) >= 0)
                n++;
        }
    if (!(spec = flux_jobspec1_from_command((int)json_array_size(argv), cargv, envp, (int)nprocs, 1, 0, 0, 0.)))
        goto nomem;
    if ((wdir || cwd) && flux_jobspec1_set_cwd(spec, wdir ? wdir : cwd) < 0)
        goto nomem;
    /* The spawner's shell options (rpmi's among them, and how the shell loads plugins), then what makes it a
     * spawned job of rpmi's. */
    if ((json_is_object(options) && flux_jobspec1_attr_pack(spec, "system.shell.options", "O", options) < 0) ||
        flux_jobspec1_attr_pack(spec, "system.shell.options.pmi", "s", "rpmi") < 0 ||
        flux_jobspec1_attr_pack(spec, "system.shell.options.rpmi-spawned", "{s:I s:O s:{s:s s:i}}", "parent",
                                (json_int_t)ctx->id, "preputs", preputs, "names", "topic", ctx->names_topic, "rank",
                                ctx->names_rank) < 0 ||
        (json_array_size(listed) > 1 &&
         flux_jobspec1_attr_pack(spec, "system.shell.options.rpmi-spawned.commands", "O", listed) < 0))
        goto nomem;
    flux_jobspec1_error_t error;
    if (flux_jobspec1_attr_check(spec, &error) < 0) {
        snprintf(why, why_len, "the spawned job's jobspec: %s", error.text);
        goto done;
    }
    encoded = flux_jobspec1_encode(spec, 0);
    if (!encoded)
        goto nomem;
    goto done;
nomem:
    snprintf(why, why_len, "cannot make the spawned job's jobspec: %s", strerror(errno));
done:
    for (i = 0; envp && envp[i]; i++)
        free(envp[i]);
    free(envp);
    free(cargv);
    json_decref(preputs);
    json_decref(seen);
    json_decref(listed);
    flux_jobspec1_destroy(spec);
    return encoded;
}

static int on_spawn(void *host_data, rpmi_instance *instance, uint32_t task, const char *request_json, size_t len) {
    struct rpmi_flux *ctx = host_data;
    json_t *req = json_loadb(request_json, len, 0, NULL), *commands = NULL, *cmd;
    json_int_t nprocs = 0, count;
    char why[512] = "", *jobspec = NULL;
    size_t i;
    (void)instance;
    if (ctx->ending) {
        json_decref(req);
        return RPMI_ERR_STATE;
    }
    struct spawn *sp = task < ctx->local_count ? calloc(1, sizeof *sp) : NULL;
    if (!sp) {
        json_decref(req);
        return RPMI_ERR_SYSTEM;
    }
    *sp = (struct spawn){.ctx = ctx, .task = task, .next = ctx->spawns};
    ctx->spawns = sp;
    ctx->spawn_count++;
    if (!req || json_unpack(req, "{s:o}", "commands", &commands) < 0 || !json_is_array(commands) ||
        json_array_size(commands) == 0)
        snprintf(why, sizeof why, "a malformed spawn request");
    /* rpmi passes a spawn of 1 to 65536 processes only (plugin-spec section 8); this keeps the sum in range
     * whatever library is loaded. */
    json_array_foreach(commands, i, cmd) {
        if (json_unpack(cmd, "{s:I}", "nprocs", &count) < 0 || count < 1 || count > INT32_MAX - nprocs)
            snprintf(why, sizeof why, "a malformed spawn request");
        else
            nprocs += count;
    }
    if (!why[0] && ctx->spawn_count > SPAWNS_MAX)
        snprintf(why, sizeof why, "this shell already has %d spawned jobs running", SPAWNS_MAX);
    else if (!why[0] && (jobspec = spawn_jobspec(ctx, commands, (uint32_t)nprocs, why, sizeof why))) {
        sp->nprocs = (uint32_t)nprocs;
        snprintf(sp->ref, sizeof sp->ref, "rpmi-spawn-%u", ctx->spawn_seq++);
        if (flux_shell_add_completion_ref(ctx->shell, "%s", sp->ref) < 0)
            sp->ref[0] = '\0';
        if (!(sp->submitted = flux_job_submit(ctx->h, jobspec, FLUX_JOB_URGENCY_DEFAULT, 0)) ||
            flux_future_then(sp->submitted, -1., spawn_submitted_cb, sp) < 0)
            snprintf(why, sizeof why, "cannot submit the spawned job: %s", strerror(errno));
    }
    free(jobspec);
    json_decref(req);
    if (why[0]) {
        spawn_answer(sp, RPMI_ERR_SYSTEM, why);
        spawn_free(sp);
    }
    return RPMI_OK;
}

/* Shell 0 of a spawned job: the spawner's eventlog. Its failure, or its end before this job's, ends this job:
 * the spawned processes would wait for ever on processes that are gone. */
static void parent_event_cb(flux_future_t *f, void *arg) {
    struct rpmi_flux *ctx = arg;
    const char *event, *name = "", *type = "", *note = "";
    int severity = -1;
    char id[64] = "";
    json_t *o = NULL;
    (void)flux_job_id_encode(ctx->parent, "f58", id, sizeof id);
    if (flux_job_event_watch_get(f, &event) < 0) {
        /* The spawner's eventlog ends after its finish (handled below); any other end leaves no tie. */
        if (errno != ENODATA)
            fail_job(ctx, "cannot follow the job that spawned this one (%s): %s", id, strerror(errno));
        return;
    }
    if (ctx->failed) {
        flux_future_reset(f);
        return;
    }
    if ((o = json_loads(event, 0, NULL)) && json_unpack(o, "{s:s}", "name", &name) == 0) {
        (void)json_unpack(o, "{s:{s?s s?s s?i}}", "context", "type", &type, "note", &note, "severity", &severity);
        if (strcmp(name, "exception") == 0 && severity == 0)
            fail_job(ctx, "the job that spawned this one (%s) failed: %s%s%s", id, type, note[0] ? ": " : "", note);
        else if (strcmp(name, "finish") == 0)
            fail_job(ctx, "the job that spawned this one (%s) ended first", id);
    }
    json_decref(o);
    flux_future_reset(f);
}

/* ---------------------------------------------------------------------------------------------------------
 * Names across jobs. The first job's shell 0 holds the names of the whole launch (rpmi's instance serves its
 * own tasks' requests); a job it spawned, at any depth, sends its tasks' requests there ("rpmi-name", named
 * in -o rpmi-spawned), and that shell hands them to its instance (ABI revision 6, serve_name). Only the job's
 * user may ask; a request is at most a service and a port of 1024 bytes each, and at most NAMES_WAITING_MAX
 * wait at once. */

#define NAMES_WAITING_MAX 1024
/* How long a spawned job's task waits for the launch's names to answer. */
#define NAMES_TIMEOUT 30.0

struct name_request {
    struct name_request *next;
    uint64_t id;
    const flux_msg_t *msg;
};

/* Shell 0 of the first job: a request from another job of the launch. */
static void name_cb(flux_t *h, flux_msg_handler_t *mh, const flux_msg_t *msg, void *arg) {
    struct rpmi_flux *ctx = arg;
    const char *service = NULL, *port = NULL;
    int op = -1;
    (void)mh;
    if (flux_msg_authorize(msg, getuid()) < 0) {
        flux_respond_error(h, msg, EPERM, "only the job's owner may use its names");
        return;
    }
    if (flux_request_unpack(msg, NULL, "{s:i s:s s?s}", "op", &op, "service", &service, "port", &port) < 0) {
        flux_respond_error(h, msg, EPROTO, "a malformed request of the names");
        return;
    }
    if (ctx->names_waiting_count >= NAMES_WAITING_MAX) {
        flux_respond_error(h, msg, EAGAIN, "too many requests of the names wait");
        return;
    }
    struct name_request *r = calloc(1, sizeof *r);
    if (!r) {
        flux_respond_error(h, msg, ENOMEM, NULL);
        return;
    }
    *r = (struct name_request){.next = ctx->names_waiting, .id = ++ctx->names_seq, .msg = flux_msg_incref(msg)};
    ctx->names_waiting = r;
    ctx->names_waiting_count++;
    if (ctx->plugin->serve_name(ctx->inst, r->id, op, service, port) != RPMI_OK) {
        ctx->names_waiting = r->next;
        ctx->names_waiting_count--;
        flux_respond_error(h, msg, EINVAL, "this shell holds no names, or the request is not one rpmi takes");
        flux_msg_decref(r->msg);
        free(r);
    }
}

/* rpmi's answer to a request name_cb handed it. */
static void on_name_served(void *host_data, rpmi_instance *instance, uint64_t request, int status,
                           const char *result) {
    struct rpmi_flux *ctx = host_data;
    (void)instance;
    for (struct name_request **at = &ctx->names_waiting; *at; at = &(*at)->next) {
        struct name_request *r = *at;
        if (r->id != request)
            continue;
        *at = r->next;
        ctx->names_waiting_count--;
        if (status == RPMI_OK)
            flux_respond_pack(ctx->h, r->msg, "{s:s}", "port", result);
        else
            flux_respond_error(ctx->h, r->msg, ENOENT, result);
        flux_msg_decref(r->msg);
        free(r);
        return;
    }
}

/* A spawned job's task's request, on its way to the first job's shell 0. */
struct name_ask {
    struct name_ask *next;
    struct rpmi_flux *ctx;
    uint32_t task;
    flux_future_t *f;
};

static void name_ask_free(struct name_ask *a) {
    for (struct name_ask **at = &a->ctx->names_asked; *at; at = &(*at)->next)
        if (*at == a) {
            *at = a->next;
            break;
        }
    flux_future_destroy(a->f);
    free(a);
}

static void name_answered_cb(flux_future_t *f, void *arg) {
    struct name_ask *a = arg;
    const char *port = NULL;
    if (flux_rpc_get_unpack(f, "{s:s}", "port", &port) == 0) {
        a->ctx->plugin->service_complete(a->ctx->inst, a->task, RPMI_OK, port[0] ? port : NULL);
    } else {
        const char *why = flux_future_error_string(f);
        a->ctx->plugin->service_complete(a->ctx->inst, a->task, RPMI_ERR_STATE, why ? why : strerror(errno));
    }
    name_ask_free(a);
}

/* A spawned job's task asks the launch's names: sent to the first job's shell 0. */
static int ask_names(struct rpmi_flux *ctx, uint32_t task, int op, const char *service, const char *port) {
    if (ctx->ending)
        return RPMI_ERR_STATE;
    struct name_ask *a = malloc(sizeof *a);
    flux_future_t *f = NULL;
    if (!a)
        return RPMI_ERR_SYSTEM;
    *a = (struct name_ask){.ctx = ctx, .task = task, .next = ctx->names_asked};
    f = port ? flux_rpc_pack(ctx->h, ctx->names_topic, (uint32_t)ctx->names_rank, 0, "{s:i s:s s:s}", "op", op,
                             "service", service, "port", port)
             : flux_rpc_pack(ctx->h, ctx->names_topic, (uint32_t)ctx->names_rank, 0, "{s:i s:s}", "op", op, "service",
                             service);
    /* Answered at once where the names are; a shell that is gone may leave no answer at all. */
    if (!f || flux_future_then(f, NAMES_TIMEOUT, name_answered_cb, a) < 0) {
        flux_future_destroy(f);
        free(a);
        return RPMI_ERR_SYSTEM;
    }
    a->f = f;
    ctx->names_asked = a;
    return RPMI_OK;
}

static int on_publish(void *host_data, rpmi_instance *instance, uint32_t task, const char *service,
                      const char *port) {
    (void)instance;
    return ask_names(host_data, task, RPMI_NAME_PUBLISH, service, port);
}

static int on_unpublish(void *host_data, rpmi_instance *instance, uint32_t task, const char *service) {
    (void)instance;
    return ask_names(host_data, task, RPMI_NAME_UNPUBLISH, service, NULL);
}

static int on_lookup(void *host_data, rpmi_instance *instance, uint32_t task, const char *service) {
    (void)instance;
    return ask_names(host_data, task, RPMI_NAME_LOOKUP, service, NULL);
}

static void on_log(void *host_data, int32_t level, const char *message, size_t len) {
    int lvl = level <= RPMI_LOG_ERROR  ? FLUX_SHELL_ERROR
              : level == RPMI_LOG_WARN ? FLUX_SHELL_WARN
              : level == RPMI_LOG_INFO ? FLUX_SHELL_DEBUG
                                       : FLUX_SHELL_TRACE;
    (void)host_data;
    flux_shell_log(FLUX_SHELL_PLUGIN_NAME, lvl, __FILE__, __LINE__, "%.*s", (int)(len > 4000 ? 4000 : len), message);
}

static void on_ready(flux_reactor_t *r, flux_watcher_t *w, int revents, void *arg) {
    struct rpmi_flux *ctx = arg;
    (void)r;
    (void)revents;
    if (ctx->stopped)
        return;
    int rc = ctx->plugin->progress(ctx->inst);
    if (rc != RPMI_OK) {
        ctx->stopped = 1;
        flux_watcher_stop(w);
        fail_job(ctx, "the PMI server stopped (%d)", rc);
    }
}

static int on_watch_fd(void *host_data, rpmi_instance *instance, int fd) {
    struct rpmi_flux *ctx = host_data;
    ctx->inst = instance;
    ctx->watch = flux_fd_watcher_create(flux_get_reactor(ctx->h), fd, FLUX_POLLIN, on_ready, ctx);
    if (!ctx->watch)
        return RPMI_ERR_SYSTEM;
    flux_watcher_start(ctx->watch);
    return RPMI_OK;
}

/* ---------------------------------------------------------------------------------------------------------
 * The shell's hooks. */

/* A task connecting from its task.exec hook: handed to rpmi once its pid says which task it is. */
static void on_connect(flux_reactor_t *r, flux_watcher_t *w, int revents, void *arg) {
    struct rpmi_flux *ctx = arg;
    (void)r;
    (void)w;
    (void)revents;
    for (;;) {
        int fd = accept4(ctx->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                /* Out of fds, say: the watcher would fire again at once, for ever. */
                flux_watcher_stop(ctx->accept_w);
                fail_job(ctx, "cannot accept the tasks' connections: %s", strerror(errno));
            }
            return;
        }
        struct ucred peer = {0};
        socklen_t len = sizeof peer;
        struct task *t = NULL;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 && peer.uid == getuid()) {
            for (uint32_t i = 0; i < ctx->local_count && !t; i++) {
                struct task *c = &ctx->tasks[i];
                flux_subprocess_t *p = c->task ? flux_shell_task_subprocess(c->task) : NULL;
                if (p && !c->attached && flux_subprocess_pid(p) == peer.pid)
                    t = c;
            }
        }
        if (!t) {
            shell_log_error("refused a PMI connection from pid %ld: not a task of this shell waiting for one",
                            (long)peer.pid);
            close(fd);
            continue;
        }
        t->attached = 1;
        /* rpmi's from here on, even if the call fails. */
        int rc = ctx->plugin->task_attach(ctx->inst, t->local, fd);
        if (rc != RPMI_OK)
            fail_job(ctx, "task_attach for local task %u failed (%d)", (unsigned)t->local, rc);
    }
}

/* The directory of the shell's own (mode 0700, under the job's tmpdir when its path is short enough) and the
 * socket in it where the tasks connect. */
static int listen_for_tasks(struct rpmi_flux *ctx) {
    const char *tmp = flux_shell_getenv(ctx->shell, "FLUX_JOB_TMPDIR");
    if (!tmp || strlen(tmp) > 64)
        tmp = "/tmp";
    snprintf(ctx->socket_dir, sizeof ctx->socket_dir, "%s/rpmi-XXXXXX", tmp);
    if (!mkdtemp(ctx->socket_dir)) {
        ctx->socket_dir[0] = '\0';
        return shell_log_errno("cannot make a directory for the tasks' socket in %s", tmp);
    }
    ctx->socket_addr.sun_family = AF_UNIX;
    snprintf(ctx->socket_addr.sun_path, sizeof ctx->socket_addr.sun_path, "%s/pmi", ctx->socket_dir);
    ctx->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (ctx->listen_fd < 0 ||
        bind(ctx->listen_fd, (const struct sockaddr *)&ctx->socket_addr, sizeof ctx->socket_addr) < 0 ||
        listen(ctx->listen_fd, SOMAXCONN) < 0)
        return shell_log_errno("cannot listen on %s", ctx->socket_addr.sun_path);
    ctx->accept_w = flux_fd_watcher_create(flux_get_reactor(ctx->h), ctx->listen_fd, FLUX_POLLIN, on_connect, ctx);
    if (!ctx->accept_w)
        return -1;
    flux_watcher_start(ctx->accept_w);
    return 0;
}

/* In the child, says why the task cannot start, with async-signal-safe calls only, and exits. */
static void child_fail(const char *what) {
    static const char prefix[] = "rpmi: cannot connect the task to its PMI server: ";
    ssize_t ignored = write(STDERR_FILENO, prefix, sizeof prefix - 1);
    ignored = write(STDERR_FILENO, what, strlen(what));
    ignored = write(STDERR_FILENO, "\n", 1);
    (void)ignored;
    _exit(127);
}

/* The task a task.* hook is called for (its Flux task and rank too), or NULL. */
static struct task *current_task(struct rpmi_flux *ctx, flux_shell_task_t **task, int *rank) {
    int localid;
    if (!(*task = flux_shell_current_task(ctx->shell)) ||
        flux_shell_task_info_unpack(*task, "{s:i s:i}", "localid", &localid, "rank", rank) < 0 || localid < 0 ||
        (uint32_t)localid >= ctx->local_count)
        return NULL;
    return &ctx->tasks[localid];
}

/* A spawned job of several commands: rank `rank` runs its command's argv, not the first command's. */
static int set_command(struct rpmi_flux *ctx, flux_cmd_t *cmd, uint32_t rank) {
    json_t *c = NULL, *arg;
    json_int_t count = 0;
    size_t i;
    json_array_foreach(ctx->commands, i, c) {
        (void)json_unpack(c, "{s:I}", "nprocs", &count);
        if (rank < count)
            break;
        rank -= (uint32_t)count;
    }
    json_t *argv = json_object_get(c, "argv");
    while (flux_cmd_argc(cmd) > 0)
        if (flux_cmd_argv_delete(cmd, 0) < 0)
            return -1;
    json_array_foreach(argv, i, arg) {
        if (flux_cmd_argv_append(cmd, json_string_value(arg)) < 0)
            return -1;
    }
    return 0;
}

static int task_init(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    struct rpmi_flux *ctx = flux_plugin_aux_get(p, "rpmi");
    flux_shell_task_t *task;
    flux_cmd_t *cmd;
    struct task *t;
    int rank;
    (void)topic;
    (void)args;
    (void)arg;
    if (!ctx)
        return 0;
    if (!(t = current_task(ctx, &task, &rank)) || !(cmd = flux_shell_task_cmd(task)))
        return shell_log_errno("cannot read the task's rank");
    if (ctx->commands && set_command(ctx, cmd, (uint32_t)rank) < 0)
        return shell_log_errno("cannot give rank %d its command", rank);
    rpmi_task_env env;
    memset(&env, 0, sizeof env);
    env.struct_size = sizeof env;
    int rc = ctx->plugin->task_env(ctx->inst, t->local, &env);
    if (rc != RPMI_OK) {
        shell_log_error("task_env for rank %d failed (%d)", rank, rc);
        return -1;
    }
    for (size_t i = 0; i < env.env_count; i++) {
        const char *eq = strchr(env.env[i], '=');
        if (!eq)
            continue;
        char name[64];
        size_t n = (size_t)(eq - env.env[i]);
        if (n >= sizeof name)
            continue;
        memcpy(name, env.env[i], n);
        name[n] = '\0';
        if (flux_cmd_setenvf(cmd, 1, name, "%s", eq + 1) < 0)
            return shell_log_errno("cannot set %s", name);
    }
    t->task = task;
    ctx->starting = t;
    /* Above the standard streams, even when the shell runs without some of them. */
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    t->reserved_fd = null < 0 ? -1 : fcntl(null, F_DUPFD_CLOEXEC, 3);
    if (null >= 0)
        close(null);
    if (t->reserved_fd < 0 || flux_cmd_setenvf(cmd, 1, "PMI_FD", "%d", t->reserved_fd) < 0)
        return shell_log_errno("cannot reserve PMI_FD for rank %d", rank);
    return 0;
}

/* In the child, after Flux closed every fd but its own and before exec: connects to the shell and moves the
 * connection to the number PMI_FD names. Async-signal-safe calls only. */
static int task_exec(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    struct rpmi_flux *ctx = flux_plugin_aux_get(p, "rpmi");
    (void)topic;
    (void)args;
    (void)arg;
    if (!ctx)
        return 0;
    if (!ctx->starting || ctx->starting->reserved_fd < 0)
        child_fail("no PMI_FD was reserved for it");
    int want = ctx->starting->reserved_fd;
    /* Not close-on-exec: the task keeps it. */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        child_fail("socket failed");
    /* The shell takes each connection as soon as the task is forked (task_fork); a shell that does not within
     * a minute is stuck, and the task says so rather than hang. */
    struct timeval limit = {.tv_sec = 60};
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    int rc;
    do
        rc = connect(fd, (const struct sockaddr *)&ctx->socket_addr, sizeof ctx->socket_addr);
    while (rc < 0 && errno == EINTR);
    if (rc < 0)
        child_fail(ctx->socket_addr.sun_path);
    /* The limit was the connection's: the task's own writes wait as long as they must. */
    struct timeval none = {0};
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
    if (fd != want && (dup2(fd, want) < 0 || close(fd) < 0))
        child_fail("dup2 failed");
    return 0;
}

/* In the parent, once the task is forked: the number it holds for PMI_FD is free again. */
static void release_reserved(struct task *t) {
    if (t->reserved_fd >= 0) {
        close(t->reserved_fd);
        t->reserved_fd = -1;
    }
}

static int task_fork(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    struct rpmi_flux *ctx = flux_plugin_aux_get(p, "rpmi");
    flux_shell_task_t *task;
    struct task *t;
    int rank;
    (void)topic;
    (void)args;
    (void)arg;
    if (!ctx)
        return 0;
    if ((t = current_task(ctx, &task, &rank)))
        release_reserved(t);
    ctx->starting = NULL;
    /* The shell starts all its tasks before its reactor runs again: each connection is taken now (the child
     * connected before it exec'd, which the fork waited for), so that no more than one waits in the listen
     * queue, whatever its length. */
    on_connect(NULL, ctx->accept_w, 0, ctx);
    /* And what the tasks started so far have asked is answered now, not once the last task has started: a
     * task's start-up (MPICH's before its first barrier) then runs beside the starts of the tasks after it. */
    on_ready(NULL, ctx->watch, 0, ctx);
    return 0;
}

static int task_exit(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    struct rpmi_flux *ctx = flux_plugin_aux_get(p, "rpmi");
    flux_shell_task_t *task;
    struct task *t;
    int rank, status = 0;
    (void)topic;
    (void)args;
    (void)arg;
    if (!ctx || !(t = current_task(ctx, &task, &rank)))
        return 0;
    (void)flux_shell_task_info_unpack(task, "{s:i}", "wait_status", &status);
    /* Its connection, if it is still in the listen queue, goes to rpmi before the task is said to have left. */
    on_connect(NULL, ctx->accept_w, 0, ctx);
    release_reserved(t);
    cancel_unstarted(ctx, t->local);
    /* The shell may free the task after this; a task that never connected is seen leaving by rpmi here. */
    t->task = NULL;
    ctx->plugin->task_exit(ctx->inst, t->local, status);
    /* rpmi sees the task's connection close now, while the shell runs: what it tells the other shells (a rank
     * that left, a goodbye) holds the shell open until it is sent. */
    on_ready(NULL, ctx->watch, 0, ctx);
    return 0;
}

static void rpmi_flux_destroy(void *arg) {
    struct rpmi_flux *ctx = arg;
    if (!ctx)
        return;
    /* The instance goes first, while all it may call back on is whole: it serves what the tasks wrote last,
     * and what that asks anew (a spawn, names from another shell) is refused. Its fd is watched no more
     * before destroy closes it. */
    ctx->ending = 1;
    flux_watcher_destroy(ctx->watch);
    if (ctx->inst)
        ctx->plugin->destroy(ctx->inst);
    ctx->inst = NULL;
    /* Nothing is answered once the instance is gone. */
    while (ctx->spawns) {
        ctx->spawns->answered = 1;
        ctx->spawns->ref[0] = '\0';
        spawn_free(ctx->spawns);
    }
    while (ctx->names_asked)
        name_ask_free(ctx->names_asked);
    while (ctx->holds) {
        ctx->holds->released = 1;
        hold_free(ctx->holds);
    }
    json_decref(ctx->commands);
    for (struct name_request *r = ctx->names_waiting, *next; r; r = next) {
        next = r->next;
        flux_respond_error(ctx->h, r->msg, ECONNRESET, "the shell holding the launch's names is ending");
        flux_msg_decref(r->msg);
        free(r);
    }
    if (ctx->parent_watch)
        (void)flux_job_event_watch_cancel(ctx->parent_watch);
    flux_future_destroy(ctx->parent_watch);
    flux_watcher_destroy(ctx->accept_w);
    if (ctx->listen_fd >= 0)
        close(ctx->listen_fd);
    if (ctx->socket_dir[0]) {
        unlink(ctx->socket_addr.sun_path);
        rmdir(ctx->socket_dir);
    }
    for (uint32_t i = 0; ctx->tasks && i < ctx->local_count; i++)
        release_reserved(&ctx->tasks[i]);
    free(ctx->broker_rank);
    free(ctx->tasks);
    for (uint32_t i = 0; ctx->links && i < ctx->nshells; i++) {
        flux_msg_decref(ctx->links[i].join);
        for (struct queued *q = ctx->links[i].head, *next; q; q = next) {
            next = q->next;
            free(q);
        }
    }
    free(ctx->links);
    free(ctx);
    /* librpmi.so stays loaded: unloading a library that has run threads is not safe. */
}

/* Is `word` one of the comma-separated `list`? */
static int listed(const char *list, const char *word) {
    size_t n = strlen(word);
    for (const char *s = list; s && *s; s = strchr(s, ',') ? strchr(s, ',') + 1 : NULL)
        if (strncmp(s, word, n) == 0 && (s[n] == ',' || s[n] == '\0'))
            return 1;
    return 0;
}

/* The job's `-o rpmi` options for rpmi: a JSON object, or NULL. */
static int read_options(struct rpmi_flux *ctx, char **options_json) {
    json_t *opts = NULL;
    *options_json = NULL;
    if (flux_shell_getopt_unpack(ctx->shell, "rpmi", "o", &opts) < 0 || (opts && !json_is_object(opts))) {
        shell_log_error("-o rpmi must be a set of rpmi.KEY=VALUE options");
        return -1;
    }
    if (!opts)
        return 0;
    *options_json = json_dumps(opts, JSON_COMPACT);
    return *options_json ? 0 : -1;
}

/* A spawned job of several commands: each rank's appnum, its command's index (ranks follow the commands in
 * order); the commands are kept for task_init. */
static int read_commands(struct rpmi_flux *ctx, json_t *commands, int32_t **appnums) {
    json_t *cmd, *argv;
    json_int_t count;
    size_t i, j;
    uint32_t rank = 0;
    if (!commands)
        return 0;
    if (!json_is_array(commands) || !(*appnums = calloc(ctx->ntasks, sizeof **appnums)))
        goto bad;
    json_array_foreach(commands, i, cmd) {
        if (json_unpack(cmd, "{s:I s:o}", "nprocs", &count, "argv", &argv) < 0 || count < 1 ||
            count > (json_int_t)(ctx->ntasks - rank) || !json_is_array(argv) || json_array_size(argv) == 0)
            goto bad;
        for (j = 0; j < json_array_size(argv); j++)
            if (!json_is_string(json_array_get(argv, j)))
                goto bad;
        for (json_int_t k = 0; k < count; k++)
            (*appnums)[rank++] = (int32_t)i;
    }
    if (rank != ctx->ntasks)
        goto bad;
    ctx->commands = json_incref(commands);
    return 0;
bad:
    shell_log_error("-o rpmi-spawned: commands that do not add up to the job's %u tasks", (unsigned)ctx->ntasks);
    return -1;
}

/* A spawned job's `-o rpmi-spawned`: its spawner's id and the preputs (borrowed from the shell's options). */
static int read_spawned(struct rpmi_flux *ctx, rpmi_keyval **preputs, size_t *count, int32_t **appnums) {
    json_t *o = NULL, *list = NULL, *pair;
    json_int_t parent = 0;
    const char *names_topic = NULL;
    size_t i;
    /* The first job's names are its own shell 0's. */
    snprintf(ctx->names_topic, sizeof ctx->names_topic, "%srpmi-name", ctx->topic_prefix);
    ctx->names_rank = ctx->broker_rank[0];
    if (flux_shell_getopt_unpack(ctx->shell, "rpmi-spawned", "o", &o) < 0 ||
        (o && (json_unpack(o, "{s:I s:o s:{s:s s:i}}", "parent", &parent, "preputs", &list, "names", "topic",
                           &names_topic, "rank", &ctx->names_rank) < 0 ||
               parent <= 0 || !json_is_array(list) || ctx->names_rank < 0 ||
               snprintf(ctx->names_topic, sizeof ctx->names_topic, "%s", names_topic) >=
                   (int)sizeof ctx->names_topic))) {
        shell_log_error("-o rpmi-spawned must be what rpmi sets for a spawned job");
        return -1;
    }
    if (!o)
        return 0;
    ctx->parent = (flux_jobid_t)parent;
    if (read_commands(ctx, json_object_get(o, "commands"), appnums) < 0)
        return -1;
    *preputs = calloc(json_array_size(list) + 1, sizeof **preputs);
    if (!*preputs)
        return -1;
    json_array_foreach(list, i, pair) {
        if (json_unpack(pair, "[ss]", &(*preputs)[i].key, &(*preputs)[i].value) < 0) {
            shell_log_error("-o rpmi-spawned: a preput that is not a pair of strings");
            return -1;
        }
    }
    *count = json_array_size(list);
    return 0;
}

static int load_rpmi(struct rpmi_flux *ctx) {
    void *lib = dlopen(RPMI_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        shell_log_error("cannot load %s: %s", RPMI_LIBRARY, dlerror());
        return -1;
    }
    const rpmi_plugin *(*entry)(void) = (const rpmi_plugin *(*)(void))dlsym(lib, "rpmi_plugin_entry");
    const rpmi_plugin *t = entry ? entry() : NULL;
    /* Revision 6 is the first with serve_name (5 with shell_message, 4 with task_env and task_attach); a table
     * that ends before it is older. */
    if (!t || t->abi_version != RPMI_ABI_VERSION ||
        t->struct_size < offsetof(rpmi_plugin, serve_name) + sizeof t->serve_name || t->abi_revision < 6 ||
        !t->task_env || !t->task_attach || !t->shell_message || !t->serve_name) {
        shell_log_error("%s is not an rpmi of ABI version %d, revision 6 or later", RPMI_LIBRARY, RPMI_ABI_VERSION);
        return -1;
    }
    ctx->plugin = t;
    return 0;
}

/* What rpmi needs to know of the job, from the shell's info. Freed by the caller, whatever is returned. */
struct job {
    uint32_t *task_map, *local_ranks;
    const char **hostnames;
};

static int read_job(struct rpmi_flux *ctx, struct job *job) {
    const struct taskmap *map = flux_shell_get_taskmap(ctx->shell);
    if (!map || taskmap_unknown(map) || taskmap_total_ntasks(map) != (int)ctx->ntasks ||
        taskmap_nnodes(map) != (int)ctx->nshells) {
        shell_log_error("the job's task map is unknown or does not match its size");
        return -1;
    }
    job->task_map = calloc(ctx->ntasks, sizeof *job->task_map);
    job->hostnames = calloc(ctx->nshells, sizeof *job->hostnames);
    ctx->broker_rank = calloc(ctx->nshells, sizeof *ctx->broker_rank);
    ctx->links = calloc(ctx->nshells, sizeof *ctx->links);
    if (!job->task_map || !job->hostnames || !ctx->broker_rank || !ctx->links)
        return -1;
    for (uint32_t r = 0; r < ctx->ntasks; r++) {
        int node = taskmap_nodeid(map, (int)r);
        if (node < 0 || (uint32_t)node >= ctx->nshells)
            return -1;
        job->task_map[r] = (uint32_t)node;
    }
    for (uint32_t s = 0; s < ctx->nshells; s++) {
        if (flux_shell_rank_info_unpack(ctx->shell, (int)s, "{s:s s:i}", "name", &job->hostnames[s], "broker_rank",
                                        &ctx->broker_rank[s]) < 0)
            return -1;
    }
    /* Local task i is rank taskids[i], ascending: Flux's localid order. */
    const struct idset *ids = taskmap_taskids(map, (int)ctx->rank);
    ctx->local_count = ids ? (uint32_t)idset_count(ids) : 0;
    if (ctx->local_count == 0) {
        shell_log_error("this shell has no tasks in the task map");
        return -1;
    }
    job->local_ranks = calloc(ctx->local_count, sizeof *job->local_ranks);
    ctx->tasks = calloc(ctx->local_count, sizeof *ctx->tasks);
    if (!job->local_ranks || !ctx->tasks)
        return -1;
    uint32_t i = 0;
    for (unsigned int id = idset_first(ids); id != IDSET_INVALID_ID && i < ctx->local_count;
         id = idset_next(ids, id), i++) {
        job->local_ranks[i] = id;
        ctx->tasks[i] = (struct task){.local = i, .rank = id, .reserved_fd = -1};
    }
    return 0;
}

static int shell_init(flux_plugin_t *p, const char *topic, flux_plugin_arg_t *args, void *arg) {
    flux_shell_t *shell = flux_plugin_get_shell(p);
    const char *pmi = NULL, *service = NULL;
    flux_jobid_t id;
    int rank, size, ntasks;
    (void)topic;
    (void)args;
    (void)arg;
    if (flux_shell_getopt_unpack(shell, "pmi", "s", &pmi) < 0 || !pmi || !listed(pmi, "rpmi"))
        return 0;
    if (listed(pmi, "simple") || listed(pmi, "pmi1") || listed(pmi, "pmi2")) {
        shell_log_error("-o pmi=%s: rpmi and Flux's simple PMI cannot serve one job (both set PMI_FD)", pmi);
        return -1;
    }
    struct rpmi_flux *ctx = calloc(1, sizeof *ctx);
    if (!ctx || flux_plugin_aux_set(p, "rpmi", ctx, rpmi_flux_destroy) < 0) {
        free(ctx);
        return -1;
    }
    ctx->shell = shell;
    ctx->h = flux_shell_get_flux(shell);
    ctx->listen_fd = -1;
    if (flux_shell_info_unpack(shell, "{s:I s:i s:i s:i s:s}", "jobid", &id, "rank", &rank, "size", &size, "ntasks",
                               &ntasks, "service", &service) < 0 ||
        rank < 0 || size < 1 || ntasks < 1 || rank >= size)
        return shell_log_errno("cannot read the shell's info");
    ctx->id = id;
    ctx->rank = (uint32_t)rank;
    ctx->nshells = (uint32_t)size;
    ctx->ntasks = (uint32_t)ntasks;
    if (snprintf(ctx->topic_prefix, sizeof ctx->topic_prefix, "%s.", service) >= (int)sizeof ctx->topic_prefix)
        return -1;

    char job_id[64], *options = NULL;
    struct job job = {0};
    rpmi_keyval *preputs = NULL;
    size_t preput_count = 0;
    int32_t *appnums = NULL;
    int rc = -1;
    if (flux_job_id_encode(id, "f58plain", job_id, sizeof job_id) < 0 || read_options(ctx, &options) < 0 ||
        load_rpmi(ctx) < 0 || read_job(ctx, &job) < 0 || read_spawned(ctx, &preputs, &preput_count, &appnums) < 0)
        goto done;
    if (flux_shell_service_register(shell, "rpmi-msg.*", msg_cb, ctx) < 0 ||
        flux_shell_service_register(shell, "rpmi-abort", abort_cb, ctx) < 0 ||
        flux_shell_service_register(shell, "rpmi-knock", knock_cb, ctx) < 0 ||
        flux_shell_service_register(shell, "rpmi-hello", hello_cb, ctx) < 0 ||
        flux_shell_service_register(shell, "rpmi-join", join_cb, ctx) < 0 ||
        flux_shell_service_register(shell, "rpmi-name", name_cb, ctx) < 0 ||
        flux_shell_service_register(shell, "rpmi-hold", hold_cb, ctx) < 0) {
        shell_log_errno("cannot register the exchange's services");
        goto done;
    }

    rpmi_job_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    info.job_id = job_id;
    info.shell_index = ctx->rank;
    info.shell_count = ctx->nshells;
    info.size = ctx->ntasks;
    info.task_map = job.task_map;
    info.local_ranks = job.local_ranks;
    info.local_count = ctx->local_count;
    info.hostnames = job.hostnames;
    info.options_json = options;
    info.spawned = ctx->parent != 0;
    info.preputs = preputs;
    info.preput_count = (uint32_t)preput_count;
    info.appnums = appnums;

    rpmi_host_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.struct_size = sizeof ops;
    ops.abi_version = RPMI_ABI_VERSION;
    ops.host_data = ctx;
    ops.shell_send = on_shell_send;
    ops.job_done = on_job_done;
    ops.abort = on_abort;
    ops.log = on_log;
    ops.watch_fd = on_watch_fd;
    ops.spawn = on_spawn;
    ops.name_served = on_name_served;
    /* A spawned job's names are the first job's, which its shell 0 holds. */
    if (ctx->parent) {
        ops.publish = on_publish;
        ops.unpublish = on_unpublish;
        ops.lookup = on_lookup;
    }

    char err[512] = "";
    int crc = ctx->plugin->create(&info, &ops, &ctx->inst, err, sizeof err);
    if (crc != RPMI_OK) {
        ctx->inst = NULL;
        shell_log_error("rpmi: %s", err);
        goto done;
    }
    if (listen_for_tasks(ctx) < 0)
        goto done;
    if (ctx->rank == 0 && ctx->nshells > 1) {
        if (flux_shell_add_completion_ref(shell, "rpmi-job") < 0)
            goto done;
        ctx->holding_job = 1;
    }
    if (ctx->rank == 0 && ctx->parent &&
        (!(ctx->parent_watch = flux_job_event_watch(ctx->h, ctx->parent, "eventlog", 0)) ||
         flux_future_then(ctx->parent_watch, -1., parent_event_cb, ctx) < 0)) {
        shell_log_errno("cannot follow the job that spawned this one");
        goto done;
    }
    shell_debug("serving PMI for %u tasks", (unsigned)ctx->local_count);
    rc = 0;
done:
    free(options);
    free(preputs);
    free(appnums);
    free(job.task_map);
    free(job.local_ranks);
    free(job.hostnames);
    return rc;
}

int flux_plugin_init(flux_plugin_t *p) {
    if (flux_plugin_set_name(p, FLUX_SHELL_PLUGIN_NAME) < 0 || flux_plugin_add_handler(p, "shell.init", shell_init, NULL) < 0 ||
        flux_plugin_add_handler(p, "shell.post-init", post_init, NULL) < 0 ||
        flux_plugin_add_handler(p, "shell.lost", shell_lost_cb, NULL) < 0 ||
        flux_plugin_add_handler(p, "task.init", task_init, NULL) < 0 ||
        flux_plugin_add_handler(p, "task.exec", task_exec, NULL) < 0 ||
        flux_plugin_add_handler(p, "task.fork", task_fork, NULL) < 0 ||
        flux_plugin_add_handler(p, "task.exit", task_exit, NULL) < 0)
        return -1;
    return 0;
}
