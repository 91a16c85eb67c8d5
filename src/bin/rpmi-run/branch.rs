//! A virtual node's branch of the collective's tree: its node's machine (`rpmi::collective::Node`, node index
//! = virtual node index) and its connections, to the coordinator (the root: every node's reports and
//! goodbyes, its ending, and the coordinator's order to end the tasks), to its parent when that is a node,
//! to its children, and to its peers in Bruck's rounds. The shell's event loop reads and writes them; nothing that the plugin calls waits on
//! a socket. What the branch needs of the shell comes back as [`Act`]s, for the shell to carry out once the
//! branch is unlocked (they call into the plugin).

use crate::conn::{self, Blame, Conn, Heard, COLLECTIVE, CONTROL_MAX, ENDING, GROUP, KILL, LEFT};
use rpmi::abi::ffi;
use rpmi::collective::groups::{self, DoneParts};
use rpmi::collective::{frame, Allgather, Bounds, Node, Output, Parts, Peer, Tree};
use rpmi_core::codec::FrameReader;
use std::ffi::c_int;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How long a node's shell that has ended keeps sending what it still has queued for the tree to a peer that
/// takes none of it (a stopped process, say) before it exits anyway.
pub const FINISH_GRACE: Duration = Duration::from_secs(10);

/// A shell's connections and its node's machine, shared by the event loop and the plugin's callbacks.
pub struct Branch {
    state: Mutex<State>,
}

struct State {
    node: Node,
    me: u32,
    /// The connections: the coordinator's first (so that its order to end the tasks is heard before a
    /// failure that follows from it), then the other nodes'.
    conns: Vec<Conn>,
    /// Who is at the other end of each.
    peers: Vec<Peer>,
    /// Whether each peer said it is done.
    said_bye: Vec<bool>,
    /// The tasks are all gone and the instance is destroyed: this node said it is done, and results that
    /// come now are nobody's.
    finished: bool,
    /// The largest end of a group exchange the coordinator may send.
    group_max: usize,
    /// The coordinator's orders to end the tasks (a signal each), and the group exchanges it ended.
    kills: Vec<c_int>,
    groups_done: Vec<DoneParts>,
    /// The coordinator sent a group exchange's end that does not read: why.
    bad_group: Option<String>,
}

/// What the branch asks of the shell, in order, once it is unlocked (it calls into the plugin).
#[derive(Debug)]
pub enum Act {
    /// The coordinator's order: end the tasks with this signal.
    Kill(c_int),
    /// A group exchange the coordinator ended: every member's part.
    CompleteGroup(DoneParts),
    /// The exchange in progress completed.
    Complete(Parts),
    /// The machine failed for good (`live`: the exchange's barrier is still to be failed).
    Fail { message: String, live: bool },
    /// The job cannot go on, for what `Blame` says.
    JobError(Blame),
}

impl Branch {
    /// Node `me` of `tree`, whose exchanges go by `allgather`: `root` to the coordinator, `peers` to every
    /// node it talks to ([`Node::peers`]), by node.
    pub fn new(
        tree: Tree,
        allgather: Allgather,
        me: u32,
        bounds: Bounds,
        root: UnixStream,
        peers: Vec<(u32, UnixStream)>,
    ) -> Result<Branch, String> {
        // Every node's part, each at most the exchange's bound, and all of them too.
        let all_max = frame::parts_len(tree.nodes() as usize, bounds.exchange_max.bytes);
        let node = Node::new(tree, me, bounds, all_max).map_err(|e| e.to_string())?.with_allgather(allgather);
        let mut ends = vec![(Peer::Root, root)];
        ends.extend(peers.into_iter().map(|(c, s)| (Peer::Node(c), s)));
        let mut conns = Vec::with_capacity(ends.len());
        let mut peers = Vec::with_capacity(ends.len());
        for (peer, stream) in ends {
            conns.push(Conn::new(stream).map_err(|e| format!("cannot connect virtual node {me} to {peer}: {e}"))?);
            peers.push(peer);
        }
        let said_bye = vec![false; conns.len()];
        let group_max = groups::done_max(tree.nodes(), &bounds);
        let state = State {
            node,
            me,
            conns,
            peers,
            said_bye,
            finished: false,
            group_max,
            kills: Vec::new(),
            groups_done: Vec::new(),
            bad_group: None,
        };
        Ok(Branch { state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the state, sends the frames the machine hands back, and returns what else it asks.
    fn drive<T>(&self, f: impl FnOnce(&mut State) -> T) -> (T, Vec<Act>) {
        let mut state = self.lock();
        let value = f(&mut state);
        let mut acts: Vec<Act> = state.kills.drain(..).map(Act::Kill).collect();
        let done = std::mem::take(&mut state.groups_done);
        if !state.finished {
            acts.extend(done.into_iter().map(Act::CompleteGroup));
        }
        state.take_outputs(&mut acts);
        if let Some(message) = state.bad_group.take() {
            acts.push(Act::JobError(Blame { node: None, left: false, message }));
        }
        (value, acts)
    }

    /// The plugin's `collective`: this node's part of the exchange in progress.
    pub fn contribute(&self, part: &[u8]) -> (c_int, Vec<Act>) {
        self.drive(|s| match s.node.contribute(part.to_vec()) {
            Ok(()) => ffi::RPMI_OK,
            Err(e) => {
                say!("virtual node {}: the plugin started {e}", s.me);
                ffi::RPMI_ERR_STATE
            }
        })
    }

    /// The plugin's `group_collective`: this node's part of group exchange `id`, which the coordinator
    /// gathers from the member nodes.
    pub fn group(&self, id: &[u8], part: &[u8]) -> c_int {
        let sent = groups::encode_part(id, part).is_some_and(|m| self.lock().conns[0].send(GROUP, Arc::new(m)));
        if sent {
            ffi::RPMI_OK
        } else {
            ffi::RPMI_ERR_STATE
        }
    }

    /// Tells the coordinator that rank `rank` of this node has exited, so that a group exchange waiting for
    /// it there ends the job instead of waiting for ever.
    pub fn send_left(&self, rank: u32) {
        self.lock().conns[0].send(LEFT, Arc::new(rank.to_le_bytes().to_vec()));
    }

    /// Tells the coordinator that a rank of this node called `PMI_Abort` with `code`, news on this node (see
    /// `ShellHost::end_job`). Returns false if the coordinator is gone.
    pub fn send_abort(&self, code: i32, message: &str) -> bool {
        self.lock().conns[0].send(conn::ABORT, conn::abort(code, rpmi::os::monotonic_ns(), message))
    }

    /// Tells the coordinator, up the tree, that the job cannot go on for what `blame` says.
    pub fn send_report(&self, blame: &Blame) -> (bool, Vec<Act>) {
        self.drive(|s| s.conns[0].open() && s.node.report(&blame.encode()).is_ok())
    }

    /// Tells the coordinator that this node ended the job for another reason; it says `message` (unless
    /// empty) if it is news for the whole job too.
    pub fn send_ending(&self, message: &str) -> bool {
        self.lock().conns[0].send(ENDING, conn::ending(message))
    }

    /// Adds what to poll for, one entry per connection, in the order `ready` takes them.
    pub fn watch(&self, fds: &mut Vec<libc::pollfd>) {
        fds.extend(self.lock().conns.iter().map(Conn::pollfd));
    }

    /// Writes and reads the connections that `fds` (from `watch`, polled) found ready.
    pub fn ready(&self, fds: &[libc::pollfd]) -> Vec<Act> {
        let ((), acts) = self.drive(|s| {
            for (i, fd) in fds.iter().enumerate().take(s.conns.len()) {
                if fd.revents != 0 && !s.conns[i].ended() {
                    s.conns[i].flush();
                    s.hear(i);
                }
            }
        });
        acts
    }

    /// The node's tasks are all gone and its instance destroyed: says so to the tree, then sends what is
    /// still queued before the shell exits, reading meanwhile, so that a peer that writes to this node is
    /// not kept waiting by it. Once `grace` ([`FINISH_GRACE`]) has passed, whatever is left is given up
    /// on, so that a peer that takes nothing (stopped, say) cannot keep this node's shell from exiting.
    /// `carry_out` does what the branch asks meanwhile.
    pub fn finish(&self, grace: Duration, carry_out: &dyn Fn(Vec<Act>)) {
        let ((), acts) = self.drive(|s| {
            s.finished = true;
            s.node.finish();
        });
        carry_out(acts);
        let deadline = Instant::now() + grace;
        loop {
            let mut fds = Vec::new();
            self.watch(&mut fds);
            if fds.iter().all(|fd| fd.events & libc::POLLOUT == 0) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let me = self.lock().me;
                return say!(
                    "virtual node {me}: a peer in the tree took nothing for {:.1} s; exiting without sending it the \
                     rest",
                    grace.as_secs_f64()
                );
            }
            // SAFETY: poll over our own array.
            if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, left.as_millis() as i32 + 1) } > 0 {
                carry_out(self.ready(&fds));
            }
        }
    }
}

impl State {
    /// Reads connection `i` until no whole frame is left; the coordinator's order to end the tasks is
    /// carried out first of all.
    fn hear(&mut self, i: usize) {
        let peer = self.peers[i];
        loop {
            let node = &self.node;
            let group_max = self.group_max;
            let max = |kind| match kind {
                COLLECTIVE => node.frame_max(peer),
                GROUP => group_max,
                _ => CONTROL_MAX,
            };
            match self.conns[i].receive(max) {
                Heard::Frame(COLLECTIVE, frame) => {
                    self.said_bye[i] |= frame::is_bye(&frame);
                    self.node.receive(peer, Arc::new(frame));
                }
                Heard::Frame(GROUP, m) if peer == Peer::Root => match DoneParts::decode(Arc::new(m)) {
                    Ok(done) => self.groups_done.push(done),
                    // Its barrier would never end: the job cannot go on.
                    Err(why) => {
                        let message =
                            format!("rpmi-run sent virtual node {} a malformed group exchange: {}", self.me, why.0);
                        self.bad_group = Some(message);
                    }
                },
                Heard::Frame(KILL, signal) if peer == Peer::Root => {
                    self.kills.push(FrameReader::new(&signal).i32_le().unwrap_or(libc::SIGKILL));
                }
                Heard::Frame(..) => {}
                Heard::Pending => return,
                Heard::Ended => return self.node.lost(peer),
                Heard::TooLong { kind, len, max } => {
                    say!(
                        "virtual node {}: {peer} sent a frame (kind {kind}) of {len} bytes, over the {max} it may; \
                         closing the connection",
                        self.me
                    );
                    return self.node.lost(peer);
                }
            }
        }
    }

    /// Sends what the machine hands back, and adds to `acts` what else it asks.
    fn take_outputs(&mut self, acts: &mut Vec<Act>) {
        while let Some(output) = self.node.poll() {
            match output {
                // The queues stay bounded: on each connection the machine has at most one exchange's frame
                // in flight (a CONTRIB up once every part of it is in; an ALL to each child, one frame
                // shared, and the child's next CONTRIB, so the next ALL, waits until it has read that one),
                // or with Bruck's allgather a round of this exchange and of the next (none further: the
                // next one needs the peer's part), besides a few control frames.
                Output::Send { to, frame } => {
                    if let Some(i) = self.peers.iter().position(|&p| p == to) {
                        self.conns[i].send(COLLECTIVE, frame);
                    }
                }
                Output::Done { parts, .. } if !self.finished => acts.push(Act::Complete(parts)),
                Output::Failed { message, .. } => acts.push(Act::Fail { message, live: !self.finished }),
                Output::JobError { node, message } => {
                    let left = node.is_some_and(|n| self.left(n));
                    acts.push(Act::JobError(Blame { node, left, message }));
                }
                Output::Done { .. } | Output::Report { .. } => {}
            }
        }
    }

    /// Whether node `n` (this one, or a peer) had said it is done.
    fn left(&self, n: u32) -> bool {
        if n == self.me {
            return self.finished;
        }
        self.peers.iter().zip(&self.said_bye).any(|(&p, &bye)| p == Peer::Node(n) && bye)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::tests::{read_frame, write_frame as send};
    use rpmi::collective::frame::Frame;
    use rpmi::collective::Bound;

    fn next(from: &mut UnixStream) -> (u8, Vec<u8>) {
        read_frame(from).expect("a frame")
    }

    fn decode(frame: Vec<u8>) -> Frame {
        Frame::decode(&Arc::new(frame), usize::MAX).unwrap()
    }

    /// One turn of the shell's event loop, without the instance: what the branch asks of the shell.
    fn turn(branch: &Branch) -> Vec<Act> {
        let mut fds = Vec::new();
        branch.watch(&mut fds);
        // SAFETY: poll over our own array.
        assert!(unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 5000) } > 0);
        branch.ready(&fds)
    }

    fn bounds() -> Bounds {
        let bound = Bound { bytes: 1 << 20, option: "-o kvs_bytes_max" };
        Bounds { part_max: bound, exchange_max: bound }
    }

    /// Node 1 of a chain of 3: under node 0, over node 2.
    #[test]
    fn a_node_sends_its_subtrees_parts_up_and_its_news_to_the_coordinator() {
        let pair = || UnixStream::pair().unwrap();
        let ((mut root, r), (mut parent, p), (mut child, c)) = (pair(), pair(), pair());
        let branch =
            Branch::new(Tree::new(3, 1).unwrap(), Allgather::Tree, 1, bounds(), r, vec![(0, p), (2, c)]).unwrap();

        assert_eq!(branch.contribute(b"x").0, ffi::RPMI_OK);
        send(&mut child, COLLECTIVE, &frame::contrib(0, std::iter::once((2, &b"y"[..]))).unwrap());
        turn(&branch);
        let Frame::Contrib { epoch: 0, parts } = decode(next(&mut parent).1) else { panic!("not a CONTRIB") };
        assert_eq!(parts.iter().collect::<Vec<_>>(), [(1, &b"x"[..]), (2, &b"y"[..])]);
        assert_eq!(branch.contribute(b"z").0, ffi::RPMI_ERR_STATE, "one exchange at a time");

        assert!(branch.send_ending("rank 1 left"));
        assert_eq!(next(&mut root), (ENDING, b"rank 1 left".to_vec()));
        let before = rpmi::os::monotonic_ns();
        assert!(branch.send_abort(-3, "rank 1 called PMI_Abort"));
        let (kind, abort) = next(&mut root);
        let (code, at, message) = conn::read_abort(&abort);
        assert_eq!((kind, code, message), (conn::ABORT, -3, &b"rank 1 called PMI_Abort"[..]));
        assert!(before <= at && at <= rpmi::os::monotonic_ns());
        let blame = Blame { node: Some(2), left: true, message: "node 2 cannot join".into() };
        assert!(branch.send_report(&blame).0);
        let (kind, report) = next(&mut root);
        let Frame::Report(bytes) = decode(report) else { panic!("not a REPORT (kind {kind})") };
        assert_eq!(
            Blame::decode(&bytes),
            Some(Blame { node: Some(2), left: true, message: "node 2 cannot join".into() })
        );

        send(&mut root, KILL, &libc::SIGKILL.to_le_bytes());
        let acts = turn(&branch);
        assert!(matches!(acts[..], [Act::Kill(libc::SIGKILL)]), "the coordinator's order ends the tasks: {acts:?}");
    }

    /// Node 1 of a chain of 3 ends, its child's part in: it says goodbye to everyone, and reports that it left
    /// the exchange its child joined.
    #[test]
    fn a_node_that_ends_during_an_exchange_says_it_left() {
        let pair = || UnixStream::pair().unwrap();
        let ((mut root, r), (mut parent, p), (mut child, c)) = (pair(), pair(), pair());
        let branch =
            Branch::new(Tree::new(3, 1).unwrap(), Allgather::Tree, 1, bounds(), r, vec![(0, p), (2, c)]).unwrap();
        send(&mut child, COLLECTIVE, &frame::contrib(0, std::iter::once((2, &b"y"[..]))).unwrap());
        turn(&branch);
        // The job cannot go on: the shell hears it (and ends the job, which reports it up the tree).
        let asked = std::cell::RefCell::new(Vec::new());
        branch.finish(FINISH_GRACE, &|acts| asked.borrow_mut().extend(acts));
        let asked = asked.into_inner();
        let blame = asked.iter().find_map(|a| match a {
            Act::JobError(blame) => Some(blame),
            _ => None,
        });
        assert_eq!(blame.map(|b| (b.node, b.left)), Some((Some(1), true)), "{asked:?}");
        assert_eq!(decode(next(&mut parent).1), Frame::Bye);
        assert_eq!(decode(next(&mut root).1), Frame::Bye);
        assert_eq!(decode(next(&mut child).1), Frame::Bye);
        assert!(matches!(decode(next(&mut child).1), Frame::Fail { epoch: 0, .. }));
    }

    /// Node 1 of a chain of 3 ends while its parent reads nothing, its CONTRIB too large for the socket: it
    /// gives up on the parent after the grace, having said goodbye to the others.
    #[test]
    fn a_node_that_ends_gives_up_on_a_peer_that_reads_nothing() {
        let pair = || UnixStream::pair().unwrap();
        let ((mut root, r), (_parent, p), (mut child, c)) = (pair(), pair(), pair());
        let branch =
            Branch::new(Tree::new(3, 1).unwrap(), Allgather::Tree, 1, bounds(), r, vec![(0, p), (2, c)]).unwrap();
        assert_eq!(branch.contribute(&vec![b'x'; 900 << 10]).0, ffi::RPMI_OK);
        send(&mut child, COLLECTIVE, &frame::contrib(0, std::iter::once((2, &b"y"[..]))).unwrap());
        turn(&branch);
        let start = Instant::now();
        branch.finish(Duration::from_millis(300), &|_| {});
        assert!(start.elapsed() >= Duration::from_millis(300), "it waited for the parent first");
        assert_eq!(decode(next(&mut root).1), Frame::Bye);
        assert_eq!(decode(next(&mut child).1), Frame::Bye);
    }
}
