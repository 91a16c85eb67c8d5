#!/bin/bash
# A PMI-1 client written on the wire, for the spawn tests without MPI: three spawns, each answer printed.
#
#   pmi_spawn.sh PROBE [HOST]
#
# 1. Two commands (appnums 0 and 1), one task and two, each running `PROBE info`; the second command's
#    info names HOST (default localhost) as where to run.
# 2. Two tasks of `rpmi-probe get greeting`, found in the `path` info (PROBE's directory) and run in the
#    `wdir` /, with the preput greeting="hello world".
# 3. One task of a shell that says init and finalize and prints its PMI_SPAWNED (a spawned process speaks
#    PMI: srun --mpi=rpmi answers a spawn once each one has).
set -eu
probe=$1
host=${2:-localhost}
say() { printf '%s\n' "$1" >&"$PMI_FD"; }
hear() { read -r line <&"$PMI_FD"; printf '%s\n' "$line"; }
say 'cmd=init pmi_version=1 pmi_subversion=1'
hear >/dev/null
printf 'mcmd=spawn\nnprocs=1\nexecname=%s\ntotspawns=2\nspawnssofar=1\nargcnt=1\narg1=info\npreput_num=0\ninfo_num=0\nendcmd\n' "$probe" >&"$PMI_FD"
printf 'mcmd=spawn\nnprocs=2\nexecname=%s\ntotspawns=2\nspawnssofar=2\nargcnt=1\narg1=info\ninfo_num=1\ninfo_key_0=host\ninfo_val_0=%s\nendcmd\n' "$probe" "$host" >&"$PMI_FD"
echo "spawner: $(hear)"
printf 'mcmd=spawn\nnprocs=2\nexecname=%s\ntotspawns=1\nspawnssofar=1\nargcnt=2\narg1=get\narg2=greeting\npreput_num=1\npreput_key_0=greeting\npreput_val_0=hello world\ninfo_num=2\ninfo_key_0=path\ninfo_val_0=%s\ninfo_key_1=wdir\ninfo_val_1=/\nendcmd\n' "${probe##*/}" "${probe%/*}" >&"$PMI_FD"
echo "spawner: $(hear)"
child='echo "cmd=init pmi_version=1 pmi_subversion=1" >&$PMI_FD; read -r l <&$PMI_FD; printenv PMI_SPAWNED; echo cmd=finalize >&$PMI_FD; read -r l <&$PMI_FD'
printf 'mcmd=spawn\nnprocs=1\nexecname=bash\ntotspawns=1\nspawnssofar=1\nargcnt=2\narg1=-c\narg2=%s\npreput_num=0\ninfo_num=0\nendcmd\n' "$child" >&"$PMI_FD"
echo "spawner: $(hear)"
say 'cmd=finalize'
hear >/dev/null
