/* pmi.h: the PMI-1 API (RFC 13, "Simple Process Manager Interface v1") as rpmi's libpmi.so.0 provides it.
 *
 * A process started by a PMI-1 launcher (PMI_FD, or PMI_PORT, in its environment) talks to that launcher's
 * server through these calls; a process started without one is a job of one (rank 0, size 1) whose key-value
 * space lives in the process. Every call is safe from several threads; they are served one at a time, but
 * for PMI_Barrier_group, which waits without holding the others: several, one per thread, may be waited
 * in at once, entered in any order on each rank.
 *
 * Link with -lpmi (pkg-config rpmi-pmi). */
#ifndef RPMI_PMI_H
#define RPMI_PMI_H

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes (RFC 13). PMI_ERR_INVALID_KVS is not in RFC 13's table, but its text returns it from the
 * key-value calls; it has MPICH's value. */
#define PMI_SUCCESS 0
#define PMI_FAIL -1
#define PMI_ERR_INIT 1
#define PMI_ERR_NOMEM 2
#define PMI_ERR_INVALID_ARG 3
#define PMI_ERR_INVALID_KEY 4
#define PMI_ERR_INVALID_KEY_LENGTH 5
#define PMI_ERR_INVALID_VAL 6
#define PMI_ERR_INVALID_VAL_LENGTH 7
#define PMI_ERR_INVALID_LENGTH 8
#define PMI_ERR_INVALID_NUM_ARGS 9
#define PMI_ERR_INVALID_ARGS 10
#define PMI_ERR_INVALID_NUM_PARSED 11
#define PMI_ERR_INVALID_KEYVALP 12
#define PMI_ERR_INVALID_SIZE 13
#define PMI_ERR_INVALID_KVS 14

#define PMI_TRUE 1
#define PMI_FALSE 0

typedef int PMI_BOOL;

typedef struct PMI_keyval_t {
    const char *key;
    char *val;
} PMI_keyval_t;

/* Initialization */
int PMI_Init(int *spawned);
int PMI_Initialized(int *initialized);
int PMI_Finalize(void);
int PMI_Abort(int exit_code, const char error_msg[]);

/* Limits: each length includes the terminating NUL. */
int PMI_KVS_Get_name_length_max(int *length);
int PMI_KVS_Get_key_length_max(int *length);
int PMI_KVS_Get_value_length_max(int *length);
int PMI_Get_id_length_max(int *length);

/* Process group information */
int PMI_Get_size(int *size);
int PMI_Get_rank(int *rank);
int PMI_Get_universe_size(int *size);
int PMI_Get_appnum(int *appnum);
int PMI_Get_clique_size(int *size);
int PMI_Get_clique_ranks(int ranks[], int length);
int PMI_Get_id(char id_str[], int length);
int PMI_Get_kvs_domain_id(char id_str[], int length);

/* Key-value space */
int PMI_KVS_Get_my_name(char kvsname[], int length);
int PMI_KVS_Put(const char kvsname[], const char key[], const char value[]);
int PMI_KVS_Commit(const char kvsname[]);
int PMI_KVS_Get(const char kvsname[], const char key[], char value[], int length);
int PMI_Barrier(void);

/* PMI 1.2 (MPICH): a barrier of the ranks in group[0..count), told apart from others over the same ranks by
 * stringtag. PMI_FAIL when the server serves PMI 1.1 only (use PMI_Barrier then). */
int PMI_Barrier_group(const int *group, int count, const char *stringtag);

/* OPTIONAL in RFC 13: no PMI-1 request creates, destroys or walks a key-value space; these return PMI_FAIL. */
int PMI_KVS_Create(char kvsname[], int length);
int PMI_KVS_Destroy(const char kvsname[]);
int PMI_KVS_Iter_first(const char kvsname[], char key[], int key_len, char val[], int val_len);
int PMI_KVS_Iter_next(const char kvsname[], char key[], int key_len, char val[], int val_len);

/* Dynamic processes */
int PMI_Spawn_multiple(int count, const char *cmds[], const char **argvs[], const int maxprocs[],
                       const int info_keyval_sizesp[], const PMI_keyval_t *info_keyval_vectors[],
                       int preput_keyval_size, const PMI_keyval_t preput_keyval_vector[], int errors[]);
int PMI_Publish_name(const char service_name[], const char port[]);
int PMI_Unpublish_name(const char service_name[]);
int PMI_Lookup_name(const char service_name[], char port[]);

/* OPTIONAL in RFC 13 (dropped from MPICH's pmi.h in 2009): they return PMI_FAIL. */
int PMI_Parse_option(int num_args, char *args[], int *num_parsed, PMI_keyval_t **keyvalp, int *size);
int PMI_Args_to_keyval(int *argcp, char *((*argvp)[]), PMI_keyval_t **keyvalp, int *size);
int PMI_Free_keyvals(PMI_keyval_t keyvalp[], int size);
int PMI_Get_options(char *str, int *length);

#ifdef __cplusplus
}
#endif

#endif /* RPMI_PMI_H */
