//! The exchanges among a job's shells as the plugin runs them for a host that only carries messages (ABI
//! revision 5, `rpmi_host_ops.shell_send`): each instance runs its shell's [`Node`] of the collective (the
//! tree, its top at shell 0, or Bruck's allgather), and shell 0's instance also the [`Root`] above it and the
//! [`GroupRoot`] of PMI 1.2's group exchanges. Sans-I/O: [`Shells`] takes the shell's parts, the messages
//! other shells sent and the tasks that left, and hands back what to send and what completed
//! ([`Action`]).
//!
//! **Messages.** A message is a machine's frame, and beside it a byte saying which machine it is for
//! ([`Kind`]), which the host carries with it; the frames go as the machines made them (one frame to several
//! shells is shared, not copied), and each is read and bounded by the machine that takes it. A message of a kind its sender may not send (a group's part to a shell other than 0, a
//! root's frame from a shell other than 0) is the sender's fault: the job ends naming it.
//!
//! **Ranks that leave.** A shell tells shell 0 of every rank of its own that closes its PMI connection
//! (GONE). A rank that leaves without `PMI_Finalize` fails every exchange from then on (the root's FAIL
//! reaches every shell, each failing its waiting barrier with the root's words, which name the rank), and
//! its shell never says it is done: an exchange cannot complete without it, even one whose FAIL is still on
//! its way. Shell 0 ends the job when its own ranks wait in (or come to) such an exchange, and when a group
//! exchange waits for a rank that left or a shell that is done. A shell whose every rank finalized says it
//! is done (BYE): an exchange that waits for it then fails, naming it. Once every rank of the job has left,
//! shell 0 says so ([`Action::JobDone`]): until then the others may need it (its root, the group exchanges,
//! the names).

use crate::collective::groups::{self, Blocked, DoneParts, GroupRoot};
use crate::collective::{frame, Allgather, Bounds, Bytes, Node, Output, Parts, Peer, Root, Tree};
use crate::server::{NameOp, Names, TaskMap};
use rpmi_core::codec::{self, FrameReader, FrameWriter};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

/// The longest service name or port a task may send through the name service.
pub const NAME_MAX: usize = 1024;
/// The longest answer of the name service: a port, or why a request failed (which may quote a name).
const ANSWER_MAX: usize = 2 * NAME_MAX;

/// The bit of a message's kind that says it is a goodbye (`RPMI_SHELL_GOODBYE`): the host may drop it rather
/// than wait to reach a shell it has not reached yet.
const GOODBYE: u8 = 0x80;

/// Which machine a message is for: the byte the host carries beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    /// A node's frame to another node (its parent, child or peer in the rounds).
    Node = 0,
    /// A node's frame to the root, at shell 0.
    Up = 1,
    /// The root's frame to a node.
    Down = 2,
    /// A shell's part of a group exchange, to shell 0 (`groups::encode_part`).
    Group = 3,
    /// The end of a group exchange, from shell 0 to each member (`groups::encode_done`).
    GroupDone = 4,
    /// A rank of the sending shell closed its connection: `rank:u32 finalized:u8` (big-endian).
    Gone = 5,
    /// A task's request of the name service, to shell 0: `task:u32 op:u8 name_len:u16 name port`.
    Name = 6,
    /// Shell 0's answer to it: `task:u32 ok:u8 text` (the port a lookup found, or why it failed).
    NameAnswer = 7,
}

impl Kind {
    fn of(byte: u8) -> Option<Kind> {
        use Kind::*;
        [Node, Up, Down, Group, GroupDone, Gone, Name, NameAnswer].into_iter().find(|k| *k as u8 == byte)
    }
}

/// Why the job ends, as the host's `abort` is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A rank left while others wait for it.
    TaskLost,
    /// A shell broke the protocol or a bound, or was lost.
    Shell,
}

/// What the host carries out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send shell `to` the message `frame` of kind `kind` (a frame may go to several shells: it is shared).
    Send { to: u32, frame: Bytes, kind: u8 },
    /// The exchange this shell contributed to completed: every node's part, or why it failed.
    Complete(Result<Parts, String>),
    /// A group exchange this shell is a member of completed.
    GroupComplete(DoneParts),
    /// The answer to local task `task`'s request of the name service: whether it succeeded, and the port a
    /// lookup found or why it failed.
    Answer { task: u32, ok: bool, text: String },
    /// End the job: `rank` is the rank at fault (or the first of the shell at fault).
    EndJob { rank: u32, fault: Fault, message: String },
    /// Shell 0: every rank of the job has closed its connection; the other shells need nothing more of it.
    JobDone,
}

/// Shell 0's part beside its node: the root above the tree, and the group exchanges.
struct Top {
    root: Root,
    groups: GroupRoot,
    /// Every rank that left, its shell, and whether it finalized first, in the order they left.
    left: Vec<(u32, u32, bool)>,
    /// Whether each rank of the job left.
    gone: Vec<bool>,
    /// The first rank that left without finalize, and the words that fail the exchanges for it.
    lost: Option<(u32, String)>,
    /// The job's published names.
    names: Names,
}

/// One shell's side of the job's exchanges: see the module's documentation.
pub struct Shells {
    me: u32,
    task_map: TaskMap,
    node: Node,
    top: Option<Top>,
    /// Local ranks still connected, and whether one left without finalize.
    connected: usize,
    unfinalized: bool,
    /// The job's end was asked: nothing more is asked.
    ended: bool,
    /// Local tasks whose request of the name service shell 0 has not answered yet.
    asked: BTreeSet<u32>,
    actions: VecDeque<Action>,
}

impl Shells {
    /// Shell `me` of the job `task_map` describes, its `local` ranks connected, its exchanges along `tree`
    /// (its top at node 0) by `allgather`, held to `bounds`.
    pub fn new(
        tree: Tree,
        allgather: Allgather,
        me: u32,
        bounds: Bounds,
        task_map: TaskMap,
        local: usize,
    ) -> Result<Shells, String> {
        let tree = tree.top_at_first_node();
        let nodes = tree.nodes();
        if task_map.node_count() != nodes as usize {
            return Err(format!("the task map has {} shells, the tree {nodes}", task_map.node_count()));
        }
        let all_max = frame::parts_len(nodes as usize, bounds.exchange_max.bytes);
        let node = Node::new(tree, me, bounds, all_max).map_err(|e| e.to_string())?.with_allgather(allgather);
        let top = (me == 0).then(|| Top {
            root: Root::new(tree, bounds),
            groups: GroupRoot::new(task_map.clone(), bounds),
            left: Vec::new(),
            gone: vec![false; task_map.size()],
            lost: None,
            names: Names::new(),
        });
        Ok(Shells {
            me,
            task_map,
            node,
            top,
            connected: local,
            unfinalized: false,
            ended: false,
            asked: BTreeSet::new(),
            actions: VecDeque::new(),
        })
    }

    /// The next thing for the host to do.
    pub fn poll(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The shell's part of the next exchange.
    pub fn contribute(&mut self, part: Vec<u8>) -> Result<(), String> {
        self.node.contribute(part).map_err(|e| e.to_string())?;
        self.pump();
        Ok(())
    }

    /// The shell's part of group exchange `id`, whose member shells the root tells from the id.
    pub fn group_part(&mut self, id: &[u8], part: &[u8]) -> Result<(), String> {
        let message = groups::encode_part(id, part).ok_or("a group exchange id too long to send")?;
        match self.me {
            0 => self.group(0, &message),
            _ => self.send(0, Kind::Group, message),
        }
        self.pump();
        Ok(())
    }

    /// Local task `task`'s request of the name service, which shell 0 serves for the whole job.
    pub fn name(&mut self, task: u32, op: NameOp, name: &str, port: &str) -> Result<(), String> {
        if name.len() > NAME_MAX || port.len() > NAME_MAX {
            return Err(format!("a service name or port longer than {NAME_MAX} bytes, the most the job's shells take"));
        }
        let mut m = FrameWriter::with_capacity(7 + name.len() + port.len());
        m.u32(task).u8(op as u8);
        m.prefixed16(name.as_bytes()).ok_or("a service name too long to send")?.bytes(port.as_bytes());
        self.asked.insert(task);
        match self.me {
            0 => self.serve_name(0, &m.into_vec()),
            _ => self.send(0, Kind::Name, m.into_vec()),
        }
        self.pump();
        Ok(())
    }

    /// Local rank `rank` closed its PMI connection (`finalized`: after `PMI_Finalize`). Once every local
    /// rank has, the shell says it is done, unless one left without finalize.
    pub fn task_closed(&mut self, rank: u32, finalized: bool) {
        let mut gone = rank.to_be_bytes().to_vec();
        gone.push(finalized as u8);
        match self.me {
            0 => self.gone(0, &gone),
            _ => self.send(0, Kind::Gone, gone),
        }
        self.unfinalized |= !finalized;
        self.connected = self.connected.saturating_sub(1);
        if self.connected == 0 && !self.unfinalized {
            self.node.finish();
        }
        self.pump();
    }

    /// A message of kind `kind` that shell `from` sent this one.
    pub fn message(&mut self, from: u32, kind: u8, message: Vec<u8>) {
        if from >= self.task_map.node_count() as u32 || from == self.me {
            return self.end_job(
                None,
                Fault::Shell,
                format!("a message came from shell {from}, not another shell of the job"),
            );
        }
        let Some(kind) = Kind::of(kind & !GOODBYE) else {
            return self.end_job(
                Some(from),
                Fault::Shell,
                format!("shell {from} sent shell {} a message of no known kind", self.me),
            );
        };
        let bytes: Bytes = Arc::new(message);
        match (kind, &mut self.top) {
            (Kind::Node, _) => self.node.receive(Peer::Node(from), bytes),
            (Kind::Down, _) if from == 0 => self.node.receive(Peer::Root, bytes),
            (Kind::GroupDone, _) if from == 0 => self.group_done(bytes),
            (Kind::Up, Some(top)) => {
                top.root.receive(from, bytes);
                self.groups_blocked();
            }
            (Kind::NameAnswer, _) if from == 0 => self.name_answer(&bytes),
            (Kind::Group, Some(_)) => self.group(from, &bytes),
            (Kind::Gone, Some(_)) => self.gone(from, &bytes),
            (Kind::Name, Some(_)) => self.serve_name(from, &bytes),
            (kind, _) => {
                let what =
                    format!("shell {from} sent shell {} a message ({kind:?}) only shell 0 may send or take", self.me);
                self.end_job(Some(from), Fault::Shell, what);
            }
        }
        self.pump();
    }

    /// The host can carry no more messages between this shell and `shell`.
    pub fn lost(&mut self, shell: u32) {
        if shell >= self.task_map.node_count() as u32 || shell == self.me {
            return;
        }
        if self.node.peers().contains(&shell) {
            self.node.lost(Peer::Node(shell));
        }
        if shell == 0 {
            self.node.lost(Peer::Root);
        }
        // The root ends the job for a shell lost before it said it was done.
        if let Some(top) = &mut self.top {
            top.root.lost(shell);
        }
        self.pump();
    }

    /// Carries out what the machines ask until they are quiet: frames between the machines of this shell go
    /// straight from one to the other.
    fn pump(&mut self) {
        loop {
            let mut busy = false;
            while let Some(output) = self.node.poll() {
                busy = true;
                match output {
                    Output::Send { to: Peer::Node(to), frame } => self.send(to, Kind::Node, frame),
                    Output::Send { to: Peer::Root, frame } => match &mut self.top {
                        Some(top) => top.root.receive(0, frame),
                        None => self.send(0, Kind::Up, frame),
                    },
                    Output::Done { parts, .. } => self.actions.push_back(Action::Complete(Ok(parts))),
                    Output::Failed { message, .. } => {
                        self.actions.push_back(Action::Complete(Err(message)));
                        if let Some((rank, message)) = self.top.as_ref().and_then(|t| t.lost.clone()) {
                            self.end_job_for_rank(rank, Fault::TaskLost, message);
                        }
                    }
                    Output::JobError { node, message } => self.end_job(node, Fault::Shell, message),
                    // No node here reports to the root.
                    Output::Report { .. } => {}
                }
            }
            while let Some(output) = self.top.as_mut().and_then(|t| t.root.poll()) {
                busy = true;
                match output {
                    Output::Send { to: Peer::Node(0), frame } => self.node.receive(Peer::Root, frame),
                    Output::Send { to: Peer::Node(to), frame } => self.send(to, Kind::Down, frame),
                    Output::JobError { node, message } => self.end_job(node, Fault::Shell, message),
                    // What a root never hands back, and reports, which no node here sends.
                    Output::Send { to: Peer::Root, .. } | Output::Done { .. } | Output::Failed { .. } => {}
                    Output::Report { .. } => {}
                }
            }
            if !busy {
                return;
            }
        }
    }

    fn send(&mut self, to: u32, kind: Kind, frame: impl Into<Bytes>) {
        // Once every local rank has left, what this shell sends others but shell 0 is a goodbye, which a shell
        // that has ended too has no use for: the host may drop it rather than wait to reach that shell.
        let goodbye = if self.connected == 0 && to != 0 { GOODBYE } else { 0 };
        self.actions.push_back(Action::Send { to, frame: frame.into(), kind: kind as u8 | goodbye });
    }

    /// Shell 0: shell `from`'s part of a group exchange; once every member's is in, each member gets them.
    fn group(&mut self, from: u32, m: &[u8]) {
        let Some(top) = &mut self.top else { return };
        let taken = groups::decode_part(m).map_err(|e| e.0).and_then(|p| top.groups.contribute(from, &p.id, p.part));
        match taken {
            Ok(Some(done)) => {
                let Some(end) = DoneParts::new(&done.id, &done.parts) else {
                    return self.end_job(None, Fault::Shell, "a group exchange's end too large to send".into());
                };
                let message: Bytes = Arc::new(end.message().to_vec());
                for &member in done.shells.iter() {
                    match member {
                        0 => self.actions.push_back(Action::GroupComplete(end.clone())),
                        m => self.send(m, Kind::GroupDone, message.clone()),
                    }
                }
            }
            Ok(None) => self.groups_blocked(),
            Err(message) => self.end_job(Some(from), Fault::Shell, message),
        }
    }

    fn group_done(&mut self, message: Bytes) {
        match DoneParts::decode(message) {
            Ok(done) => self.actions.push_back(Action::GroupComplete(done)),
            Err(e) => self.end_job(
                Some(0),
                Fault::Shell,
                format!("shell 0 sent the end of a group exchange that does not read: {}", e.0),
            ),
        }
    }

    /// Shell 0: a rank of shell `from` left.
    fn gone(&mut self, from: u32, m: &[u8]) {
        let mut r = FrameReader::new(m);
        let Ok((rank, finalized)) =
            r.u32().and_then(|rank| Ok((rank, r.flag("finalized")?))).and_then(|g| r.end().map(|()| g))
        else {
            return self.end_job(
                Some(from),
                Fault::Shell,
                format!("shell {from} said a rank left in a message that does not read"),
            );
        };
        if self.task_map.node_of(rank) != Some(from) {
            return self.end_job(
                Some(from),
                Fault::Shell,
                format!("shell {from} said rank {rank} left, not one of its own"),
            );
        }
        let Some(top) = &mut self.top else { return };
        if std::mem::replace(&mut top.gone[rank as usize], true) {
            return self.end_job(Some(from), Fault::Shell, format!("shell {from} said rank {rank} left twice"));
        }
        top.left.push((rank, from, finalized));
        if top.left.len() == top.gone.len() {
            self.actions.push_back(Action::JobDone);
        }
        let Some(top) = &mut self.top else { return };
        if !finalized && top.lost.is_none() {
            let message = format!(
                "rank {rank} on shell {from} closed its PMI connection (exited or crashed) without PMI_Finalize: \
                 the barriers that wait for it cannot complete"
            );
            top.lost = Some((rank, message.clone()));
            top.root.fail(&message);
        }
        self.groups_blocked();
    }

    /// Whether this shell holds the job's names (shell 0).
    pub fn holds_names(&self) -> bool {
        self.top.is_some()
    }

    /// Shell 0: a request of the job's names from outside the job (a job it spawned); whether it succeeded,
    /// and a lookup's port or why it failed.
    pub fn serve_name_outside(&mut self, op: NameOp, name: &str, port: &str) -> (bool, String) {
        match &mut self.top {
            Some(top) => served(&mut top.names, op, name, port),
            None => (false, format!("shell {} holds none of the job's names", self.me)),
        }
    }

    /// Shell 0: shell `from`'s task asks the name service; the answer goes back to it.
    fn serve_name(&mut self, from: u32, m: &[u8]) {
        let Some(top) = &mut self.top else { return };
        let mut r = FrameReader::new(m);
        let request = (|| {
            let (task, op) = (r.u32()?, r.u8()?);
            let name = String::from_utf8_lossy(r.prefixed16(NAME_MAX, "a service name")?).into_owned();
            let port = String::from_utf8_lossy(r.rest_max(NAME_MAX, "a port")?).into_owned();
            Ok::<_, codec::Malformed>((task, op, name, port))
        })();
        let op = |b: u8| [NameOp::Publish, NameOp::Unpublish, NameOp::Lookup].into_iter().find(|o| *o as u8 == b);
        let Some((task, op, name, port)) = request.ok().and_then(|(t, o, n, p)| Some((t, op(o)?, n, p))) else {
            return self.end_job(
                Some(from),
                Fault::Shell,
                format!("shell {from} asked the name service in a message that does not read"),
            );
        };
        let (ok, text) = served(&mut top.names, op, &name, &port);
        let mut answer = FrameWriter::with_capacity(5 + text.len());
        answer.u32(task).flag(ok).bytes(text.as_bytes());
        match from {
            0 => self.name_answer(&answer.into_vec()),
            _ => self.send(from, Kind::NameAnswer, answer.into_vec()),
        }
    }

    /// Shell 0's answer to a local task's request of the name service.
    fn name_answer(&mut self, m: &[u8]) {
        let mut r = FrameReader::new(m);
        let answer = (|| Ok::<_, codec::Malformed>((r.u32()?, r.flag("ok")?, r.text(ANSWER_MAX, "an answer")?)))();
        match answer {
            Ok((task, ok, text)) if self.asked.remove(&task) => {
                self.actions.push_back(Action::Answer { task, ok, text })
            }
            Ok((task, ..)) => {
                let what = format!(
                    "shell 0 answered a request of the name service task {task} of shell {} did not make",
                    self.me
                );
                self.end_job(Some(0), Fault::Shell, what);
            }
            Err(e) => self.end_job(
                Some(0),
                Fault::Shell,
                format!("shell 0 answered the name service in a message that does not read: {}", e.0),
            ),
        }
    }

    /// Shell 0: ends the job if a group exchange waits for a rank that left or a shell that is done.
    fn groups_blocked(&mut self) {
        let Some(top) = self.top.as_ref().filter(|_| !self.ended) else { return };
        let nodes = self.task_map.node_count() as u32;
        let (rank, fault, message) = match top.groups.blocked(top.left.iter().copied(), nodes, |s| top.root.said_bye(s))
        {
            None => return,
            Some(Blocked::Rank { id, rank, node, finalized }) => {
                let how =
                    if finalized { "called PMI_Finalize" } else { "closed its PMI connection without PMI_Finalize" };
                let message =
                    format!("rank {rank} on shell {node} {how} while other ranks wait for it in group barrier {id}");
                (rank, Fault::TaskLost, message)
            }
            Some(Blocked::Node { id, node }) => {
                let message = format!(
                    "ranks wait in group barrier {id} that shell {node} cannot join: every rank on it has closed its \
                     PMI connection"
                );
                (self.first_rank(node), Fault::Shell, message)
            }
        };
        self.end_job_for_rank(rank, fault, message);
    }

    /// Ends the job for shell `shell`'s fault (`None`: shell 0's root), naming its first rank.
    fn end_job(&mut self, shell: Option<u32>, fault: Fault, message: String) {
        let rank = self.first_rank(shell.unwrap_or(0));
        self.end_job_for_rank(rank, fault, message);
    }

    /// The first rank of shell `shell`.
    fn first_rank(&self, shell: u32) -> u32 {
        (0..self.task_map.size() as u32).find(|&r| self.task_map.node_of(r) == Some(shell)).unwrap_or(0)
    }

    fn end_job_for_rank(&mut self, rank: u32, fault: Fault, message: String) {
        if !std::mem::replace(&mut self.ended, true) {
            self.actions.push_back(Action::EndJob { rank, fault, message });
        }
    }

    /// The messages unread went over the `max` bytes this shell holds, shell `from` holding the most: one was
    /// dropped.
    pub fn overflowed(&mut self, from: u32, max: usize) {
        let what = format!(
            "shell {} holds at most {max} bytes of messages unread, and shell {from} sent the most of them",
            self.me
        );
        self.end_job(Some(from), Fault::Shell, what);
    }
}

/// What the job's names answer a request: whether it succeeded, and a lookup's port or why it failed (cut to
/// what an answer carries).
fn served(names: &mut Names, op: NameOp, name: &str, port: &str) -> (bool, String) {
    let (ok, text) = match names.serve(op, name, port) {
        Ok(port) => (true, port),
        Err(why) => (false, why),
    };
    (ok, codec::cut(&text, ANSWER_MAX).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Bound;

    const BOUND: Bound = Bound { bytes: 1 << 20, option: "kvs_bytes_max" };
    const BOUNDS: Bounds = Bounds { part_max: BOUND, exchange_max: BOUND };

    /// The shells of one job in memory: every message delivered in the order sent; what each shell completed
    /// or asked, in order.
    struct Job {
        shells: Vec<Shells>,
        queue: VecDeque<(u32, u32, u8, Vec<u8>)>,
        seen: Vec<Vec<Action>>,
    }

    impl Job {
        /// `ranks[s]` ranks on shell s, in blocks.
        fn new(ranks: &[u32], width: u32, allgather: Allgather) -> Job {
            let map = TaskMap::block(ranks);
            let tree = Tree::new(ranks.len() as u32, width).unwrap();
            let shells = (0..ranks.len() as u32)
                .map(|s| Shells::new(tree, allgather, s, BOUNDS, map.clone(), ranks[s as usize] as usize).unwrap())
                .collect();
            Job { shells, queue: VecDeque::new(), seen: vec![Vec::new(); ranks.len()] }
        }

        fn run(&mut self) {
            loop {
                for s in 0..self.shells.len() {
                    while let Some(a) = self.shells[s].poll() {
                        match a {
                            Action::Send { to, frame, kind } => {
                                self.queue.push_back((s as u32, to, kind, frame.to_vec()))
                            }
                            a => self.seen[s].push(a),
                        }
                    }
                }
                let Some((from, to, kind, message)) = self.queue.pop_front() else { return };
                self.shells[to as usize].message(from, kind, message);
            }
        }

        fn parts(&self, s: usize) -> Vec<Vec<u8>> {
            match self.seen[s].last() {
                Some(Action::Complete(Ok(parts))) => parts.iter().map(|(_, b)| b.to_vec()).collect(),
                other => panic!("shell {s}: {other:?}"),
            }
        }
    }

    #[test]
    fn every_shell_gets_every_part_in_shell_order_by_the_tree_and_by_bruck() {
        for allgather in [Allgather::Tree, Allgather::Bruck] {
            let mut job = Job::new(&[1, 2, 1, 1, 3, 1, 1], 2, allgather);
            for epoch in 0..3u8 {
                for s in (0..7).rev() {
                    job.shells[s].contribute(vec![epoch, s as u8]).unwrap();
                    job.run();
                }
                let want: Vec<Vec<u8>> = (0..7).map(|s| vec![epoch, s]).collect();
                for s in 0..7 {
                    assert_eq!(job.parts(s), want, "{allgather:?}, shell {s}, exchange {epoch}");
                }
            }
        }
    }

    #[test]
    fn a_group_exchange_reaches_its_member_shells_only() {
        let mut job = Job::new(&[2, 2, 2, 2], 4, Allgather::Tree);
        // Ranks 3 and 6: shells 1 and 3.
        job.shells[3].group_part(b"3,6:0", b"c").unwrap();
        job.run();
        assert!(job.seen.iter().all(Vec::is_empty));
        job.shells[1].group_part(b"3,6:0", b"a").unwrap();
        job.run();
        for s in [1, 3] {
            let Some(Action::GroupComplete(done)) = job.seen[s].last() else { panic!("{:?}", job.seen[s]) };
            assert_eq!((done.id(), done.parts().collect::<Vec<_>>()), (&b"3,6:0"[..], vec![&b"a"[..], b"c"]));
        }
        assert!(job.seen[0].is_empty() && job.seen[2].is_empty());
        // WORLD, with shell 0 a member: its end is its own, not a message to itself.
        for s in 0..4 {
            job.shells[s].group_part(b"WORLD:1", &[s as u8]).unwrap();
            job.run();
        }
        assert!((0..4).all(|s| matches!(job.seen[s].last(), Some(Action::GroupComplete(d)) if d.len() == 4)));
    }

    #[test]
    fn a_rank_that_leaves_without_finalize_fails_the_barrier_and_shell_0_ends_the_job_naming_it() {
        for allgather in [Allgather::Tree, Allgather::Bruck] {
            let mut job = Job::new(&[1, 1, 2, 1], 2, allgather);
            job.shells[0].contribute(vec![0]).unwrap();
            job.shells[1].contribute(vec![1]).unwrap();
            job.run();
            // Rank 3, on shell 2, leaves; rank 2 finalized; shell 3 has not come to the barrier yet.
            job.shells[2].task_closed(2, true);
            job.shells[2].task_closed(3, false);
            job.run();
            for s in [0, 1] {
                let Some(Action::Complete(Err(why))) = job.seen[s].first() else { panic!("{:?}", job.seen[s]) };
                assert!(why.contains("rank 3 on shell 2") && why.contains("without PMI_Finalize"), "{why}");
            }
            let Some(Action::EndJob { rank: 3, fault: Fault::TaskLost, message }) = job.seen[0].last() else {
                panic!("{:?}", job.seen[0])
            };
            assert!(message.contains("rank 3"), "{message}");
            // The shell that comes later is failed too, not left waiting.
            job.shells[3].contribute(vec![3]).unwrap();
            job.run();
            assert!(matches!(job.seen[3].last(), Some(Action::Complete(Err(_)))), "{:?}", job.seen[3]);
        }
    }

    #[test]
    fn a_shell_whose_ranks_all_finalized_blocks_the_next_barrier_and_the_job_ends_naming_its_rank() {
        for allgather in [Allgather::Tree, Allgather::Bruck] {
            let mut job = Job::new(&[1, 1, 1, 1, 2], 2, allgather);
            job.shells[4].task_closed(5, true);
            job.shells[4].task_closed(4, true);
            job.run();
            for s in 0..4 {
                job.shells[s].contribute(vec![s as u8]).unwrap();
                job.run();
            }
            let ends: Vec<_> = job.seen.iter().flatten().filter(|a| matches!(a, Action::EndJob { .. })).collect();
            let Some(Action::EndJob { rank: 4, fault: Fault::Shell, message }) = ends.first() else {
                panic!("{ends:?}")
            };
            assert!(message.contains("node 4 cannot join"), "{message}");
        }
    }

    #[test]
    fn once_every_local_rank_left_a_shell_sends_others_but_shell_0_goodbyes() {
        let mut job = Job::new(&[1, 1, 1], 1, Allgather::Tree);
        job.shells[1].task_closed(1, true);
        let kinds: Vec<(u32, u8)> = std::iter::from_fn(|| job.shells[1].poll())
            .filter_map(|a| match a {
                Action::Send { to, kind, .. } => Some((to, kind)),
                _ => None,
            })
            .collect();
        // Its rank's leaving and its BYE to the root go to shell 0 as they are; its BYE to its child, node 2,
        // and to its parent, node 0, as goodbyes but to shell 0.
        assert!(kinds.contains(&(0, Kind::Gone as u8)) && kinds.contains(&(0, Kind::Up as u8)), "{kinds:?}");
        assert!(kinds.contains(&(2, Kind::Node as u8 | GOODBYE)), "{kinds:?}");
        assert!(kinds.contains(&(0, Kind::Node as u8)), "{kinds:?}");
        // The bit is not part of the kind a shell takes.
        job.shells[2].message(1, Kind::Node as u8 | GOODBYE, frame::bye().to_vec());
        job.run();
        assert!(job.seen[2].is_empty(), "{:?}", job.seen[2]);
    }

    #[test]
    fn a_group_barrier_that_waits_for_a_finalized_rank_ends_the_job_naming_it() {
        let mut job = Job::new(&[1, 1, 1], 2, Allgather::Tree);
        job.shells[1].group_part(b"1,2:0", b"x").unwrap();
        job.shells[2].task_closed(2, true);
        job.run();
        let Some(Action::EndJob { rank: 2, fault: Fault::TaskLost, message }) = job.seen[0].last() else {
            panic!("{:?}", job.seen[0])
        };
        assert!(message.contains("group barrier 1,2:0"), "{message}");
    }

    #[test]
    fn a_message_a_shell_may_not_send_ends_the_job_naming_it() {
        let mut job = Job::new(&[1, 2, 1], 2, Allgather::Tree);
        // Only shell 0 sends a root's frame or a group's end; only shell 0 takes a part or a rank's leaving.
        let cases: [(u32, u32, Kind, Vec<u8>); 6] = [
            (2, 1, Kind::Down, vec![]),
            (2, 1, Kind::GroupDone, vec![]),
            (1, 2, Kind::Gone, vec![0, 0, 0, 1, 0]),
            (1, 0, Kind::Gone, vec![0, 0, 0, 0, 0]),
            (2, 1, Kind::NameAnswer, vec![]),
            (1, 2, Kind::Name, vec![]),
        ];
        for (from, to, kind, message) in cases {
            let mut job2 = Job::new(&[1, 2, 1], 2, Allgather::Tree);
            job2.shells[to as usize].message(from, kind as u8, message.clone());
            job2.run();
            let first_rank = [0, 1, 3][from as usize];
            match job2.seen[to as usize].last() {
                Some(Action::EndJob { rank, fault: Fault::Shell, message: why }) => {
                    assert_eq!(*rank, first_rank, "{why}");
                    assert!(why.contains(&format!("shell {from}")), "{why}");
                }
                other => panic!("{from} -> {to} {kind:?} {message:?}: {other:?}"),
            }
        }
        // A kind no shell sends, and a message said to come from the shell itself.
        job.shells[0].message(2, 9, vec![]);
        job.shells[1].message(1, Kind::Node as u8, vec![]);
        job.run();
        assert!(
            matches!(job.seen[0].last(), Some(Action::EndJob { rank: 3, message, .. }) if message.contains("no known kind"))
        );
        assert!(matches!(job.seen[1].last(), Some(Action::EndJob { .. })));
    }

    #[test]
    fn the_name_service_is_the_jobs_held_at_shell_0() {
        let mut job = Job::new(&[1, 2, 1], 2, Allgather::Tree);
        job.shells[1].name(1, NameOp::Publish, "svc", "port-1").unwrap();
        job.run();
        assert_eq!(job.seen[1], [Action::Answer { task: 1, ok: true, text: String::new() }]);
        job.shells[2].name(0, NameOp::Lookup, "svc", "").unwrap();
        job.shells[0].name(0, NameOp::Lookup, "svc", "").unwrap();
        job.run();
        for s in [0, 2] {
            assert_eq!(job.seen[s], [Action::Answer { task: 0, ok: true, text: "port-1".into() }], "shell {s}");
        }
        job.shells[0].name(0, NameOp::Publish, "svc", "port-0").unwrap();
        job.shells[2].name(0, NameOp::Unpublish, "svc", "").unwrap();
        job.run();
        job.shells[2].name(0, NameOp::Lookup, "svc", "").unwrap();
        job.run();
        assert!(
            matches!(&job.seen[0][1], Action::Answer { ok: false, text, .. } if text.contains("already published"))
        );
        assert!(matches!(&job.seen[2][1..], [Action::Answer { ok: true, .. }, Action::Answer { ok: false, .. }]));
        assert!(job.shells[1].name(0, NameOp::Publish, &"x".repeat(NAME_MAX + 1), "p").is_err());
    }

    /// ABI revision 6: a job outside this one (one it spawned) uses the same names, through shell 0 only.
    #[test]
    fn jobs_outside_share_the_names_through_shell_0() {
        let mut job = Job::new(&[1, 1], 2, Allgather::Tree);
        assert!(job.shells[0].holds_names() && !job.shells[1].holds_names());
        assert_eq!(job.shells[0].serve_name_outside(NameOp::Publish, "svc", "port-x"), (true, String::new()));
        job.shells[1].name(0, NameOp::Lookup, "svc", "").unwrap();
        job.run();
        assert_eq!(job.seen[1], [Action::Answer { task: 0, ok: true, text: "port-x".into() }]);
        let (ok, why) = job.shells[0].serve_name_outside(NameOp::Publish, "svc", "port-y");
        assert!(!ok && why.contains("already published"), "{why}");
        assert_eq!(job.shells[0].serve_name_outside(NameOp::Unpublish, "svc", ""), (true, String::new()));
        assert!(!job.shells[0].serve_name_outside(NameOp::Lookup, "svc", "").0);
        let (ok, why) = job.shells[1].serve_name_outside(NameOp::Lookup, "svc", "");
        assert!(!ok && why.contains("holds none"), "{why}");
    }

    #[test]
    fn an_answer_of_the_name_service_nobody_asked_for_ends_the_job_naming_shell_0() {
        let mut job = Job::new(&[1, 1], 2, Allgather::Tree);
        let mut answer = FrameWriter::new();
        answer.u32(0).flag(true).bytes(b"port");
        job.shells[1].message(0, Kind::NameAnswer as u8, answer.into_vec());
        job.run();
        assert!(
            matches!(&job.seen[1][..], [Action::EndJob { rank: 0, fault: Fault::Shell, message }] if message.contains("did not make"))
        );
        // And a request that does not read is its sender's fault.
        job.shells[0].message(1, Kind::Name as u8, vec![0, 0, 0, 0, 9]);
        job.run();
        assert!(matches!(&job.seen[0][..], [Action::EndJob { rank: 1, fault: Fault::Shell, .. }]), "{:?}", job.seen[0]);
    }

    #[test]
    fn a_shell_lost_before_it_said_it_was_done_ends_the_job() {
        let mut job = Job::new(&[1, 1, 1], 2, Allgather::Tree);
        job.shells[0].contribute(vec![0]).unwrap();
        job.run();
        job.shells[0].lost(2);
        job.run();
        assert!(job.seen[0].iter().any(|a| matches!(a, Action::Complete(Err(_)))), "{:?}", job.seen[0]);
        assert!(job.seen[0].iter().any(|a| matches!(a, Action::EndJob { rank: 2, fault: Fault::Shell, .. })));
    }
}
