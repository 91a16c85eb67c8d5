#!/usr/bin/env python3
"""Writes the seed inputs of fuzz/seeds/engine and fuzz/seeds/parse (realistic PMI-1 sessions, and PMI-2
sessions for the engine), of fuzz/seeds/pmi2 (PMI-2 frames and bodies), of fuzz/seeds/frames (streams of slurmstepd-srun frames, src/slurm/wire.rs) and of fuzz/seeds/collective
(events for one of the collective's machines, crates/core/src/collective/).

The engine input format is the one fuzz_targets/engine.rs decodes: byte 0 is the configuration (bit 0
trace, bit 1 host offers services, bit 2 small limits, bit 3 cyclic task map, bit 4 group exchanges, bit 5
the node barrier's page served), then operations, each an
op byte (op % 16 = what, (op // 16) % 3 = task) and its argument bytes. The frames input format is the
one fuzz_targets/frames.rs decodes: 4 header bytes (see fuzz/README.md, "The `frames` target"), then the
stream. Run from anywhere:
    python3 fuzz/make_seeds.py
"""

import hashlib
import hmac
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# Canned request indices (fuzz_targets/engine.rs, canned()).
INIT, INIT2, MAXES, USIZE, APPNUM, KVSNAME, PUT, PUT_SPACES, GET, GET_MAPPING, BARRIER, FINALIZE, ABORT = range(13)
PUBLISH, UNPUBLISH, LOOKUP, R2H, SPAWN, SPAWN_START, ENDCMD = range(13, 19 + 1)
# Canned PMI-2 request indices (fuzz_targets/engine.rs, canned2()): the same ops send these to a task once the
# shell has answered its INIT2 (and the host has written the answer).
(F_INIT, F_GETID, F_CONNECT, F_DISCONNECT, F_PUT, F_PUT_SEMI, F_FENCE, F_GET, F_GET_VAR, F_GET_MAPPING, F_JOBATTR,
 F_PUTNODE, F_GETNODE_WAIT, F_GETNODE, F_GETNODE_MAYBE, F_ABORT, F_FINALIZE, F_PUBLISH, F_UNPUBLISH, F_LOOKUP,
 F_SPAWN, F_SPAWN_BAD, F_BAD_PREFIX, F_UNKNOWN, F_MISSING, F_THRID, F_MALFORMED, F_TOO_LONG, F_NEWLINE,
 F_SPAWN_MANY, F_PMI1_LINE, F_TWO) = range(32)
# Bit 5 of a PMI-2 kind: the length is padded on the left (Slurm's libpmi2), not the right (MPICH).
LEFT = 0x20


class Session:
    def __init__(self, config):
        self.b = bytearray([config])

    def op(self, kind, task=0, *args):
        self.b.append(kind + 16 * task)
        self.b.extend(args)
        return self

    def req(self, task, k, a=0, b=0):
        return self.op(0, task, k, a, b)

    def split(self, task, k, a, b, at):
        return self.op(6, task, k, a, b, at)

    def raw(self, task, data, chunk=0x80):
        assert len(data) < 256
        return self.op(7, task, len(data), chunk).extend(data)

    def extend(self, data):
        self.b.extend(data)
        return self

    def disconnect(self, task):
        return self.op(8, task)

    def complete_own(self):
        return self.op(9)

    def complete_raw(self, data, order=0):
        return self.op(10, 0, order, len(data)).extend(data)

    def complete_remote(self, entries):
        self.op(11, 0, len(entries))
        for rank, key, val in entries:
            self.b.extend([rank, key, val])
        return self

    def complete_err(self):
        return self.op(12)

    def reply(self, task, v):
        return self.op(13, task, v)

    def piece(self, p):
        return self.op(14, 0, p)


def wire_up(s, tasks=3, value=0x22):
    # value 0x22: VALUE_LENGTHS[2] = 7 bytes; 0x90: 800 bytes.
    """init, maxes, kvsname, appnum, universe size, one put each, barrier."""
    for t in range(tasks):
        for k in (INIT, MAXES, KVSNAME, APPNUM, USIZE, GET_MAPPING):
            s.req(t, k)
        s.req(t, PUT, t, value)
        s.req(t, BARRIER)
    return s


def sessions():
    out = {}
    # MPICH-like wire-up over two nodes: the other shell brings ranks 3 and 4.
    s = wire_up(Session(0)).complete_remote([(3, 3, 30), (4, 4, 40)])
    for t in range(3):
        for key in range(5):
            s.req(t, GET, key)
    for t in range(3):
        s.req(t, BARRIER)
    s.complete_own()
    for t in range(3):
        s.req(t, FINALIZE)
        s.disconnect(t)
    out["wireup"] = s

    # Same with big (800-byte) values, the other shell's contribution as raw bytes, and tracing on.
    s = wire_up(Session(1), value=0x90)
    s.complete_raw(b"3 k3=" + b"x" * 100 + b"\n4 k4=y\n", order=1)
    for t in range(3):
        s.req(t, GET, (t + 1) % 5).req(t, GET, 7)
    for t in range(3):
        s.req(t, FINALIZE)
    out["wireup_big_trace"] = s

    # A rank aborts while the others wait in the barrier.
    s = Session(0)
    for t in range(3):
        s.req(t, INIT).req(t, MAXES)
    s.req(0, BARRIER).req(2, BARRIER).req(1, ABORT, 7, 1)
    for t in range(3):
        s.disconnect(t)
    out["abort"] = s

    # A task dies in the barrier; the collective fails.
    s = Session(0)
    for t in range(3):
        s.req(t, INIT).req(t, PUT, t, 3)
    s.req(0, BARRIER).req(1, BARRIER).disconnect(2)
    out["task_lost"] = s
    s = wire_up(Session(0)).complete_err()
    out["collective_error"] = s

    # Name service and spawn through a host that offers them.
    s = Session(2)
    s.req(0, INIT).req(0, PUBLISH, 1, 2).reply(0, 0)
    s.req(1, INIT).req(1, LOOKUP, 1).reply(1, 1)
    s.req(1, LOOKUP, 2).reply(1, 6)
    s.req(0, UNPUBLISH, 1).reply(0, 0)
    s.req(2, INIT).req(2, SPAWN, 2, 0).reply(2, 14)
    # Two blocks: totspawns=2.
    s.req(2, SPAWN, 1, 1).req(2, SPAWN, 3, 3).reply(2, 24)
    s.req(0, R2H)
    out["services"] = s

    # The same requests without services on offer.
    s = Session(0)
    s.req(0, INIT).req(0, PUBLISH, 1, 2).req(0, LOOKUP, 1).req(0, SPAWN, 2, 0).req(0, R2H)
    out["no_services"] = s

    # Small limits, cyclic map: fill the KVS, write output a few bytes at a time, split lines.
    s = Session(4 | 8).piece(5)
    for t in range(3):
        s.req(t, INIT).req(t, PUT, t, 0x70)  # a 299-byte value, the most these limits allow
        for i in range(7):
            s.raw(t, b"cmd=put kvsname=kvs_fuzz_1 key=z%d%d value=%s\n" % (t, i, b"v" * 200))
    s.split(0, GET, 1, 0, 128).split(1, MAXES, 0, 0, 64)
    s.raw(2, b"cmd=get_maxes\ncmd=get_ranks2hosts\ncmd=get_my_kvsname\n", chunk=3)
    s.piece(200)
    out["small_limits"] = s

    # A spawn block typed out as raw bytes, a few bytes per read.
    block = (
        b"mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\nargcnt=2\narg1=-v\narg2=a b\n"
        b"preput_num=1\npreput_key_0=PARENT_ROOT_PORT_NAME\npreput_val_0=tag#0$\ninfo_num=0\nendcmd\n"
    )
    s = Session(2).req(0, INIT).raw(0, block, chunk=6).reply(0, 4 + 10 * 2)
    out["spawn_raw"] = s

    # The node barrier: every task speaks rpmi=3 (INIT's a=1), the first barrier by lines turns it on, then
    # barriers by the node's one line (BARRIER's b=3); a task that goes breaks it, and the rest come by lines.
    s = Session(32)
    for t in range(3):
        s.req(t, INIT, 1).req(t, PUT, t, 3).req(t, BARRIER)
    s.complete_own()
    s.req(1, BARRIER, 0, 3).complete_remote([(3, 3, 30)])
    s.req(0, BARRIER, 0, 3).complete_err()
    s.disconnect(2).req(0, BARRIER).req(1, BARRIER, 0, 3).req(1, BARRIER)
    out["node_barrier"] = s

    # PMI-2 client, Intel's ranks2hosts, garbage.
    s = Session(0).req(0, INIT2).req(1, INIT).req(1, R2H).raw(2, b"cmd=put kvsname=kvs_fuzz_1 key=a\n")
    out["odd_clients"] = s

    out.update(pmi2_sessions())
    return out


def frame2(body, left=False):
    """A PMI-2 frame: the body's length in 6 bytes, padded with spaces, then the body."""
    return (b"%-6d" if left else b"%6d") % len(body) + body


def pmi2_wire_up(s, tasks=3, value=0x22):
    """MPICH 4 with PMI-2: init asking for 2, fullinit, job id, job attributes, a put each, a fence."""
    for t in range(tasks):
        s.req(t, INIT2).req(t, F_INIT, 0).req(t, F_GETID).req(t, F_JOBATTR, 0).req(t, F_JOBATTR, 1)
        s.req(t, F_PUT, t, value)
        s.req(t, F_FENCE)
    return s


def pmi2_sessions():
    out = {}
    # Wire-up over two nodes: the other shell brings ranks 3 and 4; gets, a second fence, finalize.
    s = pmi2_wire_up(Session(0)).complete_remote([(3, 3, 30), (4, 4, 40)])
    for t in range(3):
        for key in range(5):
            s.req(t, F_GET, key)
        s.req(t, F_GET_VAR, 2, t).req(t, F_GET_MAPPING)
    for t in range(3):
        s.req(t, F_FENCE | LEFT)
    s.complete_own()
    for t in range(3):
        s.req(t, F_FINALIZE)
        s.disconnect(t)
    out["pmi2_wireup"] = s

    # PMI-1 and PMI-2 tasks in one job, traced, with big values (800 bytes; 1000 and 1100 for PMI-2), a
    # value with ';' and a thrid; Slurm's fullinit.
    s = Session(1)
    for k in (INIT, MAXES, KVSNAME):
        s.req(0, k)
    s.req(0, PUT, 0, 0x90).req(0, BARRIER)
    s.req(1, INIT2).req(1, F_INIT, 3).req(1, F_PUT, 1, 0xd0).req(1, F_PUT_SEMI, 2, 7).req(1, F_FENCE)
    s.req(2, INIT2).req(2, F_INIT, 1).req(2, F_PUT, 3, 0xe0).req(2, F_THRID, 0, 0x42).complete_own()
    s.req(0, GET, 1).req(0, GET, 2).req(1, F_GET, 0).req(1, F_GET, 2).req(2, F_THRID, 1, 9)
    s.req(2, F_GET_VAR, 2, 1)
    out["pmi2_mixed_trace"] = s

    # Node attributes: a waiter woken by a put, waits nobody can satisfy any more, wait=FALSE.
    s = Session(0)
    for t in range(3):
        s.req(t, INIT2).req(t, F_INIT, 0)
    s.req(0, F_GETNODE_WAIT, 1).req(1, F_PUTNODE, 1, 5).req(0, F_GETNODE, 1).req(2, F_GETNODE, 2, 1)
    s.req(0, F_GETNODE_WAIT, 2, 1).req(2, F_GETNODE_WAIT, 3).req(1, F_FINALIZE)
    s.req(0, F_PUTNODE, 2, 0x90).req(2, F_FENCE).req(0, F_FENCE)
    out["pmi2_nodeattr"] = s

    # Name service and spawns through a host that offers them; job-connect refused.
    s = Session(2)
    for t in range(3):
        s.req(t, INIT2).req(t, F_INIT, 0)
    s.req(0, F_PUBLISH, 1, 2).reply(0, 0).req(1, F_LOOKUP, 1).reply(1, 1).req(1, F_LOOKUP, 5).reply(1, 6)
    s.req(0, F_PUBLISH, 6, 3).reply(0, 7).req(0, F_UNPUBLISH, 1).reply(0, 0)
    s.req(2, F_SPAWN, 3, 1).reply(2, 4).req(2, F_SPAWN, 0, 2).reply(2, 9).req(2, F_SPAWN, 1, 3).reply(2, 6)
    s.req(1, F_CONNECT).req(1, F_DISCONNECT).req(1, F_LOOKUP, 2).req(1, F_ABORT, 3, 0)
    out["pmi2_services"] = s

    # The same without services, spawns of 256 and 257 commands, and a spawn whose counts disagree.
    s = Session(0)
    for t in range(3):
        s.req(t, INIT2)
    s.req(0, F_PUBLISH, 1, 2).req(0, F_LOOKUP, 1).req(0, F_SPAWN, 1, 0).req(0, F_SPAWN_MANY, 255, 0)
    s.req(1, F_SPAWN_MANY, 255, 1).req(2, F_SPAWN_BAD, 1)
    out["pmi2_no_services"] = s

    # Malformed requests, one per task (each cuts its task off).
    faults = [
        (F_UNKNOWN, 0, 0), (F_MISSING, 0, 0), (F_GETNODE_MAYBE, 1, 0),
        (F_BAD_PREFIX, 0, 0), (F_BAD_PREFIX, 3, 0), (F_MALFORMED, 0, 0),
        (F_SPAWN_BAD, 0, 0), (F_SPAWN_BAD, 3, 0), (F_SPAWN_BAD, 4, 0),
        (F_TOO_LONG, 0, 5), (F_TOO_LONG, 1, 0), (F_NEWLINE, 0, 1),
        (F_PMI1_LINE, 10, 0), (F_TWO, 1, 3), (F_MALFORMED, 6, 0),
    ]
    for i in range(0, len(faults), 3):
        s = Session(0)
        for t, (k, a, b) in enumerate(faults[i:i + 3]):
            s.req(t, INIT2).req(t, F_INIT, 0).req(t, k, a, b)
        out["pmi2_faults_%d" % (i // 3)] = s

    # Small limits, cyclic map, output a few bytes at a time: frames split (in the prefix too), typed in
    # small chunks, left-padded lengths, puts over the limit, a fence with a task that aborts while waiting.
    s = Session(4 | 8).piece(5)
    for t in range(3):
        s.req(t, INIT2)
    s.piece(200)
    for t in range(3):
        s.req(t, F_INIT | LEFT, 0).req(t, F_PUT, t, 0x70).req(t, F_PUT, t, 0x80)
    s.split(0, F_GET, 1, 0, 3).split(1, F_PUTNODE, 2, 0x97, 100).split(2, F_JOBATTR | LEFT, 0, 0, 200)
    s.raw(0, frame2(b"cmd=kvs-put;key=z0;value=" + b"v" * 200 + b";"), chunk=4)
    s.raw(1, frame2(b"cmd=kvs-get;jobid=kvs_fuzz_1;srcid=-1;key=z0;", left=True) + frame2(b"cmd=kvs-fence;"), chunk=5)
    s.req(0, F_FENCE).req(2, F_TWO, 2, 1)
    out["pmi2_small_limits"] = s

    # Raw frames: a session typed out by hand, a frame that announces more than comes, then a disconnect.
    s = Session(2).req(0, INIT2).req(1, INIT2).req(2, INIT)
    s.raw(0, frame2(b"cmd=fullinit;pmirank=0;") + frame2(b"cmd=job-getid;thrid=1;") + frame2(b"cmd=kvs-put;key=a;value=b;;c;"))
    s.raw(0, frame2(b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./x;maxprocs=2;argc=1;argv0=-v;infokeycount=0;"), chunk=9)
    s.reply(0, 4)
    s.raw(1, b"    40cmd=kvs-get;key=a;")
    s.disconnect(1)
    s.raw(2, b"cmd=init pmi_version=2 pmi_subversion=0\n" + frame2(b"cmd=fullinit;pmirank=2;"), chunk=11)
    out["pmi2_raw"] = s
    return out


# PMI-2 seeds for the pmi2 target: whole frames (prefix and body) and bare bodies.
PMI2_SEEDS = [
    frame2(b"cmd=fullinit;pmirank=0;"),
    frame2(b"cmd=fullinit;pmijobid=1.0;pmirank=3;threaded=FALSE;", left=True),
    frame2(b"cmd=job-getid;thrid=0x7ffd1234;"),
    frame2(b"cmd=kvs-put;key=-bcast-1-0;value=a b=c;"),
    frame2(b"cmd=kvs-put;key=P0-businesscard;value=description#node0$port#4242$ifname#10.0.0.1$;"),
    b"cmd=kvs-get;thrid=0x1;jobid=kvs_1;srcid=-1;key=x;;y",
    frame2(b"cmd=kvs-fence;"),
    frame2(b"cmd=info-getjobattr;key=PMI_process_mapping;"),
    frame2(b"cmd=info-putnodeattr;key=shm;value=/dev/shm/x;;1;"),
    frame2(b"cmd=info-getnodeattr;key=shm;wait=TRUE;"),
    b"cmd=info-getnodeattr;key=k;wait=maybe;",
    frame2(b"cmd=abort;isworld=1;exitcode=-3;message=rank 3: out of memory;"),
    frame2(b"cmd=finalize;"),
    frame2(b"cmd=name-publish;name=svc;port=tag#0$port#42$;"),
    frame2(b"cmd=name-unpublish;name=svc;"),
    frame2(b"cmd=name-lookup;thrid=7;name=svc;"),
    frame2(b"cmd=job-connect;jobid=kvs_2;"),
    frame2(
        b"cmd=spawn;thrid=1;ncmds=2;preputcount=1;ppkey0=PARENT_ROOT_PORT_NAME;ppval0=tag#0$port$;"
        b"subcmd=./a;maxprocs=2;argc=2;argv0=x;argv1=two words;infokeycount=1;infokey0=wdir;infoval0=/tmp;"
        b"subcmd=./b;maxprocs=1;argc=0;infokeycount=0;"
    ),
    b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=1;argv1=x;",
    b"cmd=spawn;ncmds=2;preputcount=0;subcmd=./a;maxprocs=1;argc=0;",
    b"cmd=spawn;ncmds=1;preputcount=1;subcmd=./a;maxprocs=-1;argc=0;infokeycount=1;infokey3=k;",
    b"cmd=spawn;ncmds=257;preputcount=0;" + b"subcmd=./a;" * 257,
    b" 1 3  cmd=finalize;",
    b"-00013cmd=finalize;",
    b"cmd=finalize;junk;",
    b"cmd=kvs-put;=v;",
    b"key=v;cmd=finalize;",
    b"cmd=no-such;",
]


PARSE_SEEDS = [
    b"cmd=init pmi_version=1 pmi_subversion=1",
    b"cmd=get_maxes",
    b"cmd=put kvsname=kvs_1 key=P0-businesscard value=description#node0$port#4242$ifname#10.0.0.1$",
    b"cmd=get kvsname=kvs_1 key=PMI_process_mapping",
    b"cmd=barrier_in",
    b"cmd=abort exitcode=3 message=rank 3: out of memory",
    b"cmd=publish_name service=svc port=tag#0$",
    b"cmd=get_ranks2hosts",
    b"mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\nargcnt=2\narg1=-v\narg2=a b\n"
    b"preput_num=1\npreput_key_0=PARENT_ROOT_PORT_NAME\npreput_val_0=tag#0$\ninfo_num=1\ninfo_key_0=wdir\n"
    b"info_val_0=/tmp\nendcmd",
]


# The frames of crates/core/src/slurm/protocol.rs: a u32 big-endian payload length, then the payload
# (kind byte first). A COLLECTIVE carries a frame of the collective (crates/core/src/collective/frame.rs) unchanged.

K_HELLO, K_JOINED, K_ABORT, K_ERROR, K_GONE, K_BYE, K_PROOF, K_UP = 1, 2, 3, 4, 5, 6, 7, 8
K_END, K_CHALLENGE, K_WELCOME, K_PARENT, K_PARENT_DONE, K_DOWN = 0x83, 0x84, 0x85, 0x86, 0x87, 0x88
# The collective's kinds.
C_CONTRIB, C_LOST, C_BYE, C_REPORT, C_ALL, C_FAIL, C_END = 1, 2, 3, 4, 0x81, 0x82, 0x83
VERSION = 3
MESSAGE_MAX = 4096
# Who admits, in a transcript, when it is srun (crates/core/src/slurm/auth.rs).
TO_ROOT = 0xFFFFFFFF
# The target's step secret, the nonce its acceptor challenges with and the one its joiner says HELLO with.
SECRET = b"\x5a" * 32
ACCEPTOR_NONCE = b"\x5a" * 32
JOINER_NONCE = b"\xa5" * 32


def frame(kind, payload=b""):
    return struct.pack(">IB", 1 + len(payload), kind) + payload


def hello(node, nonce, port=0, width=1, version=VERSION):
    return frame(K_HELLO, b"RPMI" + struct.pack(">HI", version, node) + nonce + struct.pack(">HI", port, width))


def prove(label, node, to, joiner_nonce, acceptor_nonce):
    """A proof of the handshake (auth::Secret::prove): HMAC-SHA256 over the label and the transcript."""
    message = label + struct.pack(">II", node, to) + joiner_nonce + acceptor_nonce
    return hmac.new(SECRET, message, hashlib.sha256).digest()


def proof(node, to, joiner_nonce):
    """The joiner's right PROOF, after the target's acceptor challenged with ACCEPTOR_NONCE."""
    return frame(K_PROOF, prove(b"rpmi join", node, to, joiner_nonce, ACCEPTOR_NONCE))


def welcome(node, to, acceptor_nonce):
    """The acceptor's right WELCOME to the target's joiner (HELLO with JOINER_NONCE)."""
    return frame(K_WELCOME, prove(b"rpmi admit", node, to, JOINER_NONCE, acceptor_nonce))


def up(inner):
    return frame(K_UP, inner)


def down(inner):
    return frame(K_DOWN, inner)


def abort(rank, code, message):
    return frame(K_ABORT, struct.pack(">Ii", rank, code) + message)


def error(rank, failed, message):
    return frame(K_ERROR, struct.pack(">IB", rank, failed) + message)


def u32(kind, n):
    return frame(kind, struct.pack(">I", n))


# The collective's frames (the payload of a COLLECTIVE).
def parts(ps):
    return struct.pack(">I", len(ps)) + b"".join(struct.pack(">II", n, len(b)) + b for n, b in ps)


def contrib(epoch, ps):
    return bytes([C_CONTRIB]) + struct.pack(">I", epoch) + parts(ps)


def all_(epoch, ps):
    return bytes([C_ALL]) + struct.pack(">I", epoch) + parts(ps)


def fail(epoch, message):
    return bytes([C_FAIL]) + struct.pack(">I", epoch) + message


def lost(node):
    return bytes([C_LOST]) + struct.pack(">I", node)


def report(data):
    return bytes([C_REPORT]) + data


# Header byte 0: the receiver (SRUN: srun from node n; PARENT_OF: n's parent from n, n moved among the
# nodes whose parent is a stepd; FROM_SRUN: stepd n from srun; FROM_PARENT: stepd n (moved likewise) from
# its parent), + FIRST for the stream from the connection's first byte (the handshake first), + SMALL for
# small bounds, + the tree's width * 16 (0: the star); byte 1: n (modulo the nodes), and with SMALL the
# bound on a part in units of 256 bytes; byte 2: nodes - 1; byte 3: chunk sizes (bits 0-1: at most 1, 7,
# 64, 4096 bytes; the rest seeds them).
SRUN, PARENT_OF, FROM_SRUN, FROM_PARENT, FIRST, SMALL = 0, 1, 2, 3, 4, 8


def frames(receiver, stream, node=0, nodes=1, width=0, chunks=2):
    return bytes([receiver | width << 4, node, nodes - 1, chunks]) + stream


def kvs(node, n):
    """A node's contribution: `<rank> <key>=<value>` lines, as the engine sends them."""
    return b"".join(b"%d kvs_%d_%d=v%d\n" % (node * 2 + i, node, i, i) for i in range(n))


FRAME_SEEDS = {
    # A stepd's whole life as srun reads it: node 1 of 5 in a tree of width 2 (its subtree: 1 and 4), with
    # the right proof; two exchanges of its subtree's parts, a rank gone, its child lost, a report, the end.
    "srun_session": frames(
        SRUN | FIRST,
        hello(1, bytes(range(32)), port=4242, width=2)
        + proof(1, TO_ROOT, bytes(range(32)))
        + u32(K_JOINED, 0)
        + up(contrib(0, [(1, kvs(1, 2)), (4, kvs(4, 1))]))
        + u32(K_JOINED, 1)
        + up(contrib(1, [(1, b""), (4, b"")]))
        + u32(K_GONE, 3)
        + up(lost(4))
        + up(report(b"\x01rank 9 exited"))
        + up(bytes([C_BYE]))
        + frame(K_BYE),
        node=1,
        nodes=5,
        width=2,
        chunks=1,
    ),
    # Aborts and job errors (with a UTF-8 text, an empty one, one of MESSAGE_MAX bytes), after the handshake.
    "srun_faults": frames(
        SRUN,
        abort(0, 7, b"rank 0: out of memory")
        + abort(2, -1, b"")
        + error(5, 1, "caf\u00e9 \u2014 rank 5 exited".encode())
        + error(6, 0, b"x" * MESSAGE_MAX)
        + u32(K_GONE, 4)
        + u32(K_JOINED, 2),
        chunks=3,
    ),
    # A text over MESSAGE_MAX, which no encoder writes: refused.
    "srun_long_text": frames(SRUN, abort(1, 2, b"z" * (MESSAGE_MAX + 1)) + frame(K_BYE), chunks=2),
    # Small bounds (768 bytes a part, node 0 of a star of 3): a CONTRIB, one with a part over the bound
    # (refused by the collective), then a frame over the transport's bound (16,386 bytes: a control frame of
    # the collective and its kind), refused as soon as its length has come.
    "srun_small_bound": frames(
        SRUN | SMALL,
        up(contrib(3, [(0, kvs(0, 3))]))
        + up(contrib(4, [(0, b"y" * 800)]))
        + struct.pack(">IB", 16387, K_UP)
        + bytes([C_REPORT]) * 8,
        node=3,
        nodes=3,
        chunks=6,
    ),
    # Not a stepd: an HTTP request, and a HELLO of protocol version 2 (without port and width), as srun's
    # first frame.
    "srun_garbage": frames(SRUN | FIRST, b"GET / HTTP/1.0\r\n\r\n", chunks=0),
    "srun_version_2": frames(
        SRUN | FIRST,
        frame(K_HELLO, b"RPMI" + struct.pack(">HI", 2, 0) + bytes(32)) + frame(K_PROOF, bytes(32)),
        chunks=4,
    ),
    # Malformed frames: a trailing byte, a job error whose cause is 2, an unknown kind, an empty frame, a
    # JOINED cut short; COLLECTIVEs with nothing inside, a part count the frame cannot hold, a part longer
    # than the frame, a FAIL text over MESSAGE_MAX, an unknown collective kind.
    "malformed": frames(
        SRUN,
        frame(K_BYE, b"\0")
        + error(1, 2, b"?")
        + frame(99)
        + struct.pack(">I", 0)
        + frame(K_JOINED, b"\0\0")
        + up(b"")
        + up(bytes([C_CONTRIB]) + struct.pack(">II", 0, 1000) + bytes(8))
        + up(bytes([C_CONTRIB]) + struct.pack(">IIII", 0, 1, 0, 9) + b"a")
        + down(fail(0, b"f" * (MESSAGE_MAX + 1)))
        + up(bytes([0x42])),
        chunks=5,
    ),
    # A parent stepd admits its child: node 2 of 7 in a tree of width 2 (parent 0, subtree 2 and 6), with
    # the right proof; the child's CONTRIB, its goodbye (the collective's and a BYE, which only srun takes).
    "parent_from_child": frames(
        PARENT_OF | FIRST,
        hello(2, bytes(range(64, 96)), port=0, width=2)
        + proof(2, 0, bytes(range(64, 96)))
        + up(contrib(0, [(2, kvs(2, 1)), (6, kvs(6, 2))]))
        + up(bytes([C_BYE]))
        + frame(K_BYE),
        node=0,
        nodes=7,
        width=2,
        chunks=3,
    ),
    # The stepd's side: node 3 of 7 in a tree of width 2 joins srun (the right WELCOME), hears where its
    # parent listens, then only the end; node 0, srun's child, gets the exchanges, a failure and the end.
    "stepd_from_srun": frames(
        FROM_SRUN | FIRST,
        frame(K_CHALLENGE, bytes(range(32, 64)))
        + welcome(3, TO_ROOT, bytes(range(32, 64)))
        + frame(K_PARENT, struct.pack(">H", 4242))
        + down(bytes([C_END]))
        + frame(K_END),
        node=3,
        nodes=7,
        width=2,
        chunks=7,
    ),
    "stepd_from_srun_child": frames(
        FROM_SRUN | FIRST,
        frame(K_CHALLENGE, bytes(range(32, 64)))
        + welcome(0, TO_ROOT, bytes(range(32, 64)))
        + down(all_(0, [(0, kvs(0, 2)), (1, kvs(1, 2)), (2, kvs(2, 1))]))
        + down(all_(1, [(0, b""), (1, b""), (2, b"")]))
        + down(fail(2, b"rank 3 on n2 closed its PMI connection"))
        + down(bytes([C_END]))
        + frame(K_END),
        node=0,
        nodes=3,
        width=2,
        chunks=2,
    ),
    # A parent that finished before its child joined it; a WELCOME whose proof is wrong.
    "stepd_parent_done": frames(
        FROM_SRUN | FIRST,
        frame(K_CHALLENGE, bytes(32)) + frame(K_WELCOME, bytes(32)) + frame(K_PARENT_DONE) + frame(K_END),
        node=5,
        nodes=6,
        width=1,
        chunks=1,
    ),
    # Node 2 of 7 (width 2) joins its parent, node 0 (the right WELCOME): the ALL, the parent's goodbye, a
    # failure of the next exchange, the root's end.
    "stepd_from_parent": frames(
        FROM_PARENT | FIRST,
        frame(K_CHALLENGE, bytes(range(96, 128)))
        + welcome(2, 0, bytes(range(96, 128)))
        + down(all_(0, [(i, kvs(i, 1)) for i in range(7)]))
        + down(bytes([C_BYE]))
        + down(fail(1, b"node 4 lost"))
        + down(bytes([C_END])),
        node=0,
        nodes=7,
        width=2,
        chunks=2,
    ),
    # Small bounds (256 bytes a part, a store of 1024; node 1 of a chain of 2): an ALL with a part over the
    # bound, one within, then a frame over the transport's bound (16,386 bytes), refused.
    "stepd_small_bound": frames(
        FROM_PARENT | SMALL,
        down(all_(0, [(0, b"a" * 100), (1, b"b" * 300)]))
        + down(all_(1, [(0, b""), (1, b"")]))
        + struct.pack(">IB", 16387, K_DOWN)
        + bytes([C_ALL]),
        node=1,
        nodes=2,
        width=1,
        chunks=1,
    ),
    # A failure whose text is not UTF-8 (each bad byte decodes to U+FFFD, 3 bytes).
    "stepd_not_utf8": frames(FROM_SRUN, down(fail(0, b"\xff" * 64 + "\u00e9".encode()[:1])) + frame(K_END), chunks=3),
    # The frames of both directions in one stream, whole.
    "both_sides": frames(
        SRUN,
        hello(0, bytes(32), width=4)
        + frame(K_CHALLENGE, bytes(32))
        + frame(K_PROOF, bytes(32))
        + frame(K_WELCOME, bytes(32))
        + u32(K_JOINED, 0)
        + frame(K_PARENT, struct.pack(">H", 1))
        + frame(K_PARENT_DONE)
        + up(contrib(0, [(0, b"0 k=v\n")]))
        + down(all_(0, [(0, b"0 k=v\n")]))
        + frame(K_BYE)
        + frame(K_END),
        chunks=3,
    ),
}


# fuzz_targets/collective.rs: 4 header bytes (nodes - 1, width (0: the star), the machine (0xFF: the root,
# else a node), small bounds), then events: an op byte (op % 12), a peer byte (0xFF: the root), arguments.
COLLECTIVE_SEEDS = {
    # The root of 3 nodes, width 2: node 0 sends a well-formed CONTRIB of epoch 0 with one part of its own.
    "root-contrib": bytes([2, 2, 0xFF, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1, 0x61]),
    # Node 0 of 3 contributes, then its parent (the root) sends an ALL of epoch 0.
    "node-contribute-all": bytes([2, 2, 0, 0, 8, 0, 4]) + b"abcd" + bytes([2, 0xFF, 0, 0, 0, 0, 3]),
    # Node 2 of a 6-node chain contributes, then loses its child (node 3).
    "chain-lost": bytes([5, 1, 2, 1, 8, 0, 2]) + b"hi" + bytes([7, 3]),
}


def main():
    engine = os.path.join(HERE, "seeds", "engine")
    parse = os.path.join(HERE, "seeds", "parse")
    os.makedirs(engine, exist_ok=True)
    os.makedirs(parse, exist_ok=True)
    for name, s in sessions().items():
        with open(os.path.join(engine, name), "wb") as f:
            f.write(bytes(s.b))
    for i, data in enumerate(PARSE_SEEDS):
        with open(os.path.join(parse, "seed%02d" % i), "wb") as f:
            f.write(data)
    pmi2 = os.path.join(HERE, "seeds", "pmi2")
    os.makedirs(pmi2, exist_ok=True)
    for i, data in enumerate(PMI2_SEEDS):
        with open(os.path.join(pmi2, "seed%02d" % i), "wb") as f:
            f.write(data)
    frames_dir = os.path.join(HERE, "seeds", "frames")
    os.makedirs(frames_dir, exist_ok=True)
    for name, data in FRAME_SEEDS.items():
        with open(os.path.join(frames_dir, name), "wb") as f:
            f.write(data)
    collective_dir = os.path.join(HERE, "seeds", "collective")
    os.makedirs(collective_dir, exist_ok=True)
    for name, data in COLLECTIVE_SEEDS.items():
        with open(os.path.join(collective_dir, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
