#!/usr/bin/env python3
"""The fault and soak campaign of `srun --mpi=rpmi` beside Slurm's own `--mpi=pmi2` and, for what Slurm does
without any PMI, `--mpi=none` with plain (non-MPI) tasks, run by docker/campaign.sh on the local Slurm cluster.

Faults: a victim job on n2,n3 is hit (SIGKILL of one of its tasks, of one of its slurmstepds, of its srun or of
the slurmd of its node; its srun stopped, then continued) at a random point of its launch, exchange, barrier loop
or finalize (one rank late into MPI_Finalize, the others waiting in theirs), while two bystander jobs run on n1.
Each run records how long srun took to go after the fault, what of the step was left behind, and how every
bystander step exited.
Soak: steps back to back, 8 at a time (MPICH jobs, exchanges, aborts), with srun's, the slurmstepds' and
slurmd's memory and open fds, the first steps against the last.
Throughout, a slurmd that glibc ends (Slurm 22.05.8 corrupting its own heap: CrashWatch) is started again, and
what it overlapped is listed, not judged.

Writes a markdown report and its JSON; exits 1 when a target is not met. Needs SLURM_CONF (the cluster
docker/with-slurm.sh starts), root (it reads every process's /proc entries) and Python 3's standard library.
"""

import argparse
import datetime
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import namedtuple

MARK = "RPMI_CAMPAIGN_MARK"  # in srun's environment, so in each task's: finds a job's tasks, orphans too
CLUSTER = os.path.dirname(os.path.abspath(os.environ.get("SLURM_CONF", "/nonexistent/slurm.conf")))
CLUSTER_MARK = "RPMI_SLURM_CLUSTER"  # docker/slurm-cluster.sh puts it in its daemons' environment

POLL = 0.05  # s between looks at the victim
SAMPLE = 0.1  # s between samples of the soak's steps
SLURMD_EVERY = 5  # soak samples per sample of slurmd
GONE_WITHIN = 30  # s: the targets (srun gone after the fault; the step gone after srun)
# s after the fault (or SIGCONT) past which srun is hung and killed: how much longer it would run says no more.
GUARD = 40
STEP_GUARD = 120  # s any step without a fault may take before it counts as hung
SLURMD_RESTART_AFTER = 1  # s a killed slurmd stays down, as a supervisor would restart it
# What glibc prints when it finds a heap corrupted and aborts (Debian 12's slurmd 22.05.8 corrupts its own heap
# under the soak's launches, whatever the plugin: benches/results/README.md, "slurmd's heap in the soak").
GLIBC_HEAP_ABORT = re.compile(rb"^(?:[a-z_]+\(\): [^\n]*|double free or corruption[^\n]*|corrupted [^\n]*)$", re.M)
# s after a crashed slurmd's restart within which a step may still fail of it (its node re-registering).
CRASH_MARGIN = 10

KINDS = ["task", "stepd", "srun", "slurmd", "stop"]
PHASES = ["launch", "exchange", "barrier", "finalize"]
KIND_TEXT = {
    "task": "SIGKILL of a task",
    "stepd": "SIGKILL of a slurmstepd",
    "srun": "SIGKILL of srun",
    "slurmd": "SIGKILL of a slurmd",
    "stop": "srun SIGSTOP, SIGCONT 1-8 s later",
}
VICTIM_NODES = ["n2", "n3"]
VICTIM_LAYOUT = ["-w", "n[2-3]", "-N2", "-n4"]
VICTIM_TASKS = 4
BYSTANDER_LAYOUT = ["-w", "n1", "-N1", "-n2"]
SOAK_LAYOUT = ["-N3", "-n6"]  # one layout: a step's figures then depend on its kind only
SOAK_TASKS = 6
SOAK_KINDS = ["pairs", "exchange", "abort"]
SOAK_PARALLEL = 8
# rpmi-probe's arguments: the victim's exchange and barrier loop (a few seconds each here), the bystander's
# barrier loop, the soak's exchange.
EXCHANGE = ["exchange", "--puts", "10000", "--size", "400", "--count", "20000"]
# The barrier loops' counts by plugin, so that each lasts a few seconds under its plugin: a barrier of 4 ranks on
# 2 nodes takes 0.08 ms under rpmi and 11.6 ms under pmi2 here (whose srun-side agent waits on a timer).
BARRIER_COUNTS = {"rpmi": 30000, "pmi2": 350}
BYSTANDER_BARRIER_COUNTS = {"rpmi": 5000, "pmi2": 200}


# The finalize's workload: the victim's last rank enters MPI_Finalize this long after the others.
FINALIZE_LATE = 2  # s
SOAK_EXCHANGE = ["exchange", "--puts", "50", "--size", "200"]
# `--mpi=none` runs plain tasks (no PMI, no MPI) instead: each sleeps BEFORE s, rank 0 then prints its line,
# rank LATE sleeps LATE_S more, and rank EXIT_RANK exits with EXIT_CODE.
PLAIN_TASK = """import os, sys, time
before, late, late_s, exit_rank, exit_code = sys.argv[1:]
rank = os.environ["SLURM_PROCID"]
time.sleep(float(before))
if rank == "0":
    print("plain: done", flush=True)
if rank == exit_rank:
    sys.exit(int(exit_code))
if rank == late:
    time.sleep(float(late_s))
"""


def barriers(counts, mpi):
    return ["barrier", "--count", str(counts.get(mpi, counts["pmi2"]))]


def plain(before, late_s=0, exit_rank=-1, exit_code=0):
    """A plain task's command line (PLAIN_TASK): for `--mpi=none`."""
    return ["python3", "-c", PLAIN_TASK, str(before), str(VICTIM_TASKS - 1), str(late_s), str(exit_rank),
            str(exit_code)]


# --------------------------------------------------------------------------------------------------------------
# /proc


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def alive(pid):
    """True while pid runs (a zombie is gone)."""
    stat = read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b") ", 1)[1][:1] not in (b"Z", b"X")


def environ(pid):
    raw = read(f"/proc/{pid}/environ") or b""
    return dict(e.split(b"=", 1) for e in raw.split(b"\0") if b"=" in e)


def status_field(pid, field):
    """The text of one field of /proc/PID/status, or None."""
    for line in (read(f"/proc/{pid}/status") or b"").decode(errors="replace").splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def status_kib(pid, field):
    text = status_field(pid, field)
    return None if text is None else int(text.split()[0])


def nfds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def ppid(pid):
    stat = read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b") ", 1)[1].split()[1]) if stat else None


def stepd_node(pid):
    """The node a slurmstepd of this cluster serves: the one whose log or spool directory it holds open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.match(re.escape(CLUSTER) + r"/(?:spool/|log/slurmd-)(n\d+)", link)
        if m:
            return m.group(1)
    return None


Task = namedtuple("Task", "rank node job")
_seen = {}  # (pid, comm) -> Task, ("stepd", job, node) or None: a process is read again only once it execs


def scan():
    """One look at /proc: {mark: {pid: Task}} of the campaign's live tasks and {job: {pid: node}} of this
    cluster's live slurmstepds. A task is found by the marker in its environment (so an orphan too); a
    slurmstepd by its title `slurmstepd: [JOB.STEP]` and a file of this cluster it holds open, not counting its
    children before they exec their task (named slurmstepd too)."""
    global _seen
    tasks, stepds, seen = {}, {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        comm = read(f"/proc/{pid}/comm")
        if comm is None or not alive(pid):
            continue
        key = (pid, comm)
        if key in _seen:
            info = _seen[key]
        elif comm == b"slurmstepd\n":
            info = None
            m = re.search(rb"\[(\d+)\.", read(f"/proc/{pid}/cmdline") or b"")
            parent = read(f"/proc/{ppid(pid)}/comm")
            node = stepd_node(pid) if m and parent != b"slurmstepd\n" else None
            if node is None:
                continue  # not ours, a child about to exec, or not yet titled: look again next time
            info = ("stepd", m.group(1).decode(), node)
        else:
            env = environ(pid)
            mark, rank = env.get(MARK.encode()), env.get(b"SLURM_PROCID")
            info = None
            if mark and rank is not None:  # srun has the marker too, but no SLURM_PROCID
                info = (mark.decode(), Task(int(rank), env.get(b"SLURMD_NODENAME", b"?").decode(),
                                            env.get(b"SLURM_JOB_ID", b"").decode()))
        seen[key] = info
        if info is None:
            continue
        if info[0] == "stepd":
            stepds.setdefault(info[1], {})[pid] = info[2]
        else:
            tasks.setdefault(info[0], {})[pid] = info[1]
    _seen = seen
    return tasks, stepds


def slurmds():
    """{node: pid} of this cluster's slurmd daemons (found by the cluster's marker, as slurm-cluster.sh does),
    not counting the children a slurmd forks to start a step (named slurmd too, until they exec)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and read(f"/proc/{name}/comm") == b"slurmd\n" and alive(int(name)) and \
                read(f"/proc/{ppid(name)}/comm") != b"slurmd\n":
            if environ(name).get(CLUSTER_MARK.encode()) == CLUSTER.encode():
                argv = (read(f"/proc/{name}/cmdline") or b"").split(b"\0")
                if b"-N" in argv:
                    out[argv[argv.index(b"-N") + 1].decode()] = int(name)
    return out


def kill(pid, sig=signal.SIGKILL):
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def describe(tasks, stepds):
    parts = [f"task rank {t.rank} ({t.node}) pid {pid}" for pid, t in sorted(tasks.items())]
    parts += [f"slurmstepd {node} pid {pid}" for pid, node in sorted(stepds.items())]
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------------------------
# Slurm


def slurm(*args, timeout=10):
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return ""


def job_of(mark):
    """The id of the job named `mark`, while slurmctld still shows it (MinJobAge after its end)."""
    ids = slurm("squeue", "-h", "-t", "all", f"--name={mark}", "-o", "%i").split()
    return ids[0] if ids else None


def job_state(mark):
    states = slurm("squeue", "-h", f"--name={mark}", "-o", "%T").split()
    return states[0] if states else None


def proc_state(pid):
    """The State of /proc/PID/status, and its threads' count."""
    return f"state {status_field(pid, 'State') or '?'}, {status_field(pid, 'Threads') or '?'} threads"


def wait_idle(limit=120):
    """Waits until every node is idle, resuming one a fault left down or drained. Returns what is worth noting:
    a node resumed, a wait of more than 5 s, nodes still busy after `limit` s; else ""."""
    start, resumed, states = time.monotonic(), set(), {}
    while time.monotonic() - start < limit:
        states = dict(line.split() for line in slurm("sinfo", "-h", "-N", "-o", "%N %T").splitlines() if line)
        if states and all(s == "idle" for s in states.values()):
            break
        for node, s in states.items():
            if re.match(r"(down|drain|fail)", s) and node not in resumed:
                slurm("scontrol", "update", f"nodename={node}", "state=resume")
                resumed.add(node)
        time.sleep(0.2)
    else:
        # Whether each such node's slurmd runs, and in what state (a slurmd that runs but answers slurmctld no
        # more is not one that died).
        found = slurmds()
        procs = {node: f"slurmd pid {found[node]}, {proc_state(found[node])}" if node in found else "no slurmd"
                 for node, s in states.items() if s != "idle"}
        return f"nodes not idle after {limit} s: {states} ({procs})"
    took = time.monotonic() - start
    said = [f"resumed {', '.join(sorted(resumed))}"] if resumed else []
    if resumed or took > 5:
        said.append(f"nodes idle after {took:.1f} s")
    return "; ".join(said)


class Srun:
    """One `srun -Q --mpi=MPI` of the campaign, its output in files, reaped by a thread of its own; every task
    carries its marker."""

    count = itertools.count()

    def __init__(self, work, name, mpi, args):
        self.mark = f"campaign-{os.getpid()}-{next(Srun.count)}-{name}"
        self.out, self.err = (os.path.join(work, f"{self.mark}.{ext}") for ext in ("out", "err"))
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(["srun", "-Q", f"--mpi={mpi}", f"--job-name={self.mark}", *args],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env={**os.environ, MARK: self.mark})
        self.pid, self.start = self.proc.pid, time.monotonic()
        self.end = self.code = None
        self.done = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self):
        _, status = os.waitpid(self.pid, 0)
        self.end, self.code = time.monotonic(), os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.code  # reaped here: Popen must not wait for it again
        self.done.set()

    def wait(self, timeout):
        return self.done.wait(timeout)

    def stdout(self):
        return (read(self.out) or b"").decode(errors="replace")

    def stderr(self):
        return (read(self.err) or b"").decode(errors="replace")

    def kill_all(self):
        """Ends srun, its job and what is left of its tasks (a hung run, a leftover)."""
        kill(self.pid)
        self.wait(10)
        slurm("scancel", "--quiet", f"--name={self.mark}")
        for pid in scan()[0].get(self.mark, {}):
            kill(pid)


def exit_text(code):
    if code is None:
        return "-"
    if code == "hung":
        return "hung"
    return f"signal {signal.Signals(-code).name}" if code < 0 else str(code)


class Bystander(threading.Thread):
    """Steps of one workload on n1, back to back until stopped: each must exit 0 whatever the victim suffers."""

    def __init__(self, work, name, mpi, argv):
        super().__init__(daemon=True)
        self.work, self.name_, self.mpi, self.argv = work, name, mpi, argv
        self.stop, self.codes = threading.Event(), []

    def run(self):
        while not self.stop.is_set():
            step = Srun(self.work, self.name_, self.mpi, BYSTANDER_LAYOUT + self.argv)
            if step.wait(STEP_GUARD):
                self.codes.append(step.code)
            else:
                step.kill_all()
                self.codes.append("hung")

    def finish(self):
        self.stop.set()
        self.join()
        return {"steps": len(self.codes), "failed": [exit_text(c) for c in self.codes if c != 0]}


# --------------------------------------------------------------------------------------------------------------
# Faults

Workload = namedtuple("Workload", "name argv line")


def workloads(pairs, probe, mpi):
    if mpi == "none":
        # Plain tasks about as long as each workload here, whose faults show what Slurm does on its own.
        return {
            "pairs": Workload("pairs", plain(0.3), "plain:"),
            "finalize": Workload("finalize", plain(0.3, FINALIZE_LATE), "plain:"),
            "exchange": Workload("exchange", plain(1.5), "plain:"),
            "barrier": Workload("barrier", plain(4), "plain:"),
        }
    # stdbuf: rank 0's line (printed just before MPI_Finalize) reaches srun at once, marking the finalize.
    late = f"finalize_after={VICTIM_TASKS - 1}:{FINALIZE_LATE}"
    return {
        "pairs": Workload("pairs", ["stdbuf", "-oL", pairs], "mpi_pairs:"),
        "finalize": Workload("finalize", ["stdbuf", "-oL", pairs, late], "mpi_pairs:"),
        "exchange": Workload("exchange", [probe, *EXCHANGE], "exchange:"),
        "barrier": Workload("barrier", [probe, *barriers(BARRIER_COUNTS, mpi)], "barrier:"),
    }


# For each phase: its workload, the moment its window opens (srun's start, every task seen, rank 0's line seen)
# and how the window's length follows from the calibration runs (of which a fault run takes WINDOW_SHARE: runs
# vary, and a fault after the phase tests no more than one at its end).
WINDOW_SHARE = 0.6
PHASE_PLAN = {
    "launch": ("pairs", "start", lambda c: c["line"]),
    "exchange": ("exchange", "tasks", lambda c: c["exit"] - c["tasks"]),
    "barrier": ("barrier", "tasks", lambda c: c["exit"] - c["tasks"]),
    "finalize": ("finalize", "line", lambda c: c["exit"] - c["line"]),
}


class Victim:
    """The victim step on n2,n3, looked at from /proc: its tasks, its slurmstepds and the moments its phases
    begin."""

    def __init__(self, ctx, mpi, workload):
        self.workload = workload
        self.srun = Srun(ctx.work, f"victim-{mpi}-{workload.name}", mpi, VICTIM_LAYOUT + workload.argv)
        self.job = self.tasks_at = self.line_at = None
        self.asked = 0.0

    def look(self):
        tasks, stepds = scan()
        tasks = tasks.get(self.srun.mark, {})
        now = time.monotonic()
        if self.job is None:
            self.job = next((t.job for t in tasks.values()), None)
        if self.job is None and now - self.asked > 0.5:  # no task yet: ask slurmctld, not too often
            self.asked, self.job = now, job_of(self.srun.mark)
        if self.tasks_at is None and len(tasks) >= VICTIM_TASKS:
            self.tasks_at = now
        if self.line_at is None and self.workload.line in self.srun.stdout():
            self.line_at = now
        return tasks, stepds.get(self.job, {}) if self.job else {}

    def anchor(self, which):
        """Waits for the moment `which` (start, tasks, line); None if srun ended first."""
        while True:
            self.look()
            at = {"start": self.srun.start, "tasks": self.tasks_at, "line": self.line_at}[which]
            if at is not None:
                return at
            if self.srun.done.is_set():
                return None
            time.sleep(POLL / 5)

    def sleep_until(self, at):
        while time.monotonic() < at:
            self.look()
            time.sleep(min(POLL, max(0, at - time.monotonic())))

    def pick(self, rng, which):
        """A random live task or slurmstepd of the step, waiting for one to exist: (pid, text, node), or
        (None, why, None) once srun is gone."""
        while True:
            tasks, stepds = self.look()
            if which == "task" and tasks:
                pid = rng.choice(sorted(tasks))
                return pid, f"task rank {tasks[pid].rank} ({tasks[pid].node}) pid {pid}", tasks[pid].node
            if which == "stepd" and stepds:
                pid = rng.choice(sorted(stepds))
                return pid, f"slurmstepd {stepds[pid]} pid {pid}", stepds[pid]
            if self.srun.done.is_set():
                what = "task" if which == "task" else "slurmstepd"
                return None, f"nothing: srun gone, no {what} of the step left", None
            time.sleep(POLL / 5)


class Cluster:
    """What the campaign needs of the cluster: its slurmds, killed and restarted as slurm-cluster.sh started
    them."""

    def __init__(self):
        self.children = {}  # restarted slurmds are our children: reaped when killed again
        # Held while a slurmd is killed or started again, by a fault or by CrashWatch: one at a time.
        self.lock = threading.Lock()

    @staticmethod
    def launch_of(pid):
        """How the slurmd `pid` was started: what restart_slurmd needs to start it again."""
        return {"argv": [a.decode() for a in read(f"/proc/{pid}/cmdline").split(b"\0")[:-1]],
                "env": {k.decode(): v.decode() for k, v in environ(pid).items()},
                "cwd": os.readlink(f"/proc/{pid}/cwd"), "out": os.readlink(f"/proc/{pid}/fd/1")}

    def strike_slurmd(self, node):
        """The fault: SIGKILL of `node`'s slurmd, started again SLURMD_RESTART_AFTER later. Returns when it was
        killed, its pid and the new one's. A slurmd missing (Slurm's own crash, which CrashWatch mends) is
        waited for first."""
        until = time.monotonic() + GONE_WITHIN
        while True:
            with self.lock:
                pid = slurmds().get(node)
                if pid is not None:
                    saved, fault = self.launch_of(pid), time.monotonic()
                    kill(pid)
                    if pid in self.children:
                        self.children.pop(pid).wait()
                    while alive(pid):
                        time.sleep(0.01)
                    time.sleep(SLURMD_RESTART_AFTER)
                    return fault, pid, self.restart_slurmd(node, saved)
            if time.monotonic() > until:
                raise SystemExit(f"campaign: no slurmd of {node} to strike for {GONE_WITHIN} s")
            time.sleep(POLL)

    def restart_slurmd(self, node, saved):
        """Starts `node`'s slurmd again (under self.lock): as slurm-cluster.sh's launch, in its own session
        (setsid), stdin /dev/null, output appended to its .out file, the same arguments, initial environment
        (the cluster's marker with it) and directory."""
        with open(saved["out"], "ab") as out:
            proc = subprocess.Popen(saved["argv"], env=saved["env"], cwd=saved["cwd"], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.children[proc.pid] = proc
        with open(os.path.join(CLUSTER, "run", f"slurmd-{node}.launch.pid"), "w") as f:
            f.write(f"{proc.pid}\n")
        time.sleep(1)
        if proc.poll() is not None:
            raise SystemExit(f"campaign: the restarted slurmd of {node} exited ({proc.returncode}); see "
                             f"{saved['out']}")
        return proc.pid


def size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def kernel_faults(within=5):
    """The kernel's lines, from the last `within` s, of a slurmd that faulted inside libc (a segfault, a
    general protection fault): how a corrupted heap can end it without a word of glibc's. The line names the
    faulting thread, not the process: it is told by its time (the watch sees a slurmd gone within a second)."""
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True).stdout  # empty where the log is not ours to read
        uptime = float((read("/proc/uptime") or b"0").split()[0])
    except (OSError, ValueError):
        return []
    fault = rb"(?:segfault|general protection fault)[^\n]* in libc[^\n]*"
    found = re.findall(rb"^\[ *(\d+\.\d+)\] (?:traps: )?(slurmd\[\d+\]:? " + fault + rb")", kernel, re.M)
    return [line for at, line in found if uptime - float(at) <= within]


def heap_abort(out, offset):
    """Why glibc ended a slurmd, if it did: the heap check it printed on its output `out` after `offset`, or a
    kernel line of kernel_faults(). None otherwise."""
    try:
        with open(out, "rb") as f:
            f.seek(offset)
            said = GLIBC_HEAP_ABORT.findall(f.read())
    except OSError:
        said = []
    found = said or kernel_faults()
    return found[-1].decode(errors="replace") if found else None


class CrashWatch:
    """Watches the cluster's slurmds for the whole campaign, in a thread of its own: one that glibc ended (its
    heap found corrupted, heap_abort) is started again as the faults start one, and when it was gone is kept, so
    that the fault runs and soak steps it overlapped are told from the plugin's own failures (hit). A slurmd
    gone for any other reason is left alone: what it breaks counts. A fault's kill and restart hold the
    cluster's lock, so the watch never sees that gap."""

    def __init__(self, cluster):
        self.cluster, self.crashes, self.lock = cluster, [], threading.Lock()
        self.launches = {}  # node -> (pid, how it was started, the size of its output then)
        self.seen = {}  # node -> when its slurmd was last seen running
        self.judged = set()  # pids found gone, crashed or not: each is judged once
        self.looks = threading.Condition()
        self.looked = 0  # looks completed
        self.done = threading.Event()
        self.look()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.wait(SAMPLE * SLURMD_EVERY):
            try:
                self.look()
            except Exception as e:  # the watch must outlive what it meets; the campaign goes on either way
                print(f"campaign: the slurmd watch: {e!r}", file=sys.stderr, flush=True)
            with self.looks:
                self.looked += 1
                self.looks.notify_all()

    def stop(self):
        self.done.set()
        self.thread.join()

    def settle(self):
        """Waits until a look that began after this call has ended: a crash that happened before it is known."""
        with self.looks:
            want = self.looked + 2
            self.looks.wait_for(lambda: self.looked >= want or self.done.is_set(), timeout=10)

    def look(self):
        with self.cluster.lock:
            now, found = time.monotonic(), slurmds()
            for node, pid in found.items():
                self.seen[node] = now
                if self.launches.get(node, (None,))[0] != pid:
                    try:
                        launch = self.cluster.launch_of(pid)
                    except (OSError, AttributeError):  # gone meanwhile: seen at the next look
                        continue
                    self.launches[node] = (pid, launch, size(launch["out"]))
            for node in [n for n in self.launches if n not in found]:
                pid, launch, offset = self.launches[node]
                if pid in self.judged:
                    continue
                self.judged.add(pid)
                why = heap_abort(launch["out"], offset)
                if not why:
                    continue
                say_slurmd_gone(node, f"({why}); starting it again")
                crash = {"node": node, "from": self.seen.get(node, now), "until": time.monotonic(), "why": why}
                with self.lock:  # known at once, before the restart's second
                    self.crashes.append(crash)
                try:
                    new = self.cluster.restart_slurmd(node, launch)
                except (SystemExit, OSError) as e:  # not started again: its node's steps fail, and count
                    print(e, file=sys.stderr, flush=True)
                    continue
                with self.lock:
                    crash["until"] = time.monotonic()
                self.launches[node] = (new, launch, size(launch["out"]))

    def hit(self, start, end):
        """Whether something that ran from `start` to `end` overlapped a crash (or its node's return after it)."""
        with self.lock:
            return any(start <= c["until"] + CRASH_MARGIN and end >= c["from"] for c in self.crashes)

    def since(self, origin):
        """The crashes, in seconds from `origin`."""
        with self.lock:
            return [{"node": c["node"], "from_s": round(c["from"] - origin, 1),
                     "until_s": round(c["until"] - origin, 1), "why": c["why"]} for c in self.crashes]


def bystanders(ctx, mpi):
    """The bystanders of a victim under `mpi`: steps of the same plugin (plain tasks under none)."""
    barrier = plain(2) if mpi == "none" else [ctx.probe, *barriers(BYSTANDER_BARRIER_COUNTS, mpi)]
    pairs = plain(0.3) if mpi == "none" else [ctx.pairs]
    return [Bystander(ctx.work, f"bystander-{mpi}-barrier", mpi, barrier),
            Bystander(ctx.work, f"bystander-{mpi}-pairs", mpi, pairs)]


def calibrate(ctx, mpi, runs=2):
    """Clean runs of each victim workload under `mpi` beside the bystanders: when its tasks are all up, when rank
    0's line comes, when srun exits (s from srun's start; the least of the runs, so that a window stays in its
    phase)."""
    found = {}
    for name, workload in ctx.workloads[mpi].items():
        seen, unseen, crashed = [], 0, 0
        while len(seen) < runs:
            wait_idle()
            began = time.monotonic()
            side = bystanders(ctx, mpi)
            for b in side:
                b.start()
            victim = Victim(ctx, mpi, workload)
            while not victim.srun.done.is_set():
                victim.look()
                time.sleep(POLL / 5)
            victim.look()
            by = [b.finish() for b in side]
            failed = victim.srun.code != 0 or any(b["failed"] for b in by)
            ended = time.monotonic()
            ctx.watch.settle()
            if ctx.watch.hit(began, ended):
                # A crash of Slurm's own slurmd overlapped it: made again, three times at most.
                crashed += 1
                if crashed > 3:
                    raise SystemExit(f"campaign: four runs of {name} under --mpi={mpi} met a slurmd crash")
                continue
            if failed:
                raise SystemExit(f"campaign: a clean run of {name} under --mpi={mpi} failed "
                                 f"({exit_text(victim.srun.code)}, "
                                 f"bystanders {by}):\n{victim.srun.stderr()}")
            if victim.tasks_at is None or victim.line_at is None:
                # The run was right but the look at /proc missed a moment of it: it is timed again, twice at
                # most.
                unseen += 1
                if unseen > 2:
                    raise SystemExit(f"campaign: three clean runs of {name} whose tasks or line were not seen")
                continue
            s = victim.srun
            seen.append({"tasks": victim.tasks_at - s.start, "line": victim.line_at - s.start, "exit": s.end - s.start})
        found[name] = {k: min(c[k] for c in seen) for k in seen[0]}
    return found


# CI's runs: each kind twice, in two phases, each of whose outcome is rpmi's to decide. A slurmstepd is struck
# after its launch (one killed before it joins srun's root leaves the step waiting as Slurm's own does without
# rpmi) and before its tasks end (after, srun waits for it as Slurm's own does): the full campaign counts those,
# but CI cannot pass them by chance.
CI_PLAN = [("task", "exchange"), ("stepd", "exchange"), ("srun", "barrier"), ("slurmd", "finalize"),
           ("stop", "launch"), ("task", "finalize"), ("stepd", "barrier"), ("srun", "exchange"),
           ("slurmd", "launch"), ("stop", "exchange")]


def fault_plan(n, rng, ci):
    """n (kind, phase) pairs: CI's plan, or every 5 in a row have each kind once, and over 20 runs each kind
    meets each phase once (100 runs: each pair 5 times); the phases start at a random one."""
    if ci:
        return CI_PLAN[:n]
    r = rng.randrange(len(PHASES))
    return [(KINDS[i % 5], PHASES[(i // 5 + i % 5 + r) % 4]) for i in range(n)]


def fault_run(ctx, mpi, rng, index, kind, phase):
    """Fault run `index` under `--mpi=mpi`; `rng` is the run's own (the same for every plugin: the same share of
    the window, the same draws of what to strike)."""
    workload, anchor_name, window_of = PHASE_PLAN[phase]
    window = max(0.0, WINDOW_SHARE * window_of(ctx.calibration[mpi][workload]))
    delay = rng.uniform(0, window)
    run = {"run": index, "mpi": mpi, "kind": kind, "phase": phase, "workload": workload,
           "window_s": round(window, 3)}
    notes = []
    wait_idle()
    began = time.monotonic()
    side = bystanders(ctx, mpi)
    for b in side:
        b.start()
    time.sleep(0.5)  # the bystanders' first steps are under way
    victim = Victim(ctx, mpi, ctx.workloads[mpi][workload])
    anchor = victim.anchor(anchor_name)
    if anchor is None:
        notes.append(f"srun ended before its {phase} window opened")
        anchor = time.monotonic()
    victim.sleep_until(anchor + delay)

    # The fault. `hit`: the victim was still in the phase when struck (its result line not yet out; for the
    # finalize, a task still running).
    tasks, _ = victim.look()
    running = not victim.srun.done.is_set()
    run["hit"] = running and (bool(tasks) if phase == "finalize" else victim.line_at is None)
    resumed = None
    if kind in ("task", "stepd"):
        pid, target, node = victim.pick(rng, kind)
        fault = time.monotonic()
        if pid is not None:
            kill(pid)
    elif kind in ("srun", "stop"):
        pid, fault = victim.srun.pid, time.monotonic()
        if kind == "srun":
            target = f"srun pid {pid}" if kill(pid) else "nothing: srun already gone"
        elif kill(pid, signal.SIGSTOP):
            stopped = rng.uniform(1, 8)
            time.sleep(stopped)
            kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
            target = f"srun pid {pid}, stopped {stopped:.1f} s"
        else:
            target = "nothing: srun already gone"
    else:
        node = rng.choice(VICTIM_NODES)
        fault, pid, new = ctx.cluster.strike_slurmd(node)
        target = f"slurmd {node} pid {pid}, restarted as pid {new}"
    run.update(delay_s=round(fault - victim.srun.start, 3), killed=target, pid=pid)

    # How long srun took to go, from the fault (from SIGCONT for a stop); past the guard it is hung, and killed.
    since = resumed or fault
    if not victim.srun.wait(max(0, since + GONE_WITHIN - time.monotonic())):
        tasks, stepds = victim.look()
        running = describe(tasks, stepds)
        notes.append(f"{GONE_WITHIN} s after the fault{' and SIGCONT' if resumed else ''} srun still ran; "
                     + (f"of its step: {running}" if running else "its step's tasks and slurmstepds were all gone"))
    if not victim.srun.wait(max(0, since + GUARD - time.monotonic())):
        run["hung"] = True
        notes.append(f"srun still running {GUARD} s after the fault{' and SIGCONT' if resumed else ''}: killed")
        kill(victim.srun.pid)
        victim.srun.wait(10)
    run["srun_gone_s"] = round(victim.srun.end - since, 2)
    run["srun_exit"] = exit_text(victim.srun.code)

    # What of the step is left, looked at until GONE_WITHIN after srun is gone.
    while True:
        tasks, stepds = victim.look()
        if not tasks and not stepds:
            run["step_gone_s"] = round(max(0.0, time.monotonic() - victim.srun.end), 2)
            break
        if time.monotonic() - victim.srun.end > GONE_WITHIN:
            run["left"] = describe(tasks, stepds)
            if kind == "stepd" and not stepds and all(t.node == node for t in tasks.values()):
                notes.append(f"what is left are tasks the killed slurmstepd had started on {node}, which Slurm "
                             "(proctrack/pgid) cannot end without it")
            for p in list(tasks) + list(stepds):
                kill(p)
            break
        time.sleep(POLL)
    if job_state(victim.srun.mark) == "RUNNING":  # its srun killed as hung, the job may still hold n2,n3
        notes.append(f"job {victim.job or '?'} still RUNNING after its step: cancelled")
        slurm("scancel", "--quiet", f"--name={victim.srun.mark}")
    run["bystanders"] = [b.finish() for b in side]
    run["stderr"] = victim.srun.stderr().splitlines()[:12]
    ended = time.monotonic()
    idle = wait_idle()
    if idle:
        notes.append(idle)
    ctx.watch.settle()
    if ctx.watch.hit(began, ended):
        run["slurmd_crash"] = True
        notes.append("a crash of Slurm's own slurmd (glibc's heap check) overlapped the run: not judged")
    run["notes"] = notes
    run["job"] = victim.job
    return run


# --------------------------------------------------------------------------------------------------------------
# Soak


class SoakStep:
    def __init__(self, index, kind, argv, expect):
        self.index, self.kind, self.argv, self.expect = index, kind, argv, expect
        self.srun = self.job = self.srun_rss = self.srun_fds = self.left = self.gone_after = None
        self.closing = threading.Event()  # srun is gone and the job's id known: look for what is left
        self.hung = False

    def record(self, stepd_figures, crashed):
        """`crashed`: a slurmd crash of Slurm's own (CrashWatch) overlapped the step: its failure is not judged."""
        # An abort's step is the job's own failure: srun exits with its code where the plugin passes it on (rpmi),
        # else with any failure (pmi2: the signal that ended the step).
        code = self.srun.code
        expected = code == self.expect if self.expect is not None else code not in (0, None)
        own = not self.hung and not self.left and expected
        stepds = stepd_figures.get(self.job, {}).values()
        return {"step": self.index, "kind": self.kind, "expect": self.expect,
                "job": self.job, "exit": "hung" if self.hung else exit_text(self.srun.code),
                "seconds": round(self.srun.end - self.srun.start, 2), "srun_rss_kib": self.srun_rss,
                "srun_fds": self.srun_fds, "stepds": len(stepds),
                "stepd_rss_kib": max((f["rss"] for f in stepds), default=None),
                "stepd_fds": max((f["fds"] for f in stepds), default=None), "left": self.left,
                "gone_s": None if self.gone_after is None else round(self.gone_after, 2), "ok": own,
                "slurmd_crash": crashed}


# The plugins whose srun exits with an abort's code (the others' with the signal that ended the step); under
# none a plain task exits with it.
ABORT_CODE_PLUGINS = {"rpmi", "none"}


def soak_plan(n, rng, pairs, probe, mpi):
    """n steps: half MPICH jobs, a quarter exchanges, a quarter aborts (rank R calls MPI_Abort with CODE, which
    srun must exit with, under a plugin that passes it on: the job's own failure). Under none, plain tasks:
    rank R of an abort exits with CODE."""
    steps = []
    for i in range(n):
        kind = rng.choices(SOAK_KINDS, [2, 1, 1])[0]
        if kind == "pairs":
            argv, expect = plain(0.1) if mpi == "none" else [pairs], 0
        elif kind == "exchange":
            argv, expect = plain(0.1) if mpi == "none" else [probe, *SOAK_EXCHANGE], 0
        else:
            rank, code = rng.randrange(SOAK_TASKS), rng.randrange(10, 120)
            argv = plain(0.1, exit_rank=rank, exit_code=code) if mpi == "none" else [pairs, f"abort={rank}:{code}"]
            expect = code if mpi in ABORT_CODE_PLUGINS else None
        steps.append(SoakStep(i, kind, argv, expect))
    return steps


def compared(n):
    """How many steps of a soak of n are compared: the first and the last 50 (halves of a shorter soak)."""
    return min(50, max(1, n // 2))


def slurmd_usage(nodes=()):
    """{node: figures} of each slurmd found; waits up to GONE_WITHIN for those of `nodes` (one a fault restarted
    may be starting). A slurmd still missing is left out: the report says so."""
    until = time.monotonic() + GONE_WITHIN
    while not set(nodes) <= set(found := slurmds()) and time.monotonic() < until:
        time.sleep(POLL)
    return {node: {"rss_kib": status_kib(pid, "VmRSS"), "fds": nfds(pid)} for node, pid in sorted(found.items())}


def say_slurmd_gone(node, when):
    """Says on stderr, as soon as it is seen, that a node's slurmd is gone, with the end of its log and of its
    stderr (where glibc says why it aborted): the steps that hang after it are explained in CI's output."""
    ends = []
    for name in (f"slurmd-{node}.log", f"slurmd-{node}.out"):
        path = os.path.join(CLUSTER, "log", name)
        tail = b"".join((read(path) or b"").splitlines(keepends=True)[-10:]).decode(errors="replace")
        ends.append(f"the end of {path}:\n{tail}")
    print(f"campaign: no slurmd of {node} {when}; " + "".join(ends), file=sys.stderr, flush=True)


def soak(ctx, steps, mpi):
    """Runs the steps under `--mpi=mpi`, SOAK_PARALLEL at a time. One sampler records every slurmstepd's VmHWM and fds by job (a
    short step may be over before its tasks are seen: its job id comes from slurmctld after srun's exit), each
    running srun's fds, and once a step's srun is gone waits (up to GONE_WITHIN) for its tasks and stepds to go."""
    before = wait_idle()
    if before.startswith("nodes not idle"):
        print(f"campaign: before the soak under --mpi={mpi}: {before}", file=sys.stderr, flush=True)
    # slurmd, idle at the start and the end, and sampled while the steps run (SLURMD_EVERY samples): its figures
    # while the first compared() steps ran are set against those while the last ones did.
    began = time.monotonic()
    slurmd = {"start": slurmd_usage(), "samples": []}
    finished = itertools.count(1)
    queue, active, lock = iter(steps), [], threading.Lock()
    stepd_figures = {}  # job -> {pid: {"rss": KiB, "fds": n}}, the highest seen
    workers_done = threading.Event()

    def worker():
        while True:
            with lock:
                step = next(queue, None)
            if step is None:
                return
            step.srun = Srun(ctx.work, f"soak-{mpi}-{step.kind}", mpi, SOAK_LAYOUT + step.argv)
            with lock:
                active.append(step)
            if not step.srun.wait(STEP_GUARD):
                step.hung = True
                kill(step.srun.pid)
                step.srun.wait(10)
            if step.job is None:
                step.job = job_of(step.srun.mark) or ""
            step.closing.set()
            with lock:
                if next(finished) == compared(len(steps)):
                    slurmd["first_until"] = time.monotonic() - began

    def sampler():
        for tick in itertools.count():
            if workers_done.is_set() and not active:
                return
            tasks, stepds = scan()
            now = time.monotonic()
            if tick % SLURMD_EVERY == 0:
                slurmd["samples"].append((round(now - began, 2), slurmd_usage()))
            for job, pids in stepds.items():
                for pid in pids:
                    rss, fds = status_kib(pid, "VmHWM"), nfds(pid)
                    if rss is None or fds is None:
                        continue  # gone meanwhile
                    figures = stepd_figures.setdefault(job, {}).setdefault(pid, {"rss": 0, "fds": 0})
                    figures["rss"], figures["fds"] = max(figures["rss"], rss), max(figures["fds"], fds)
            with lock:
                current = list(active)
            for step in current:
                mine = tasks.get(step.srun.mark, {})
                if step.job is None:
                    step.job = next((t.job for t in mine.values()), None)
                if not step.srun.done.is_set():
                    # VmHWM, srun's own: its ru_maxrss would be ours (Linux carries a process's peak across
                    # exec, and Popen's vfork child runs in our memory until it execs srun).
                    rss = status_kib(step.srun.pid, "VmHWM")
                    step.srun_rss = max(filter(None, [step.srun_rss, rss]), default=None)
                    step.srun_fds = max(filter(None, [step.srun_fds, nfds(step.srun.pid)]), default=None)
                if not step.closing.is_set():
                    continue
                theirs = stepds.get(step.job, {})
                if not mine and not theirs:
                    step.gone_after = now - step.srun.end
                elif now - step.srun.end > GONE_WITHIN:
                    step.left = describe(mine, theirs)
                    for pid in list(mine) + list(theirs):
                        kill(pid)
                else:
                    continue
                if job_state(step.srun.mark) == "RUNNING":
                    slurm("scancel", "--quiet", f"--name={step.srun.mark}")
                with lock:
                    active.remove(step)
            time.sleep(SAMPLE)

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(SOAK_PARALLEL)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    workers_done.set()
    sampling.join()
    idle = wait_idle()
    slurmd["end"] = slurmd_usage(slurmd["start"])
    for node in sorted(set(slurmd["start"]) - set(slurmd["end"])):
        say_slurmd_gone(node, f"after the soak under --mpi={mpi}")
    slurmd["last_from"] = steps[len(steps) - compared(len(steps))].srun.start - began
    ctx.watch.settle()
    slurmd["crashes"] = [c for c in ctx.watch.since(began) if c["until_s"] >= 0]
    return {"steps": [s.record(stepd_figures, ctx.watch.hit(s.srun.start, s.srun.end or time.monotonic()))
                      for s in steps],
            "slurmd": slurmd, "idle": idle}


# --------------------------------------------------------------------------------------------------------------
# The report

FLAT_RATIO, FLAT_KIB, FLAT_FDS = 1.10, 1024, 2
# The fewest steps a window must hold for a step figure to be judged flat or not.
JUDGED_MIN = 20


def flat(first, last, slack):
    """Flat: `last` at most 10% (or `slack`) over `first`. srun and the slurmstepds are new for each step, so
    only what they are handed could grow with the steps; the margin is for sampling's noise."""
    return last <= first * FLAT_RATIO + slack


def mib(kib):
    return "-" if kib is None else f"{kib / 1024:.1f}"


def count(n):
    return "-" if n is None else f"{n:g}"


def span(least_most, show):
    least, most = (show(x) for x in least_most)
    return least if least == most else f"{least}-{most}"


def duration(seconds):
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fault_targets(runs):
    hung = [r for r in runs if r.get("hung") or r["srun_gone_s"] > GONE_WITHIN]
    left = [r for r in runs if r.get("left")]
    hit = [r for r in runs if any(b["failed"] for b in r["bystanders"])]
    slowest = max(runs, key=lambda r: r["srun_gone_s"])
    steps = sum(b["steps"] for r in runs for b in r["bystanders"])
    return [
        ("faults: no hang (srun gone within 30 s of the fault, of SIGCONT for a stop)", not hung,
         f"slowest {slowest['srun_gone_s']} s (run {slowest['run']}, {slowest['kind']}/{slowest['phase']})"
         + (f"; over: runs {', '.join(str(r['run']) for r in hung)}" if hung else "")),
        ("faults: nothing of the step left 30 s after srun", not left,
         f"left in runs {', '.join(str(r['run']) for r in left)}" if left else
         f"slowest step end {max(r.get('step_gone_s', 0) for r in runs)} s after srun"),
        ("faults: no bystander affected", not hit,
         f"{steps} bystander steps" + (f"; failures in runs {', '.join(str(r['run']) for r in hit)}" if hit
                                       else ", every one exited 0")),
    ]


# A kind and phase of fault is ended in time when srun is gone within this of the fault and nothing is left.
ENDED_WITHIN = 10  # s


def verdict(mine, refs):
    """How the plugin under test (`mine`, its runs of one kind and phase) fares against the reference plugins'
    runs of it (`refs`: lists of runs, the first the one to meet): in time, no worse than the first reference
    (then the cause is Slurm's, which both share; named with every reference that fares the same), or worse."""
    def figures(runs):
        return (max(r["srun_gone_s"] for r in runs), sum(bool(r.get("left")) for r in runs),
                sum(bool(b["failed"]) for r in runs for b in r["bystanders"]))

    def no_worse(runs):
        most_s, most_left, most_hit = figures(runs)
        return slowest <= most_s + 1 and left <= most_left and hit <= most_hit

    slowest, left, hit = figures(mine)
    if slowest <= ENDED_WITHIN and not left and not hit:
        return "in time"
    refs = [runs for runs in refs if runs]
    if not refs:
        return "**late**"
    if no_worse(refs[0]):
        return "as " + " and ".join(runs[0]["mpi"] for runs in refs if no_worse(runs))
    return f"**worse than {refs[0][0]['mpi']}**"


def soak_stats(result):
    """The figures of each kind of step, its first steps against its last (compared() of them), and slurmd's."""
    steps = result["steps"]
    rows, all_flat = [], True
    for key, what, slack, show in (("srun_rss_kib", "srun peak RSS (MiB)", FLAT_KIB, mib),
                                   ("srun_fds", "srun open fds", FLAT_FDS, count),
                                   ("stepd_rss_kib", "slurmstepd peak RSS (MiB)", FLAT_KIB, mib),
                                   ("stepd_fds", "slurmstepd open fds", FLAT_FDS, count)):
        for kind in SOAK_KINDS:
            mine = [s for s in steps if s["kind"] == kind]
            k = compared(len(mine))
            first = [s[key] for s in mine[:k] if s[key] is not None]
            last = [s[key] for s in mine[len(mine) - k:] if s[key] is not None]
            if not first or not last:
                rows.append((what, kind, k, "-", "-", "-", "-", "no samples"))
                all_flat = False
                continue
            ok = flat(statistics.median(first), statistics.median(last), slack)
            # A figure sampled in flight (fds, while tasks come and go) over a handful of steps is noise: judged
            # only over JUDGED_MIN steps a window or more (the full soak), shown either way.
            judged = min(len(first), len(last)) >= JUDGED_MIN
            all_flat &= ok or not judged
            verdict = ("yes" if ok else "**no**") if judged else f"{'yes' if ok else 'no'} (too few to judge)"
            rows.append((what, kind, k, show(statistics.median(first)), show(max(first)),
                         show(statistics.median(last)), show(max(last)), verdict))
    k = compared(len(steps))
    # slurmd, sampled while the first k steps ran against while the last k did (both busy: a figure at rest
    # would not compare with them). Flat: the least of the last window no more than the highest of the first.
    # slurmd grows over its first steps (buffers, thread arenas) and an RPC's connection is an fd for a moment;
    # a leak raises the floor above both.
    slurmd_rows, usage = [], result["slurmd"]
    for node in sorted(usage["start"]):
        during = []
        for keep in (lambda t: t <= usage.get("first_until", 0), lambda t: t >= usage["last_from"]):
            seen = [u[node] for t, u in usage["samples"] if keep(t) and u.get(node, {}).get("rss_kib") is not None]
            during.append({key: (min(u[key] for u in seen), max(u[key] for u in seen)) for key in ("rss_kib", "fds")}
                          if seen else {})
        first, last = during
        end = usage["end"].get(node)
        ok = bool(first and last and end) and flat(first["rss_kib"][1], last["rss_kib"][0], FLAT_KIB) and \
            flat(first["fds"][1], last["fds"][0], FLAT_FDS)
        # A slurmd started again after Slurm's own crash is a new process: its figures say nothing of a leak.
        restarted = any(c["node"] == node for c in usage.get("crashes", []))
        all_flat &= ok or restarted
        rest = [f"{mib(u.get('rss_kib'))} / {count(u.get('fds'))}" if u else "**no slurmd**"
                for u in (usage["start"][node], end)]
        busy = [f"{span(w['rss_kib'], mib)} / {span(w['fds'], count)}" if w else "-" for w in during]
        slurmd_rows.append((node, rest[0], *busy, rest[1],
                            "not judged (started again)" if restarted else "yes" if ok else "**no**"))
    return k, rows, slurmd_rows, all_flat


def report(meta, calibrations, runs, soaks):
    """The markdown report of every plugin's runs (`runs` carry their plugin; `calibrations` and `soaks` are by
    plugin), and whether the plugin under test (the first) met every target: its own, or no worse than the
    reference plugins in the same run where Slurm's behaviour is what both share."""
    plugins = meta["plugins"]
    first, refs = plugins[0], plugins[1:]
    # The runs a crash of Slurm's own slurmd overlapped are listed, not judged.
    by = {mpi: [r for r in runs if r["mpi"] == mpi and not r.get("slurmd_crash")] for mpi in plugins}
    out = [
        "# Fault and soak campaign: " + ", ".join(f"`srun --mpi={mpi}`" for mpi in plugins),
        "",
        f"`{meta['command']}` (docker/campaign.sh, driving docker/campaign.py), {meta['date']}, on a machine with "
        f"{meta['cores']} cores, {meta['slurm']}, rpmi {meta['commit']}; seed {meta['seed']}. The local cluster of "
        "docker/with-slurm.sh (one slurmctld and three slurmd on 127.0.0.1, nodes n1..n3), the plugin as built "
        f"(no mpi.conf). Total time {duration(meta['total_s'])} (faults, with their calibration, "
        f"{duration(meta['faults_s'])}; soak {duration(meta['soak_s'])}), the build and the cluster's start aside. "
        + ("Every fault run is made under each plugin in turn, with the same draws (the share of its window, what "
           "is struck), and each soak runs the same steps." if refs else ""),
        "",
        "## Targets",
        "",
    ]
    targets = {mpi: (fault_targets(by[mpi]) if by[mpi] else []) for mpi in plugins}
    for mpi in plugins:
        overlapped = sum(r["mpi"] == mpi and bool(r.get("slurmd_crash")) for r in runs)
        if overlapped:  # a campaign mostly overlapped by crashes says nothing
            total = len(by[mpi]) + overlapped
            targets[mpi].append(("faults: most runs judged (not overlapped by a crash of Slurm's slurmd)",
                                 overlapped * 2 <= total, f"{total - overlapped} of {total}"))
    for mpi in plugins:
        soaked = soaks.get(mpi)
        if soaked:
            steps = soaked["steps"]
            bad = [s for s in steps if not s["ok"] and not s["slurmd_crash"]]
            excused = [s for s in steps if not s["ok"] and s["slurmd_crash"]]
            k, _, _, all_flat = soak_stats(soaked)
            # Steps a crash of Slurm's own hit are not judged, but a soak that is mostly such steps says nothing.
            targets[mpi] += [("soak: no failure that is not the job's own", not bad and len(excused) * 2 <= len(steps),
                              f"{len(steps)} steps, {len(bad)} such failures"
                              + (f"; {len(excused)} failed during a crash of Slurm's slurmd, not judged"
                                 if excused else "")),
                             (f"soak: flat (each kind's last steps against its first; slurmd during the last {k} "
                              f"steps against the first {k})", all_flat, "see the soak's table")]
    cells = {}
    for mpi in plugins:
        for t, ok, f in targets[mpi]:
            cells.setdefault(t, {})[mpi] = f"{'met' if ok else '**not met**'}: {f}"
    met = all(ok for _, ok, _ in targets[first])
    def of(mpi, key):
        return [r for r in by[mpi] if (r["kind"], r["phase"]) == key]

    if refs and by[first]:
        verdicts = [verdict(mine, [of(mpi, key) for mpi in refs]) for key, mine in group(by[first]).items()]
        bad = [v for v in verdicts if v.startswith("**")]
        cells[f"faults: each kind and phase ended in {ENDED_WITHIN} s, nothing left, no bystander hit, or no "
              f"worse than {refs[0]}"] = {first: f"{'met' if not bad else '**not met**'}: "
                                                f"{len(verdicts) - len(bad)} of {len(verdicts)} cells"}
        # The targets the plugin misses where the reference misses them too are Slurm's, not the plugin's.
        met = all(ok for t, ok, _ in targets[first] if not t.startswith("faults: no hang")
                  and not t.startswith("faults: nothing")) and not bad
    out += [table(["target", *plugins], [(t, *(c.get(mpi, "-") for mpi in plugins)) for t, c in cells.items()]), ""]
    crashes = meta.get("slurmd_crashes", [])
    if crashes:
        out += ["Crashes of Slurm's own slurmd (glibc found its heap corrupted; no code of the plugin runs in slurmd "
                "after its start), each slurmd started again as a fault starts one; the fault runs and soak steps "
                f"that ran from when it was last seen until {CRASH_MARGIN} s after its new start are not judged:", "",
                table(["node", "last seen running (s from the start)", "started again (s)", "what ended it"],
                      [(c["node"], c["from_s"], c["until_s"], f"`{c['why']}`") for c in crashes]), ""]

    if runs:
        out += [
            "## Faults",
            "",
            "A victim step (`srun -Q --mpi=MPI -w n[2-3] -N2 -n4`) is struck at a random point of one phase while "
            "two bystanders of the same plugin run on n1 (`-w n1 -N1 -n2`), each a stream of steps back to back "
            "until the run is over: `rpmi-probe barrier --count N` and mpi_pairs. Phases and their "
            "workloads: launch: mpi_pairs, from srun's start until rank 0's line (after MPI_Init, an allreduce and "
            f"the pairs); exchange: `rpmi-probe {' '.join(EXCHANGE)}`, once all tasks run; barrier: "
            f"`rpmi-probe barrier --count N`, once all tasks run; finalize: mpi_pairs `finalize_after="
            f"{VICTIM_TASKS - 1}:{FINALIZE_LATE}` (rank {VICTIM_TASKS - 1} enters MPI_Finalize {FINALIZE_LATE} s "
            "after the others, which wait for it in theirs), from rank 0's line (printed just before "
            "MPI_Finalize) to srun's exit. N, the barrier loops' counts, is sized to last a "
            "few seconds under each plugin: "
            + "; ".join(f"{mpi}: {BARRIER_COUNTS.get(mpi, BARRIER_COUNTS['pmi2'])} for the victim, "
                        f"{BYSTANDER_BARRIER_COUNTS.get(mpi, BYSTANDER_BARRIER_COUNTS['pmi2'])} for the bystander"
                        for mpi in plugins if mpi != "none")
            + (". Under `--mpi=none` every step is plain tasks (`python3 -c`, no PMI, no MPI) as long as its "
               f"workload here (the victim's: 0.3 s to rank 0's line, rank {VICTIM_TASKS - 1} then {FINALIZE_LATE} s "
               "more for the finalize, 1.5 s for the exchange, 4 s for the barrier loop; the bystanders': 2 s and "
               "0.3 s): what Slurm does on its own when such a step is struck" if "none" in plugins else "")
            + ". The windows come from clean runs beside the "
            f"bystanders (below); the delay is drawn uniformly within the first {WINDOW_SHARE:.0%} of the window. A "
            f"task or slurmstepd struck is one of the step's, at random; a slurmd is n2's or n3's, restarted "
            f"{SLURMD_RESTART_AFTER} s later as it was started (same arguments, environment, session and log). "
            "*hit*: the fault came while the step was still in that phase. After srun is gone the step's tasks and "
            f"slurmstepds are looked for during {GONE_WITHIN} s; what is left then is killed. srun still running "
            f"{GUARD} s after the fault is hung and killed.",
            "",
            "Calibration (s from srun's start, least of 2 clean runs):",
            "",
            table(["plugin", "workload", "all tasks up", "rank 0's line", "srun exit"],
                  [(mpi, n, f"{c['tasks']:.2f}", f"{c['line']:.2f}", f"{c['exit']:.2f}")
                   for mpi, cal in calibrations.items() for n, c in cal.items()]),
            "",
            "Per kind and phase, each plugin's runs: hit, srun gone after the fault at the slowest (s), srun's exits, "
            "runs with leftovers, bystanders failed"
            + (f"; and how {first} fares: in {ENDED_WITHIN} s with nothing left, as {refs[0]} (no later, no more "
               f"left: what both share is Slurm's; with every other plugin that fares the same), or worse."
               if refs else "."),
            "",
        ]
        rows = []
        for (kind, phase), mine in group(by[first]).items():
            row = [KIND_TEXT[kind], phase, len(mine)]
            for mpi in plugins:
                rs = [r for r in by[mpi] if (r["kind"], r["phase"]) == (kind, phase)]
                row.append(summary(rs) if rs else "-")
            if refs:
                row.append(verdict(mine, [of(mpi, (kind, phase)) for mpi in refs]))
            rows.append(row)
        out += [table(["fault", "phase", "runs", *plugins, *(["verdict"] if refs else [])], rows), "",
                "Every run:", ""]
        rows = []
        for r in sorted(runs, key=lambda r: (r["run"], plugins.index(r["mpi"]))):
            left = r.get("left") or f"none ({r['step_gone_s']} s)"
            bys = "; ".join(f"{b['steps']} ok" if not b["failed"] else
                            f"{b['steps']}, failed: {', '.join(b['failed'])}" for b in r["bystanders"])
            gone = f"{r['srun_gone_s']:.2f}" if r["srun_gone_s"] >= 0 else "before the fault"
            rows.append((r["run"], r["mpi"], r["kind"], r["phase"], f"{r['delay_s']:.2f}", "yes" if r["hit"] else "no",
                         r["killed"], gone, r["srun_exit"], left, bys, "; ".join(r["notes"])))
        out += [table(["#", "plugin", "kind", "phase", "delay (s)", "hit", "struck", "srun gone (s)", "srun exit",
                       "left 30 s after srun (else: step gone after)", "bystanders (barrier; pairs)", "notes"], rows),
                ""]
        odd = [r for r in runs if r.get("hung") or r.get("left") or any(b["failed"] for b in r["bystanders"])]
        for r in odd:
            out += [f"Run {r['run']} under {r['mpi']} ({r['kind']}/{r['phase']}, job {r['job']}), srun's stderr:", "",
                    "```", *r["stderr"], "```", ""]

    for mpi, soaked in soaks.items():
        steps = soaked["steps"]
        out += [
            f"## Soak: `--mpi={mpi}`",
            "",
            f"{len(steps)} steps `srun -Q --mpi={mpi} {' '.join(SOAK_LAYOUT)}`, {SOAK_PARALLEL} at a time, back to "
            + (f"back: mpi_pairs; `rpmi-probe {' '.join(SOAK_EXCHANGE)}`; mpi_pairs `abort=R:CODE` (srun must exit "
               if mpi != "none" else "back: plain tasks of 0.1 s for each kind, rank R of an abort exiting with "
               "CODE (srun must exit ")
            + ("with CODE" if mpi in ABORT_CODE_PLUGINS else "non-zero: this plugin does not pass CODE on")
            + "). srun's and its slurmstepds' VmHWM and open fds are sampled "
            f"every {SAMPLE} s while the step runs (a step over before a sample has none). Flat: for each kind, the "
            "median of its last 50 steps (of the last half when it has fewer than 100) at most "
            f"{FLAT_RATIO - 1:.0%} (or {FLAT_KIB >> 10} MiB, {FLAT_FDS} fds) over that of its first, judged only "
            f"with {JUDGED_MIN} steps or more a window; slurmd, sampled "
            f"every {SAMPLE * SLURMD_EVERY:.1f} s, the least of its figures during the last {compared(len(steps))} "
            "steps against the highest during the first (its warm-up and the connections of the moment aside, a "
            "leak raises its floor).",
            "",
        ]
        rows = []
        for kind in SOAK_KINDS:
            ks = [s for s in steps if s["kind"] == kind]
            if ks:
                gone = [s["gone_s"] for s in ks if s["gone_s"] is not None]
                seconds = [s["seconds"] for s in ks]
                rows.append((kind, len(ks), sum(s["ok"] for s in ks), f"{statistics.median(seconds):.2f}",
                             f"{max(seconds):.2f}", f"{max(gone):.2f}" if gone else "-",
                             sum(s["stepds"] > 0 for s in ks)))
        out += [table(["step", "runs", "as expected", "srun median (s)", "srun max (s)",
                       "step gone after srun, max (s)", "stepds sampled"], rows), ""]
        k, rows, slurmd_rows, _ = soak_stats(soaked)
        out += [table(["figure", "step", "compared", "first: median", "max", "last: median", "max", "flat"], rows), "",
                "slurmd, RSS (MiB) / open fds:", "",
                table(["node", "at rest, before", f"during the first {k} steps (least-highest)", f"during the last {k}",
                       "at rest, after", "flat"], slurmd_rows), ""]
        bad = [s for s in steps if not s["ok"]]
        if bad:
            out += ["Failures that are not the job's own:", "",
                    table(["step", "kind", "expected", "exit", "left", "during a slurmd crash"],
                          [(s["step"], s["kind"], "non-zero" if s["expect"] is None else s["expect"], s["exit"],
                            s["left"] or "", "yes (not judged)" if s["slurmd_crash"] else "")
                           for s in bad[:30]]), ""]
        if soaked["idle"]:
            out += [f"After the soak: {soaked['idle']}.", ""]
    return "\n".join(out), met


def group(runs):
    """Runs by (kind, phase), in the order of KINDS and PHASES."""
    found = {}
    for kind in KINDS:
        for phase in PHASES:
            rs = [r for r in runs if (r["kind"], r["phase"]) == (kind, phase)]
            if rs:
                found[(kind, phase)] = rs
    return found


def summary(rs):
    """One plugin's runs of a kind and phase, in one cell."""
    exits = ", ".join(sorted({r["srun_exit"] for r in rs}))
    left = sum(bool(r.get("left")) for r in rs)
    hit = sum(bool(b["failed"]) for r in rs for b in r["bystanders"])
    return (f"hit {sum(r['hit'] for r in rs)}; {max(r['srun_gone_s'] for r in rs):.2f} s; exits {exits}"
            + (f"; **left {left}**" if left else "") + (f"; **bystanders failed {hit}**" if hit else ""))


# --------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="10 fault runs (CI_PLAN: each kind twice) and 50 soak steps")
    ap.add_argument("--faults", type=int, help="fault runs (default 100; 10 with --ci)")
    ap.add_argument("--soak", type=int, help="soak steps (default 1000; 50 with --ci)")
    ap.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 31))
    ap.add_argument("--out", default="benches/results/campaign.md", help="the markdown; its JSON beside it")
    ap.add_argument("--probe", required=True, help="rpmi-probe")
    ap.add_argument("--pairs", required=True, help="tests/programs/mpi_pairs.c built with MPICH")
    ap.add_argument("--work", required=True, help="a scratch directory")
    ap.add_argument("--command", default="docker/campaign.sh", help="the command line, for the report")
    ap.add_argument("--mpi", default="rpmi,pmi2,none",
                    help="the plugins, comma-separated: the one under test first, then the references, the one to "
                         "meet first (rpmi,pmi2,none; none runs plain tasks)")
    args = ap.parse_args()
    faults = args.faults if args.faults is not None else (len(CI_PLAN) if args.ci else 100)
    soak_n = args.soak if args.soak is not None else (50 if args.ci else 1000)
    if os.geteuid() != 0 or "SLURM_CONF" not in os.environ:
        sys.exit("campaign: run as root, under docker/with-slurm.sh (SLURM_CONF is the local cluster's)")
    for path in (args.probe, args.pairs):
        if not os.access(path, os.X_OK):
            sys.exit(f"campaign: {path} not found (cargo build --release --bins; mpicc)")

    rng = random.Random(args.seed)
    ctx = argparse.Namespace(work=args.work, pairs=os.path.abspath(args.pairs), probe=os.path.abspath(args.probe),
                             cluster=Cluster())
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
        except OSError:  # no git where it runs (a Debian chroot of another Slurm line)
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    plugins = [p for p in args.mpi.split(",") if p]
    if not plugins or not all(re.fullmatch(r"[a-z0-9_]+", p) for p in plugins):
        sys.exit(f"campaign: --mpi takes plugin names, comma-separated, not {args.mpi!r}")
    ctx.workloads = {mpi: workloads(ctx.pairs, ctx.probe, mpi) for mpi in plugins}
    meta = {"command": args.command, "seed": args.seed, "cores": os.cpu_count(), "commit": commit, "plugins": plugins,
            "slurm": slurm("srun", "--version").strip(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    start = time.monotonic()
    ctx.watch = CrashWatch(ctx.cluster)

    runs, ctx.calibration = [], {}
    if faults:
        for mpi in plugins:
            print(f"campaign: calibrating the victim's workloads under --mpi={mpi}", file=sys.stderr)
            ctx.calibration[mpi] = calibrate(ctx, mpi)
        for i, (kind, phase) in enumerate(fault_plan(faults, rng, args.ci), 1):
            # One seed a run: each plugin's run of it draws the same.
            seed = rng.randrange(1 << 31)
            for mpi in plugins:
                run = fault_run(ctx, mpi, random.Random(seed), i, kind, phase)
                runs.append(run)
                print(f"campaign: fault {i}/{faults} --mpi={mpi} {kind}/{phase} at {run['delay_s']:.2f} s: "
                      f"{run['killed']}; srun gone after {run['srun_gone_s']} s ({run['srun_exit']}), left: "
                      f"{run.get('left') or 'nothing'}", file=sys.stderr)
    meta["faults_s"] = time.monotonic() - start
    soaks = {}
    if soak_n:
        seed = rng.randrange(1 << 31)
        for mpi in plugins:
            print(f"campaign: soak of {soak_n} steps under --mpi={mpi}", file=sys.stderr)
            soaks[mpi] = soak(ctx, soak_plan(soak_n, random.Random(seed), ctx.pairs, ctx.probe, mpi), mpi)
    meta["total_s"] = time.monotonic() - start
    meta["soak_s"] = meta["total_s"] - meta["faults_s"]
    ctx.watch.stop()
    meta["slurmd_crashes"] = ctx.watch.since(start)

    text, met = report(meta, ctx.calibration, runs, soaks)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"meta": meta, "calibration": ctx.calibration, "faults": runs, "soak": soaks}, f, indent=1)
    print(text)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
