/* rpmi_plugin.h: the job-shell plugin ABI of rpmi, a PMI server (PMI-1, 1.2 and 2).
 *
 * Normative; plugin-spec/README.md specifies the lifecycle, threads, ownership and errors in prose.
 * A job shell (one per node of a job) loads librpmi.so, fetches the plugin table with rpmi_plugin_entry(),
 * creates one instance per job shell, and calls the task hooks around each task's fork and exec.
 *
 * Rules that hold everywhere:
 *  - Both tables (rpmi_host_ops, rpmi_plugin) begin with struct_size and abi_version. Fields are only ever
 *    appended (each revision below appends to the one before); a reader checks struct_size before reading a
 *    field. A NULL callback means "not supported".
 *  - Arguments are borrowed for the duration of a call. Anything handed back for later use says how long it
 *    lives. No variadic functions, no format strings: text is (pointer, length) or NUL-terminated as stated.
 *  - Every fd the plugin creates is close-on-exec; only a task's own PMI_FD survives its exec.
 *  - When a call fails, create writes the reason into its err buffer; other calls but task_exec send it to
 *    the host's log callback (stderr without one) on the calling thread, before they return.
 */
#ifndef RPMI_PLUGIN_H
#define RPMI_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version: a host and a plugin work together when their versions are equal. Only an incompatible
 * change would raise it; appending does not, so it stays 1 and a host built against any revision of this
 * header keeps working with every later plugin. */
#define RPMI_ABI_VERSION 1

/* The revision of ABI version 1 this header describes. Each revision only appends fields and constants:
 *  1: the first.
 *  2: dynamic processes: per-rank appnums (MPMD launch, a spawn of several commands) and preputs in
 *     rpmi_job_info; rpmi_plugin.abi_revision.
 *  3: PMI 1.2's group barriers: rpmi_host_ops.group_collective, rpmi_plugin.group_complete.
 *  4: connections the host makes: rpmi_plugin.task_env and task_attach.
 *  5: the plugin runs the exchanges among the shells, the host carries its messages: rpmi_host_ops.shell_send,
 *     rpmi_plugin.shell_message and shell_lost, RPMI_ABORT_SHELL.
 *  6: the names of a job's shell 0 serve other jobs (the jobs it spawned): rpmi_plugin.serve_name,
 *     rpmi_host_ops.name_served, RPMI_NAME_*.
 * A plugin serves hosts of every revision up to its own; a host that needs revision R checks
 * rpmi_plugin.abi_revision >= R (a plugin of revision 1 has no such field: see struct_size). */
#define RPMI_ABI_REVISION 6

/* Return codes of the plugin's functions and of the host's callbacks. */
#define RPMI_OK 0
#define RPMI_ERR_INVALID (-1)  /* a bad argument: NULL pointer, unknown task, inconsistent job info */
#define RPMI_ERR_VERSION (-2)  /* abi_version or struct_size the other side cannot work with */
#define RPMI_ERR_OPTION (-3)   /* options_json is not valid JSON, or names an unknown option */
#define RPMI_ERR_SYSTEM (-4)   /* a system call failed (socketpair, thread, epoll, fcntl) */
#define RPMI_ERR_STATE (-5)    /* a call out of order (task_init twice, progress in thread mode) */
#define RPMI_ERR_INTERNAL (-6) /* a bug in the plugin (it caught a panic); the instance is unusable */

/* Log levels, for rpmi_host_ops.log. */
#define RPMI_LOG_ERROR 1
#define RPMI_LOG_WARN 2
#define RPMI_LOG_INFO 3
#define RPMI_LOG_DEBUG 4
#define RPMI_LOG_TRACE 5 /* the wire trace: one call per line, "rank R C: ..." or "rank R S: ..." */

/* Why rpmi_host_ops.abort is called. */
#define RPMI_ABORT_CALLED 1    /* the task called PMI_Abort(exit_code, message) */
#define RPMI_ABORT_PROTOCOL 2  /* the task broke the PMI protocol (RFC 13: end the job) */
#define RPMI_ABORT_TASK_LOST 3 /* the task left (exited, crashed, finalized) while others wait for it */
#define RPMI_ABORT_SHELL 4     /* revision 5: a shell of the job broke the exchange's protocol or bounds, or was lost */

/* Revision 5: the bit of a message's kind (rpmi_host_ops.shell_send) that says the message is a goodbye, sent
 * to a shell other than shell 0 once every local task has left. A host MAY drop it rather than wait to reach
 * a shell it has not reached yet (one that has ended too has no use for it); it carries it as it is otherwise. */
#define RPMI_SHELL_GOODBYE 0x80

/* Revision 6: what rpmi_plugin.serve_name asks of the job's names. */
#define RPMI_NAME_PUBLISH 0
#define RPMI_NAME_UNPUBLISH 1
#define RPMI_NAME_LOOKUP 2

/* One instance of the plugin: the PMI server of one job shell. Opaque. */
typedef struct rpmi_instance rpmi_instance;

/* A borrowed byte buffer. */
typedef struct rpmi_buf {
    const uint8_t *data;
    size_t len;
} rpmi_buf;

/* A key and its value, both NUL-terminated. */
typedef struct rpmi_keyval {
    const char *key;
    const char *value;
} rpmi_keyval;

/* What the host knows about the job, given to create(). Borrowed for the call; the plugin copies it. */
typedef struct rpmi_job_info {
    uint32_t struct_size; /* sizeof(rpmi_job_info) as the host compiled it; at least ABI version 1's */
    /* The job's id: letters, digits, '.', '_' and '-', at most 48 characters. Same on every shell; it names
     * the job's KVS and is given to tasks as PMI_JOBID. */
    const char *job_id;
    uint32_t shell_index; /* this job shell (node) among all of the job: 0 .. shell_count-1 */
    uint32_t shell_count;
    uint32_t size;                /* ranks in the job */
    const uint32_t *task_map;     /* size entries: the shell index (node) of every rank */
    /* local_count (>= 1) entries: the rank of each local task, task i being local_ranks[i]; exactly the ranks
     * task_map puts on this shell. */
    const uint32_t *local_ranks;
    uint32_t local_count;
    const char *const *hostnames; /* shell_count NUL-terminated hostnames, indexed by shell index */
    const char *options_json;     /* NULL or a JSON object of options (plugin-spec/README.md, "Options") */
    int32_t appnum;               /* PMI_Get_appnum: 0 for the job's first (or only) application */
    uint32_t universe_size;       /* PMI_Get_universe_size; 0 means size */
    uint32_t spawned;             /* non-zero: the job was created by PMI_Spawn_multiple (sets PMI_SPAWNED=1) */
    /* Revision 2. A host of revision 1 passes a struct_size that ends here. */
    /* NULL, or size entries: the appnum of every rank, which PMI_Get_appnum answers instead of `appnum` (an
     * MPMD launch, or a spawn of several commands: each command's ranks have its index). Same on every
     * shell. */
    const int32_t *appnums;
    /* preput_count pairs in the job's key-value space before any task runs, readable by every rank and put
     * by none (PMI_Spawn_multiple's preputs: the spawner's, for the job it spawns). Keys and values follow
     * the same rules and limits as a task's put. Same on every shell. */
    const rpmi_keyval *preputs;
    uint32_t preput_count;
} rpmi_job_info;

/* What task_init (or task_env) gives the host for one task. Owned by the instance; valid until task_forked
 * or task_exit for that task, or destroy, whichever comes first. */
typedef struct rpmi_task_env {
    uint32_t struct_size; /* set by the host to sizeof(rpmi_task_env) before the call; at least version 1's */
    int child_fd;         /* the task's end of its PMI connection; the number PMI_FD names (-1: task_env) */
    size_t env_count;
    /* env_count "NAME=value" strings to set in the task's environment. Build the task's environment from them
     * before fork: after fork the child of a multi-threaded host may only call async-signal-safe functions. */
    const char *const *env;
} rpmi_task_env;

/* The host's callbacks. Each receives host_data first. They are called on the thread that drives the
 * instance: the plugin's progress thread, or (event-loop mode) the host's own thread inside progress() or
 * destroy(). Two exceptions: watch_fd is called inside create, and log also receives the reason a plugin
 * function fails on the thread that called it, before it returns (plugin-spec/README.md, section 4). With
 * several instances in thread mode, callbacks of different instances run concurrently. A callback must not
 * call back into the same instance, except the *_complete functions. */
typedef struct rpmi_host_ops {
    uint32_t struct_size; /* sizeof(rpmi_host_ops) as the host compiled it */
    uint32_t abi_version; /* RPMI_ABI_VERSION as the host compiled it */
    void *host_data;

    /* Required. Start this shell's part of a barrier: an allgather of `data` (this shell's new puts, possibly
     * empty) across all shell_count shells of the job. The data is valid only during this call: copy it,
     * unless the collective is completed before this returns (the plugin copies the parts). Complete it, once,
     * with rpmi_plugin.collective_complete, from any thread, even before this callback returns. At most one
     * collective per instance is outstanding. Return RPMI_OK, or an error code to fail the barrier now. */
    int (*collective)(void *host_data, rpmi_instance *instance, const uint8_t *data, size_t len);

    /* Required. End the job: exit_code is the job's exit status (PMI_Abort's code, may be negative; 1 for
     * RPMI_ABORT_PROTOCOL and RPMI_ABORT_TASK_LOST). message (len bytes, no NUL) belongs on the job's stderr:
     * for RPMI_ABORT_CALLED the task's own message (may be empty), otherwise a sentence naming the rank;
     * message[len] is a NUL. `reason` is one of RPMI_ABORT_*. It may be called more than once for a job (by
     * several tasks, several shells, or while tasks are being killed); the first exit code should win. */
    void (*abort)(void *host_data, uint32_t rank, int32_t exit_code, int32_t reason, const char *message,
                  size_t len);

    /* Optional. A message for the job's log (len bytes, no NUL): the instance's own, or why a plugin function
     * called on any host thread is failing (on that thread). NULL: the plugin logs to stderr. */
    void (*log)(void *host_data, int32_t level, const char *message, size_t len);

    /* Optional: event-loop mode. Called once, during create, on the thread calling create. The host watches
     * `fd` for readability (level-triggered) until it calls destroy, and calls rpmi_plugin.progress from its
     * loop whenever it is readable, never before create has returned. NULL: the plugin runs one progress
     * thread for all local tasks, which ends once every task has closed its connection. */
    int (*watch_fd)(void *host_data, rpmi_instance *instance, int fd);

    /* Optional name service and spawn. Each starts a request for local task `task` and returns RPMI_OK, then
     * the host answers once with rpmi_plugin.service_complete, from any thread, even before returning (a
     * failure status with a message is how a host refuses with words of its own: a spawn it cannot place,
     * say). Another return code fails the request now with a generic message. NULL: the task gets a failure
     * reply. */
    int (*publish)(void *host_data, rpmi_instance *instance, uint32_t task, const char *service,
                   const char *port);
    int (*unpublish)(void *host_data, rpmi_instance *instance, uint32_t task, const char *service);
    int (*lookup)(void *host_data, rpmi_instance *instance, uint32_t task, const char *service);
    /* The whole spawn request as a JSON object: {"commands": [{"nprocs": N, "execname": "...",
     * "args": [...], "preputs": [["k","v"]...], "infos": [["k","v"]...]}...]} (len bytes, no NUL). The new
     * job's instances get the preputs (rpmi_job_info.preputs), spawned = 1, and each command's index as its
     * ranks' appnum (plugin-spec/README.md, section 8, also says how the jobs' ends are tied). */
    int (*spawn)(void *host_data, rpmi_instance *instance, uint32_t task, const char *request_json, size_t len);

    /* Revision 3. Optional: PMI 1.2's group barriers (plugin-spec/README.md, section 6.1). Start this shell's
     * part of group exchange `id` (id_len bytes, no NUL): an allgather of `data` (the new puts of this shell's
     * members of the group, possibly empty) among only the nshells shells listed in `shells` (ascending,
     * this one and at least one other); the job's other shells take no part. `id` names the group, the same on
     * every member shell: "WORLD:<tag>" or ascending ranks "0,4,8:<tag>", at most 1024 bytes. A shell starts
     * an exchange of an id only once its last one of that id completed, so the parts of one id that meet are
     * all of one barrier. Complete it, once, with rpmi_plugin.group_complete and the same id, from any
     * thread, even before this returns. Group exchanges of different ids may be outstanding at once, beside
     * a collective. Data, id and shells are valid only during this call. Return RPMI_OK, or an error
     * code to fail the group barrier now. Set: the plugin answers PMI 1.2 to the clients that ask for it.
     * NULL: it answers PMI 1.1 to every client, which then sends no group barriers. */
    int (*group_collective)(void *host_data, rpmi_instance *instance, const uint8_t *id, size_t id_len,
                            const uint32_t *shells, size_t nshells, const uint8_t *data, size_t len);

    /* Revision 5. Optional: the plugin runs the job's exchanges among the shells itself (plugin-spec/README.md,
     * section 6.2): the tree or Bruck's allgather, PMI 1.2's group barriers, and ending the job when a rank
     * leaves while others wait for it; the host only carries its messages. Send `message` (len bytes, valid
     * only during this call) and its `kind` (a byte the host carries beside it) to the instance of shell
     * `shell` (never this one) of the same job, which takes them with rpmi_plugin.shell_message, this shell's
     * index as `from`. Messages from one shell to another arrive whole and in the order sent. Return RPMI_OK,
     * or an error code: the plugin then takes `shell` for lost.
     * Set: collective and group_collective are never called (they may be NULL), and the plugin answers PMI
     * 1.2 to the clients that ask for it. */
    int (*shell_send)(void *host_data, rpmi_instance *instance, uint32_t shell, uint8_t kind, const uint8_t *message,
                      size_t len);

    /* Revision 5. Optional, with shell_send, and called on shell 0's instance only: every rank of the job has
     * closed its PMI connection, so the other shells need nothing more of this one (its part of the tree, the
     * group barriers and the names it holds for them). A host that keeps shell 0 running for the others (as
     * the Flux plugin does) may let it end. */
    void (*job_done)(void *host_data, rpmi_instance *instance);

    /* Revision 6. Optional: the answer to rpmi_plugin.serve_name's request `request`, on the thread that
     * serves the instance. status RPMI_OK: `result` is a lookup's port ("" for publish and unpublish);
     * otherwise `result` says why the request failed (a name published twice, one not published). `result`
     * is NUL-terminated and valid only during this call. */
    void (*name_served)(void *host_data, rpmi_instance *instance, uint64_t request, int status, const char *result);
} rpmi_host_ops;

/* The plugin's functions. */
typedef struct rpmi_plugin {
    uint32_t struct_size; /* sizeof(rpmi_plugin) as the plugin compiled it */
    uint32_t abi_version; /* RPMI_ABI_VERSION as the plugin compiled it */
    const char *version;  /* the plugin's release, e.g. "rpmi 0.1.0"; static */

    /* Create the instance for one job shell. `ops` is copied (host_data is kept). On failure, writes a
     * NUL-terminated reason into err (errlen bytes, may be 0) and returns an RPMI_ERR_* code. */
    int (*create)(const rpmi_job_info *job, const rpmi_host_ops *ops, rpmi_instance **instance, char *err,
                  size_t errlen);

    /* Parent, before forking local task `task` (0 .. local_count-1): make its PMI connection and fill `env`
     * (the host sets env->struct_size first). Once per task. */
    int (*task_init)(rpmi_instance *instance, uint32_t task, rpmi_task_env *env);

    /* Child, after fork and before exec: let the task's end of its connection survive exec. Only calls
     * async-signal-safe functions (fcntl), so it is safe in a child of a multi-threaded host. */
    int (*task_exec)(rpmi_instance *instance, uint32_t task);

    /* Parent, after fork: close the task's end in the host. */
    int (*task_forked)(rpmi_instance *instance, uint32_t task);

    /* Parent, after the task exited with wait status `status`. Closes the host's copy of the task's end if
     * task_forked was not called; the plugin sees the task leave when the task's end closes (or here, for a
     * task of task_env that was never attached). */
    int (*task_exit)(rpmi_instance *instance, uint32_t task, int status);

    /* Event-loop mode: do the work that made the watched fd readable. Never blocks. */
    int (*progress)(rpmi_instance *instance);

    /* The collective started by rpmi_host_ops.collective finished. status RPMI_OK: `parts` holds the
     * contributions of all shells (this one's included, any order; contributions are self-delimiting, so a
     * host may also concatenate whole contributions into fewer parts), borrowed for the call. Otherwise `error`
     * (NUL-terminated, may be NULL) says why; every task waiting in the barrier gets a failure. Any thread. */
    int (*collective_complete)(rpmi_instance *instance, int status, const rpmi_buf *parts, size_t nparts,
                               const char *error);

    /* The answer to a publish/unpublish/lookup/spawn request of `task`. status RPMI_OK: `result` is NULL for
     * publish and unpublish, the port for lookup, and for spawn a comma-separated list of one error code per
     * process asked for, in the order of the commands, 0 for a process started (any other value: not
     * started; the task sees it as it is). Otherwise `result` is the failure's message (may be NULL). Any
     * thread, even inside the request's own callback. */
    int (*service_complete)(rpmi_instance *instance, uint32_t task, int status, const char *result);

    /* Stop serving and free the instance: serves what the tasks wrote before they left (on the progress
     * thread, which it joins, or in event-loop mode here, calling back on this thread), closes every fd. No
     * other call on the instance may run concurrently with it or follow it, completions included, but the
     * completions its own callbacks make meanwhile (taken or dropped); since callbacks run meanwhile, the
     * host must not hold a lock its callbacks take while calling it. */
    void (*destroy)(rpmi_instance *instance);

    /* Revision 2. The revision of ABI version 1 the plugin serves (RPMI_ABI_REVISION as it was compiled);
     * a table whose struct_size ends before this field is revision 1. */
    uint32_t abi_revision;

    /* Revision 3. The group exchange `id` (id_len bytes) started by rpmi_host_ops.group_collective finished:
     * as collective_complete, with the contributions of the member shells only. Any thread. */
    int (*group_complete)(rpmi_instance *instance, const uint8_t *id, size_t id_len, int status,
                          const rpmi_buf *parts, size_t nparts, const char *error);

    /* Revision 4. Instead of task_init, for a host that makes the task's connection itself (a job shell that
     * closes every fd of a task but its own before exec; plugin-spec/README.md, section 5.1): fills `env` with
     * every variable but PMI_FD, which the host sets to its own end's number, and makes nothing (child_fd is
     * -1). task_exec and task_forked are not called for this task; task_attach and task_exit are. */
    int (*task_env)(rpmi_instance *instance, uint32_t task, rpmi_task_env *env);

    /* Revision 4. The host's end of the connection it made for task `task` (after task_env), a Unix stream
     * socket: from this call on the plugin owns `fd` (it closes it, even when the call fails) and serves it as
     * it serves the connections it makes. Once per task; a task that exits before it is attached is seen
     * leaving at task_exit. */
    int (*task_attach)(rpmi_instance *instance, uint32_t task, int fd);

    /* Revision 5. A message and its kind that shell `from` sent this one through its host's shell_send
     * (message borrowed for the call; the plugin copies it). The host MUST hand on only messages that came from the instance of
     * shell `from` of this job: the plugin trusts the sender's index, and checks everything else. Any thread. */
    int (*shell_message)(rpmi_instance *instance, uint32_t from, uint8_t kind, const uint8_t *message, size_t len);

    /* Revision 5. The host can carry no more messages between this shell and shell `shell` (its shell is gone,
     * or the connection to it broke). A shell that said it was done may go; one that did not fails the job.
     * Any thread. */
    int (*shell_lost)(rpmi_instance *instance, uint32_t shell);

    /* Revision 6. Shell 0 of a job whose names rpmi holds (a host with shell_send and no publish, unpublish or
     * lookup of its own): serve `op` (RPMI_NAME_*) from those names for someone outside the job, a task of a
     * job it spawned, say, whose host took the request with its own publish, unpublish or lookup
     * (plugin-spec/README.md, section 8). `service` and `port` (NULL but for a publish) are RFC 13 words of at
     * most 1024 bytes, borrowed for the call. The answer comes once, through rpmi_host_ops.name_served with
     * the host's `request`. Returns RPMI_OK, or RPMI_ERR_STATE where this instance holds no names (not shell
     * 0, or its host serves names itself), RPMI_ERR_INVALID for a bad argument: then no answer comes. Any
     * thread. */
    int (*serve_name)(rpmi_instance *instance, uint64_t request, int op, const char *service, const char *port);
} rpmi_plugin;

/* The one symbol a host looks up: the plugin table, static for the life of the library. */
const rpmi_plugin *rpmi_plugin_entry(void);

#ifdef __cplusplus
}
#endif

#endif /* RPMI_PLUGIN_H */
