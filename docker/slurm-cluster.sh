#!/usr/bin/env bash
# A throwaway, real 3-node Slurm cluster (any line from 22.05 to 26.05) on localhost, for rpmi's end-to-end tests, benchmarks and CI.
#
#   docker/slurm-cluster.sh start [--plugin-dir DIR] [--nodes N] [--mpi-conf FILE] [--mpi-default TYPE] [--netns]
#                                                      (re)start the cluster; DIR (holding mpi_rpmi.so) comes
#                                                      first in PluginDir; N nodes n1..nN instead of 3; FILE
#                                                      becomes the cluster's mpi.conf; TYPE is its MpiDefault
#                                                      (none unless given, e.g. rpmi); --netns: each node in a
#                                                      network namespace of its own, with its own /tmp
#   docker/slurm-cluster.sh stop                       stop it and remove its state directory
#   docker/slurm-cluster.sh status                     sinfo of the cluster
#   docker/slurm-cluster.sh env                        prints `export SLURM_CONF=...`; use as
#                                                      eval "$(docker/slurm-cluster.sh env)"
#
# One slurmctld and three slurmd daemons (nodes n1..n3, or n1..nN with --nodes N, all 127.0.0.1, each slurmd on
# its own port: Debian's slurmd is built with --enable-multiple-slurmd), munge authentication, no cgroups
# (proctrack/pgid, task/none). 100 nodes start in seconds and take about 0.5 GB together.
# With --netns (250 nodes at most), each slurmd, and so its steps, runs in a network namespace of its own, on a
# bridge with this machine (its own address, 10.S.0.I+1, where slurmctld and srun are 10.S.0.1), and sees a /tmp
# of its own (under the state directory), as separate machines would: what a plugin keeps in /tmp (Slurm's PMIx
# keeps its per-step directories there) does not collide between nodes. The state directory stays visible at
# its own path. A step's programs must then lie outside /tmp.
# All state, configuration and logs live under one directory, ${RPMI_SLURM_DIR:-/tmp/rpmi-slurm}, so several
# clusters (different RPMI_SLURM_DIR) can run side by side; ports are picked free at start, never 6817/6818 fixed.
# Must run as root (slurmd runs as root so that it can start steps). munged is started if it is not running and
# is left running by `stop` (it may serve other users of the machine).
# After replacing mpi_rpmi.so, run `start` again: the daemons load plugins only at start-up.
#
# Environment: RPMI_SLURM_PREFIX (a Slurm installed under a prefix, e.g. built from source with
# --enable-multiple-slurmd: its sbin/ and bin/ come first in PATH, its lib/slurm is the PluginDir; default:
# Debian's packages), RPMI_SLURM_DIR (state dir), RPMI_SLURM_START_TIMEOUT (seconds to wait for idle nodes, 60),
# RPMI_SLURM_PORTS="ctld n1 n2 n3 ..." (fixed ports instead of free random ones below the ephemeral range, one per
# node after slurmctld's).
# Notes for callers: `start` prints the `export SLURM_CONF=...` line on stdout (all else goes to stderr);
# an srun issued right after another one may print "srun: job N queued and waiting for resources" and wait up to
# about a second (the previous job's nodes are still COMPLETING): use `srun -Q` where stderr is compared, and one
# allocation (salloc) with many steps where launch latency is measured. -N3 -nK fills n1 first (block layout).
set -euo pipefail
[[ -z ${RPMI_SLURM_PREFIX:-} ]] || PATH=$RPMI_SLURM_PREFIX/sbin:$RPMI_SLURM_PREFIX/bin:$PATH

D=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm}
NODES=(n1 n2 n3)
MPI_CONF=""
MPI_DEFAULT=none
NETNS=0
MARK_FILE=.rpmi-slurm-cluster   # present in every state dir this script made; `stop` removes nothing else
MARK_VAR=RPMI_SLURM_CLUSTER     # =$D in slurmctld's and the slurmds' environment, to recognise them safely
START_TIMEOUT=${RPMI_SLURM_START_TIMEOUT:-60}

log() { printf 'slurm-cluster: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

case "$D" in
  /*) ;;
  *) D="$(pwd)/$D" ;;
esac
D=${D%/}
[[ -n "$D" && "$D" != / ]] || die "refusing state directory '$D'"
CONF="$D/slurm.conf"

# ---------------------------------------------------------------------------------------------------------------
# Finding this cluster's processes. Never by name alone: a daemon is a recorded pid or any process whose initial
# environment holds $MARK_VAR=$D; a slurmstepd is one that holds a file under $D open; a client is an srun/salloc
# started with SLURM_CONF=$D/slurm.conf. Nothing of another cluster (other state dir) or of the host matches.

# True if pid $1 is alive and carries MARK_VAR=$D in its (initial) environment, i.e. is one of ours.
is_ours() {
  local pid=$1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/environ ]] || return 1
  grep -qzxF "$MARK_VAR=$D" "/proc/$pid/environ" 2>/dev/null
}

# Every live process that carries our marker: slurmctld and the slurmds (whose pid files may be lost).
marked_pids() {
  # grep -z: the environment is NUL-separated; -x: the whole entry; -l: print the file names.
  grep -lzxF "$MARK_VAR=$D" /proc/[0-9]*/environ 2>/dev/null | awk -F/ '{ print $3 }' || true
}

# Every slurmstepd of this cluster. slurmstepd overwrites its environment with its process title, so the marker
# is unreadable there; instead it is a process named slurmstepd holding a file under $D open (the slurmd log it
# inherited, its socket in the spool directory), which no other cluster's stepd does.
stepd_pids() {
  local pid fd
  for pid in $(grep -lxF slurmstepd /proc/[0-9]*/comm 2>/dev/null | awk -F/ '{ print $3 }'); do
    for fd in /proc/"$pid"/fd/*; do
      if [[ "$(readlink "$fd" 2>/dev/null)" == "$D"/* ]]; then echo "$pid"; break; fi
    done
  done
  return 0
}

# Clients of this cluster still running (an srun or salloc whose job died with the daemons would wait forever):
# named srun/salloc and started with SLURM_CONF pointing at our slurm.conf.
client_pids() {
  local pid
  for pid in $(grep -lxE 'srun|salloc' /proc/[0-9]*/comm 2>/dev/null | awk -F/ '{ print $3 }'); do
    grep -qzxF "SLURM_CONF=$CONF" "/proc/$pid/environ" 2>/dev/null && echo "$pid"
  done
  return 0
}

# Descendants of the given pids (the job tasks a slurmstepd started), by walking the parent links.
descendants_of() {
  (($#)) || return 0
  ps -e -o pid= -o ppid= | awk -v roots="$*" '
    BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
    { parent[$1] = $2; pids[++m] = $1 }
    END {
      changed = 1
      while (changed) {
        changed = 0
        for (i = 1; i <= m; i++) { p = pids[i]; if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; out[p] = 1; changed = 1 } }
      }
      for (p in out) print p
    }'
}

# True if any of the pids is still running (a zombie, not yet reaped by its parent, counts as gone).
alive() {
  local p st
  for p in "$@"; do
    st=$(awk '{ sub(/.*\) /, ""); print $1 }' 2>/dev/null <"/proc/$p/stat") || continue
    [[ -n $st && $st != Z && $st != X ]] && return 0
  done
  return 1
}

# TERM the pids, wait up to $1 seconds, then KILL whatever is left.
term_then_kill() {
  local secs=$1; shift
  (($#)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  local i
  for ((i = 0; i < secs * 10; i++)); do
    alive "$@" || return 0
    sleep 0.1
  done
  log "still alive after ${secs}s, sending KILL: $*"
  kill -KILL "$@" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do alive "$@" || return 0; sleep 0.1; done
  log "warning: could not kill: $*"
}

# ---------------------------------------------------------------------------------------------------------------
# stop

# Pids of this cluster's daemons: those recorded at start (launch pids and the daemons' own pid files) and any
# process carrying our marker, each checked to be ours (a recycled pid is not).
daemon_pids() {
  local f pid
  {
    for f in "$D"/run/*.pid; do
      [[ -e $f ]] || continue
      pid=$(<"$f") || continue
      if is_ours "$pid"; then echo "$pid"; fi
    done
    marked_pids
  } | sort -un
}

cluster_running() {
  [[ -n "$(daemon_pids)$(stepd_pids)" ]]
}

do_stop() {
  local quiet=${1:-}
  if [[ ! -e $D ]]; then
    [[ -n $quiet ]] || log "no state directory $D; looking for leftover processes only"
  elif [[ ! -e $D/$MARK_FILE ]]; then
    die "$D exists but was not made by this script (no $MARK_FILE); not touching it"
  fi

  # 1. Cancel the jobs so that slurmstepd ends the tasks in order (best effort, a few seconds at most).
  local i daemons=() kids=() stepds=()
  mapfile -t daemons < <(daemon_pids)
  if [[ -e $CONF ]] && ((${#daemons[@]})); then
    local jobs
    jobs=$(SLURM_CONF=$CONF timeout 3 squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
    if [[ -n ${jobs// /} ]]; then
      [[ -n $quiet ]] || log "cancelling jobs: $jobs"
      # shellcheck disable=SC2086  # one word per job id
      SLURM_CONF=$CONF timeout 5 scancel --quiet $jobs >/dev/null 2>&1 || true
      local until=$((SECONDS + 5))
      while ((SECONDS < until)); do
        [[ -z "$(SLURM_CONF=$CONF timeout 2 squeue -h -o %i 2>/dev/null || true)" ]] && break
        sleep 0.1
      done
    fi
  fi

  # 2. The daemons, with their children (slurmctld's slurmscriptd): TERM, then KILL after 10 s.
  mapfile -t daemons < <(daemon_pids)
  if ((${#daemons[@]})); then
    mapfile -t kids < <(descendants_of "${daemons[@]}")
    [[ -n $quiet ]] || log "stopping daemons: ${daemons[*]}${kids[*]:+ (children: ${kids[*]})}"
    term_then_kill 10 "${daemons[@]}" ${kids[@]+"${kids[@]}"}
  fi

  # 3. Leftover slurmstepds (a step still running, or slurmd died) and the tasks below them.
  mapfile -t stepds < <(stepd_pids)
  if ((${#stepds[@]})); then
    mapfile -t kids < <(descendants_of "${stepds[@]}")
    [[ -n $quiet ]] || log "killing leftover slurmstepd: ${stepds[*]}${kids[*]:+ and their tasks: ${kids[*]}}"
    term_then_kill 2 "${stepds[@]}" ${kids[@]+"${kids[@]}"}
  fi

  # 4. Clients left waiting for a job that is gone.
  local clients=()
  mapfile -t clients < <(client_pids)
  if ((${#clients[@]})); then
    [[ -n $quiet ]] || log "killing leftover srun/salloc of this cluster: ${clients[*]}"
    term_then_kill 2 "${clients[@]}"
  fi

  remove_netns

  if [[ -e $D/$MARK_FILE ]]; then
    rm -rf -- "$D"
    [[ -n $quiet ]] || log "stopped; removed $D"
  fi
}

# ---------------------------------------------------------------------------------------------------------------
# --netns: names are made from the state directory, so that clusters of other state directories keep their own.

NETID=$(printf %s "$D" | cksum | awk '{ printf "%05d", $1 % 100000 }')
BRIDGE=rb$NETID
SUBNET=10.$((100 + 10#$NETID % 100)).0

netns_of() { echo "rpmi$NETID-$1"; }

# Removes this state directory's namespaces, their links and the bridge (each gone with its namespace).
remove_netns() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk -v p="rpmi$NETID-" 'index($1, p) == 1 { print $1 }'); do
    ip netns delete "$ns" 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE" 2>/dev/null || true; fi
}

# Node $2 (n1..) at index $1: its namespace, a veth pair to the bridge, its address; its /tmp under $D.
make_netns() {
  local i=$1 node=$2 ns host
  ns=$(netns_of "$node")
  host=rv${NETID}h$((i + 1))
  # (start_once runs under `||`, where set -e does not hold: each step says when it fails.)
  ip netns add "$ns" || die "ip netns add $ns failed"
  ip link add "$host" type veth peer name eth0 netns "$ns" || die "no veth pair for $node"
  ip link set "$host" master "$BRIDGE" up || die "$host cannot join $BRIDGE"
  ip -n "$ns" addr add "$SUBNET.$((i + 2))/24" dev eth0 || die "no address for $node"
  ip -n "$ns" link set eth0 up || die "eth0 of $node stays down"
  ip -n "$ns" link set lo up || die "lo of $node stays down"
  ip -n "$ns" route add default via "$SUBNET.1" || die "no route for $node"
  mkdir -p "$D/tmp/$node"
  chmod 1777 "$D/tmp/$node"
  # Where the node's /tmp will show the directories it keeps (those that lie under /tmp).
  local kept
  for kept in "${KEPT[@]}"; do
    [[ $kept != /tmp/* ]] || mkdir -p "$D/tmp/$node/${kept#/tmp/}"
  done
}

# The bridge between this machine and the nodes' namespaces.
make_bridge() {
  need ip
  remove_netns
  # The subnet comes from the state directory's name: another cluster's, or a network of this machine's,
  # may have it already.
  [[ -z $(ip -4 route show "$SUBNET.0/24") ]] ||
    die "$SUBNET.0/24 is routed here already (another cluster, or this machine's network): use another RPMI_SLURM_DIR"
  ip link add "$BRIDGE" type bridge || die "ip link add $BRIDGE failed"
  ip addr add "$SUBNET.1/24" dev "$BRIDGE" || die "no address for $BRIDGE"
  ip link set "$BRIDGE" up || die "$BRIDGE stays down"
}

# `sh -c AS_NODE - D NODE KEPT... -- COMMAND...`, in a mount namespace of its own, runs COMMAND as node NODE:
# the node's /tmp over this machine's, and each KEPT directory (the state directory, the plugin directories)
# that lies under /tmp at its own path in it. (Not through `ip netns exec`, whose /sys of the namespace hides
# the cgroups slurmd wants.)
AS_NODE='D=$1 node=$2; shift 2
while [ "$1" != -- ]; do
  case $1 in /tmp/*) mount --bind "$1" "$D/tmp/$node/${1#/tmp/}" || exit 1 ;; esac
  shift
done
shift
mount --rbind "$D/tmp/$node" /tmp || exit 1
exec "$@"'
# The directories every node keeps at their own paths (set at start).
KEPT=()

# ---------------------------------------------------------------------------------------------------------------
# start

need() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found; run docker/install-deps.sh"; }

# TCP ports in use on this machine (any state, IPv4 and IPv6), one per line, decimal.
used_ports() {
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk 'NR > 0 && $2 ~ /:/ { split($2, a, ":"); print a[2] }' |
    while read -r hex; do echo $((16#$hex)); done | sort -un
}

# Prints $1 distinct free ports, below the ephemeral range (so no outgoing connection can be holding them).
pick_ports() {
  local want=$1 lo hi used p n=0 tries=0
  read -r lo _ </proc/sys/net/ipv4/ip_local_port_range
  hi=$((lo - 1)); ((hi > 10000)) || hi=29999
  lo=10000
  used=" $(used_ports | tr '\n' ' ') "
  local got=" "
  while ((n < want)); do
    ((++tries < 10000)) || die "could not find $want free TCP ports in $lo-$hi"
    p=$((lo + (RANDOM * 32768 + RANDOM) % (hi - lo + 1)))
    [[ $used == *" $p "* || $got == *" $p "* ]] && continue
    got+="$p "; ((++n))
  done
  echo $got
}

ensure_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  log "munged is not answering; starting it"
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile=/etc/munge/munge.key --force
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
  fi
  chown -R munge:munge /etc/munge
  chmod 0700 /etc/munge
  chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  chmod 0700 /var/lib/munge /var/log/munge
  # A stale pid file or socket from a dead munged (e.g. a container restarted) would stop it from starting.
  local mpid
  if [[ -s /run/munge/munged.pid ]]; then
    mpid=$(</run/munge/munged.pid)
    if ! kill -0 "$mpid" 2>/dev/null; then rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock; fi
  fi
  # Debian runs munged as the munge user; do the same (runuser is part of util-linux, always present).
  runuser -u munge -- munged 9>&- ||
    die "munged failed to start; see /var/log/munge/munged.log"
  local i
  for ((i = 0; i < 50; i++)); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged started but munge/unmunge does not work; see /var/log/munge/munged.log"
}

default_plugin_dir() {
  local d
  local dirs=("/usr/lib/$(uname -m)-linux-gnu/slurm-wlm" /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/lib64/slurm /usr/lib/slurm)
  [[ -z ${RPMI_SLURM_PREFIX:-} ]] || dirs=("$RPMI_SLURM_PREFIX/lib/slurm" "$RPMI_SLURM_PREFIX/lib64/slurm")
  for d in "${dirs[@]}"; do
    [[ -e $d/auth_munge.so ]] && { echo "$d"; return; }
  done
  die "cannot find Slurm's plugin directory (auth_munge.so) in ${dirs[*]}; is Slurm installed?"
}

# The address of slurmctld, and of node index $1.
CTLD_ADDR=127.0.0.1
node_addr() { if ((NETNS)); then echo "$SUBNET.$(($1 + 2))"; else echo 127.0.0.1; fi; }

write_conf() {
  local plugindir=$1 ctlport=$2; shift 2
  local ports=("$@") i
  {
    cat <<EOF
# Throwaway rpmi test cluster, written by docker/slurm-cluster.sh; removed by its 'stop'.
ClusterName=rpmitest
SlurmctldHost=localhost($CTLD_ADDR)
SlurmctldPort=$ctlport
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
# What a site turns on to debug MPI: Slurm then logs a slurmstepd's environment (tests/slurm.rs checks that the
# step's secret is not in it).
SlurmdDebug=verbose
DebugFlags=MPI
PluginDir=$plugindir
PlugStackConfig=$D/plugstack.conf
# While $D/hold-launch exists (20 s at most), a job's first launch on a node waits in this prolog: the tests
# act on srun's collective port before any slurmstepd starts.
Prolog=$D/prolog.sh
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=$MPI_DEFAULT
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
MinJobAge=2
MailProg=/bin/true
# An srun that arrives while the previous job's nodes are still COMPLETING (the ~10 ms after the previous srun
# returned) is queued, and by default waits for the next scheduler pass (seconds). Pass every second instead.
SchedulerParameters=bf_interval=1,sched_interval=1
EOF
    for i in "${!NODES[@]}"; do
      echo "NodeName=${NODES[$i]} NodeAddr=$(node_addr "$i") NodeHostname=localhost Port=${ports[$i]} CPUs=32 RealMemory=8000"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } >"$CONF"
  if [[ -n $MPI_CONF ]]; then cp -- "$MPI_CONF" "$D/mpi.conf"; fi   # read by slurmd at start, beside slurm.conf
  : >"$D/plugstack.conf"   # keep the host's /etc/slurm/plugstack.conf (SPANK plugins) out of the tests
  # Slurm 23.02 and later probe cgroups at slurmd's start even with proctrack/pgid, and fail where there are none
  # to use (a chroot, a container); this cluster uses none. `disabled` came in 24.05: before, slurmd finds the
  # host's own cgroups.
  local version
  version=$(slurmd -V | awk '{split($2, v, "."); printf "%d%02d", v[1], v[2]}')
  if ((version >= 2405)); then echo "CgroupPlugin=disabled" >"$D/cgroup.conf"; fi
  cat >"$D/prolog.sh" <<EOF
#!/bin/sh
i=0
while [ -e "$D/hold-launch" ] && [ \$i -lt 400 ]; do sleep 0.05; i=\$((i + 1)); done
exit 0
EOF
  chmod 755 "$D/prolog.sh"
}

# Starts one daemon in its own session, detached from our stdio (or "$(... start)" and CI pipes would hang),
# with the marker in its environment; records its pid in $D/run/<name>.launch.pid.
launch() {
  local name=$1; shift
  env "$MARK_VAR=$D" SLURM_CONF="$CONF" setsid "$@" </dev/null >>"$D/log/$name.out" 2>&1 9>&- &
  echo $! >"$D/run/$name.launch.pid"
}

# The end of every daemon's log (the .out file, its stderr, only when the log file itself is empty),
# without the harmless "can not load PMIx library" noise.
print_tails() {
  local f log
  for f in "$D"/log/*.out; do
    log=${f%.out}.log
    [[ -s $log ]] || log=$f
    [[ -s $log ]] || continue
    echo "----- tail of $log -----" >&2
    grep -vE 'pmix|MPI: Cannot create context' "$log" | tail -n 20 >&2 || true
  done
}

# True if some daemon died on a port that was taken meanwhile (worth retrying with other ports).
port_clash() {
  grep -qsiE 'address already in use|unable to bind|bind\(\).*fail|slurm_init_msg_engine' "$D"/log/* 2>/dev/null
}

# One attempt; returns 0 when the nodes are idle, 1 on failure (daemons left for the caller to stop),
# 2 on a port clash.
start_once() {
  local plugindir=$1 ports ctlport i
  rm -rf -- "$D"
  mkdir -p "$D"/{state,run,log}
  : >"$D/$MARK_FILE"
  for i in "${NODES[@]}"; do mkdir -p "$D/spool/$i"; done

  if [[ -n ${RPMI_SLURM_PORTS:-} ]]; then   # fixed ports, "ctld n1 n2 n3" (for debugging; no clash retry)
    read -r -a ports <<<"$RPMI_SLURM_PORTS"
    ((${#ports[@]} == 1 + ${#NODES[@]})) || die "RPMI_SLURM_PORTS needs $((1 + ${#NODES[@]})) ports"
  else
    read -r -a ports <<<"$(pick_ports $((1 + ${#NODES[@]})))"
  fi
  ctlport=${ports[0]}
  if ((NETNS)); then
    make_bridge
    CTLD_ADDR=$SUBNET.1
    IFS=: read -r -a KEPT <<<"$D:$plugindir"
  fi
  write_conf "$plugindir" "$ctlport" "${ports[@]:1}"
  log "state in $D; slurmctld port $ctlport, slurmd ports ${ports[*]:1}; PluginDir=$plugindir"

  launch slurmctld slurmctld -D -i -f "$CONF"
  # Let slurmctld bind its port before the slurmds register (they retry anyway, this only saves a round).
  for ((i = 0; i < 50; i++)); do
    SLURM_CONF=$CONF timeout 2 scontrol ping 2>/dev/null | grep -q 'is UP' && break
    alive "$(<"$D/run/slurmctld.launch.pid")" || break
    sleep 0.1
  done
  local node slurmd
  for i in "${!NODES[@]}"; do
    node=${NODES[$i]}
    slurmd=(slurmd -D -N "$node" -f "$CONF")
    if ((NETNS)); then
      make_netns "$i" "$node"
      slurmd=(unshare --mount nsenter --net="/run/netns/$(netns_of "$node")" sh -c "$AS_NODE" - "$D" "$node" \
        "${KEPT[@]}" -- "${slurmd[@]}")
    fi
    launch "slurmd-$node" "${slurmd[@]}"
  done

  local deadline=$((SECONDS + START_TIMEOUT)) states pid
  while ((SECONDS < deadline)); do
    states=$(SLURM_CONF=$CONF timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
    if [[ $(grep -cE '^n[0-9]+ idle$' <<<"$states") -eq ${#NODES[@]} ]]; then
      return 0
    fi
    for f in "$D"/run/*.launch.pid; do
      pid=$(<"$f")
      if ! alive "$pid"; then
        log "$(basename "$f" .launch.pid) exited during start-up"
        port_clash && return 2
        return 1
      fi
    done
    sleep 0.2
  done
  log "nodes not idle after ${START_TIMEOUT}s; sinfo says:"
  printf '%s\n' "$states" >&2
  return 1
}

# The cluster's nodes: n1..n$1.
set_nodes() {
  [[ $1 =~ ^[0-9]+$ ]] && (($1 >= 1 && $1 <= 1000)) || die "--nodes $1 is not a count from 1 to 1000"
  local i
  NODES=()
  for ((i = 1; i <= $1; i++)); do NODES+=("n$i"); done
}

do_start() {
  local plugin_dir=""
  while (($#)); do
    case $1 in
      --plugin-dir) (($# >= 2)) || die "--plugin-dir needs a directory"; plugin_dir=$2; shift 2 ;;
      --plugin-dir=*) plugin_dir=${1#*=}; shift ;;
      --nodes) (($# >= 2)) || die "--nodes needs a count"; set_nodes "$2"; shift 2 ;;
      --nodes=*) set_nodes "${1#*=}"; shift ;;
      --mpi-conf) (($# >= 2)) || die "--mpi-conf needs a file"; MPI_CONF=$(realpath -- "$2"); shift 2 ;;
      --mpi-conf=*) MPI_CONF=$(realpath -- "${1#*=}"); shift ;;
      --mpi-default) (($# >= 2)) || die "--mpi-default needs a type"; MPI_DEFAULT=$2; shift 2 ;;
      --mpi-default=*) MPI_DEFAULT=${1#*=}; shift ;;
      --netns) NETNS=1; shift ;;
      *) die "unknown option for start: $1" ;;
    esac
  done
  ((EUID == 0)) || die "must run as root (slurmd has to be root to start job steps)"
  ((!NETNS || ${#NODES[@]} <= 250)) || die "--netns takes 250 nodes at most"
  local c
  for c in slurmctld slurmd sinfo scontrol squeue scancel srun munge unmunge munged setsid runuser ps awk; do need "$c"; done

  local plugindir
  plugindir=$(default_plugin_dir)
  [[ -z $MPI_CONF || -f $MPI_CONF ]] || die "--mpi-conf $MPI_CONF is not a file"
  if [[ -n $plugin_dir ]]; then
    [[ -d $plugin_dir ]] || die "--plugin-dir $plugin_dir is not a directory"
    plugin_dir=$(cd "$plugin_dir" && pwd)
    [[ -e $plugin_dir/mpi_rpmi.so ]] || log "warning: no mpi_rpmi.so in $plugin_dir"
    plugindir="$plugin_dir:$plugindir"
  fi

  if [[ -e $D ]]; then
    [[ -e $D/$MARK_FILE ]] || die "$D exists but was not made by this script (no $MARK_FILE); set RPMI_SLURM_DIR"
    if cluster_running; then log "a cluster is already running from $D; stopping it first"; fi
  fi
  do_stop quiet

  ensure_munge

  local t0=$EPOCHREALTIME attempt rc
  for attempt in 1 2 3; do
    rc=0
    start_once "$plugindir" || rc=$?
    if ((rc == 0)); then
      log "up in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')s: ${#NODES[@]} nodes idle"
      SLURM_CONF=$CONF sinfo >&2
      echo "export SLURM_CONF=$(printf %q "$CONF")"   # start prints the same line as `env`
      return 0
    fi
    if ((rc == 2 && attempt < 3)) && [[ -z ${RPMI_SLURM_PORTS:-} ]]; then
      log "a port was taken meanwhile; retrying with other ports"
      do_stop quiet
      continue
    fi
    break
  done
  log "the cluster did not come up; logs:"
  print_tails
  do_stop quiet
  exit 1
}

# ---------------------------------------------------------------------------------------------------------------

# start and stop of one state dir are serialised (two CI jobs or test binaries racing on the same cluster);
# fd 9 is closed in every daemon we launch, so the lock ends with this script.
lock() {
  exec 9>>"$D.lock"
  flock -w 120 9 || die "another start/stop of $D is still running (lock $D.lock)"
}

cmd=${1:-}
(($#)) && shift
case $cmd in
  start)
    lock
    do_start "$@"
    ;;
  stop)
    ((EUID == 0)) || die "must run as root"
    lock
    do_stop
    ;;
  status)
    [[ -e $CONF ]] || die "no cluster at $D (run: $0 start)"
    SLURM_CONF=$CONF sinfo
    ;;
  env)
    [[ -e $CONF ]] || die "no cluster at $D (run: $0 start)"
    echo "export SLURM_CONF=$(printf %q "$CONF")"
    ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
