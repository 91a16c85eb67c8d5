/* A hostile user's shim for their own srun (LD_PRELOAD): whenever srun's MPI plugin sets a variable of the
 * launch environment, this also sets SLURM_JOB_ID and SLURM_STEP_ID to another job's (RPMI_SPOOF_JOB_ID,
 * RPMI_SPOOF_STEP_ID), so that every slurmstepd of the step finds those in its environment. tests/slurm.rs
 * uses it to check that the plugin, running as root in slurmstepd, never acts on them. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*overwrite_fn)(char ***env, const char *name, const char *fmt, ...);

int slurm_env_array_overwrite_fmt(char ***env, const char *name, const char *fmt, ...)
{
	static overwrite_fn real;
	char value[4096];
	va_list ap;
	const char *job = getenv("RPMI_SPOOF_JOB_ID"), *step = getenv("RPMI_SPOOF_STEP_ID");

	if (!real)
		real = (overwrite_fn)dlsym(RTLD_NEXT, "slurm_env_array_overwrite_fmt");
	if (!real)
		return 0;
	va_start(ap, fmt);
	vsnprintf(value, sizeof value, fmt, ap);
	va_end(ap);
	if (job && step && strncmp(name, "RPMI_", 5) == 0) {
		real(env, "SLURM_JOB_ID", "%s", job);
		real(env, "SLURM_STEP_ID", "%s", step);
	}
	return real(env, name, "%s", value);
}
