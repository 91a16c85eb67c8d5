/* pmi2.h: the PMI-2 API as rpmi's libpmi2.so.0 provides it, call for call and type for type as MPICH's and
 * Slurm's pmi2.h declare it, so that a program built against either runs with this library.
 *
 * A process started by a PMI-2 launcher (PMI_FD, or PMI_PORT, in its environment) talks to its server in
 * PMI-2 frames; a process started without one is a job of one (rank 0, size 1) whose key-value space and node
 * attributes live in the process. Every call is safe from several threads; they are served one at a time.
 *
 * Link with -lpmi2 (pkg-config rpmi-pmi2). */
#ifndef RPMI_PMI2_H
#define RPMI_PMI2_H

#ifdef __cplusplus
extern "C" {
#endif

#define PMI2_MAX_KEYLEN 64
#define PMI2_MAX_VALLEN 1024
#define PMI2_MAX_ATTRVALUE 1024
#define PMI2_ID_NULL -1

#define PMI2_SUCCESS 0
#define PMI2_FAIL -1
#define PMI2_ERR_INIT 1
#define PMI2_ERR_NOMEM 2
#define PMI2_ERR_INVALID_ARG 3
#define PMI2_ERR_INVALID_KEY 4
#define PMI2_ERR_INVALID_KEY_LENGTH 5
#define PMI2_ERR_INVALID_VAL 6
#define PMI2_ERR_INVALID_VAL_LENGTH 7
#define PMI2_ERR_INVALID_LENGTH 8
#define PMI2_ERR_INVALID_NUM_ARGS 9
#define PMI2_ERR_INVALID_ARGS 10
#define PMI2_ERR_INVALID_NUM_PARSED 11
#define PMI2_ERR_INVALID_KEYVALP 12
#define PMI2_ERR_INVALID_SIZE 13
#define PMI2_ERR_OTHER 14

/* What PMI2_Job_Connect would use to reach another job's leader (not served: the call fails). */
typedef struct PMI2_Connect_comm {
    int (*read)(void *buf, int maxlen, void *ctx);
    int (*write)(const void *buf, int len, void *ctx);
    void *ctx;
    int isMaster;
} PMI2_Connect_comm_t;

/* An MPI info entry, as MPICH lays it out: spawn's preputs (an array of pointers) and infos (for each command
 * an array of entries) are read through it; only key and value are used. */
typedef struct MPID_Info {
    int handle;
    int pobj_mutex;
    int ref_count;
    struct MPID_Info *next;
    char *key;
    char *value;
} MPID_Info;

int PMI2_Init(int *spawned, int *size, int *rank, int *appnum);
int PMI2_Finalize(void);
int PMI2_Initialized(void);
/* Prints msg on stderr, tells the server the job ends (flag non-zero: the whole job), and exits with 1. */
int PMI2_Abort(int flag, const char msg[]);

int PMI2_Job_Spawn(int count, const char *cmds[], int argcs[], const char **argvs[], const int maxprocs[],
                   const int info_keyval_sizes[], const struct MPID_Info *info_keyval_vectors[],
                   int preput_keyval_size, const struct MPID_Info *preput_keyval_vector[], char jobId[],
                   int jobIdSize, int errors[]);
int PMI2_Job_GetId(char jobid[], int jobid_size);
int PMI2_Job_GetRank(int *rank);
int PMI2_Info_GetSize(int *size);
int PMI2_Job_Connect(const char jobid[], PMI2_Connect_comm_t *conn);
int PMI2_Job_Disconnect(const char jobid[]);

int PMI2_KVS_Put(const char key[], const char value[]);
int PMI2_KVS_Fence(void);
/* jobid NULL: this job. */
int PMI2_KVS_Get(const char *jobid, int src_pmi_id, const char key[], char value[], int maxvalue, int *vallen);

int PMI2_Info_GetNodeAttr(const char name[], char value[], int valuelen, int *found, int waitfor);
int PMI2_Info_GetNodeAttrIntArray(const char name[], int array[], int arraylen, int *outlen, int *found);
int PMI2_Info_PutNodeAttr(const char name[], const char value[]);
int PMI2_Info_GetJobAttr(const char name[], char value[], int valuelen, int *found);
int PMI2_Info_GetJobAttrIntArray(const char name[], int array[], int arraylen, int *outlen, int *found);

int PMI2_Nameserv_publish(const char service_name[], const struct MPID_Info *info_ptr, const char port[]);
int PMI2_Nameserv_lookup(const char service_name[], const struct MPID_Info *info_ptr, char port[], int portLen);
int PMI2_Nameserv_unpublish(const char service_name[], const struct MPID_Info *info_ptr);

#ifdef __cplusplus
}
#endif

#endif /* RPMI_PMI2_H */
