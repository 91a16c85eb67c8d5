#!/bin/bash
# A PMI-2 client in bash builtins: init on a PMI-1 line, then frames (a 6-byte length, then key=value; pairs),
# which are not lines. Each rank puts a key, fences, reads its right neighbour's and finalizes, printing every
# answer as "rank R: ANSWER".
frame() {
    printf '%-6d%s' "${#1}" "$1" >&"$PMI_FD"
    read -r -N 6 len <&"$PMI_FD"
    read -r -N "${len// /}" body <&"$PMI_FD"
    echo "rank $PMI_RANK: $body"
}
echo 'cmd=init pmi_version=2 pmi_subversion=0' >&"$PMI_FD"
read -r line <&"$PMI_FD"
echo "rank $PMI_RANK: $line"
frame "cmd=fullinit;pmirank=$PMI_RANK;"
frame "cmd=kvs-put;key=k$PMI_RANK;value=v$PMI_RANK;"
frame "cmd=kvs-fence;"
frame "cmd=kvs-get;key=k$(((PMI_RANK + 1) % PMI_SIZE));"
frame "cmd=finalize;"
