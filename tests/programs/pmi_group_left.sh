#!/bin/bash
# A PMI 1.2 client written on the wire: rank 0 waits in a group barrier with rank 1, which never joins it.
#
#   pmi_group_left.sh finalize|exit
#
# Rank 1 calls finalize and exits (`finalize`), or exits without a word (`exit`); any other rank waits a
# minute, so that its node stays in the job. The server must end the job, naming why, never leave rank 0
# waiting.
set -eu
# The answers are read into a variable, not through $(...): a subshell killed with the task would keep Slurm's
# proctrack/pgid waiting seconds for the process group to empty.
say() { printf '%s\n' "$1" >&"$PMI_FD"; }
hear() { read -r line <&"$PMI_FD"; }
say 'cmd=init pmi_version=1 pmi_subversion=2'
hear
case $PMI_RANK in
0)
    say 'cmd=barrier_in group=0,1:5'
    hear
    echo "rank 0: $line"
    ;;
1)
    if [[ $1 == finalize ]]; then
        say 'cmd=finalize'
        hear
    fi
    ;;
*) exec sleep 60 ;;
esac
