//! `libpmi.so.0` and `libpmi2.so.0` (crates/libpmi, crates/libpmi2): C programs that call every function of
//! the PMI-1 and the PMI-2 API, linked against the libraries, under rpmi-run (one node and several), under
//! MPICH's Hydra (a foreign PMI-1 and PMI-2 server), and with no launcher at all (a job of one); a spawn
//! through each, and Intel MPI through each; and Slurm's own `libpmi2.so.0` under rpmi-run.
//! The Slurm cases are in tests/slurm.rs. How the programs find the libraries is in `support::libpmi`.

mod support;

use rpmi::wire::pmi2::{body_len, Message, Writer, HEADER_LEN};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use support::libpmi::{library_dir, program, spawned_and_read, Api};
use support::{impi, rpmi_run, run, start, start_in, start_with_env, Done, GUARD, RUN};

/// Every rank printed its line and the job succeeded; what each line says after `ok`.
fn ranks_ok(done: &Done, size: usize) -> Vec<String> {
    done.assert_success("the API program");
    let mut lines: Vec<&str> = done.stdout.lines().filter(|l| l.contains(": ok")).collect();
    lines.sort();
    assert_eq!(lines.len(), size, "{}", done.dump());
    for r in 0..size {
        assert!(lines.iter().any(|l| l.starts_with(&format!("rank {r} of {size}: ok"))), "{}", done.dump());
    }
    lines.iter().map(|l| l.split_once(": ok").map_or("", |(_, rest)| rest.trim()).to_string()).collect()
}

/// Each library loads nothing but the C library (its unwinder is linked in from `libgcc_eh.a`:
/// crates/client/build/link.rs) and exports nothing but its API, so the unwinder it carries never stands in
/// for the program's own.
#[test]
fn each_library_needs_only_the_c_library_and_exports_only_its_api() {
    for (api, prefix) in [(Api::Pmi1, "PMI_"), (Api::Pmi2, "PMI2_")] {
        let lib = api.built();
        let tool = |args: &[&str]| {
            let out = Command::new(args[0]).args(&args[1..]).arg(&lib).output().expect("binutils");
            assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        let dynamic = tool(&["readelf", "-d", "-W"]);
        let needed: Vec<&str> = dynamic
            .lines()
            .filter(|l| l.contains("(NEEDED)"))
            .filter_map(|l| l.split('[').nth(1)?.strip_suffix(']'))
            .collect();
        assert!(!needed.is_empty(), "{dynamic}");
        for n in &needed {
            assert!(*n == "libc.so.6" || n.starts_with("ld-linux"), "{} needs {n}", lib.display());
        }
        let exported = tool(&["nm", "-D", "--defined-only"]);
        let names: Vec<&str> = exported.lines().filter_map(|l| l.split_whitespace().nth(2)).collect();
        assert!(names.len() > 20, "{exported}");
        for name in names {
            assert!(name.starts_with(prefix), "{} exports {name}", lib.display());
        }
    }
}

/// Every call; and, through the wire's trace, that each rank's gets after each of the program's two barriers
/// were answered from the image of its node's key-value space (each rank asked for it once per barrier), but
/// the first few after each barrier (`WIRE_GETS_FIRST`) and the one of a key nobody put, which only the server
/// can answer; and that full barriers after the first went by the node barrier, but where the job says not to.
#[test]
fn every_call_under_rpmi_run_on_one_node_and_on_three() {
    let p = program(Api::Pmi1);
    let path = p.path.to_str().unwrap();
    let one = rpmi_run(&["--trace", "-n", "4", path]);
    // rpmi's server answers PMI 1.2: the group barrier is served.
    assert!(ranks_ok(&one, 4).iter().all(|l| l == "clique=4 groups=1"), "{}", one.dump());
    let three = rpmi_run(&["--trace", "-n", "6", "--nodes", "3", path]);
    assert!(ranks_ok(&three, 6).iter().all(|l| l == "clique=2 groups=1"), "{}", three.dump());
    for (done, size) in [(&one, 4), (&three, 6)] {
        let asked = done.stderr.matches(" C: cmd=get_kvs_image").count();
        let got = done.stderr.matches(" S: cmd=kvs_image rc=0 ").count();
        assert_eq!((asked, got), (2 * size, 2 * size), "{}", done.dump());
        let wire = |l: &&str| l.contains(" C: cmd=get kvsname=") && !l.ends_with(" key=no_such_key");
        // `WIRE_GETS_FIRST` of crates/client/src/image.rs.
        let first = 8;
        let wired = done.stderr.lines().filter(wire).count();
        assert!(wired <= 2 * first * size, "{wired} gets went to the server: {}", done.dump());
        // Only the first full barrier goes by lines; each later one, by the node barrier: a line a node.
        let by_lines = done.stderr.matches(" C: cmd=barrier_in\n").count();
        let paged = done.stderr.matches(" C: cmd=node_barrier_in\n").count();
        let nodes = if size == 4 { 1 } else { 3 };
        assert!(by_lines == size && paged > 0 && paged % nodes == 0, "{by_lines} {paged}: {}", done.dump());
    }
    // Not where the job says not to (`RPMI_NODE_BARRIER=0`): every barrier by lines.
    let env = [("RPMI_NODE_BARRIER", OsStr::new("0"))];
    let lines = start_with_env(RUN, &["--trace", "-n", "4", path], &env).wait(GUARD);
    assert!(ranks_ok(&lines, 4).iter().all(|l| l == "clique=4 groups=1"), "{}", lines.dump());
    assert!(!lines.stderr.contains("node_barrier"), "{}", lines.dump());
}

/// The image of the key-value space as a task receives it (tests/programs/kvs_image.c, a client written on the
/// wire that keeps the memory file): sealed, and read-only whichever way the task tries, as long as
/// announced, holding the task's key; out of reach of another user's process, through the task's /proc or its
/// server's; one file per node and fence (the node's tasks are sent the same two files), and an older one
/// unchanged once the next is made. On one node and on three.
#[test]
fn a_task_cannot_write_the_image_and_another_user_cannot_reach_it() {
    let dir = library_dir();
    let program = support::compile("cc", "kvs_image", dir.path());
    for nodes in [1, 3] {
        let done = rpmi_run(&["-n", "3", "--nodes", &nodes.to_string(), program.to_str().unwrap()]);
        let files: std::collections::BTreeSet<String> = ranks_ok(&done, 3).into_iter().collect();
        assert!(files.iter().all(|f| f.starts_with("image files=")), "{}", done.dump());
        assert_eq!(files.len(), nodes, "not one pair of files a node: {files:?}");
    }
}

/// The node barrier's page as a task receives it and uses it (tests/programs/node_barrier.c, a client written
/// on the wire that counts itself in as the libraries do): sealed in length but writable, out of another
/// user's reach, and 20 barriers on it with puts and gets between them, each got value as put; on one node,
/// from rpmi-run's own loop, and across 2 and 4 nodes (the node's ranks: 4, 2, 1).
#[test]
fn the_node_barriers_page_cannot_be_resized_and_carries_barriers_on_every_host() {
    let dir = library_dir();
    let program = support::compile("cc", "node_barrier", dir.path());
    for (mode, members) in
        [(&[][..], 4), (&["--event-loop"][..], 4), (&["--nodes", "2"][..], 2), (&["--nodes", "4"][..], 1)]
    {
        let mut args = vec!["-n", "4"];
        args.extend(mode);
        args.extend([program.to_str().unwrap(), "20"]);
        let done = rpmi_run(&args);
        let want = format!("members={members}");
        assert!(ranks_ok(&done, 4).iter().all(|l| *l == want), "{mode:?}: {}", done.dump());
    }
}

/// A rank that exits, without PMI_Finalize, past a barrier on the node barrier's page: its node's other ranks,
/// waiting on the page for it or coming to it, are woken by the break, ask by a line, and hear it named; the
/// job ends with the job error's status (125) and one line naming rank 1, at once (a hang is told from that at
/// 10 s, the page's waits looking at their connection every 0.1 s).
#[test]
fn a_rank_gone_while_its_node_waits_on_the_page_ends_the_job_naming_it() {
    let dir = library_dir();
    let program = support::compile("cc", "node_barrier", dir.path());
    for mode in [&[][..], &["--event-loop"][..], &["--nodes", "2"][..]] {
        let mut args = vec!["-n", "4"];
        args.extend(mode);
        args.extend([program.to_str().unwrap(), "20", "1"]);
        let done = start(RUN, &args).wait(support::END_GUARD);
        assert_eq!(done.code(), Some(125), "{mode:?}: {}", done.dump());
        assert!(done.elapsed < Duration::from_secs(10), "{mode:?}: {:.1?}: {}", done.elapsed, done.dump());
        let said: Vec<&str> = done.stderr.lines().filter(|l| l.starts_with("rpmi-run: ")).collect();
        assert!(said.len() == 1 && said[0].contains("rank 1 "), "{mode:?}: {}", done.dump());
    }
}

/// Gets from several threads while their rank enters the next barrier, whose image of the store replaces the
/// one they read (`pmi_api overlap`): every value as put, round after round, on one node and on three.
#[test]
fn gets_read_right_while_the_next_barriers_image_comes() {
    let p = program(Api::Pmi1);
    for nodes in ["1", "3"] {
        let done = rpmi_run(&["-n", "6", "--nodes", nodes, p.path.to_str().unwrap(), "overlap"]);
        assert!(ranks_ok(&done, 6).iter().all(|l| l == "overlap"), "{}", done.dump());
    }
}

/// A program the task execs after its gets holds no fd of the image: the library closed the memory file once
/// it mapped it (and a mapping does not outlive an exec).
#[test]
fn no_fd_of_the_image_is_left_open_for_a_program_the_task_execs() {
    let p = program(Api::Pmi1);
    let done = rpmi_run(&["-n", "2", p.path.to_str().unwrap(), "exec"]);
    assert!(ranks_ok(&done, 2).iter().all(|l| l == "exec"), "{}", done.dump());
}

/// Threaded MPICH waits in several PMI 1.2 group barriers at once, one per thread, entered in any order on
/// each rank: each rank's two threads enter theirs in opposite orders on even and odd ranks, 20 times, while
/// a third reads the exchange. Served one at a time, each rank would wait for ever in the barrier the others
/// enter last.
#[test]
fn group_barriers_from_several_threads_at_once() {
    let p = program(Api::Pmi1);
    let path = p.path.to_str().unwrap();
    for args in [&["-n", "4", path, "groups"][..], &["-n", "6", "--nodes", "3", path, "groups"]] {
        let done = rpmi_run(args);
        let size = if args[1] == "4" { 4 } else { 6 };
        assert!(ranks_ok(&done, size).iter().all(|l| l == "groups"), "{}", done.dump());
    }
}

/// A PMI-2 node attribute waited for by one thread and put by another of the same process, after other
/// calls, 20 times on each rank: under rpmi-run (one node and three) and Hydra, both of which answer a thread
/// by its `thrid`. Served one at a time, the put would wait behind the wait for ever.
#[test]
fn a_node_attribute_waited_for_by_one_thread_and_put_by_another() {
    // Each run takes well under a second; a hang is told from it at 20 s.
    const HANG: Duration = Duration::from_secs(20);
    let p = program(Api::Pmi2);
    let path = p.path.to_str().unwrap();
    for (launcher, args, size) in [
        (RUN, &["-n", "4", path, "nodewait"][..], 4),
        (RUN, &["-n", "6", "--nodes", "3", path, "nodewait"], 6),
        ("mpiexec.hydra", &["-n", "3", path, "nodewait"], 3),
    ] {
        let done = start(launcher, args).wait(HANG);
        assert!(ranks_ok(&done, size).iter().all(|l| l == "nodewait"), "{}", done.dump());
    }
}

/// A node attribute got as it is now by one thread while another waits for one: under rpmi-run and Hydra,
/// which echo `thrid` (the get goes at once: the main thread puts the attribute waited for only after it),
/// and under a server that echoes none, as Slurm's `--mpi=pmi2` ([`serve_without_thrid`]): there the two
/// answers look alike, and the get is sent only once the wait is answered.
#[test]
fn a_node_attribute_got_as_it_is_now_while_another_thread_waits_for_one() {
    // Each run takes well under a second; a hang is told from it at 20 s.
    const HANG: Duration = Duration::from_secs(20);
    let p = program(Api::Pmi2);
    let path = p.path.to_str().unwrap();
    for launcher in [RUN, "mpiexec.hydra"] {
        let done = start(launcher, &["-n", "2", path, "nodenow"]).wait(HANG);
        assert!(ranks_ok(&done, 2).iter().all(|l| l == "nodenow"), "{}", done.dump());
    }
    let (done, read) = served_by(&p.path, "nodenow", HANG, serve_without_thrid);
    assert_eq!(done.code(), Some(0), "the server read {read:?}\n{}", done.dump());
    assert_eq!(ranks_ok(&done, 1), ["nodenow"], "{}", done.dump());
}

/// `program MODE` as rank 0 of a job of one, whose PMI server is `serve` on the other end of its `PMI_FD`
/// (within `limit`); what `serve` returns (what it read).
fn served_by(
    program: &Path,
    mode: &str,
    limit: Duration,
    serve: impl FnOnce(UnixStream) -> Vec<String> + Send + 'static,
) -> (Done, Vec<String>) {
    let (server, task) = UnixStream::pair().unwrap();
    let serving = std::thread::spawn(move || serve(server));
    let fd = task.as_raw_fd();
    let mut cmd = Command::new(program);
    for var in ["PMI_PORT", "PMI_ID", "RPMI_PMI_SUBVERSION"] {
        cmd.env_remove(var);
    }
    // SAFETY: fcntl is async-signal-safe. The task's end, opened close-on-exec here, stays open in the task.
    unsafe {
        cmd.pre_exec(move || match libc::fcntl(fd, libc::F_SETFD, 0) {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        })
    };
    let fd = fd.to_string();
    let env = [
        ("PMI_FD", OsStr::new(&fd)),
        ("PMI_RANK", OsStr::new("0")),
        ("PMI_SIZE", OsStr::new("1")),
        ("PMI_JOBID", OsStr::new("1")),
    ];
    let done = start_in(cmd, &[mode], &env).wait(limit);
    drop(task);
    (done, serving.join().unwrap())
}

/// How a test server answers a task's puts: as rpmi's server (it answers `rpmi=1` at `init` to a client that
/// asks, and holds each put's answer until the barrier or fence comes, so that a library that waited for it
/// would hang), refusing the put of `refuse`; or as any other server, each request answered as it comes.
/// With `image`, it answers `rpmi=2` and sends that broken image of the key-value space when asked.
#[derive(Clone, Copy)]
struct Puts {
    rpmi: bool,
    refuse: Option<&'static str>,
    image: Option<Broken>,
}

/// A broken image of the key-value space, as a broken or hostile server could send it.
#[derive(Clone, Copy, Debug)]
enum Broken {
    /// A memory file without seals: its bytes could change after the library checked them.
    Unsealed,
    /// Sealed, but not an image.
    Garbage,
    /// Announced longer than its file.
    Longer,
    /// No memory file with the answer.
    NoFile,
}

/// A sealed memory file holding `bytes`.
fn sealed(bytes: &[u8]) -> OwnedFd {
    let mut file = std::fs::File::from(rpmi::os::memfd(c"test-image").unwrap());
    file.write_all(bytes).unwrap();
    let file = OwnedFd::from(file);
    rpmi::os::seal(&file).unwrap();
    file
}

/// Sends the answer to `get_kvs_image` with the memory file of `broken`.
fn send_broken_image(conn: &UnixStream, broken: Broken) {
    let image = rpmi::wire::image::encode(1, [(&b"a"[..], &b"1"[..])]).unwrap();
    let file = match broken {
        Broken::Unsealed => {
            // SAFETY: a new memory file, owned at once.
            let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0);
            // SAFETY: as above.
            let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            file.write_all(&image).unwrap();
            Some(OwnedFd::from(file))
        }
        Broken::Garbage => Some(sealed(&vec![0x5a; image.len()])),
        Broken::Longer => Some(sealed(&image)),
        Broken::NoFile => None,
    };
    let bytes = if matches!(broken, Broken::Longer) { image.len() + 4096 } else { image.len() };
    let line = format!("cmd=kvs_image rc=0 bytes={bytes} fence=1\n");
    match file {
        None => (&*conn).write_all(line.as_bytes()).unwrap(),
        Some(file) => {
            let sent = rpmi::os::send_with_fd(conn.as_raw_fd(), line.as_bytes(), file.as_raw_fd());
            assert_eq!(sent, line.len() as isize);
        }
    }
}

/// A PMI-1 server for a job of one, answering puts as `puts` says; what it read, a line each.
fn serve_puts_pmi1(conn: UnixStream, puts: Puts) -> Vec<String> {
    let mut lines = io::BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    let (mut read, mut held, mut kvs) = (Vec::new(), Vec::<String>::new(), BTreeMap::<String, String>::new());
    loop {
        let mut line = String::new();
        if io::BufRead::read_line(&mut lines, &mut line).unwrap() == 0 {
            return read;
        }
        let line = line.trim_end().to_string();
        read.push(line.clone());
        let field = |k: &str| line.split(' ').find_map(|w| w.strip_prefix(k)?.strip_prefix('=')).unwrap_or_default();
        let cmd = field("cmd");
        let answer = match cmd {
            "init" if puts.rpmi && puts.image.is_some() && field("rpmi") >= "2" => {
                "response_to_init rc=0 pmi_version=1 pmi_subversion=1 rpmi=2"
            }
            "init" if puts.rpmi && !field("rpmi").is_empty() => {
                "response_to_init rc=0 pmi_version=1 pmi_subversion=1 rpmi=1"
            }
            "get_kvs_image" => {
                send_broken_image(&conn, puts.image.expect("an image asked of a server that serves none"));
                continue;
            }
            "init" => "response_to_init rc=0 pmi_version=1 pmi_subversion=1",
            "get_maxes" => "maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024",
            "get_my_kvsname" => "my_kvsname rc=0 kvsname=kvs_1",
            "put" if Some(field("key")) == puts.refuse => "put_result rc=-1 msg=refused_here",
            "put" => {
                kvs.insert(field("key").into(), field("value").into());
                "put_result rc=0"
            }
            "get" => &format!("get_result rc=0 value={}", kvs[field("key")]),
            "barrier_in" => "barrier_out rc=0",
            "finalize" => "finalize_ack rc=0",
            _ => panic!("the task asked {line:?}"),
        };
        let answer = format!("cmd={answer}\n");
        if puts.rpmi && cmd == "put" {
            held.push(answer);
            continue;
        }
        for a in held.drain(..).chain([answer]) {
            conn.write_all(a.as_bytes()).unwrap();
        }
        if cmd == "finalize" {
            return read;
        }
    }
}

/// A PMI-2 server for a job of one, answering puts as `puts` says; what it read, a line (the start-up's) or a
/// frame's body each.
fn serve_puts_pmi2(mut conn: UnixStream, puts: Puts) -> Vec<String> {
    let (mut read, mut held, mut kvs) = (Vec::<String>::new(), Vec::<Vec<u8>>::new(), BTreeMap::new());
    let (mut buf, mut chunk) = (Vec::new(), [0; 4096]);
    loop {
        let request = next_request(&mut buf, read.is_empty());
        let Some(request) = request else {
            match conn.read(&mut chunk).unwrap() {
                0 => return read,
                n => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let text = String::from_utf8_lossy(&request).into_owned();
        read.push(text.clone());
        if read.len() == 1 {
            let extra = if puts.rpmi && text.contains(" rpmi=") { " rpmi=1" } else { "" };
            let init = format!("cmd=response_to_init pmi_version=2 pmi_subversion=0 rc=0{extra}\n");
            conn.write_all(init.as_bytes()).unwrap();
            continue;
        }
        let message = Message::parse(&request).unwrap();
        let field = |key| message.get(key).unwrap_or_default().to_vec();
        let answer = match message.cmd {
            b"fullinit" => framed("fullinit-response", 0, &[("rank", b"0"), ("size", b"1"), ("appnum", b"0")]),
            b"job-getid" => framed("job-getid-response", 0, &[("jobid", b"job-1")]),
            b"kvs-put" if puts.refuse.is_some_and(|k| field("key") == k.as_bytes()) => {
                framed("kvs-put-response", -1, &[("errmsg", b"refused here")])
            }
            b"kvs-put" => {
                kvs.insert(field("key"), field("value"));
                framed("kvs-put-response", 0, &[])
            }
            b"kvs-get" => framed("kvs-get-response", 0, &[("found", b"TRUE"), ("value", &kvs[&field("key")])]),
            b"kvs-fence" => framed("kvs-fence-response", 0, &[]),
            b"finalize" => framed("finalize-response", 0, &[]),
            _ => panic!("the task asked {text:?}"),
        };
        if puts.rpmi && message.cmd == b"kvs-put" {
            held.push(answer);
            continue;
        }
        for a in held.drain(..).chain([answer]) {
            conn.write_all(&a).unwrap();
        }
        if message.cmd == b"finalize" {
            return read;
        }
    }
}

/// Under rpmi's server the libraries keep a task's puts and write them ahead of its barrier or fence (the
/// server here answers no put before that comes: a library that waited would hang), answer a get of a key
/// they keep themselves, and fail the barrier, naming the key, where the server refused a put; under any other
/// server each put goes on its own, and the get to the server.
#[test]
fn puts_go_with_the_fence_under_rpmis_server_and_one_by_one_under_others() {
    // Each run takes well under a second; a hang is told from it at 20 s.
    const HANG: Duration = Duration::from_secs(20);
    for api in [Api::Pmi1, Api::Pmi2] {
        let p = program(api);
        let mut cases = vec![
            Puts { rpmi: true, refuse: None, image: None },
            Puts { rpmi: true, refuse: Some("b"), image: None },
            Puts { rpmi: false, refuse: None, image: None },
        ];
        // PMI-1 also under a server whose image is broken: the library says so and reads the wire.
        if matches!(api, Api::Pmi1) {
            let broken = [Broken::Unsealed, Broken::Garbage, Broken::Longer, Broken::NoFile];
            cases.extend(broken.map(|b| Puts { rpmi: true, refuse: None, image: Some(b) }));
        }
        for puts in cases {
            let serve = move |conn| match api {
                Api::Pmi1 => serve_puts_pmi1(conn, puts),
                Api::Pmi2 => serve_puts_pmi2(conn, puts),
            };
            let (done, read) = served_by(&p.path, "puts", HANG, serve);
            let context = format!("{api:?}, the server read {read:?}\n{}", done.dump());
            // Both speak revision 3 (the node barrier).
            assert!(read[0].contains(" rpmi=3"), "{context}");
            // The get before the barrier goes to the server only where puts are not kept; the one after it
            // (PMI-1's program), to the server with no usable image.
            let gets = read.iter().filter(|r| r.contains("cmd=get ") || r.contains("cmd=kvs-get;")).count();
            let after = if matches!(api, Api::Pmi1) { 10 } else { 0 };
            assert_eq!(gets, usize::from(!puts.rpmi) + after, "{context}");
            if let Some(broken) = puts.image {
                let said = "the PMI server's image of the key-value space cannot be used";
                assert!(done.stderr.contains(said), "{broken:?}: no `{said}`: {context}");
            }
            let put_lines = read.iter().filter(|r| r.contains("cmd=put ") || r.contains("cmd=kvs-put;")).count();
            // Under rpmi the key put twice goes once, with its last value.
            assert_eq!(put_lines, if puts.rpmi { 2 } else { 3 }, "{context}");
            let code = if puts.refuse.is_some() { "-1" } else { "0" };
            let fence = if matches!(api, Api::Pmi1) { "barrier" } else { "fence" };
            assert_eq!(ranks_ok(&done, 1), [format!("puts {fence}={code}")], "{context}");
            if puts.refuse.is_some() {
                assert!(done.stderr.contains("'b'"), "the failure does not name the key refused: {context}");
            }
        }
    }
}

/// The next whole request a PMI-2 task sent, taken from `buf`: the start-up's PMI-1 line where it is `first`,
/// else a frame's body; `None` until one is whole.
fn next_request(buf: &mut Vec<u8>, first: bool) -> Option<Vec<u8>> {
    match first {
        true => buf.iter().position(|&b| b == b'\n').map(|end| buf.drain(..=end).collect()),
        false => match buf.get(..HEADER_LEN).and_then(body_len) {
            Some(len) if buf.len() >= HEADER_LEN + len => {
                Some(buf.drain(..HEADER_LEN + len).skip(HEADER_LEN).collect())
            }
            _ => None,
        },
    }
}

/// A PMI-2 server for one task that answers as Slurm's `--mpi=pmi2` does, echoing no request's `thrid`, and
/// stands in for another task of the node: it puts the attribute the task waits for (`wait-R-N`, as
/// `put-R-N`) 100 ms after the wait, or at once when a get as it is now comes meanwhile, whose answer then
/// follows the wait's. What it read, for messages.
fn serve_without_thrid(mut conn: UnixStream) -> Vec<String> {
    let mut node = BTreeMap::new();
    let mut waiting: Option<(Vec<u8>, Instant)> = None;
    let (mut read, mut buf, mut chunk) = (Vec::<String>::new(), Vec::new(), [0; 4096]);
    conn.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    loop {
        // The start-up's PMI-1 line, then frames.
        let request = next_request(&mut buf, read.is_empty());
        let Some(request) = request else {
            match conn.read(&mut chunk) {
                Ok(0) => return read,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    if waiting.as_ref().is_some_and(|(_, since)| since.elapsed() > Duration::from_millis(100)) {
                        another_task_puts(&mut conn, &mut node, &mut waiting);
                    }
                }
                Err(e) => panic!("reading the task: {e}"),
            }
            continue;
        };
        read.push(String::from_utf8_lossy(&request).into_owned());
        if read.len() == 1 {
            conn.write_all(b"cmd=response_to_init pmi_version=2 pmi_subversion=0 rc=0\n").unwrap();
            continue;
        }
        let message = Message::parse(&request).unwrap();
        let field = |key| message.get(key).unwrap_or_default().to_vec();
        match message.cmd {
            b"fullinit" => answer(&mut conn, "fullinit-response", &[("rank", b"0"), ("size", b"1"), ("appnum", b"0")]),
            b"job-getid" => answer(&mut conn, "job-getid-response", &[("jobid", b"thridless")]),
            b"info-putnodeattr" => {
                node.insert(field("key"), field("value"));
                answer(&mut conn, "info-putnodeattr-response", &[]);
            }
            b"info-getnodeattr" if message.get("wait") == Some(b"TRUE") && !node.contains_key(&field("key")) => {
                waiting = Some((field("key"), Instant::now()));
            }
            b"info-getnodeattr" => {
                another_task_puts(&mut conn, &mut node, &mut waiting);
                match node.get(&field("key")) {
                    Some(value) => {
                        answer(&mut conn, "info-getnodeattr-response", &[("found", b"TRUE"), ("value", value)])
                    }
                    None => answer(&mut conn, "info-getnodeattr-response", &[("found", b"FALSE")]),
                }
            }
            b"finalize" => {
                answer(&mut conn, "finalize-response", &[]);
                return read;
            }
            _ => panic!("the task asked {:?}", read.last()),
        }
    }
}

/// The other task of [`serve_without_thrid`] puts the attribute waited for, if any: the wait is answered.
fn another_task_puts(
    conn: &mut UnixStream,
    node: &mut BTreeMap<Vec<u8>, Vec<u8>>,
    waiting: &mut Option<(Vec<u8>, Instant)>,
) {
    if let Some((key, _)) = waiting.take() {
        let value = [&b"put"[..], key.strip_prefix(b"wait").unwrap_or_default()].concat();
        answer(conn, "info-getnodeattr-response", &[("found", b"TRUE"), ("value", &value)]);
        node.insert(key, value);
    }
}

/// Writes an answer of `cmd` with `rc=0` and `fields`, and no `thrid`.
fn answer(conn: &mut UnixStream, cmd: &str, fields: &[(&str, &[u8])]) {
    conn.write_all(&framed(cmd, 0, fields)).unwrap();
}

/// An answer of `cmd` with `rc` and `fields`, and no `thrid`, as a frame.
fn framed(cmd: &str, rc: i32, fields: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer::answer(&mut out, cmd, None, rc);
    for (key, value) in fields {
        w = w.str(key, value);
    }
    w.finish();
    out
}

#[test]
fn every_pmi2_call_under_rpmi_run_on_one_node_and_on_three() {
    let p = program(Api::Pmi2);
    let path = p.path.to_str().unwrap();
    for (size, nodes) in [(4, "1"), (6, "3")] {
        let done = rpmi_run(&["--trace", "-n", &size.to_string(), "--nodes", nodes, path]);
        ranks_ok(&done, size);
        // Only the first fence goes by frames; each later one, by the node barrier: a frame a node.
        let by_frames = done.stderr.lines().filter(|l| l.contains(" C: ") && l.ends_with("cmd=kvs-fence;")).count();
        let paged = done.stderr.lines().filter(|l| l.contains(" C: ") && l.ends_with("cmd=node-barrier-in;")).count();
        let nodes: usize = nodes.parse().unwrap();
        assert!(by_frames == size && paged > 0 && paged % nodes == 0, "{by_frames} {paged}: {}", done.dump());
    }
}

#[test]
fn a_program_without_a_launcher_is_a_job_of_one() {
    for api in [Api::Pmi1, Api::Pmi2] {
        let p = program(api);
        let mut cmd = Command::new(&p.path);
        cmd.arg("alone");
        for var in ["PMI_FD", "PMI_PORT", "PMI_RANK", "PMI_SIZE", "PMI_ID", "PMI_JOBID", "RPMI_PMI_SUBVERSION"] {
            cmd.env_remove(var);
        }
        let done = start_in(cmd, &[] as &[&str], &[]).wait(GUARD);
        ranks_ok(&done, 1);
    }
}

/// A `PMI_FD` that is not a launcher's connection fails init, saying what is wrong with it (a number that is
/// not open is found where init makes it close-on-exec).
#[test]
fn a_wrong_pmi_fd_fails_init_and_says_why() {
    for api in [Api::Pmi1, Api::Pmi2] {
        let p = program(api);
        for (fd, says) in [
            ("250", "PMI_FD=250 is not an open file descriptor"),
            ("-3", "PMI_FD=-3 is not a file descriptor"),
            ("three", "PMI_FD=three is not an integer"),
        ] {
            let mut cmd = Command::new(&p.path);
            for var in ["PMI_PORT", "PMI_ID", "PMI_JOBID", "RPMI_PMI_SUBVERSION"] {
                cmd.env_remove(var);
            }
            let env = [("PMI_FD", OsStr::new(fd)), ("PMI_RANK", OsStr::new("0")), ("PMI_SIZE", OsStr::new("1"))];
            let done = start_in(cmd, &[] as &[&str], &env).wait(GUARD);
            assert_ne!(done.code(), Some(0), "{}", done.dump());
            assert!(done.stderr.contains(says), "PMI_FD={fd}: {}", done.dump());
        }
    }
}

/// A fork while another thread is inside a call that holds the library (a barrier, a fence that rank 0 enters
/// late): in the child every call fails at once, as before init, without waiting for that thread or speaking on
/// the parent's connection, and an abort ends the child alone; the job goes on. (Every run of either program
/// also checks that init leaves the launcher's connection close-on-exec.)
#[test]
fn a_child_of_a_fork_cannot_use_pmi_and_waits_for_no_call_of_its_parent() {
    for api in [Api::Pmi1, Api::Pmi2] {
        let p = program(api);
        let done = rpmi_run(&["-n", "3", p.path.to_str().unwrap(), "fork"]);
        assert!(ranks_ok(&done, 3).iter().all(|l| l == "fork"), "{api:?}: {}", done.dump());
    }
}

#[test]
fn an_abort_ends_the_job_with_its_code_and_message() {
    let p = program(Api::Pmi1);
    let done = rpmi_run(&["-n", "4", p.path.to_str().unwrap(), "abort"]);
    assert_eq!(done.code(), Some(7), "{}", done.dump());
    assert!(done.stderr.contains("pmi_api: rank 1 aborts on purpose"), "{}", done.dump());
    // PMI2_Abort has no code of its own: the job ends with 1.
    let p = program(Api::Pmi2);
    let done = rpmi_run(&["-n", "4", p.path.to_str().unwrap(), "abort"]);
    assert_eq!(done.code(), Some(1), "{}", done.dump());
    assert!(done.stderr.contains("pmi2_api: rank 1 aborts on purpose"), "{}", done.dump());
}

/// MPICH's Hydra serves PMI 1.1 on `PMI_FD`: the library asks it for no more (Hydra ends a job whose client
/// does), and the group barrier says it is not served. It serves PMI-2 too, where its fence is no barrier (its
/// gets wait for the key instead): the program orders its name calls by keys, not fences.
#[test]
fn every_call_under_hydra() {
    if Command::new("mpiexec.hydra").arg("--version").output().is_err() {
        panic!("mpiexec.hydra is missing: {}", support::INSTALL_HINT);
    }
    let p = program(Api::Pmi1);
    let done = run("mpiexec.hydra", &["-n", "4", p.path.to_str().unwrap()]);
    assert!(ranks_ok(&done, 4).iter().all(|l| l == "clique=4 groups=0"), "{}", done.dump());
    let p = program(Api::Pmi2);
    ranks_ok(&run("mpiexec.hydra", &["-n", "4", p.path.to_str().unwrap()]), 4);
}

/// Hydra's port start-up (`-pmi-port`): no `PMI_FD`, but `PMI_PORT=host:port` and `PMI_ID`, the rank. Both
/// libraries connect to the port and say the id (PMI-1's `initack`, PMI-2's `pmirank`).
#[test]
fn every_call_through_hydras_port() {
    let env = run(
        "mpiexec.hydra",
        &["-pmi-port", "-n", "1", "sh", "-c", "echo fd=${PMI_FD:-none} port=$PMI_PORT id=$PMI_ID"],
    );
    assert!(env.stdout.starts_with("fd=none port=") && env.stdout.contains(" id=0"), "{}", env.dump());
    let p = program(Api::Pmi1);
    let done = run("mpiexec.hydra", &["-pmi-port", "-n", "3", p.path.to_str().unwrap()]);
    assert!(ranks_ok(&done, 3).iter().all(|l| l == "clique=3 groups=0"), "{}", done.dump());
    let p = program(Api::Pmi2);
    ranks_ok(&run("mpiexec.hydra", &["-pmi-port", "-n", "3", p.path.to_str().unwrap()]), 3);
}

/// A spawn through each library, end to end: rank 0 starts two tasks of the program with a preput, which each
/// reads from its own key-value space; under rpmi-run (on one node and on three) and under Hydra.
#[test]
fn a_spawn_through_either_library_starts_a_job_that_reads_the_preput() {
    for api in [Api::Pmi1, Api::Pmi2] {
        let p = program(api);
        let path = p.path.to_str().unwrap();
        for (done, size) in [
            (rpmi_run(&["-n", "2", path, "spawn"]), 2),
            (rpmi_run(&["-n", "3", "--nodes", "3", path, "spawn"]), 3),
            (run("mpiexec.hydra", &["-n", "2", path, "spawn"]), 2),
        ] {
            done.assert_success(&format!("a spawn through {}", api.soname()));
            assert!(spawned_and_read(&done.stdout, size), "{:?}: {}", api, done.dump());
        }
    }
}

/// Open MPI 4.1 (Debian's) has no PMI-1 client of its own, but its flux component loads a `libpmi.so.0`
/// (`FLUX_PMI_LIBRARY_PATH`) wherever `FLUX_JOB_ID` is set: through rpmi's, its start-up and the program's
/// exchange run under rpmi-run on one node and on three. The trace shows the library spoke (it asks for 1.2).
/// On one node, with docs/libpmi.md's directory of the job's own for its session and shared-memory files.
#[test]
fn open_mpi_through_libpmi_by_its_flux_component() {
    let dir = library_dir();
    let pairs = support::compile("mpicc.openmpi", "mpi_pairs", dir.path());
    let lib = dir.path().join(Api::Pmi1.soname());
    for (i, (layout, size)) in [(&["-n", "4"][..], 4), (&["-n", "6", "--nodes", "3"], 6)].into_iter().enumerate() {
        // Open MPI reads the job id as a number, and loses its top bit from 32768 on; one of its own per run,
        // for the names of its shared-memory files.
        let job = (std::process::id() % 16000 * 2 + i as u32 + 1).to_string();
        let mut env: Vec<(&str, &OsStr)> = vec![
            ("FLUX_JOB_ID", OsStr::new(&job)),
            ("FLUX_PMI_LIBRARY_PATH", lib.as_os_str()),
            // Its flux component, or a failure: nothing else it has could start it here.
            ("OMPI_MCA_pmix", OsStr::new("flux")),
        ];
        // docs/libpmi.md's recipe: the job's own directory for Open MPI's session and shared-memory files,
        // which a repeated FLUX_JOB_ID then cannot share.
        let own = dir.path().join(format!("ompi-job-{job}"));
        if size == 6 {
            // The virtual nodes share one host, where its shared-memory transport names its files by host
            // and local rank: each node's local rank 0 would take the same file. TCP between all ranks.
            env.push(("OMPI_MCA_btl", OsStr::new("self,tcp")));
        } else {
            env.extend([
                ("OMPI_MCA_orte_tmpdir_base", own.as_os_str()),
                ("OMPI_MCA_btl_vader_backing_directory", own.as_os_str()),
            ]);
        }
        let mut args: Vec<&OsStr> = layout.iter().map(OsStr::new).collect();
        args.extend([OsStr::new("--trace"), pairs.as_os_str()]);
        let done = start_with_env(RUN, &args, &env).wait(GUARD);
        done.assert_success("Open MPI's mpi_pairs through libpmi.so.0");
        let want = format!("mpi_pairs: {size} ranks, allreduce {}, all pairs exchanged", size * (size + 1) / 2);
        assert!(done.stdout.contains(&want), "{}", done.dump());
        assert!(done.stderr.contains("C: cmd=init pmi_version=1 pmi_subversion=2"), "{}", done.dump());
        if size == 4 {
            assert!(own.is_dir() && !done.stderr.contains("shmem: mmap: an error"), "{}", done.dump());
        }
    }
}

/// Slurm's own `libpmi2.so.0` (Debian's `libpmi2-0`) under rpmi's server: the benchmark's task
/// (`benches/libpmi/pmi_bench.c`) puts, fences and gets every rank's key with no job id, which Slurm's library
/// sends as an empty `jobid=` (rpmi's server once refused each such get as another job's).
#[test]
fn slurms_libpmi2_under_rpmi_run() {
    let slurms = Path::new("/usr/lib/x86_64-linux-gnu/libpmi2.so.0");
    assert!(slurms.exists(), "Slurm's libpmi2.so.0 is missing: {}", support::INSTALL_HINT);
    let dir = library_dir();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let program = dir.path().join("pmi_bench");
    let out = Command::new("cc")
        .args(["-O1", "-DCLIENT=2", "-o"])
        .arg(&program)
        .arg(root.join("benches/libpmi/pmi_bench.c"))
        .arg(format!("-I{}", root.join("crates/libpmi2/include").display()))
        .arg(slurms)
        .arg("-ldl")
        .output()
        .expect("cc (build-essential)");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    let done = rpmi_run(&[OsStr::new("-n"), OsStr::new("4"), program.as_os_str(), OsStr::new("100")]);
    done.assert_success("pmi_bench through Slurm's libpmi2");
    assert!(done.stdout.contains("lib=/usr/lib/x86_64-linux-gnu/libpmi2.so.0"), "{}", done.dump());
}

/// Intel MPI loads a library by `I_MPI_PMI_LIBRARY` and speaks through it (`I_MPI_PMI=pmi1` or `pmi2`): IMB's
/// start-up and Allreduce under rpmi-run, and with no launcher at all, where Slurm's and Flux's libraries
/// make it fail.
#[test]
fn intel_mpi_through_both_libraries_under_rpmi_run_and_alone() {
    let intel = impi::intel_mpi();
    let dir = library_dir();
    for (api, mode, asks) in
        [(Api::Pmi1, "pmi1", "C: cmd=init pmi_version=1 pmi_subversion=2"), (Api::Pmi2, "pmi2", "C: cmd=fullinit;")]
    {
        let lib = dir.path().join(api.soname());
        let env = intel.env(Some((&lib, mode)));
        let env: Vec<(&str, &OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        let mut args: Vec<String> = ["-n", "4", "--trace"].map(String::from).to_vec();
        args.extend(intel.imb(4));
        let done = start_with_env(RUN, &args, &env).wait(GUARD);
        done.assert_success(&format!("IMB-MPI1 through {}", api.soname()));
        assert!(impi::imb_ran(&done.stdout, 4), "{}", done.dump());
        // It was this library that spoke (Intel MPI's own PMI-1 client asks for 1.1).
        assert!(done.stderr.contains(asks), "{}", done.dump());

        let imb = intel.imb(1);
        let mut alone = Command::new(&imb[0]);
        for var in ["PMI_FD", "PMI_PORT", "PMI_RANK", "PMI_SIZE", "PMI_ID", "PMI_JOBID", "RPMI_PMI_SUBVERSION"] {
            alone.env_remove(var);
        }
        let done = start_in(alone, &imb[1..], &env).wait(GUARD);
        done.assert_success(&format!("IMB-MPI1 through {} with no launcher", api.soname()));
        assert!(impi::imb_ran(&done.stdout, 1), "{}", done.dump());
    }
}
