# A process of the job's user (run as a task, under `flux python`) that forges shell-to-shell messages of
# rpmi's Flux plugin, all claiming to be from shell 1: to shell 0, a message for rpmi, an abort for rank 4 and
# a join with a nonce of its own; to shell 1, a hello with that nonce. Prints what became of each.
import errno
import os

import flux
from flux.core.inner import ffi, raw
from flux.job import JobID

h = flux.Flux()
service = f"{os.getuid()}-shell-{JobID(os.environ['FLUX_JOB_ID']).f58plain}"


def outcome(f):
    # A message that is taken is not answered (shells send theirs without asking for an answer).
    try:
        raw.flux_future_wait_for(f, 5.0)
        raw.flux_rpc_get(f, ffi.NULL)
        return "taken"
    except OSError as e:
        return "taken (no answer yet)" if e.errno == errno.ETIMEDOUT else f"refused: {os.strerror(e.errno)}"


# From shell 1, of kind 0 (a node's frame): a BYE frame for node 0 (kind 3 of the collective's frames).
message = bytes([3])
f = raw.flux_rpc_raw(h.handle, f"{service}.rpmi-msg.1.0".encode(), message, len(message), 0, 0)
print("forged message:", outcome(f), flush=True)
for what, body, shell in [
    ("abort", {"shell": 1, "rank": 4, "exit_code": 3, "reason": 1, "message": "forged"}, 0),
    ("join", {"shell": 1, "nonce": "0" * 32}, 0),
    ("hello", {"nonce": "0" * 32}, 1),
]:
    rpc = h.rpc(f"{service}.rpmi-{what}", body, nodeid=shell)
    print(f"forged {what}:", outcome(rpc.handle), flush=True)
