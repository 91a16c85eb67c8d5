//! Virtual nodes as processes of their own. With `--nodes M` above 1, rpmi-run forks one shell process per
//! node, each the leader of a session of its own (as a real node's job shell is, e.g. Slurm's slurmstepd),
//! so the kernel schedules each node's shell and its tasks as one group. The nodes exchange each
//! collective over a k-ary tree (`--tree-width`) or by Bruck's allgather (`--allgather bruck`), through a
//! socketpair per pair of nodes that talk, each node's shell running its node's machine (see `branch`), the
//! tree's top at node 0; rpmi-run itself stays as the coordinator, the tree's
//! root above node 0 (`rpmi::collective::Root`), with a socketpair to every node, taking no part in exchanges.
//! It passes on why and when the job ends: it
//! says what is news for the whole job (the first reason, the first abort), and ends a job that cannot go
//! on, such as one whose barrier waits for a node that has ended.

use crate::branch::Branch;
use crate::conn::{self, Blame, Conn, Heard, ABORT, COLLECTIVE, CONTROL_MAX, ENDING, GROUP, KILL, LEFT};
use crate::services::Ended;
use rpmi::abi::ffi;
use rpmi::collective::{frame, groups, Allgather, Blocked, Bounds, Bytes, GroupRoot, Output, Peer, Root, Tree};
use rpmi::server::{TaskMap, JOB_ERROR_EXIT_CODE};
use rpmi_core::codec::FrameReader;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Who ended the job first, as the coordinator heard it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum First {
    /// A node's shell, which then exits with the job's status (unless a task called PMI_Abort).
    Node(usize),
    /// The collective: a machine found a job error (see [`Outcome::blamed`]).
    Collective,
}

/// A task's PMI_Abort, as its node's shell told it.
#[derive(Debug)]
struct Abort {
    code: i32,
    /// When the shell heard of it (`rpmi::os::monotonic_ns`).
    at: u64,
    message: Vec<u8>,
}

/// What the coordinator heard of the job's ending.
#[derive(Default, Debug)]
struct Outcome {
    first: Option<First>,
    /// When the coordinator heard of the first (`rpmi::os::monotonic_ns`).
    began: Option<u64>,
    /// The first PMI_Abort, from any node: by when its shell heard of it, not when the coordinator did. A
    /// task's abort can make others fail and abort too (an MPI rank whose peer vanished during MPI_Init),
    /// and their nodes' news can reach the coordinator first.
    abort: Option<Abort>,
    /// The job error that ended the job, not said yet: it waits for the node at fault to end its
    /// connection, after anything it had to say of its own (what it found first, such as a task that
    /// failed or another node that left, which then is the news; see `Coordinator::supersedes`).
    blamed: Option<Blame>,
}

/// Forks a shell process for each node (`cliques`: each node's ranks) of `tree`, which runs `shell(index,
/// branch)` in a session of its own and exits with what it returns, then serves as the tree's root until all
/// have exited. Returns rpmi-run's exit status: the code of the first PMI_Abort (see [`Outcome::abort`]);
/// else, if a node ended the job, that node's exit status (which follows the same rules, see
/// `host::Fate::status`); if the collective did (a node left an exchange the others joined, a node was
/// lost), [`JOB_ERROR_EXIT_CODE`]; else the first non-zero status of a shell; else 0; with when the job began
/// to end. Messages that are not news for the job are said only at `verbosity` debug. `after_fork` runs once
/// every node is forked; signals are passed on to `spawned_runs` too. Call it before any other thread exists
/// (it forks).
pub fn coordinate(
    cliques: &[Vec<u32>],
    (tree, allgather): (Tree, Allgather),
    bounds: Bounds,
    verbosity: i32,
    spawned_runs: &Arc<Mutex<Vec<libc::pid_t>>>,
    after_fork: impl FnOnce(),
    host: impl Fn(usize, Branch) -> i32,
) -> Result<Ended, String> {
    let nodes = cliques.len();
    let mut conns: Vec<Conn> = Vec::with_capacity(nodes);
    let mut pids: Vec<libc::pid_t> = Vec::with_capacity(nodes);
    // Each node's ends of its socketpairs to lower nodes (its parent, and its peers in Bruck's rounds), made
    // along with theirs (a lower node is forked first) and held until the node is forked.
    let mut held: Vec<Vec<(u32, UnixStream)>> = (0..nodes).map(|_| Vec::new()).collect();
    for index in 0..nodes {
        let me = index as u32;
        let connect = |e: io::Error| format!("cannot connect virtual node {index}: {e}");
        let (ours, theirs) = UnixStream::pair().map_err(connect)?;
        let mut peers = std::mem::take(&mut held[index]);
        for peer in allgather.peers(&tree, me).into_iter().filter(|&p| p > me) {
            let (mine, its) = UnixStream::pair().map_err(connect)?;
            held[peer as usize].push((me, its));
            peers.push((peer, mine));
        }
        let branch = Branch::new(tree, allgather, me, bounds, theirs, peers)?;
        let ours = Conn::new(ours).map_err(connect)?;
        // SAFETY: no other thread exists yet, so the child may go on running Rust code after fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            for &pid in &pids {
                // SAFETY: kill on our own children.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            return Err(format!("cannot start virtual node {index}: {}", io::Error::last_os_error()));
        }
        if pid == 0 {
            // Only its own ends stay open, so that every connection ends when the shell at either end does.
            drop((conns, held, ours));
            // SAFETY: setsid has no memory effects; it fails only for a process group leader, which a child
            // just forked is not.
            unsafe { libc::setsid() };
            std::process::exit(host(index, branch));
        }
        drop(branch);
        conns.push(ours);
        pids.push(pid);
    }

    after_fork();

    // After a signal passed on, the tasks end by it: what follows (a node left an exchange) is no news.
    let signalled = Arc::new(AtomicBool::new(false));
    // When the first signal came (0: none), which is when the job began to end if nothing else did first.
    let signal_at = Arc::new(AtomicU64::new(0));
    let (passed, at, shells, spawned_runs) = (signalled.clone(), signal_at.clone(), pids.clone(), spawned_runs.clone());
    crate::output::forward_signals(move |sig| {
        say!("got signal {sig}, passing it to every task");
        passed.store(true, Ordering::SeqCst);
        let _ = at.compare_exchange(0, rpmi::os::monotonic_ns(), Ordering::SeqCst, Ordering::SeqCst);
        for &pid in &shells {
            // SAFETY: kill on our own children; each shell passes the signal on to its tasks.
            unsafe { libc::kill(pid, sig) };
        }
        crate::output::signal_each(&spawned_runs, sig);
    });

    let mut coordinator = Coordinator::new(tree, bounds, cliques, conns, verbosity, signalled);
    coordinator.run();
    let outcome = coordinator.outcome;
    let mut statuses = Vec::with_capacity(nodes);
    for (index, &pid) in pids.iter().enumerate() {
        let mut status = 0;
        // SAFETY: waitpid on our own child into a local.
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break;
            }
        }
        let code = if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            say!("virtual node {index} died of signal {}", libc::WTERMSIG(status));
            128 + libc::WTERMSIG(status)
        };
        statuses.push(code);
    }
    let status = match &outcome {
        Outcome { abort: Some(Abort { code, .. }), .. } => *code,
        Outcome { first: Some(First::Node(index)), .. } => statuses[*index],
        Outcome { first: Some(First::Collective), .. } => JOB_ERROR_EXIT_CODE,
        Outcome { first: None, .. } => statuses.iter().copied().find(|&code| code != 0).unwrap_or(0),
    };
    let signalled_at = Some(signal_at.load(Ordering::SeqCst)).filter(|&t| t != 0);
    let began = outcome.abort.as_ref().map(|a| a.at).into_iter().chain(outcome.began).chain(signalled_at).min();
    Ok(Ended { status, began })
}

/// `rank 3`, `ranks 0,2`: a node's ranks, the first few of many.
fn ranks(clique: &[u32]) -> String {
    const SHOWN: usize = 8;
    let listed: Vec<String> = clique.iter().take(SHOWN).map(u32::to_string).collect();
    let more = if clique.len() > SHOWN { format!(",... ({} ranks)", clique.len()) } else { String::new() };
    let noun = if clique.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}{more}", listed.join(","))
}

/// The tree's root and its connection to every node, on one thread.
struct Coordinator<'a> {
    root: Root,
    /// PMI 1.2's group exchanges, a star through the coordinator.
    groups: GroupRoot,
    /// Ranks that have exited, with their node.
    left: Vec<(u32, u32)>,
    /// To each node, by index.
    conns: Vec<Conn>,
    cliques: &'a [Vec<u32>],
    /// Whether each node said it is done.
    said_bye: Vec<bool>,
    outcome: Outcome,
    /// What was said, so that a reason every node gives alike is said once.
    said: Vec<Vec<u8>>,
    verbosity: i32,
    signalled: Arc<AtomicBool>,
}

impl<'a> Coordinator<'a> {
    fn new(
        tree: Tree,
        bounds: Bounds,
        cliques: &'a [Vec<u32>],
        conns: Vec<Conn>,
        verbosity: i32,
        signalled: Arc<AtomicBool>,
    ) -> Coordinator<'a> {
        let said_bye = vec![false; conns.len()];
        let root = Root::new(tree, bounds);
        let mut node_of = vec![0; cliques.iter().map(Vec::len).sum()];
        for (node, ranks) in cliques.iter().enumerate() {
            for &rank in ranks {
                node_of[rank as usize] = node as u32;
            }
        }
        Coordinator {
            root,
            groups: GroupRoot::new(TaskMap::new(node_of), bounds),
            left: Vec::new(),
            conns,
            cliques,
            said_bye,
            outcome: Outcome::default(),
            said: Vec::new(),
            verbosity,
            signalled,
        }
    }

    /// Serves every node until all have gone, then says the first abort, if any.
    fn run(&mut self) {
        while self.conns.iter().any(|c| !c.ended()) {
            let mut fds: Vec<libc::pollfd> = self.conns.iter().map(Conn::pollfd).collect();
            // SAFETY: poll over our own array.
            if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) } <= 0 {
                continue;
            }
            for (index, fd) in fds.iter().enumerate() {
                if fd.revents != 0 && !self.conns[index].ended() {
                    self.conns[index].flush();
                    self.hear(index);
                }
            }
        }
        if let Some(abort) = self.outcome.abort.take() {
            self.say_once(&abort.message, true);
            self.outcome.abort = Some(abort);
        }
    }

    /// Reads node `index`'s connection until no whole frame is left.
    fn hear(&mut self, index: usize) {
        let from = index as u32;
        loop {
            let (root, group_max) = (&self.root, self.groups.contribution_max());
            let max = |kind| match kind {
                COLLECTIVE => root.frame_max(from),
                GROUP => group_max,
                _ => CONTROL_MAX,
            };
            match self.conns[index].receive(max) {
                Heard::Frame(COLLECTIVE, frame) => {
                    let bye = frame::is_bye(&frame);
                    self.said_bye[index] |= bye;
                    self.root.receive(from, Arc::new(frame));
                    if bye {
                        self.group_blocked();
                    }
                }
                Heard::Frame(ENDING, message) => {
                    let first = self.ended_by(index, &message);
                    self.say_once(&message, first);
                }
                Heard::Frame(ABORT, payload) => {
                    let (code, at, message) = conn::read_abort(&payload);
                    self.ended_by(index, message);
                    self.abort(Abort { code, at, message: message.to_vec() });
                }
                Heard::Frame(GROUP, m) => self.group(from, &m),
                Heard::Frame(LEFT, rank) => {
                    if let Ok(rank) = FrameReader::new(&rank).u32_le() {
                        self.left.push((rank, from));
                        self.group_blocked();
                    }
                }
                Heard::Frame(..) => {}
                Heard::Pending => break,
                Heard::Ended => {
                    self.root.lost(from);
                    self.group_blocked();
                    break;
                }
                Heard::TooLong { kind, len, max } => {
                    let message = format!(
                        "virtual node {index} sent rpmi-run a frame (kind {kind}) of {len} bytes, over the {max} it \
                         takes"
                    );
                    self.blame(None, Blame { node: Some(from), left: false, message });
                    self.root.lost(from);
                    break;
                }
            }
            self.serve_root();
        }
        self.serve_root();
        if self.conns[index].ended() && self.outcome.blamed.as_ref().is_some_and(|b| b.node == Some(from)) {
            self.say_blamed();
        }
    }

    /// Node `from`'s part of a group exchange; once every member's is in, the parts go to each member.
    fn group(&mut self, from: u32, m: &[u8]) {
        let taken = groups::decode_part(m).map_err(|e| e.0).and_then(|p| self.groups.contribute(from, &p.id, p.part));
        match taken {
            Ok(Some(done)) => {
                let end = groups::encode_done(&done.id, &done.parts).map(Arc::new);
                for (member, end) in done.shells.iter().zip(std::iter::repeat(end).flatten()) {
                    if let Some(conn) = self.conns.get_mut(*member as usize) {
                        conn.send(GROUP, end);
                    }
                }
            }
            // A member may have gone before the first part came.
            Ok(None) => self.group_blocked(),
            Err(message) => self.blame(None, Blame { node: Some(from), left: false, message }),
        }
    }

    /// Ends the job if a group exchange waits for a rank that has exited, or a node that said it is done or
    /// has gone.
    fn group_blocked(&mut self) {
        let (said_bye, conns) = (&self.said_bye, &self.conns);
        let left = self.left.iter().map(|&(r, n)| (r, n, false));
        let gone = |n: u32| said_bye[n as usize] || conns[n as usize].ended();
        let (node, message) = match self.groups.blocked(left, conns.len() as u32, gone) {
            None => return,
            Some(Blocked::Rank { id, rank, node, .. }) => {
                (node, format!("rank {rank} exited while other ranks wait for it in group barrier {id}"))
            }
            // Said as it is (a node that left is otherwise said to have left "a barrier").
            Some(Blocked::Node { id, node }) => (
                node,
                format!(
                    "ranks wait in group barrier {id} that virtual node {node} cannot join: every rank on it has \
                     closed its PMI connection"
                ),
            ),
        };
        self.blame(None, Blame { node: Some(node), left: false, message });
    }

    /// Sends what the root hands back, and ends the job on a job error.
    fn serve_root(&mut self) {
        while let Some(output) = self.root.poll() {
            match output {
                Output::Send { to: Peer::Node(to), frame } => {
                    if let Some(conn) = self.conns.get_mut(to as usize) {
                        conn.send(COLLECTIVE, frame);
                    }
                }
                Output::Report { from, bytes } => {
                    if let Some(blame) = Blame::decode(&bytes) {
                        self.blame(Some(from as usize), blame);
                    }
                }
                Output::JobError { node, message } => {
                    let left = node.is_some_and(|n| self.said_bye.get(n as usize) == Some(&true));
                    self.blame(None, Blame { node, left, message });
                }
                Output::Send { to: Peer::Root, .. } | Output::Done { .. } | Output::Failed { .. } => {}
            }
        }
    }

    /// Node `index` ended the job for a cause found on it (`why`); returns whether it is the first to.
    fn ended_by(&mut self, index: usize, why: &[u8]) -> bool {
        let first = if self.supersedes(index) {
            true
        } else if self.outcome.first.is_none() {
            self.end_job(Some(index), &String::from_utf8_lossy(why));
            true
        } else {
            false
        };
        if first {
            self.outcome.first = Some(First::Node(index));
            self.outcome.began.get_or_insert_with(rpmi::os::monotonic_ns);
        }
        first
    }

    /// Whether what node `index` tells now, rather than the job error found about it and not said yet, ended
    /// the job. It does if the node is the one at fault: the node found it before it left, as the job error
    /// waits for the node's connection to end, and what a node sends comes before that.
    fn supersedes(&mut self, index: usize) -> bool {
        let here = self.outcome.blamed.as_ref().is_some_and(|b| b.node == Some(index as u32));
        if let Some(blame) = self.outcome.blamed.take_if(|_| here) {
            self.say_once(blame.message.as_bytes(), false);
        }
        here
    }

    /// Keeps the earliest abort; a later one follows from the ending.
    fn abort(&mut self, abort: Abort) {
        let earliest = self.outcome.abort.as_ref().is_none_or(|first| abort.at < first.at);
        let later = if earliest { self.outcome.abort.replace(abort) } else { Some(abort) };
        if let Some(later) = later {
            self.say_once(&later.message, false);
        }
    }

    /// A machine found a job error (reported by node `from`, or by the root): the first ends the job, and is
    /// said once its node at fault has gone.
    fn blame(&mut self, from: Option<usize>, blame: Blame) {
        if !from.is_some_and(|index| self.supersedes(index)) {
            if self.outcome.first.is_some() || self.signalled.load(Ordering::SeqCst) {
                return self.say_once(blame.message.as_bytes(), false);
            }
            self.end_job(None, &blame.message);
            self.outcome.first = Some(First::Collective);
            self.outcome.began.get_or_insert_with(rpmi::os::monotonic_ns);
        }
        let gone = blame.node.is_none_or(|n| self.conns.get(n as usize).is_none_or(Conn::ended));
        self.outcome.blamed = Some(blame);
        if gone {
            self.say_blamed();
        }
    }

    /// Ends every node's tasks but `but`'s (which ends its own), and fails the exchange in progress, after
    /// the order to end the tasks, so that they are killed before they hear their barrier failed.
    fn end_job(&mut self, but: Option<usize>, why: &str) {
        let kill: Bytes = Arc::new(libc::SIGKILL.to_le_bytes().to_vec());
        for (_, conn) in self.conns.iter_mut().enumerate().filter(|&(i, _)| Some(i) != but) {
            conn.send(KILL, kill.clone());
        }
        self.root.fail(why);
        self.serve_root();
    }

    /// Says the job error that ended the job, naming the node at fault's ranks.
    fn say_blamed(&mut self) {
        let Some(Blame { node, left, message }) = self.outcome.blamed.take() else { return };
        let text = match node.and_then(|n| Some((n, self.cliques.get(n as usize)?))) {
            Some((n, clique)) if left => format!(
                "virtual node {n} ended: {} exited while other ranks wait for {} in a barrier",
                ranks(clique),
                if clique.len() == 1 { "it" } else { "them" }
            ),
            Some((n, clique)) => format!("{message} ({} on virtual node {n})", ranks(clique)),
            None => message,
        };
        self.say_once(text.as_bytes(), true);
    }

    /// Says `message` unless it is empty or was said: if it is `news` for the job, else as what follows from
    /// the ending, at verbosity debug only.
    fn say_once(&mut self, message: &[u8], news: bool) {
        if message.is_empty() || self.said.iter().any(|m| m == message) {
            return;
        }
        if news {
            say!("{}", String::from_utf8_lossy(message));
        } else if self.verbosity >= ffi::RPMI_LOG_DEBUG {
            say!("as the job ends: {}", String::from_utf8_lossy(message));
        } else {
            return;
        }
        self.said.push(message.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::tests::{read_frame as next, write_frame as send};
    use rpmi::collective::frame::{self, Frame};
    use rpmi::collective::Bound;
    use std::net::Shutdown;

    #[test]
    fn a_node_is_named_by_its_first_few_ranks() {
        assert_eq!(ranks(&[3]), "rank 3");
        assert_eq!(ranks(&[1, 5]), "ranks 1,5");
        assert_eq!(ranks(&(0..512).collect::<Vec<_>>()), "ranks 0,1,2,3,4,5,6,7,... (512 ranks)");
    }

    /// What a frame is: `KILL`, or the collective frame's kind (`a failure of PMI exchange 0`, ...).
    fn what(frame: (u8, Vec<u8>)) -> String {
        match frame {
            (COLLECTIVE, f) => Frame::decode(&Arc::new(f), usize::MAX).unwrap().to_string(),
            (KILL, _) => "KILL".into(),
            (kind, _) => format!("kind {kind}"),
        }
    }

    fn contrib(node: u32, part: &[u8]) -> Vec<u8> {
        frame::contrib(0, std::iter::once((node, part))).unwrap().to_vec()
    }

    /// Runs a coordinator over one-rank nodes of `tree` while `play` plays the nodes' shells on their ends
    /// (shutting down writing where a shell exits); returns the outcome, what was said, and every frame
    /// left for each node after what `play` read.
    fn serve(tree: Tree, play: impl FnOnce(&mut [UnixStream])) -> (Outcome, Vec<String>, Vec<Vec<String>>) {
        let n = tree.nodes();
        let cliques: Vec<Vec<u32>> = (0..n).map(|i| vec![i]).collect();
        let (ours, mut theirs): (Vec<_>, Vec<_>) = (0..n).map(|_| UnixStream::pair().unwrap()).unzip();
        let conns = ours.into_iter().map(|s| Conn::new(s).unwrap()).collect();
        let bound = Bound { bytes: 1 << 20, option: "-o kvs_bytes_max" };
        let bounds = Bounds { part_max: bound, exchange_max: bound };
        let (outcome, said) = std::thread::scope(|scope| {
            let coordinator = scope.spawn(|| {
                let signalled = Arc::new(AtomicBool::new(false));
                let mut c = Coordinator::new(tree, bounds, &cliques, conns, ffi::RPMI_LOG_WARN, signalled);
                c.run();
                (c.outcome, c.said)
            });
            play(&mut theirs);
            for end in &theirs {
                let _ = end.shutdown(Shutdown::Write);
            }
            coordinator.join().unwrap()
        });
        let said = said.iter().map(|m| String::from_utf8_lossy(m).into_owned()).collect();
        let left = theirs.iter_mut().map(|end| std::iter::from_fn(|| next(end)).map(what).collect()).collect();
        (outcome, said, left)
    }

    /// The tree rpmi-run runs: its top at node 0.
    fn tree(nodes: u32, width: u32) -> Tree {
        Tree::new(nodes, width).unwrap().top_at_first_node()
    }

    /// Every exchange turns at node 0: parts sent to the coordinator end the job. (A node that leaves an
    /// exchange the others joined is found by node 0: tests/rpmi_run.rs.)
    #[test]
    fn the_coordinator_takes_no_part_in_an_exchange() {
        let (outcome, said, left) = serve(tree(2, 2), |nodes| {
            send(&mut nodes[0], COLLECTIVE, &contrib(0, b"a"));
            assert_eq!(next(&mut nodes[1]).map(what).as_deref(), Some("KILL"));
        });
        assert_eq!(outcome.first, Some(First::Collective));
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].contains("node 0 sent") && said[0].contains("every exchange turns at node 0"), "{said:?}");
        assert_eq!(left[0], ["KILL", "a failure of PMI exchange 0"]);
    }

    /// The job error names node 2, found by its parent, before node 2's own news reaches the coordinator:
    /// a task of it failed before the node left. That is what is said, and the node's status decides.
    #[test]
    fn the_node_at_fault_says_what_ended_the_job_if_it_found_it_first() {
        let (outcome, said, _) = serve(tree(3, 1), |nodes| {
            let blame = Blame { node: Some(2), left: true, message: "node 2 cannot join".into() };
            send(&mut nodes[1], COLLECTIVE, &frame::report(&blame.encode()).unwrap());
            assert_eq!(next(&mut nodes[2]).map(what).as_deref(), Some("KILL"));
            send(&mut nodes[2], ENDING, b"rank 2 exited with code 3; ending the job");
            send(&mut nodes[2], COLLECTIVE, &frame::bye());
        });
        assert_eq!(outcome.first, Some(First::Node(2)));
        assert_eq!(said, ["rank 2 exited with code 3; ending the job"]);
    }

    #[test]
    fn the_first_node_to_end_the_job_decides_and_a_later_abort_still_counts() {
        let (outcome, said, left) = serve(tree(3, 3), |nodes| {
            send(&mut nodes[1], ENDING, b"rank 1 left");
            assert_eq!(next(&mut nodes[0]).map(what).as_deref(), Some("KILL"));
            send(&mut nodes[0], ENDING, b"rank 0 left");
            send(&mut nodes[0], ABORT, &conn::abort(7, rpmi::os::monotonic_ns(), "rank 0 aborts"));
        });
        assert_eq!(outcome.first, Some(First::Node(1)));
        assert_eq!(outcome.abort.map(|a| a.code), Some(7));
        assert_eq!(said, ["rank 1 left", "rank 0 aborts"]);
        // The failure goes to node 0, the top, which passes it down the tree.
        assert_eq!(left[0], ["a failure of PMI exchange 0"]);
        assert!(left[1].is_empty(), "no order to node 1, which ends its own tasks: {:?}", left[1]);
        assert_eq!(left[2], ["KILL"]);
    }

    /// Node 2 left the exchange; its parent, node 1, found it and ended its own tasks, so node 1 left too,
    /// which node 0 found and reported first.
    #[test]
    fn a_node_that_left_because_it_found_a_job_error_is_not_at_fault() {
        let (outcome, said, _) = serve(tree(3, 1), |nodes| {
            let blame = |node, message: &str| Blame { node: Some(node), left: true, message: message.into() };
            send(&mut nodes[0], COLLECTIVE, &frame::report(&blame(1, "node 1 cannot join").encode()).unwrap());
            assert_eq!(next(&mut nodes[1]).map(what).as_deref(), Some("KILL"));
            send(&mut nodes[1], COLLECTIVE, &frame::report(&blame(2, "node 2 cannot join").encode()).unwrap());
            send(&mut nodes[1], COLLECTIVE, &frame::bye());
            nodes[1].shutdown(Shutdown::Write).unwrap();
            assert_eq!(next(&mut nodes[2]).map(what).as_deref(), Some("KILL"));
            send(&mut nodes[2], COLLECTIVE, &frame::bye());
        });
        assert_eq!(outcome.first, Some(First::Collective));
        assert_eq!(said, ["virtual node 2 ended: rank 2 exited while other ranks wait for it in a barrier"]);
    }

    /// Rank 1 aborted first; rank 0, which then failed, aborted too, and its news came first.
    #[test]
    fn the_abort_heard_of_first_on_its_node_decides_whichever_comes_first() {
        let (outcome, said, _) = serve(tree(2, 2), |nodes| {
            let (before, after) = (rpmi::os::monotonic_ns(), rpmi::os::monotonic_ns() + 1);
            send(&mut nodes[0], ABORT, &conn::abort(15, after, "rank 0 called PMI_Abort with exit code 15"));
            assert_eq!(next(&mut nodes[1]).map(what).as_deref(), Some("KILL"));
            send(&mut nodes[1], ABORT, &conn::abort(7, before, "rank 1 called PMI_Abort with exit code 7"));
        });
        assert_eq!(outcome.first, Some(First::Node(0)));
        assert_eq!(outcome.abort.map(|a| a.code), Some(7));
        assert_eq!(said, ["rank 1 called PMI_Abort with exit code 7"]);
    }

    #[test]
    fn a_node_lost_without_goodbye_is_named_with_its_ranks() {
        let (outcome, said, _) = serve(tree(2, 2), |nodes| {
            nodes[1].shutdown(Shutdown::Write).unwrap();
            assert_eq!(next(&mut nodes[0]).map(what).as_deref(), Some("KILL"));
        });
        assert_eq!(outcome.first, Some(First::Collective));
        assert_eq!(said, ["lost the connection to node 1: it was killed or failed (rank 1 on virtual node 1)"]);
    }
}
