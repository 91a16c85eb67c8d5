//! The engine's behaviour, command by command, driven with byte strings, in memory: what it asks of its host
//! is read from its effects.

use super::*;
use crate::server::{TaskMap, NOT_SUPPORTED};
use crate::wire::SpawnRequest;

/// What the engine asked of its host, taken from its effects as a host takes them.
#[derive(Default)]
struct Recorder {
    collectives: Vec<Vec<u8>>,
    aborts: Vec<(u32, i32, String)>,
    errors: Vec<JobError>,
    logs: Vec<(log::Level, String)>,
    traces: Vec<String>,
    /// Offer the optional services (publish, lookup, spawn).
    offer: bool,
    /// Refuse collectives and the services offered at once, saying this.
    refusal: Option<&'static str>,
    requests: Vec<String>,
    spawns: Vec<SpawnRequest>,
    started: Vec<u32>,
    /// The group exchanges started: id, shells and contribution.
    groups: Vec<(String, Vec<u32>, Vec<u8>)>,
}

impl Recorder {
    /// Takes every effect `server` has queued; what it refuses (`refusal`, a service not offered) it hands
    /// back at once, as a host does.
    fn take(&mut self, server: &mut Server) {
        while let Some(effect) = server.next_effect() {
            match effect {
                Effect::Collective(contribution) => {
                    self.collectives.push(contribution);
                    if let Some(why) = self.refusal {
                        server.collective_complete(Err(why));
                    }
                }
                Effect::GroupCollective { id, shells, contribution } => {
                    self.groups.push((String::from_utf8(id).unwrap(), shells, contribution));
                }
                Effect::Abort { rank, exit_code, message } => self.aborts.push((rank, exit_code, message)),
                Effect::JobError(error) => self.errors.push(error),
                Effect::Log(level, message) => self.logs.push((level, message)),
                Effect::Trace { rank, speaker, line } => {
                    self.traces.push(format!("{rank} {speaker}: {}", String::from_utf8_lossy(&line)));
                }
                Effect::TaskStarted(rank) => self.started.push(rank),
                Effect::TaskClosed { .. } => {}
                Effect::Request { task, request } => {
                    if !self.offer {
                        server.host_reply(task, HostReply::Failed(NOT_SUPPORTED.into()));
                        continue;
                    }
                    if let HostRequest::Spawn(spawn) = &request {
                        self.spawns.push((**spawn).clone());
                    }
                    self.requests.push(format!("{request:?}"));
                    if let Some(why) = self.refusal {
                        server.host_reply(task, HostReply::Failed(why.into()));
                    }
                }
            }
        }
    }
}

/// A server of a `ppn.len()`-node block-mapped job serving the ranks of node `node`.
fn shell_on(ppn: &[u32], node: u32) -> Server {
    let map = TaskMap::block(ppn);
    let local = map.clique(node);
    let hosts = (0..ppn.len()).map(|n| format!("node{n}")).collect();
    Server::new(JobInfo::new("kvs_42", map, local, hosts), Limits::default()).unwrap()
}

/// Sends `input` from `task` and returns everything queued for it.
fn send(server: &mut Server, host: &mut Recorder, task: TaskId, input: &str) -> String {
    server.receive(task, input.as_bytes());
    host.take(server);
    drain(server, task)
}

fn drain(server: &mut Server, task: TaskId) -> String {
    let mut out = Vec::new();
    while !server.output(task).is_empty() {
        let piece = server.output(task);
        let n = piece.len();
        out.extend_from_slice(piece);
        server.consume(task, n);
    }
    String::from_utf8(out).unwrap()
}

/// Completes the pending collective with this server's own contribution and `others`.
fn complete(server: &mut Server, host: &mut Recorder, others: &[&[u8]]) {
    let own = host.collectives.last().cloned().unwrap();
    let mut parts: Vec<&[u8]> = vec![&own];
    parts.extend_from_slice(others);
    server.collective_complete(Ok(&parts));
    host.take(server);
}

#[test]
fn init_version_matrix() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let ok = "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n";
    assert_eq!(send(&mut s, &mut h, 0, "cmd=init pmi_version=1 pmi_subversion=1\n"), ok);
    assert_eq!(send(&mut s, &mut h, 0, "cmd=init pmi_version=1 pmi_subversion=0\n"), ok);
    // 1.2 is answered with 1.1 by a host that runs no group exchanges (1.2 would oblige barrier groups).
    assert_eq!(send(&mut s, &mut h, 0, "cmd=init pmi_version=1 pmi_subversion=2\n"), ok);
    let refused = "cmd=response_to_init rc=-1 pmi_version=1 pmi_subversion=1 msg=unsupported_PMI_version\n";
    assert_eq!(send(&mut s, &mut h, 0, "cmd=init pmi_version=3 pmi_subversion=0\n"), refused);
    assert_eq!(send(&mut s, &mut h, 0, "cmd=init pmi_version=0 pmi_subversion=9\n"), refused);
    assert!(h.errors.is_empty());
    // A client that asks for 2 speaks PMI-2 from then on (its conformance: tests/conformance.rs).
    let two = "cmd=response_to_init rc=0 pmi_version=2 pmi_subversion=0\n";
    assert_eq!(send(&mut s, &mut h, 0, "cmd=init pmi_version=2 pmi_subversion=0\n"), two);
    assert_eq!(send(&mut s, &mut h, 0, "    14cmd=job-getid;"), "    41cmd=job-getid-response;rc=0;jobid=kvs_42;");
}

#[test]
fn rpmis_clients_are_told_the_revision_of_its_additions_others_are_answered_as_before() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let asked = "cmd=init pmi_version=1 pmi_subversion=1 rpmi=1\n";
    assert_eq!(send(&mut s, &mut h, 0, asked), "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1 rpmi=1\n");
    // A later revision is answered with the one this server speaks.
    let later = "cmd=init pmi_version=1 pmi_subversion=1 rpmi=9\n";
    assert_eq!(send(&mut s, &mut h, 0, later), "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1 rpmi=3\n");
    let plain = "cmd=init pmi_version=1 pmi_subversion=1\n";
    assert_eq!(send(&mut s, &mut h, 0, plain), "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n");
    let two = "cmd=init pmi_version=2 pmi_subversion=0 rpmi=2\n";
    assert_eq!(send(&mut s, &mut h, 0, two), "cmd=response_to_init rc=0 pmi_version=2 pmi_subversion=0 rpmi=2\n");
}

/// rpmi's libraries write a barrier's puts ahead of it in one write: each is answered in turn, then the
/// barrier once the collective completes.
#[test]
fn puts_written_with_their_barrier_are_answered_in_turn() {
    let mut s = shell_on(&[1, 1], 0);
    let mut h = Recorder::default();
    let batch = "cmd=put kvsname=kvs_42 key=a value=1\ncmd=put kvsname=kvs_42 key=b value=2 2\n\
                 cmd=put kvsname=kvs_42 key=a value=3\ncmd=barrier_in\n";
    assert_eq!(send(&mut s, &mut h, 0, batch), "cmd=put_result rc=0\n".repeat(3));
    assert_eq!(h.collectives, vec![b"0 a=1\n0 b=2 2\n0 a=3\n".to_vec()]);
    complete(&mut s, &mut h, &[b"1 c=4\n"]);
    assert_eq!(drain(&mut s, 0), "cmd=barrier_out rc=0\n");
    assert_eq!(send(&mut s, &mut h, 0, "cmd=get kvsname=kvs_42 key=a\n"), "cmd=get_result rc=0 value=3\n");
    // A refused put among them is answered so, and the ones after it and the barrier still are.
    let batch = "cmd=put kvsname=kvs_42 key=c value=5\ncmd=put kvsname=kvs_42 key=d value=6\ncmd=barrier_in\n";
    let answers = send(&mut s, &mut h, 0, batch);
    assert!(answers.starts_with("cmd=put_result rc=4 msg=rank_1_already_put"), "{answers}");
    assert!(answers.ends_with("\ncmd=put_result rc=0\n"), "{answers}");
    assert_eq!(h.collectives.len(), 2);
}

/// After a fence, the image of the key-value space is made once, at the first request, for the host to keep
/// in the node's memory file, and each task's answer names it; it holds every key the fence left.
#[test]
fn the_image_of_a_fence_is_made_once_at_the_first_request() {
    let mut s = shell_on(&[2, 1], 0);
    let mut h = Recorder::default();
    assert_eq!(send(&mut s, &mut h, 0, "cmd=get_kvs_image\n"), "cmd=kvs_image rc=-1 msg=no_fence_yet\n");
    send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key=a value=1\ncmd=barrier_in\n");
    send(&mut s, &mut h, 1, "cmd=put kvsname=kvs_42 key=b value=2\ncmd=barrier_in\n");
    complete(&mut s, &mut h, &[b"2 c=3\n"]);
    drain(&mut s, 0);
    drain(&mut s, 1);
    assert_eq!(s.kvs_image_due(), None, "due before anyone asked");
    s.receive(0, b"cmd=get_kvs_image\n");
    h.take(&mut s);
    assert_eq!(s.attached(0), Some(Attached::KvsImage(1)));
    assert_eq!(s.kvs_image_due(), Some(1));
    let mut bytes = Vec::new();
    s.write_kvs_image(&mut bytes).unwrap();
    assert_eq!(s.kvs_image_due(), None);
    let image = crate::wire::image::Image::parse(&bytes).unwrap();
    assert_eq!(image.fence(), 1);
    for (key, value) in [("a", "1"), ("b", "2"), ("c", "3")] {
        assert_eq!(image.get(key.as_bytes()), Some(value.as_bytes()), "{key}");
    }
    assert!(image.get(PROCESS_MAPPING_KEY.as_bytes()).is_some());
    assert_eq!(drain(&mut s, 0), format!("cmd=kvs_image rc=0 bytes={} fence=1\n", bytes.len()));
    assert_eq!(s.attached(0), None, "the memory file goes with the answer's first byte only");
    // Another task of the node is sent the same image: none is made again.
    assert_eq!(
        send(&mut s, &mut h, 1, "cmd=get_kvs_image\n"),
        format!("cmd=kvs_image rc=0 bytes={} fence=1\n", bytes.len())
    );
    assert_eq!(s.kvs_image_due(), None);
    // PMI-2 asks the same.
    s.receive(1, b"cmd=init pmi_version=2 pmi_subversion=0\n");
    h.take(&mut s);
    drain(&mut s, 1);
    let answer = send(&mut s, &mut h, 1, "    14cmd=kvs-image;");
    assert!(answer.ends_with(&format!("cmd=kvs-image-response;rc=0;bytes={};fence=1;", bytes.len())), "{answer}");
}

/// A put that reaches the store after the fence makes its image impossible: the task reads the wire.
#[test]
fn no_image_once_the_store_changed_since_the_fence() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    complete(&mut s, &mut h, &[]);
    drain(&mut s, 0);
    send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key=late value=1\n");
    let answer = send(&mut s, &mut h, 0, "cmd=get_kvs_image\n");
    assert_eq!(answer, "cmd=kvs_image rc=-1 msg=the_key-value_space_changed_since_the_last_fence\n");
    assert_eq!(s.attached(0), None);
    // The next fence makes one possible again.
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    complete(&mut s, &mut h, &[]);
    drain(&mut s, 0);
    assert!(send(&mut s, &mut h, 0, "cmd=get_kvs_image\n").starts_with("cmd=kvs_image rc=0 bytes="));
}

/// A fence that brought nothing keeps the image of the one before; the images one server makes add up to the
/// store's bound at most, each charged the pages it takes (a task may keep each one's memory alive), and
/// beyond it tasks read the wire.
#[test]
fn the_images_made_are_bounded_by_the_store() {
    let map = TaskMap::block(&[1]);
    // Room for five images of under 4 KiB, each charged its page and one for its file.
    let limits = Limits { kvs_bytes_max: 5 * 8192, ..Limits::default() };
    let mut s = Server::new(JobInfo::new("k", map, vec![0], vec!["h".into()]), limits).unwrap();
    let mut h = Recorder::default();
    let fence = |s: &mut Server, h: &mut Recorder, others: &[&[u8]]| {
        send(s, h, 0, "cmd=barrier_in\n");
        complete(s, h, others);
        drain(s, 0);
    };
    let ask = |s: &mut Server, h: &mut Recorder| {
        let answer = send(s, h, 0, "cmd=get_kvs_image\n");
        if s.kvs_image_due().is_some() {
            s.write_kvs_image(&mut Vec::new()).unwrap();
        }
        answer
    };
    fence(&mut s, &mut h, &[]);
    let first = ask(&mut s, &mut h);
    assert!(first.starts_with("cmd=kvs_image rc=0 ") && first.ends_with(" fence=1\n"), "{first}");
    // Empty fences: the same image, none made.
    for _ in 0..3 {
        fence(&mut s, &mut h, &[b""]);
        assert_eq!(ask(&mut s, &mut h), first);
    }
    // Each fence that brings a key makes a new one, until they add up to the bound.
    let mut made = 0;
    let refused = loop {
        send(&mut s, &mut h, 0, &format!("cmd=put kvsname=k key=k{made} value={}\n", "v".repeat(100)));
        fence(&mut s, &mut h, &[]);
        let answer = ask(&mut s, &mut h);
        if !answer.starts_with("cmd=kvs_image rc=0 ") {
            break answer;
        }
        made += 1;
        assert!(made < 20, "no bound: {answer}");
    };
    assert_eq!(made, 4, "images after the first");
    assert_eq!(
        refused,
        "cmd=kvs_image rc=-1 msg=the_images_of_the_key-value_space_this_server_made_reached_its_store's_bound\n"
    );
    assert_eq!(s.attached(0), None);
    // The wire still answers.
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get kvsname=k key=k0\n"),
        format!("cmd=get_result rc=0 value={}\n", "v".repeat(100))
    );
}

#[test]
fn information_commands() {
    let mut s = shell_on(&[2, 2], 1);
    let mut h = Recorder::default();
    // A client from before PMI 1.1 sends no init: it is served all the same.
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get_maxes\n"),
        "cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866\n"
    );
    assert_eq!(send(&mut s, &mut h, 0, "cmd=get_universe_size\n"), "cmd=universe_size rc=0 size=4\n");
    assert_eq!(send(&mut s, &mut h, 1, "cmd=get_appnum\n"), "cmd=appnum rc=0 appnum=0\n");
    assert_eq!(send(&mut s, &mut h, 1, "cmd=get_my_kvsname\n"), "cmd=my_kvsname rc=0 kvsname=kvs_42\n");
    assert_eq!(send(&mut s, &mut h, 1, "cmd=finalize\n"), "cmd=finalize_ack rc=0\n");
}

#[test]
fn configured_maxes_are_advertised() {
    let map = TaskMap::block(&[1]);
    let limits = Limits { kvsname_max: 32, keylen_max: 32, vallen_max: 512, ..Limits::default() };
    let mut s = Server::new(JobInfo::new("k", map, vec![0], vec!["h".into()]), limits).unwrap();
    let mut h = Recorder::default();
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get_maxes\n"),
        "cmd=maxes rc=0 kvsname_max=32 keylen_max=32 vallen_max=512\n"
    );
    let long = format!("cmd=put kvsname=k key=a value={}\n", "v".repeat(512));
    assert_eq!(send(&mut s, &mut h, 0, &long), "cmd=put_result rc=7 msg=value_longer_than_511\n");
}

#[test]
fn puts_are_visible_locally_and_travel_in_one_contribution() {
    let mut s = shell_on(&[2, 2], 0);
    let mut h = Recorder::default();
    assert_eq!(send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key=card-0 value=a b=c\n"), "cmd=put_result rc=0\n");
    assert_eq!(send(&mut s, &mut h, 1, "cmd=put kvsname=kvs_42 key=card-1 value=xyz\n"), "cmd=put_result rc=0\n");
    assert_eq!(send(&mut s, &mut h, 0, "cmd=barrier_in\n"), "");
    assert!(h.collectives.is_empty(), "the collective waits for every local task");
    assert_eq!(send(&mut s, &mut h, 1, "cmd=barrier_in\n"), "");
    assert_eq!(h.collectives, vec![b"0 card-0=a b=c\n1 card-1=xyz\n".to_vec()]);
    complete(&mut s, &mut h, &[b"2 card-2=from other server\n"]);
    assert_eq!(drain(&mut s, 0), "cmd=barrier_out rc=0\n");
    assert_eq!(drain(&mut s, 1), "cmd=barrier_out rc=0\n");
    assert_eq!(
        send(&mut s, &mut h, 1, "cmd=get kvsname=kvs_42 key=card-2\n"),
        "cmd=get_result rc=0 value=from other server\n"
    );
    assert_eq!(send(&mut s, &mut h, 1, "cmd=get kvsname=kvs_42 key=card-0\n"), "cmd=get_result rc=0 value=a b=c\n");
    assert_eq!(
        send(&mut s, &mut h, 1, "cmd=get kvsname=kvs_42 key=card-3\n"),
        "cmd=get_result rc=-1 msg=key_not_found\n"
    );
    // A barrier with nothing new still goes through the collective.
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    send(&mut s, &mut h, 1, "cmd=barrier_in\n");
    assert_eq!(h.collectives.len(), 2);
    assert!(h.collectives[1].is_empty());
}

#[test]
fn put_and_get_errors() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let put = |k: &str, v: &str| format!("cmd=put kvsname=kvs_42 key={k} value={v}\n");
    let longest = "v".repeat(s.limits().value_max());
    assert_eq!(send(&mut s, &mut h, 0, &put("big", &longest)), "cmd=put_result rc=0\n");
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get kvsname=kvs_42 key=big\n"),
        format!("cmd=get_result rc=0 value={longest}\n")
    );
    assert_eq!(
        send(&mut s, &mut h, 0, &put("big2", &format!("{longest}v"))),
        "cmd=put_result rc=7 msg=value_longer_than_866\n"
    );
    assert_eq!(send(&mut s, &mut h, 0, &put(&"k".repeat(63), "v")), "cmd=put_result rc=0\n");
    assert_eq!(send(&mut s, &mut h, 0, &put(&"k".repeat(64), "v")), "cmd=put_result rc=5 msg=key_longer_than_63\n");
    assert_eq!(
        send(&mut s, &mut h, 0, &format!("cmd=get kvsname=kvs_42 key={}\n", "k".repeat(64))),
        "cmd=get_result rc=5 msg=key_longer_than_63\n"
    );
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key= value=v\n"),
        "cmd=put_result rc=4 msg=invalid_key\n"
    );
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key=e value=\n"),
        "cmd=put_result rc=6 msg=empty_value\n"
    );
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=put kvsname=other key=k value=v\n"),
        "cmd=put_result rc=3 msg=unknown_kvsname\n"
    );
    assert_eq!(send(&mut s, &mut h, 0, "cmd=get kvsname=other key=k\n"), "cmd=get_result rc=3 msg=unknown_kvsname\n");
    assert!(h.errors.is_empty(), "rc errors are not protocol errors");
}

#[test]
fn duplicate_keys_follow_the_owner_rule() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    let put = "cmd=put kvsname=kvs_42 key=k value=";
    assert_eq!(send(&mut s, &mut h, 0, &format!("{put}one\n")), "cmd=put_result rc=0\n");
    assert_eq!(send(&mut s, &mut h, 0, &format!("{put}two\n")), "cmd=put_result rc=0\n");
    assert_eq!(send(&mut s, &mut h, 1, &format!("{put}two\n")), "cmd=put_result rc=0\n");
    assert_eq!(
        send(&mut s, &mut h, 1, &format!("{put}three\n")),
        "cmd=put_result rc=4 msg=rank_0_already_put_a_different_value_under_this_key\n"
    );
    assert_eq!(
        send(&mut s, &mut h, 1, "cmd=put kvsname=kvs_42 key=PMI_process_mapping value=x\n"),
        "cmd=put_result rc=4 msg=the_key_is_reserved_by_the_server\n"
    );
    assert_eq!(send(&mut s, &mut h, 1, "cmd=get kvsname=kvs_42 key=k\n"), "cmd=get_result rc=0 value=two\n");
}

#[test]
fn conflicting_puts_on_two_shells_fail_the_barrier_loudly() {
    let mut s = shell_on(&[1, 1], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key=k value=mine\n");
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    complete(&mut s, &mut h, &[b"1 k=theirs\n"]);
    assert_eq!(drain(&mut s, 0), "cmd=barrier_out rc=-1 msg=ranks_0_and_1_put_different_values_under_key_'k'\n");
    assert!(h.logs.iter().any(|(_, m)| m.contains("ranks 0 and 1 put different values under key 'k'")));
}

#[test]
fn failed_collective_fails_every_waiting_task() {
    let mut s = shell_on(&[3], 0);
    let mut h = Recorder::default();
    for t in 0..3 {
        send(&mut s, &mut h, t, "cmd=barrier_in\n");
    }
    s.collective_complete(Err("node 2 unreachable"));
    h.take(&mut s);
    for t in 0..3 {
        assert_eq!(drain(&mut s, t), "cmd=barrier_out rc=-1 msg=node_2_unreachable\n");
    }
    // The next barrier works again.
    for t in 0..3 {
        send(&mut s, &mut h, t, "cmd=barrier_in\n");
    }
    complete(&mut s, &mut h, &[]);
    assert_eq!(drain(&mut s, 2), "cmd=barrier_out rc=0\n");
    // A completion nobody asked for is a host bug, logged and ignored.
    s.collective_complete(Ok(&[]));
    h.take(&mut s);
    assert!(h.logs.iter().any(|(_, m)| m.contains("host bug")));
}

#[test]
fn malformed_collective_data_fails_the_barrier() {
    let mut s = shell_on(&[1, 1], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    complete(&mut s, &mut h, &[b"not a contribution\n"]);
    assert!(drain(&mut s, 0).starts_with("cmd=barrier_out rc=-1 msg=malformed_collective_data"));
}

#[test]
fn a_collective_refused_at_once_fails_the_barrier_at_once() {
    let mut s = shell_on(&[3, 1], 0);
    let mut h = Recorder { refusal: Some("the exchange cannot start"), ..Recorder::default() };
    send(&mut s, &mut h, 0, "cmd=put kvsname=kvs_42 key=k value=v\n");
    for t in 0..3 {
        s.receive(t, b"cmd=barrier_in\n");
        h.take(&mut s);
    }
    // Every waiting task is answered before the host completes anything, as a failed completion answers it.
    for t in 0..3 {
        assert_eq!(drain(&mut s, t), "cmd=barrier_out rc=-1 msg=the_exchange_cannot_start\n");
    }
    assert_eq!(h.collectives, vec![b"0 k=v\n".to_vec()]);
    assert!(h.logs.iter().any(|(l, m)| *l == log::Level::Error && m == "barrier failed: the exchange cannot start"));
    // Nothing is outstanding: a completion now is a host bug.
    s.collective_complete(Ok(&[]));
    h.take(&mut s);
    assert!(h.logs.iter().any(|(_, m)| m.contains("host bug")));
    // The next barrier starts a collective again, without the puts of the failed one.
    h.refusal = None;
    for t in 0..3 {
        send(&mut s, &mut h, t, "cmd=barrier_in\n");
    }
    assert_eq!(h.collectives.last().unwrap(), b"");
    complete(&mut s, &mut h, &[]);
    assert_eq!(drain(&mut s, 1), "cmd=barrier_out rc=0\n");
    assert!(h.errors.is_empty());
}

#[test]
fn kvs_byte_bound_refuses_puts_and_job_goes_on() {
    let map = TaskMap::block(&[1]);
    let limits = Limits { kvs_bytes_max: 600, ..Limits::default() };
    let mut s = Server::new(JobInfo::new("k", map, vec![0], vec!["h".into()]), limits).unwrap();
    let mut h = Recorder::default();
    // PMI_process_mapping ("(vector,(0,1,1))") is held: 35 bytes with its key, and the entry's overhead.
    assert_eq!(s.kvs_bytes(), 35 + kvs::ENTRY_OVERHEAD);
    assert_eq!(send(&mut s, &mut h, 0, "cmd=put kvsname=k key=a value=0123456789\n"), "cmd=put_result rc=0\n");
    // The entry, and twice "0 a=0123456789\n" on its way to the other shells.
    assert_eq!(s.kvs_bytes(), 35 + 11 + 2 * kvs::ENTRY_OVERHEAD + 2 * 15);
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=put kvsname=k key=b value=0123456789abcdefghij\n"),
        "cmd=put_result rc=2 msg=the_job's_key-value_store_is_full_(600_bytes)\n"
    );
    assert_eq!(send(&mut s, &mut h, 0, "cmd=get kvsname=k key=a\n"), "cmd=get_result rc=0 value=0123456789\n");
    assert!(h.errors.is_empty());
    // Once the puts have gone out at a barrier, only the store is charged.
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    complete(&mut s, &mut h, &[]);
    assert_eq!(drain(&mut s, 0), "cmd=barrier_out rc=0\n");
    assert_eq!(s.kvs_bytes(), 35 + 11 + 2 * kvs::ENTRY_OVERHEAD);
}

#[test]
fn abort_reaches_the_host_and_gets_the_rfc_reply() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    assert_eq!(send(&mut s, &mut h, 1, "cmd=abort exitcode=-3 message=out of memory = bad\n"), "\n");
    assert_eq!(h.aborts, vec![(1, -3, "out of memory = bad".to_string())]);
    assert_eq!(send(&mut s, &mut h, 1, "cmd=get_maxes\n"), "", "an aborted task is not served");
    send(&mut s, &mut h, 0, "cmd=abort exitcode=7\n");
    send(&mut s, &mut h, 0, "cmd=abort\n");
    assert_eq!(h.aborts[1], (0, 7, String::new()));
    assert_eq!(h.aborts.len(), 2);
    assert!(h.errors.is_empty(), "an abort is not reported a second time as a lost task");
}

#[test]
fn abort_is_accepted_while_a_barrier_waits() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    send(&mut s, &mut h, 0, "cmd=abort exitcode=4 message=from another thread\n");
    assert_eq!(h.aborts, vec![(0, 4, "from another thread".to_string())]);
}

#[test]
fn name_service_without_host_support() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let no = "rc=-1 msg=not_supported_by_this_resource_manager\n";
    assert_eq!(send(&mut s, &mut h, 0, "cmd=publish_name service=svc port=p1\n"), format!("cmd=publish_result {no}"));
    assert_eq!(send(&mut s, &mut h, 0, "cmd=unpublish_name service=svc\n"), format!("cmd=unpublish_result {no}"));
    assert_eq!(send(&mut s, &mut h, 0, "cmd=lookup_name service=svc\n"), format!("cmd=lookup_result {no}"));
}

#[test]
fn name_service_through_the_host() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    assert_eq!(send(&mut s, &mut h, 0, "cmd=publish_name service=svc port=tcp://h:1\n"), "");
    assert_eq!(h.requests, vec![r#"Publish { service: "svc", port: "tcp://h:1" }"#]);
    s.host_reply(0, HostReply::Done);
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "cmd=publish_result rc=0\n");
    send(&mut s, &mut h, 0, "cmd=lookup_name service=svc\n");
    s.host_reply(0, HostReply::Port("tcp://h:1".into()));
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "cmd=lookup_result rc=0 port=tcp://h:1\n");
    send(&mut s, &mut h, 0, "cmd=lookup_name service=nope\n");
    s.host_reply(0, HostReply::Failed("no such service".into()));
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "cmd=lookup_result rc=-1 msg=no_such_service\n");
    send(&mut s, &mut h, 0, "cmd=unpublish_name service=svc\n");
    s.host_reply(0, HostReply::Port("wrong kind".into()));
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "cmd=unpublish_result rc=-1 msg=the_resource_manager_gave_an_unusable_answer\n");
    // A reply nobody waits for is a host bug, logged.
    s.host_reply(0, HostReply::Done);
    h.take(&mut s);
    assert!(h.logs.iter().any(|(_, m)| m.contains("host bug")));
}

const SPAWN: &str = "mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\nargcnt=1\narg1=-x\n\
    preput_num=0\ninfo_num=0\nendcmd\n";

#[test]
fn spawn_without_host_support() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    assert_eq!(send(&mut s, &mut h, 0, SPAWN), "cmd=spawn_result rc=-1 msg=not_supported_by_this_resource_manager\n");
    assert!(h.errors.is_empty());
}

#[test]
fn spawn_through_the_host_in_pieces() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    // The request arrives split at arbitrary points.
    for piece in SPAWN.as_bytes().chunks(7) {
        s.receive(0, piece);
        h.take(&mut s);
    }
    assert_eq!(h.spawns.len(), 1);
    assert_eq!(h.spawns[0].commands[0].args, vec![b"-x".to_vec()]);
    s.host_reply(0, HostReply::Spawned { errcodes: vec![0, 0] });
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "cmd=spawn_result rc=0 errcodes=0,0\n");
}

#[test]
fn malformed_spawn_is_a_protocol_error() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "mcmd=spawn\nnprocs=x\n");
    assert!(matches!(&h.errors[..], [JobError::Protocol { rank: 0, .. }]));
}

/// docs/security.md: a spawn request is bounded by what it holds decoded, not only by its bytes on the
/// wire. A task that sends a spawn of one-byte arguments (`argN=x`), block after block, and never ends it
/// is cut off before its items hold more than the bound: each item is kept apart, in at least a `Vec` and
/// the smallest heap block an allocator gives, several times what its line of 7 to 10 bytes was.
#[test]
fn an_unfinished_spawn_of_one_byte_items_is_cut_off_within_its_bound() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    let max = s.limits().spawn_bytes_max;
    let mut items = 0;
    'blocks: for block in 1..=256 {
        let head = format!("nprocs=1\nexecname=./a\ntotspawns=256\nspawnssofar={block}\nargcnt=4096\n");
        let lines = std::iter::once("mcmd=spawn".to_string())
            .chain(head.lines().map(String::from))
            .chain((1..=4096).map(|i| format!("arg{i}=x")))
            .chain(std::iter::once("endcmd".to_string()));
        for (n, line) in lines.enumerate() {
            s.receive(0, format!("{line}\n").as_bytes());
            h.take(&mut s);
            if s.is_cut_off(0) {
                break 'blocks;
            }
            items += usize::from(n > 5 && line != "endcmd");
        }
    }
    assert!(s.is_cut_off(0), "a spawn of {items} one-byte items was taken in whole");
    let least = std::mem::size_of::<Vec<u8>>() + 8;
    assert!(
        items * least <= max,
        "{items} one-byte items were kept (at least {} bytes) under a bound of {max}",
        items * least
    );
    match &h.errors[..] {
        [JobError::Protocol { rank: 0, reason, .. }] => {
            assert!(reason.contains(&format!("over the limit of {max} bytes")), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(h.spawns.is_empty());
}

/// The bound holds for a spawn's PMI-2 frame as for its PMI-1 lines: a frame of one-byte arguments that
/// would hold more than the bound once decoded is refused, as the same request would be over PMI-1.
#[test]
fn a_pmi2_spawn_of_one_byte_items_is_bounded_decoded() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    send(&mut s, &mut h, 0, "cmd=init pmi_version=2 pmi_subversion=0\n");
    let args: String = (0..4000).map(|i| format!("argv{i}=x;")).collect();
    let body = format!("cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=4000;{args}");
    assert!(body.len() < s.limits().spawn_bytes_max, "its bytes alone are within the bound");
    send(&mut s, &mut h, 0, &format!("{:6}{body}", body.len()));
    assert!(s.is_cut_off(0) && h.spawns.is_empty());
    assert!(matches!(&h.errors[..], [JobError::Protocol { rank: 0, reason, .. }] if reason.contains("over the limit")));
}

/// A long PMI-2 frame (a spawn of 250,000 bytes) that comes in pieces is gathered in the task's
/// partial-frame buffer, which grows no larger than the frame; once the frame is whole the buffer does not
/// keep its capacity: 10,000 tasks that once each sent one would otherwise hold 256 KiB each for the rest
/// of the job.
#[test]
fn a_long_frame_leaves_no_capacity_behind() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    send(&mut s, &mut h, 0, "cmd=init pmi_version=2 pmi_subversion=0\n");
    let long = "a".repeat(250_000);
    let body = format!("cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=1;argv0={long};");
    let frame = format!("{:6}{body}", body.len());
    for piece in frame.as_bytes().chunks(4096) {
        s.receive(0, piece);
        h.take(&mut s);
        let held = s.clients[0].partial.capacity();
        assert!(held <= frame.len(), "{held} bytes held for a frame of {}", frame.len());
    }
    assert_eq!(h.spawns.len(), 1, "{:?}", h.errors);
    assert_eq!(h.spawns[0].commands[0].args, [long.into_bytes()]);
    let kept = s.clients[0].partial.capacity();
    assert!(kept <= 1024, "the partial-frame buffer kept {kept} bytes");
    s.host_reply(0, HostReply::Spawned { errcodes: vec![0] });
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "    35cmd=spawn-response;rc=0;errcodes=0;");
    // The connection goes on, short frames split across reads too.
    s.receive(0, b"    14cmd=jo");
    h.take(&mut s);
    assert_eq!(send(&mut s, &mut h, 0, "b-getid;"), "    41cmd=job-getid-response;rc=0;jobid=kvs_42;");
    assert!(h.errors.is_empty(), "{:?}", h.errors);
}

#[test]
fn ranks2hosts_answer() {
    let map = TaskMap::new(vec![1, 0, 1, 0, 1, 0, 1, 0]);
    let job = JobInfo::new("k", map, vec![1, 3, 5, 7], vec!["node001".into(), "node002".into()]);
    let mut s = Server::new(job, Limits::default()).unwrap();
    let mut h = Recorder::default();
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get_ranks2hosts\n"),
        "put_ranks2hosts 40 2\n7 node001 1,3,5,7, 7 node002 0,2,4,6, \n"
    );
}

#[test]
fn process_mapping_is_served_or_absent() {
    let mut s = shell_on(&[2, 2, 4, 4], 2);
    let mut h = Recorder::default();
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get kvsname=kvs_42 key=PMI_process_mapping\n"),
        "cmd=get_result rc=0 value=(vector,(0,2,2),(2,2,4))\n"
    );
    // 4096 nodes x 256 cyclic does not fit a value: the key is absent, never empty.
    let map = TaskMap::cyclic(&[256; 4096]);
    let mut s = Server::new(JobInfo::new("k", map, vec![0], vec!["h".into(); 4096]), Limits::default()).unwrap();
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=get kvsname=k key=PMI_process_mapping\n"),
        "cmd=get_result rc=-1 msg=key_not_found\n"
    );
}

#[test]
fn protocol_errors_name_rank_and_line() {
    for (line, reason) in [
        ("cmd=bogus\n", "unknown command 'bogus'"),
        ("hello\n", "a token is not of the form key=value"),
        ("cmd=put kvsname=kvs_42 key=k\n", "'put' request without its 'value=' field"),
        ("cmd=getmaxes\n", "unknown command 'getmaxes'"),
    ] {
        let mut s = shell_on(&[4], 0);
        let mut h = Recorder::default();
        assert_eq!(send(&mut s, &mut h, 2, line), "");
        let want = JobError::Protocol { rank: 2, line: line.trim_end().into(), reason: reason.into() };
        assert_eq!(h.errors, vec![want.clone()]);
        assert!(want.to_string().starts_with("rank 2: PMI protocol error: "));
        // The connection is dead: nothing more is answered.
        assert_eq!(send(&mut s, &mut h, 2, "cmd=get_maxes\n"), "");
    }
}

#[test]
fn a_long_line_without_newline_is_bounded() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let chunk = vec![b'x'; 64 * 1024];
    for _ in 0..16 {
        s.receive(0, &chunk);
        h.take(&mut s);
    }
    assert_eq!(h.errors.len(), 1);
    let JobError::Protocol { reason, line, .. } = &h.errors[0] else { panic!() };
    assert_eq!(reason, "a line longer than 4096 bytes");
    assert!(line.len() < 200, "the message carries an excerpt, not the line");
}

#[test]
fn a_long_line_split_across_reads_is_bounded() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    s.receive(0, &[b'x'; 4000]);
    h.take(&mut s);
    s.receive(0, &[b'x'; 200]);
    h.take(&mut s);
    assert_eq!(h.errors.len(), 1);
}

#[test]
fn lines_split_and_joined_arbitrarily() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let input = b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=get_maxes\ncmd=get_appnum\n";
    for b in input.chunks(3) {
        s.receive(0, b);
        h.take(&mut s);
    }
    assert_eq!(
        drain(&mut s, 0),
        "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n\
         cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866\ncmd=appnum rc=0 appnum=0\n"
    );
}

#[test]
fn a_request_while_one_waits_is_a_protocol_error() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "cmd=barrier_in\ncmd=get_maxes\n");
    assert!(matches!(&h.errors[..], [JobError::Protocol { rank: 0, reason, .. }] if reason.contains("still waits")));
}

#[test]
fn a_task_leaving_mid_barrier_is_reported_at_once() {
    let mut s = shell_on(&[3], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    send(&mut s, &mut h, 1, "cmd=barrier_in\n");
    s.disconnected(2);
    h.take(&mut s);
    assert_eq!(h.errors, vec![JobError::TaskLost { rank: 2, finalized: false }]);
    let out = drain(&mut s, 0);
    assert!(out.starts_with("cmd=barrier_out rc=-1 msg=rank_2_closed_its_PMI_connection"), "{out}");
    assert!(h.collectives.is_empty());
}

#[test]
fn a_task_gone_before_the_barrier_is_reported_when_it_starts() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 1, "cmd=init pmi_version=1 pmi_subversion=1\n");
    s.disconnected(1);
    h.take(&mut s);
    assert!(h.errors.is_empty(), "nobody waits yet");
    let out = send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    assert_eq!(h.errors, vec![JobError::TaskLost { rank: 1, finalized: false }]);
    assert!(out.starts_with("cmd=barrier_out rc=-1"), "{out}");
}

#[test]
fn a_finalized_task_cannot_hold_a_barrier() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    send(&mut s, &mut h, 1, "cmd=finalize\n");
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    assert_eq!(h.errors, vec![JobError::TaskLost { rank: 1, finalized: true }]);
}

#[test]
fn normal_exit_after_finalize_is_quiet() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    for t in 0..2 {
        send(&mut s, &mut h, t, "cmd=barrier_in\n");
    }
    complete(&mut s, &mut h, &[]);
    for t in 0..2 {
        drain(&mut s, t);
        send(&mut s, &mut h, t, "cmd=finalize\n");
        s.disconnected(t);
        h.take(&mut s);
    }
    assert!(h.errors.is_empty());
}

#[test]
fn a_task_leaving_while_the_collective_runs_is_reported() {
    let mut s = shell_on(&[2, 2], 0);
    let mut h = Recorder::default();
    for t in 0..2 {
        send(&mut s, &mut h, t, "cmd=barrier_in\n");
    }
    s.disconnected(1);
    h.take(&mut s);
    assert_eq!(h.errors, vec![JobError::TaskLost { rank: 1, finalized: false }]);
    complete(&mut s, &mut h, &[]);
    assert_eq!(drain(&mut s, 0), "cmd=barrier_out rc=0\n");
    assert_eq!(drain(&mut s, 1), "");
}

#[test]
fn trace_shows_both_directions() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    s.set_trace(true);
    send(&mut s, &mut h, 0, "cmd=get_appnum\n");
    assert_eq!(h.traces, vec!["0 C: cmd=get_appnum", "0 S: cmd=appnum rc=0 appnum=0"]);
}

#[test]
fn inconsistent_job_info_is_refused() {
    let map = || TaskMap::block(&[2]);
    let hosts = || vec!["h".to_string()];
    for (job, why) in [
        (JobInfo::new("k", map(), vec![0, 2], hosts()), "not a rank"),
        (JobInfo::new("k", map(), vec![1, 1], hosts()), "twice"),
        (JobInfo::new("a b", map(), vec![0], hosts()), "kvsname"),
        (JobInfo::new("k".repeat(64), map(), vec![0], hosts()), "kvsname"),
        (JobInfo::new("k", map(), vec![0], vec![]), "hostnames"),
        (JobInfo::new("k", TaskMap::block(&[]), vec![], vec![]), "0 ranks"),
    ] {
        let err = Server::new(job, Limits::default()).err().expect(why);
        assert!(err.to_string().contains(why), "{err} lacks {why}");
    }
}

/// A spawned job's preputs are in every server's store before any task runs, put by no rank; each task
/// reads its own appnum.
#[test]
fn preputs_and_appnums_of_a_spawned_job() {
    let map = TaskMap::block(&[3]);
    let mut job = JobInfo::new("kvs_9", map, vec![0, 1, 2], vec!["h".into()]);
    job.appnums = vec![0, 1, 1];
    job.preputs = vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$port 1$".to_vec())];
    let mut s = Server::new(job, Limits::default()).unwrap();
    let mut h = Recorder::default();
    let get = "cmd=get kvsname=kvs_9 key=PARENT_ROOT_PORT_NAME\n";
    assert_eq!(send(&mut s, &mut h, 2, get), "cmd=get_result rc=0 value=tag#0$port 1$\n");
    assert_eq!(send(&mut s, &mut h, 0, "cmd=get_appnum\n"), "cmd=appnum rc=0 appnum=0\n");
    assert_eq!(send(&mut s, &mut h, 1, "cmd=get_appnum\n"), "cmd=appnum rc=0 appnum=1\n");
    let put = "cmd=put kvsname=kvs_9 key=PARENT_ROOT_PORT_NAME value=mine\n";
    assert!(send(&mut s, &mut h, 1, put).starts_with("cmd=put_result rc=4 "), "a preput belongs to no rank");
}

#[test]
fn preputs_that_a_get_could_not_return_are_refused() {
    let long = vec![b'v'; Limits::default().value_max() + 1];
    for (key, value, why) in [
        (&b"a b"[..], &b"v"[..], "invalid key"),
        (&b"k"[..], &b""[..], "empty value"),
        (&b"k"[..], &b"two\nlines"[..], "line break"),
        (&b"k"[..], &long[..], "value longer than 866"),
    ] {
        let mut job = JobInfo::new("k", TaskMap::block(&[1]), vec![0], vec!["h".into()]);
        job.preputs = vec![(key.to_vec(), value.to_vec())];
        let err = Server::new(job, Limits::default()).err().expect(why);
        assert!(err.to_string().contains(why), "{err} lacks {why}");
    }
    let mut job = JobInfo::new("k", TaskMap::block(&[2]), vec![0, 1], vec!["h".into()]);
    job.appnums = vec![0];
    assert!(Server::new(job, Limits::default()).err().expect("appnums").to_string().contains("1 appnums for 2"));
}

#[test]
fn rewrites_between_barriers_are_bounded() {
    let map = TaskMap::block(&[1]);
    let limits = Limits { kvs_bytes_max: 4096, ..Limits::default() };
    let mut s = Server::new(JobInfo::new("k", map, vec![0], vec!["h".into()]), limits).unwrap();
    let mut h = Recorder::default();
    let mut refused = 0;
    for i in 0..1000 {
        let out = send(&mut s, &mut h, 0, &format!("cmd=put kvsname=k key=a value={}\n", ["x", "y"][i % 2]));
        refused += usize::from(out.starts_with("cmd=put_result rc=2"));
    }
    assert!(refused > 0, "the contribution grew without bound");
}

#[test]
fn a_late_answer_for_a_cut_off_task_is_dropped_quietly() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    send(&mut s, &mut h, 0, "cmd=lookup_name service=svc\ncmd=bogus\n");
    assert_eq!(h.errors.len(), 1);
    s.host_reply(0, HostReply::Port("p".into()));
    h.take(&mut s);
    assert!(h.logs.is_empty(), "{:?}", h.logs);
    assert_eq!(drain(&mut s, 0), "");
}

#[test]
fn spawn_error_codes_that_do_not_fit_a_line() {
    for (codes, want) in [
        (vec![0; 600], "cmd=spawn_result rc=0\n"),
        (vec![-1; 600], "cmd=spawn_result rc=-1 msg=some_processes_failed_to_start;_too_many_to_list\n"),
    ] {
        let mut s = shell_on(&[1], 0);
        let mut h = Recorder { offer: true, ..Recorder::default() };
        send(&mut s, &mut h, 0, SPAWN);
        s.host_reply(0, HostReply::Spawned { errcodes: codes });
        h.take(&mut s);
        assert_eq!(drain(&mut s, 0), want);
    }
}

#[test]
fn a_port_too_long_for_a_line_is_a_failed_lookup() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    send(&mut s, &mut h, 0, "cmd=lookup_name service=svc\n");
    s.host_reply(0, HostReply::Port("p".repeat(1000)));
    h.take(&mut s);
    assert_eq!(drain(&mut s, 0), "cmd=lookup_result rc=-1 msg=the_resource_manager_gave_an_unusable_answer\n");
}

#[test]
fn a_service_refused_at_once_answers_with_the_reason() {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, refusal: Some("the job is ending"), ..Recorder::default() };
    assert_eq!(
        send(&mut s, &mut h, 0, "cmd=lookup_name service=svc\n"),
        "cmd=lookup_result rc=-1 msg=the_job_is_ending\n"
    );
    assert_eq!(h.requests, vec![r#"Lookup { service: "svc" }"#]);
    // The task may ask again.
    assert_eq!(send(&mut s, &mut h, 0, SPAWN), "cmd=spawn_result rc=-1 msg=the_job_is_ending\n");
    assert!(h.errors.is_empty());
}

#[test]
fn untyped_answers_are_read_by_the_service_asked_for() {
    let cases: [(&str, bool, Option<&str>, &str); 10] = [
        ("cmd=publish_name service=svc port=p1\n", true, None, "cmd=publish_result rc=0\n"),
        ("cmd=unpublish_name service=svc\n", true, Some("ignored"), "cmd=unpublish_result rc=0\n"),
        ("cmd=lookup_name service=svc\n", true, Some("tcp://h:1"), "cmd=lookup_result rc=0 port=tcp://h:1\n"),
        (
            "cmd=lookup_name service=svc\n",
            true,
            None,
            "cmd=lookup_result rc=-1 msg=the_resource_manager_found_no_port\n",
        ),
        (
            "cmd=lookup_name service=svc\n",
            true,
            Some("a b"),
            "cmd=lookup_result rc=-1 msg=the_resource_manager_gave_an_unusable_answer\n",
        ),
        (SPAWN, true, Some("0,-1"), "cmd=spawn_result rc=0 errcodes=0,-1\n"),
        (
            SPAWN,
            true,
            Some("0,x"),
            "cmd=spawn_result rc=-1 msg=the_resource_manager_gave_malformed_spawn_error_codes\n",
        ),
        (SPAWN, false, Some("no slots"), "cmd=spawn_result rc=-1 msg=no_slots\n"),
        (
            "cmd=publish_name service=svc port=p1\n",
            false,
            None,
            "cmd=publish_result rc=-1 msg=the_resource_manager_failed_it\n",
        ),
        ("cmd=lookup_name service=svc\n", false, Some("unknown"), "cmd=lookup_result rc=-1 msg=unknown\n"),
    ];
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    for (request, ok, text, want) in cases {
        assert_eq!(send(&mut s, &mut h, 0, request), "");
        s.untyped_reply(0, ok, text.map(String::from));
        h.take(&mut s);
        assert_eq!(drain(&mut s, 0), want, "{request:?} answered {ok} {text:?}");
    }
    assert!(h.logs.is_empty() && h.errors.is_empty(), "{:?} {:?}", h.logs, h.errors);
}

#[test]
fn an_answer_for_a_task_that_waits_for_none_is_a_host_bug() {
    let mut s = shell_on(&[2], 0);
    let mut h = Recorder { offer: true, ..Recorder::default() };
    send(&mut s, &mut h, 1, "cmd=lookup_name service=svc\n");
    s.untyped_reply(1, true, Some("p".into()));
    h.take(&mut s);
    assert_eq!(drain(&mut s, 1), "cmd=lookup_result rc=0 port=p\n");
    // A second answer reaches the server with nothing waiting: logged, and nobody is answered.
    s.untyped_reply(1, true, Some("p".into()));
    h.take(&mut s);
    assert!(h.logs.iter().any(|(_, m)| m == "host bug: a reply for rank 1, which asked for nothing"));
    assert_eq!(drain(&mut s, 1), "");
    s.host_reply(0, HostReply::Done);
    h.take(&mut s);
    assert!(h.logs.iter().any(|(_, m)| m == "host bug: a reply for rank 0, which asked for nothing"));
    assert_eq!(drain(&mut s, 0), "");
}

// Back-pressure: a task that pipelines requests without reading its answers.

/// A one-task server holding `count` keys `k<i>`, each with a value of the longest length that starts with
/// its index; returns the server and the values.
fn shell_with_big_values(count: usize) -> (Server, Recorder, Vec<String>) {
    let mut s = shell_on(&[1], 0);
    let mut h = Recorder::default();
    let max = s.limits().value_max();
    let values: Vec<String> = (0..count).map(|i| format!("{i:<0$}", max).replace(' ', "v")).collect();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(
            send(&mut s, &mut h, 0, &format!("cmd=put kvsname=kvs_42 key=k{i} value={v}\n")),
            "cmd=put_result rc=0\n"
        );
    }
    (s, h, values)
}

/// Writes `task`'s output `piece` bytes at a time, as a host does, resuming the task once it is all written;
/// returns what was written.
fn serve(server: &mut Server, host: &mut Recorder, task: TaskId, piece: usize) -> String {
    let mut written = Vec::new();
    loop {
        let out = server.output(task);
        if out.is_empty() {
            if !server.holds_input(task) {
                return String::from_utf8(written).unwrap();
            }
            server.resume(task);
            host.take(server);
            assert!(!server.output(task).is_empty() || server.is_cut_off(task), "held input was not parsed");
            continue;
        }
        let n = out.len().min(piece);
        written.extend_from_slice(&out[..n]);
        server.consume(task, n);
    }
}

/// How many bytes of answers the server has queued for `task`, its shared answer included.
fn queued(server: &Server, task: TaskId) -> usize {
    let c = &server.clients[task];
    c.out.len() + c.shared.as_ref().map_or(0, |(a, sent)| a.len() - sent)
}

#[test]
fn pipelined_requests_wait_while_their_answers_are_unread() {
    let (mut s, mut h, values) = shell_with_big_values(200);
    let answer = |i: usize| format!("cmd=get_result rc=0 value={}\n", values[i]);
    let requests: String = (0..200).map(|i| format!("cmd=get kvsname=kvs_42 key=k{i}\n")).collect();
    s.receive(0, requests.as_bytes());
    h.take(&mut s);
    // 200 answers are 180 KB: the server stops answering once it holds more than its bound unsent.
    assert!(queued(&s, 0) <= HELD_ABOVE + answer(0).len(), "{} bytes of answers queued", queued(&s, 0));
    assert!(s.holds_input(0));
    // Nothing more is parsed until the answers are written, not even by more input.
    let before = queued(&s, 0);
    s.resume(0);
    h.take(&mut s);
    s.receive(0, b"cmd=get_appnum\n");
    h.take(&mut s);
    assert_eq!(queued(&s, 0), before);
    // Written a little at a time, every answer comes, in order, the held requests' too.
    let want: String = (0..200).map(answer).collect::<String>() + "cmd=appnum rc=0 appnum=0\n";
    assert_eq!(serve(&mut s, &mut h, 0, 1000), want);
    assert!(!s.holds_input(0));
    assert!(h.errors.is_empty());
}

#[test]
fn input_held_back_keeps_its_partial_line_and_order() {
    let (mut s, mut h, values) = shell_with_big_values(100);
    let answer = |i: usize| format!("cmd=get_result rc=0 value={}\n", values[i]);
    let request = |i: usize| format!("cmd=get kvsname=kvs_42 key=k{i}\n");
    // Just enough whole requests to back the answers up, and half of the next one.
    let whole = HELD_ABOVE / answer(0).len() + 1;
    let half = request(whole).len() / 2;
    let first: String = (0..whole).map(request).collect::<String>() + &request(whole)[..half];
    s.receive(0, first.as_bytes());
    h.take(&mut s);
    assert!(queued(&s, 0) > HELD_ABOVE && !s.holds_input(0), "the half line waits as any partial line does");
    // Its end comes while the answers are backed up: it is held, with what follows.
    let second: String = request(whole)[half..].to_string() + &(whole + 1..100).map(request).collect::<String>();
    s.receive(0, second.as_bytes());
    h.take(&mut s);
    assert!(s.holds_input(0));
    assert_eq!(serve(&mut s, &mut h, 0, usize::MAX), (0..100).map(answer).collect::<String>());
    assert!(h.errors.is_empty());
}

#[test]
fn a_protocol_error_in_held_input_cuts_off_after_what_came_before() {
    let (mut s, mut h, _) = shell_with_big_values(100);
    let requests: String = (0..100).map(|i| format!("cmd=get kvsname=kvs_42 key=k{i}\n")).collect();
    s.receive(0, format!("{requests}hello\ncmd=get_appnum\n").as_bytes());
    h.take(&mut s);
    assert!(h.errors.is_empty(), "the bad line is held, not parsed");
    let answered = serve(&mut s, &mut h, 0, usize::MAX);
    assert_eq!(answered.lines().count(), 100);
    assert!(matches!(&h.errors[..], [JobError::Protocol { rank: 0, .. }]));
    assert!(s.is_cut_off(0) && !s.holds_input(0));
}

#[test]
fn held_input_is_dropped_when_the_task_disconnects() {
    let (mut s, mut h, _) = shell_with_big_values(100);
    let requests: String = (0..100).map(|i| format!("cmd=get kvsname=kvs_42 key=k{i}\n")).collect();
    s.receive(0, requests.as_bytes());
    h.take(&mut s);
    assert!(s.holds_input(0));
    s.disconnected(0);
    h.take(&mut s);
    assert!(!s.holds_input(0));
    s.resume(0);
    h.take(&mut s);
    assert!(h.errors.is_empty());
}

#[test]
fn ranks2hosts_is_built_once_and_shared() {
    let map = TaskMap::new(vec![1, 0, 1, 0, 1, 0, 1, 0]);
    let job = JobInfo::new("k", map, vec![1, 3, 5, 7], vec!["node001".into(), "node002".into()]);
    let mut s = Server::new(job, Limits::default()).unwrap();
    let mut h = Recorder::default();
    let answer = "put_ranks2hosts 40 2\n7 node001 1,3,5,7, 7 node002 0,2,4,6, \n";
    // Pipelined with another request: that one waits until the shared answer is written.
    s.receive(0, b"cmd=get_ranks2hosts\ncmd=get_appnum\n");
    h.take(&mut s);
    s.receive(1, b"cmd=get_ranks2hosts\n");
    h.take(&mut s);
    let shared = |s: &Server, t: TaskId| s.clients[t].shared.as_ref().map(|(a, _)| a.clone()).unwrap();
    assert!(Arc::ptr_eq(&shared(&s, 0), &shared(&s, 1)), "each task got its own copy");
    assert!(s.holds_input(0));
    assert_eq!(serve(&mut s, &mut h, 0, 7), format!("{answer}cmd=appnum rc=0 appnum=0\n"));
    assert_eq!(serve(&mut s, &mut h, 1, usize::MAX), answer);
    // A later request is answered from the same copy.
    s.receive(2, b"cmd=get_ranks2hosts\n");
    h.take(&mut s);
    assert!(Arc::ptr_eq(&shared(&s, 2), s.ranks2hosts.as_ref().unwrap()));
}

/// A group barrier does not hold the connection's turn: its end, queued behind a `get_ranks2hosts` answer
/// the task has not read, goes after the server's one copy of it, rather than copying that answer into
/// each task's own output (1.2 MB a task at 100,000 ranks).
#[test]
fn a_group_barrier_ending_behind_an_unread_ranks2hosts_answer_copies_nothing() {
    let (mut s, mut h) = shell_of_groups(&vec![16; 1000], Limits::default());
    for t in 0..s.task_count() {
        s.receive(t, b"cmd=barrier_in group=WORLD:1\ncmd=get_ranks2hosts\n");
    }
    h.take(&mut s);
    assert_eq!(h.groups.len(), 1);
    s.group_complete(b"WORLD:1", Ok(&[]));
    h.take(&mut s);
    let answer = String::from_utf8(s.ranks2hosts.as_deref().unwrap().to_vec()).unwrap();
    let held: usize = s.clients.iter().map(|c| c.out.capacity() + c.after.capacity()).sum();
    assert!(held < answer.len() / 4, "one answer of {} bytes is held as {held} bytes of task output", answer.len());
    for t in 0..s.task_count() {
        assert_eq!(serve(&mut s, &mut h, t, 4096), format!("{answer}cmd=barrier_out rc=0 tag=1\n"));
    }
}

/// A task that says `finalize` again changes nothing, and the barriers waiting are not gone over again for
/// it: 127 tasks in 64 group barriers each, and another task's 5000 finalize lines.
#[test]
fn a_finalize_again_does_not_go_over_every_barrier_again() {
    let (mut s, mut h) = shell_of_groups(&[128], Limits::default());
    for t in 1..128u32 {
        let partner = if t == 127 { 1 } else { t + 1 };
        for i in 0..64 {
            assert_eq!(
                send(&mut s, &mut h, t as usize, &format!("cmd=barrier_in group={t},{partner}:{}\n", t * 64 + i)),
                ""
            );
        }
    }
    let start = std::time::Instant::now();
    s.receive(0, "cmd=finalize\n".repeat(5000).as_bytes());
    h.take(&mut s);
    assert!(h.errors.is_empty(), "{:?}", h.errors);
    // About 2 ms a line when each went over the 8128 barriers and their 128 tasks: seconds, not this.
    assert!(start.elapsed() < std::time::Duration::from_secs(2), "took {:?}", start.elapsed());
}

#[test]
fn a_task_that_reads_its_answers_is_never_held() {
    let (mut s, mut h, values) = shell_with_big_values(100);
    for (i, v) in values.iter().enumerate() {
        s.receive(0, format!("cmd=get kvsname=kvs_42 key=k{i}\n").as_bytes());
        h.take(&mut s);
        assert!(!s.holds_input(0));
        assert_eq!(drain(&mut s, 0), format!("cmd=get_result rc=0 value={v}\n"));
    }
}

#[test]
fn the_host_hears_of_each_tasks_start_once_at_its_first_whole_line() {
    let mut server = shell_on(&[1, 3], 1);
    let mut host = Recorder::default();
    server.receive(1, b"cmd=in");
    host.take(&mut server);
    assert!(host.started.is_empty(), "a part of a line is no start");
    server.receive(1, b"it pmi_version=1 pmi_subversion=1\ncmd=get_maxes\n");
    host.take(&mut server);
    send(&mut server, &mut host, 0, "cmd=get_maxes\n");
    send(&mut server, &mut host, 1, "cmd=get_appnum\n");
    assert_eq!(host.started, [2, 1]);
    // A task whose first line is garbage has started all the same (its program runs).
    send(&mut server, &mut host, 2, "garbage\n");
    assert_eq!(host.started, [2, 1, 3]);
}

/// A server of a `ppn.len()`-node block-mapped job serving the ranks of node 0 under `limits`, its tasks
/// answered PMI 1.2 by a host that runs group exchanges.
fn shell_of_groups(ppn: &[u32], limits: Limits) -> (Server, Recorder) {
    let map = TaskMap::block(ppn);
    let local = map.clique(0);
    let hosts = (0..ppn.len()).map(|n| format!("node{n}")).collect();
    let mut s = Server::new(JobInfo::new("kvs_42", map, local, hosts), limits).unwrap();
    s.serve_groups(true);
    let mut h = Recorder::default();
    for task in 0..s.task_count() {
        let answer = send(&mut s, &mut h, task, "cmd=init pmi_version=1 pmi_subversion=2\n");
        assert_eq!(answer, "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=2\n");
    }
    (s, h)
}

/// A `WORLD` barrier keeps no list of the job's shells or of the local tasks of its own (every one shares the
/// server's one list): it is charged the same in a job of 8192 nodes as in one of 2, and little; a
/// generation more is charged more.
#[test]
fn a_world_group_barrier_is_charged_little_whatever_the_job() {
    let charge = |nodes: usize| {
        let (mut s, mut h) = shell_of_groups(&vec![4; nodes], Limits::default());
        let before = s.kvs_bytes();
        assert_eq!(send(&mut s, &mut h, 0, "cmd=barrier_in group=WORLD:1\n"), "");
        let one = s.kvs_bytes() - before;
        assert_eq!(send(&mut s, &mut h, 0, "cmd=barrier_in group=WORLD:1\n"), "");
        assert!(s.kvs_bytes() - before > one, "a second generation is charged nothing");
        one
    };
    let world = charge(2);
    assert!(world > 0 && world < 512, "a WORLD barrier is charged {world} bytes");
    assert_eq!(charge(8192), world);
}

/// What group barriers hold is charged to the store's bound: one that would go over fails with rc=2 for
/// the task that entered it (not a protocol error), a put is refused beside them, and the barriers give back
/// their charge when they end.
#[test]
fn a_group_barrier_over_the_store_bound_fails_and_ended_ones_give_back_their_charge() {
    let limits = Limits { kvs_bytes_max: 16 << 10, ..Limits::default() };
    let (mut s, mut h) = shell_of_groups(&[4, 4], limits);
    let base = s.kvs_bytes();
    // Task 0 enters barriers of tags of its own until one would go over.
    let mut held = 0;
    let refused = loop {
        let answer = send(&mut s, &mut h, 0, &format!("cmd=barrier_in group=WORLD:{held}\n"));
        if !answer.is_empty() {
            break answer;
        }
        held += 1;
        assert!(held < 64, "64 barriers held within 16 KiB");
    };
    assert!(held > 0, "{refused}");
    let start = format!("cmd=barrier_out rc=2 tag={held} msg=group_barrier_WORLD:{held}_would_hold_");
    assert!(refused.starts_with(&start), "{refused}");
    assert!(refused.contains("over_what_the_job's_key-value_store_bound_of_16384_bytes"), "{refused}");
    assert!(s.kvs_bytes() <= 16 << 10, "{} bytes held", s.kvs_bytes());
    assert!(h.errors.is_empty(), "{:?}", h.errors);
    assert!(h.logs.iter().any(|(l, m)| *l == log::Level::Error && m.contains("would hold")), "{:?}", h.logs);
    let put = format!("cmd=put kvsname=kvs_42 key=k value={}\n", "v".repeat(800));
    assert!(send(&mut s, &mut h, 1, &put).starts_with("cmd=put_result rc=2 "));
    // The other tasks come in: each barrier goes to the host, and ends.
    for task in 1..4 {
        for tag in 0..held {
            assert_eq!(send(&mut s, &mut h, task, &format!("cmd=barrier_in group=WORLD:{tag}\n")), "");
        }
    }
    assert_eq!(h.groups.len(), held);
    assert!(h.groups.iter().all(|(_, shells, _)| shells == &[0, 1]));
    for tag in 0..held {
        s.group_complete(format!("WORLD:{tag}").as_bytes(), Ok(&[]));
        h.take(&mut s);
        for task in 0..4 {
            assert_eq!(drain(&mut s, task), format!("cmd=barrier_out rc=0 tag={tag}\n"));
        }
    }
    assert_eq!(s.kvs_bytes(), base);
    assert_eq!(send(&mut s, &mut h, 0, &format!("cmd=barrier_in group=WORLD:{held}\n")), "");
    assert!(h.errors.is_empty(), "{:?}", h.errors);
}

/// A server of one node of `n` tasks, with the node barrier's page served, whose tasks said `init` with
/// revision `revision` of rpmi's additions each.
fn paged_shell(revisions: &[u32]) -> (Server, Recorder) {
    let mut s = shell_on(&[revisions.len() as u32], 0);
    s.serve_node_barrier(true);
    let mut h = Recorder::default();
    for (task, r) in revisions.iter().enumerate() {
        send(&mut s, &mut h, task, &format!("cmd=init pmi_version=1 pmi_subversion=1 rpmi={r}\n"));
    }
    (s, h)
}

/// Every task of `s` enters a barrier by a line; the collective completes; what each was answered.
fn barrier_by_lines(s: &mut Server, h: &mut Recorder) -> Vec<String> {
    let n = s.task_count();
    (0..n).for_each(|t| assert_eq!(send(s, h, t, "cmd=barrier_in\n"), ""));
    complete(s, h, &[]);
    (0..n).map(|t| drain(s, t)).collect()
}

#[test]
fn the_node_barrier_is_on_after_the_first_barrier_where_every_task_speaks_it() {
    let (mut s, mut h) = paged_shell(&[3, 3, 3]);
    // The first barrier goes by lines; its answers say the node barrier is on, each with the page.
    for t in 0..3 {
        send(&mut s, &mut h, t, "cmd=barrier_in\n");
    }
    complete(&mut s, &mut h, &[]);
    for t in 0..3 {
        assert_eq!(s.attached(t), Some(Attached::NodeBarrier));
        assert_eq!(drain(&mut s, t), "cmd=barrier_out rc=0 node_barrier=3\n");
        assert_eq!(s.attached(t), None, "the page goes with the answer's first byte only");
    }
    assert_eq!(s.node_release(), None, "nobody came in on the page");
    // Then one line for the node: every task is in, and the release is the page's, no line.
    assert_eq!(send(&mut s, &mut h, 1, "cmd=node_barrier_in\n"), "");
    assert_eq!(h.collectives.len(), 2, "the node's part goes to the collective at once");
    complete(&mut s, &mut h, &[]);
    assert_eq!(s.node_release(), Some(NodeRelease { code: Some(0), broken: false }));
    assert_eq!(s.node_release(), None, "taken");
    assert!((0..3).all(|t| drain(&mut s, t).is_empty()));
    // A failed collective is released there too, with its code.
    send(&mut s, &mut h, 2, "cmd=node_barrier_in\n");
    s.collective_complete(Err("a node went"));
    h.take(&mut s);
    assert_eq!(s.node_release(), Some(NodeRelease { code: Some(rc::FAIL), broken: false }));
    assert!(h.errors.is_empty());
}

#[test]
fn the_node_barrier_stays_off_where_a_task_does_not_speak_it_or_the_host_serves_no_page() {
    let (mut s, mut h) = paged_shell(&[3, 2]);
    assert_eq!(barrier_by_lines(&mut s, &mut h), ["cmd=barrier_out rc=0\n"; 2]);
    assert_eq!(s.attached(0), None);
    // Decided for good: the next barriers go by lines too, and the line for the page is refused.
    assert_eq!(barrier_by_lines(&mut s, &mut h), ["cmd=barrier_out rc=0\n"; 2]);
    send(&mut s, &mut h, 0, "cmd=node_barrier_in\n");
    assert!(matches!(&h.errors[..], [JobError::Protocol { rank: 0, reason, .. }] if reason.contains("not on")));

    let mut s = shell_on(&[2], 0);
    let mut h = Recorder::default();
    (0..2).for_each(|t| drop(send(&mut s, &mut h, t, "cmd=init pmi_version=1 pmi_subversion=1 rpmi=3\n")));
    assert_eq!(barrier_by_lines(&mut s, &mut h), ["cmd=barrier_out rc=0\n"; 2], "no page served");
}

#[test]
fn a_task_gone_breaks_the_node_barrier_and_its_peers_hear_why_by_lines() {
    let (mut s, mut h) = paged_shell(&[3, 3, 3]);
    barrier_by_lines(&mut s, &mut h);
    // Tasks 0 and 1 wait on the page for task 2, which goes: they are woken, the page broken.
    s.disconnected(2);
    h.take(&mut s);
    assert_eq!(s.node_release(), Some(NodeRelease { code: None, broken: true }));
    assert!(h.errors.is_empty(), "nobody is in a barrier the server knows of");
    // They ask by lines, and hear the task named; a line for the page is passed over now.
    assert_eq!(send(&mut s, &mut h, 1, "cmd=node_barrier_in\n"), "");
    let out = send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    assert_eq!(h.errors, vec![JobError::TaskLost { rank: 2, finalized: false }]);
    assert!(out.starts_with("cmd=barrier_out rc=-1 msg=rank_2_closed"), "{out}");
    assert_eq!(s.node_release(), None, "broken once");
}

#[test]
fn a_task_gone_while_a_barrier_on_the_page_runs_is_told_with_its_release() {
    let (mut s, mut h) = paged_shell(&[3, 3]);
    barrier_by_lines(&mut s, &mut h);
    send(&mut s, &mut h, 0, "cmd=node_barrier_in\n");
    s.disconnected(1);
    h.take(&mut s);
    assert_eq!(h.errors, vec![JobError::TaskLost { rank: 1, finalized: false }]);
    assert_eq!(s.node_release(), None, "the break waits for the release of the barrier under way");
    // Released once, with the break: a task woken late reads its barrier's code, not a break's.
    complete(&mut s, &mut h, &[]);
    assert_eq!(s.node_release(), Some(NodeRelease { code: Some(0), broken: true }));
}

#[test]
fn a_barrier_by_a_line_while_the_node_barrier_is_on_breaks_it_and_completes() {
    let (mut s, mut h) = paged_shell(&[3, 3]);
    barrier_by_lines(&mut s, &mut h);
    // Task 1 (whose page could not be mapped, say) comes by a line; task 0, woken by the break, too.
    send(&mut s, &mut h, 1, "cmd=barrier_in\n");
    assert_eq!(s.node_release(), Some(NodeRelease { code: None, broken: true }));
    send(&mut s, &mut h, 0, "cmd=barrier_in\n");
    complete(&mut s, &mut h, &[]);
    assert_eq!(
        (drain(&mut s, 0), drain(&mut s, 1)),
        ("cmd=barrier_out rc=0\n".into(), "cmd=barrier_out rc=0\n".into())
    );
    assert!(h.errors.is_empty());
}

#[test]
fn a_finalize_after_the_last_barrier_breaks_the_page_quietly() {
    let (mut s, mut h) = paged_shell(&[3, 3]);
    barrier_by_lines(&mut s, &mut h);
    send(&mut s, &mut h, 1, "cmd=node_barrier_in\n");
    complete(&mut s, &mut h, &[]);
    assert_eq!(s.node_release(), Some(NodeRelease { code: Some(0), broken: false }));
    for t in 0..2 {
        assert_eq!(send(&mut s, &mut h, t, "cmd=finalize\n"), "cmd=finalize_ack rc=0\n");
        s.disconnected(t);
        h.take(&mut s);
    }
    // A task still asleep after the release reads that release (the generation moved by 2), not the break.
    assert_eq!(s.node_release(), Some(NodeRelease { code: None, broken: true }));
    assert!(h.errors.is_empty());
}

#[test]
fn a_node_barrier_line_that_finds_a_task_busy_breaks_the_page() {
    let (mut s, mut h) = paged_shell(&[3, 3]);
    barrier_by_lines(&mut s, &mut h);
    // Task 1 is half-way through a spawn block: it cannot be counted in, and all go by lines.
    send(&mut s, &mut h, 1, "mcmd=spawn\nnprocs=1\n");
    assert_eq!(send(&mut s, &mut h, 0, "cmd=node_barrier_in\n"), "");
    assert_eq!(s.node_release(), Some(NodeRelease { code: None, broken: true }));
    assert!(h.collectives.len() == 1 && h.errors.is_empty(), "nobody entered");
}

#[test]
fn pmi2_fences_take_the_node_barrier_too() {
    let mut s = shell_on(&[2], 0);
    s.serve_node_barrier(true);
    let mut h = Recorder::default();
    for t in 0..2 {
        let init = send(&mut s, &mut h, t, "cmd=init pmi_version=2 pmi_subversion=0 rpmi=3\n");
        assert_eq!(init, "cmd=response_to_init rc=0 pmi_version=2 pmi_subversion=0 rpmi=3\n");
        assert_eq!(send(&mut s, &mut h, t, "    14cmd=kvs-fence;"), "");
    }
    complete(&mut s, &mut h, &[]);
    for t in 0..2 {
        assert_eq!(s.attached(t), Some(Attached::NodeBarrier));
        assert_eq!(drain(&mut s, t), "    43cmd=kvs-fence-response;rc=0;node_barrier=2;");
    }
    assert_eq!(send(&mut s, &mut h, 1, "    20cmd=node-barrier-in;"), "");
    complete(&mut s, &mut h, &[]);
    assert_eq!(s.node_release(), Some(NodeRelease { code: Some(0), broken: false }));
    assert!((0..2).all(|t| drain(&mut s, t).is_empty()) && h.errors.is_empty());
}
