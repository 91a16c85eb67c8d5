#!/bin/bash
# A PMI-1 client written on the wire that sends each argument as one spawn request and prints each answer.
#
#   pmi_spawn_blocks.sh REQUEST...
#
# A REQUEST is the request's lines with `\n` between them (printf's %b), e.g.
# 'mcmd=spawn\nnprocs=1\nexecname=./prog\ntotspawns=1\nspawnssofar=1\ninfo_num=0\nendcmd'. With DELETE=FILE in
# the environment the file is removed before the first request.
set -eu
hear() { read -r line <&"$PMI_FD"; printf '%s\n' "$line"; }
printf 'cmd=init pmi_version=1 pmi_subversion=1\n' >&"$PMI_FD"
hear >/dev/null
[[ -z ${DELETE:-} ]] || rm -f "$DELETE"
for request in "$@"; do
  printf '%b\n' "$request" >&"$PMI_FD"
  echo "spawner: $(hear)"
done
printf 'cmd=finalize\n' >&"$PMI_FD"
hear >/dev/null
