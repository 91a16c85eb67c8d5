/* The Flux plugin's end while a name request waits for rpmi (tests/flux.rs): the plugin's own code, included
 * whole, with the real librpmi.so (-DRPMI_LIBRARY) and a Flux handle of its own (loop://). Shell 0 of a job of
 * two shells, the first job of a launch, which holds the launch's names, takes an rpmi-name request (as a
 * spawned job's shell sends it); then the shell ends before its reactor calls progress again, as when the
 * last completion reference goes in the same loop iteration, and the plugin is destroyed. Run under
 * AddressSanitizer, which ends the program at any use of freed memory. Prints whether the request was
 * answered, and how.
 *
 * MOCK: the flux_shell_* functions below stand for the flux-shell executable's API, which only that
 * executable provides (the plugin is loaded into it). Each does nothing, or fails, as this end needs. */
#include "rpmi_shell.c"

void flux_shell_log(const char *component, int level, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "shell log %d: ", level);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    (void)component, (void)file, (void)line;
}
int flux_shell_err(const char *component, const char *file, int line, int errnum, const char *fmt, ...) {
    (void)component, (void)file, (void)line, (void)errnum, (void)fmt;
    return -1;
}
int flux_shell_add_completion_ref(flux_shell_t *shell, const char *fmt, ...) {
    (void)shell, (void)fmt;
    return 1;
}
int flux_shell_remove_completion_ref(flux_shell_t *shell, const char *fmt, ...) {
    (void)shell, (void)fmt;
    return 0;
}
void flux_shell_raise(const char *type, int severity, const char *fmt, ...) { (void)type, (void)severity, (void)fmt; }
void flux_shell_raise_exit_status(int status, const char *fmt, ...) { (void)status, (void)fmt; }
flux_shell_t *flux_plugin_get_shell(flux_plugin_t *p) {
    (void)p;
    return NULL;
}
flux_t *flux_shell_get_flux(flux_shell_t *shell) {
    (void)shell;
    return NULL;
}
int flux_shell_getopt_unpack(flux_shell_t *shell, const char *name, const char *fmt, ...) {
    (void)shell, (void)name, (void)fmt;
    return 0;
}
const char *flux_shell_getenv(flux_shell_t *shell, const char *name) {
    (void)shell, (void)name;
    return NULL;
}
const struct taskmap *flux_shell_get_taskmap(flux_shell_t *shell) {
    (void)shell;
    return NULL;
}
int flux_shell_info_unpack(flux_shell_t *shell, const char *fmt, ...) {
    (void)shell, (void)fmt;
    return -1;
}
int flux_shell_rank_info_unpack(flux_shell_t *shell, int rank, const char *fmt, ...) {
    (void)shell, (void)rank, (void)fmt;
    return -1;
}
int flux_shell_service_register(flux_shell_t *shell, const char *method, flux_msg_handler_f cb, void *arg) {
    (void)shell, (void)method, (void)cb, (void)arg;
    return 0;
}
flux_shell_task_t *flux_shell_current_task(flux_shell_t *shell) {
    (void)shell;
    return NULL;
}
int flux_shell_task_info_unpack(flux_shell_task_t *task, const char *fmt, ...) {
    (void)task, (void)fmt;
    return -1;
}
flux_cmd_t *flux_shell_task_cmd(flux_shell_task_t *task) {
    (void)task;
    return NULL;
}
flux_subprocess_t *flux_shell_task_subprocess(flux_shell_task_t *task) {
    (void)task;
    return NULL;
}

int main(void) {
    struct rpmi_flux *ctx = calloc(1, sizeof *ctx);
    if (!ctx || !(ctx->h = flux_open("loop://", 0)))
        return 1;
    ctx->listen_fd = -1;
    ctx->nshells = ctx->ntasks = 2;
    snprintf(ctx->topic_prefix, sizeof ctx->topic_prefix, "%u-shell-f1.", (unsigned)getuid());
    if (load_rpmi(ctx) < 0)
        return 1;
    /* As read_job and shell_init make them: ranks 0 and 1, one on each shell; this is shell 0. */
    static uint32_t task_map[2] = {0, 1}, local[1] = {0};
    static const char *hosts[2] = {"a", "b"};
    ctx->broker_rank = calloc(2, sizeof *ctx->broker_rank);
    ctx->links = calloc(2, sizeof *ctx->links);
    ctx->tasks = calloc(1, sizeof *ctx->tasks);
    if (!ctx->broker_rank || !ctx->links || !ctx->tasks)
        return 1;
    ctx->local_count = 1;
    ctx->tasks[0] = (struct task){.local = 0, .rank = 0, .reserved_fd = -1};
    rpmi_job_info info = {.struct_size = sizeof info, .job_id = "f1", .shell_count = 2, .size = 2,
                          .task_map = task_map, .local_ranks = local, .local_count = 1, .hostnames = hosts};
    rpmi_host_ops ops = {.struct_size = sizeof ops, .abi_version = RPMI_ABI_VERSION, .host_data = ctx,
                         .shell_send = on_shell_send, .job_done = on_job_done, .abort = on_abort, .log = on_log,
                         .watch_fd = on_watch_fd, .spawn = on_spawn, .name_served = on_name_served};
    char err[512] = "";
    if (ctx->plugin->create(&info, &ops, &ctx->inst, err, sizeof err) != RPMI_OK) {
        fprintf(stderr, "create: %s\n", err);
        return 1;
    }
    /* A publish, from a process of the job's user. */
    flux_msg_t *msg = flux_request_encode("x.rpmi-name", "{\"op\":0,\"service\":\"svc\",\"port\":\"port-1\"}");
    if (!msg || flux_msg_set_userid(msg, getuid()) < 0 || flux_msg_set_rolemask(msg, FLUX_ROLE_OWNER) < 0)
        return 1;
    name_cb(ctx->h, NULL, msg, ctx);
    flux_msg_decref(msg);
    printf("requests waiting for rpmi: %u\n", ctx->names_waiting_count);
    flux_t *h = ctx->h;
    rpmi_flux_destroy(ctx);
    /* The answer came back on the loop handle. */
    flux_msg_t *response = flux_recv(h, FLUX_MATCH_RESPONSE, FLUX_O_NONBLOCK);
    if (!response)
        printf("the request was not answered\n");
    else if (flux_response_decode(response, NULL, NULL) == 0)
        printf("the request was answered: published\n");
    else
        printf("the request was answered: error %d\n", errno);
    flux_msg_decref(response);
    flux_close(h);
    return 0;
}
