//! The exchanges among a job's shells as the plugin runs them for a host that only carries messages (ABI
//! revision 5, `rpmi_host_ops.shell_send`): each instance runs its shell's [`Node`] of the collective (the
//! tree, its top at shell 0, or Bruck's allgather), and shell 0's instance also the [`Root`] above it and the
//! [`GroupRoot`] of PMI 1.2's group exchanges. Sans-I/O: [`Shells`] takes the shell's parts, the messages
//! other shells sent and the tasks that left, and hands back what to send and what completed
//! ([`Action`]).
//!
//! **Messages.** A message is a machine's frame followed by one byte saying which machine it is for
//! ([`Kind`]); the bytes the machines send as they are, so each frame is read and bounded by the machine
//! that takes it. A message of a kind its sender may not send (a group's part to a shell other than 0, a
//! root's frame from a shell other than 0) is the sender's fault: the job ends naming it.
//!
//! **Ranks that leave.** A shell tells shell 0 of every rank of its own that closes its PMI connection
//! (GONE). A rank that leaves without `PMI_Finalize` fails every exchange from then on (the root's FAIL
//! reaches every shell, each failing its waiting barrier with the root's words, which name the rank), and
//! its shell never says it is done: an exchange cannot complete without it, even one whose FAIL is still on
//! its way. Shell 0 ends the job when its own ranks wait in (or come to) such an exchange, and when a group
//! exchange waits for a rank that left or a shell that is done. A shell whose every rank finalized says it
//! is done (BYE): the exchanges go on without it.

use crate::collective::groups::{self, DoneParts, GroupRoot};
use crate::collective::{frame, Allgather, Bounds, Bytes, Node, Output, Parts, Peer, Root, Tree};
use crate::server::TaskMap;
use std::collections::VecDeque;
use std::sync::Arc;

/// Which machine a message is for, in its last byte.
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
}

impl Kind {
    fn of(byte: u8) -> Option<Kind> {
        [Kind::Node, Kind::Up, Kind::Down, Kind::Group, Kind::GroupDone, Kind::Gone]
            .into_iter()
            .find(|k| *k as u8 == byte)
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
    /// Send `message` to shell `to`.
    Send { to: u32, message: Vec<u8> },
    /// The exchange this shell contributed to completed: every node's part, or why it failed.
    Complete(Result<Parts, String>),
    /// A group exchange this shell is a member of completed.
    GroupComplete(DoneParts),
    /// End the job: `rank` is the rank at fault (or the first of the shell at fault).
    EndJob { rank: u32, fault: Fault, message: String },
}

/// Shell 0's part beside its node: the root above the tree, and the group exchanges.
struct Top {
    root: Root,
    groups: GroupRoot,
    /// Every rank that left, its shell, and whether it finalized first.
    left: Vec<(u32, u32, bool)>,
    /// The shells that said they are done.
    said_bye: Vec<bool>,
    /// The first rank that left without finalize, and the words that fail the exchanges for it.
    lost: Option<(u32, String)>,
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
            said_bye: vec![false; nodes as usize],
            lost: None,
        });
        Ok(Shells {
            me,
            task_map,
            node,
            top,
            connected: local,
            unfinalized: false,
            ended: false,
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

    /// A message shell `from` sent this one.
    pub fn message(&mut self, from: u32, mut message: Vec<u8>) {
        if from >= self.task_map.node_count() as u32 || from == self.me {
            return self.end_job(
                None,
                Fault::Shell,
                format!("a message came from shell {from}, not another shell of the job"),
            );
        }
        let Some(kind) = message.pop().and_then(Kind::of) else {
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
                if frame::is_bye(&bytes) {
                    top.said_bye[from as usize] = true;
                }
                top.root.receive(from, bytes);
                self.groups_blocked();
            }
            (Kind::Group, Some(_)) => self.group(from, &bytes),
            (Kind::Gone, Some(_)) => self.gone(from, &bytes),
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
        if let Some(top) = &mut self.top {
            top.root.lost(shell);
            if !top.said_bye[shell as usize] {
                let what = format!("shell {shell} was lost before it said it was done");
                self.end_job(Some(shell), Fault::Shell, what);
            }
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
                    Output::Send { to: Peer::Node(to), frame } => self.send(to, Kind::Node, frame.to_vec()),
                    Output::Send { to: Peer::Root, frame } => match &mut self.top {
                        Some(top) => {
                            if frame::is_bye(&frame) {
                                top.said_bye[0] = true;
                            }
                            top.root.receive(0, frame);
                        }
                        None => self.send(0, Kind::Up, frame.to_vec()),
                    },
                    Output::Done { parts, .. } => self.actions.push_back(Action::Complete(Ok(parts))),
                    Output::Failed { message, .. } => {
                        self.actions.push_back(Action::Complete(Err(message)));
                        if let Some((rank, message)) = self.top.as_ref().and_then(|t| t.lost.clone()) {
                            self.end_job_for_rank(rank, Fault::TaskLost, message);
                        }
                    }
                    Output::JobError { node, message } => self.end_job(node, Fault::Shell, message),
                    Output::Report { .. } => {}
                }
            }
            while let Some(output) = self.top.as_mut().and_then(|t| t.root.poll()) {
                busy = true;
                match output {
                    Output::Send { to: Peer::Node(0), frame } => self.node.receive(Peer::Root, frame),
                    Output::Send { to: Peer::Node(to), frame } => self.send(to, Kind::Down, frame.to_vec()),
                    Output::JobError { node, message } => self.end_job(node, Fault::Shell, message),
                    Output::Send { to: Peer::Root, .. } | Output::Done { .. } | Output::Failed { .. } => {}
                    Output::Report { .. } => {}
                }
            }
            if !busy {
                return;
            }
        }
    }

    fn send(&mut self, to: u32, kind: Kind, mut message: Vec<u8>) {
        message.push(kind as u8);
        self.actions.push_back(Action::Send { to, message });
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
                for &member in done.shells.iter() {
                    match member {
                        0 => self.actions.push_back(Action::GroupComplete(end.clone())),
                        m => self.send(m, Kind::GroupDone, end.message().to_vec()),
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
        let (Ok(rank), Some(&finalized)) =
            (m.get(..4).map(|b| u32::from_be_bytes(b.try_into().unwrap_or_default())).ok_or(()), m.get(4))
        else {
            return self.end_job(
                Some(from),
                Fault::Shell,
                format!("shell {from} said a rank left in a message that does not read"),
            );
        };
        if m.len() != 5 || self.task_map.node_of(rank) != Some(from) {
            return self.end_job(
                Some(from),
                Fault::Shell,
                format!("shell {from} said rank {rank} left, not one of its own"),
            );
        }
        let finalized = finalized != 0;
        let Some(top) = &mut self.top else { return };
        top.left.push((rank, from, finalized));
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

    /// Shell 0: ends the job if a group exchange waits for a rank that left or a shell that is done.
    fn groups_blocked(&mut self) {
        let Some(top) = &self.top else { return };
        if top.groups.is_idle() {
            return;
        }
        let by_rank = top.left.iter().find_map(|&(rank, shell, finalized)| {
            let id = top.groups.blocked_by_rank(rank, shell)?;
            let how = if finalized { "called PMI_Finalize" } else { "closed its PMI connection without PMI_Finalize" };
            Some((
                rank,
                format!("rank {rank} on shell {shell} {how} while other ranks wait for it in group barrier {id}"),
            ))
        });
        if let Some((rank, message)) = by_rank {
            return self.end_job_for_rank(rank, Fault::TaskLost, message);
        }
        let done = (0..top.said_bye.len() as u32).filter(|&s| top.said_bye[s as usize]);
        let by_shell = done.clone().find_map(|s| Some((s, top.groups.blocked_by_node(s)?)));
        if let Some((shell, id)) = by_shell {
            let message = format!("ranks wait in group barrier {id} that shell {shell} cannot join: every rank on it has closed its PMI connection");
            self.end_job(Some(shell), Fault::TaskLost, message);
        }
    }

    /// Ends the job for shell `shell`'s fault (`None`: shell 0's root), naming its first rank.
    fn end_job(&mut self, shell: Option<u32>, fault: Fault, message: String) {
        let shell = shell.unwrap_or(0);
        let rank = (0..self.task_map.size() as u32).find(|&r| self.task_map.node_of(r) == Some(shell)).unwrap_or(0);
        self.end_job_for_rank(rank, fault, message);
    }

    fn end_job_for_rank(&mut self, rank: u32, fault: Fault, message: String) {
        if !std::mem::replace(&mut self.ended, true) {
            self.actions.push_back(Action::EndJob { rank, fault, message });
        }
    }

    /// Shell `from` sent more than this shell holds unread (`max` bytes): one of its messages was dropped.
    pub fn overflowed(&mut self, from: u32, max: usize) {
        let what = format!("shell {from} sent shell {} more than the {max} bytes it holds unread", self.me);
        self.end_job(Some(from), Fault::Shell, what);
    }
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
        queue: VecDeque<(u32, u32, Vec<u8>)>,
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
                            Action::Send { to, message } => self.queue.push_back((s as u32, to, message)),
                            a => self.seen[s].push(a),
                        }
                    }
                }
                let Some((from, to, message)) = self.queue.pop_front() else { return };
                self.shells[to as usize].message(from, message);
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
        let cases: [(u32, u32, Vec<u8>); 5] = [
            (2, 1, vec![Kind::Down as u8]),
            (2, 1, vec![Kind::GroupDone as u8]),
            (1, 2, vec![0, 0, 0, 1, 0, Kind::Gone as u8]),
            (1, 0, vec![0, 0, 0, 0, 0, Kind::Gone as u8]),
            (2, 0, vec![9]),
        ];
        for (from, to, message) in cases {
            let mut job2 = Job::new(&[1, 2, 1], 2, Allgather::Tree);
            job2.shells[to as usize].message(from, message.clone());
            job2.run();
            let first_rank = [0, 1, 3][from as usize];
            match job2.seen[to as usize].last() {
                Some(Action::EndJob { rank, fault: Fault::Shell, message: why }) => {
                    assert_eq!(*rank, first_rank, "{why}");
                    assert!(why.contains(&format!("shell {from}")), "{why}");
                }
                other => panic!("{from} -> {to} {message:?}: {other:?}"),
            }
        }
        job.shells[1].message(1, vec![Kind::Node as u8]);
        job.run();
        assert!(matches!(job.seen[1].last(), Some(Action::EndJob { .. })));
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
