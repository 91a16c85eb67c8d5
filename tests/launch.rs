//! A launch of rpmi-run beyond one program: MPMD (`-n 2 ./a : -n 3 ./b`), `--universe`, the name service
//! (MPI_Publish_name / MPI_Lookup_name / MPI_Unpublish_name) and spawned jobs (MPI_Comm_spawn,
//! MPI_Comm_spawn_multiple), end to end with real MPICH programs from `tests/programs/` and with a PMI-1
//! client written on the wire (`pmi_spawn.sh`).
//!
//! Debian 12's MPICH 4.0.2 (ch4:ucx) cannot spawn or open a port, so the spawn tests use MPICH 5 from PyPI,
//! which `docker/install-deps.sh` installs in `/opt/rpmi-mpich5` (or `RPMI_MPICH5`, a directory with
//! `bin/mpicc`). Every run has the hang guard of `support`; each test checks that no task is left.

mod support;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use support::*;

/// The programs, each built with Debian's MPICH ("4") or MPICH 5 ("5"), and a private copy of each MPICH 5
/// spawner per test that checks none of its processes is left.
struct Programs {
    dir: PathBuf,
}

impl Programs {
    fn get(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

fn mpich5() -> PathBuf {
    let dir = std::env::var_os("RPMI_MPICH5").map_or_else(|| PathBuf::from("/opt/rpmi-mpich5"), PathBuf::from);
    let mpicc = dir.join("bin/mpicc");
    assert!(mpicc.exists(), "no MPICH 5 at {}: {INSTALL_HINT}", mpicc.display());
    mpicc
}

fn programs() -> &'static Programs {
    static PROGRAMS: OnceLock<Programs> = OnceLock::new();
    PROGRAMS.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("launch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mpicc5 = mpich5();
        for name in ["mpi_mpmd", "mpi_names"] {
            let out = compile("mpicc", name, &dir);
            std::fs::rename(&out, dir.join(format!("{name}4"))).expect("rename");
        }
        for name in ["mpi_mpmd", "mpi_names", "mpi_spawn", "mpi_spawn_multiple", "mpi_spawn_missing", "mpi_sessions"] {
            let out = compile(mpicc5.to_str().expect("UTF-8 path"), name, &dir);
            std::fs::rename(&out, dir.join(format!("{name}5"))).expect("rename");
        }
        // Private copies, so that a scan for leftover tasks sees only its own test's.
        for copy in ["spawn_missing_left", "spawn_abort_left", "spawn_abort_nested_left"] {
            let from = if copy.starts_with("spawn_missing") { "mpi_spawn_missing5" } else { "mpi_spawn5" };
            std::fs::copy(dir.join(from), dir.join(copy)).expect("copy");
        }
        Programs { dir }
    })
}

fn os(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// `rpmi-run ARGS...` with `env`, under the guard.
fn rpmi_run_env(args: &[String], env: &[(&str, &OsStr)]) -> Done {
    start_with_env(RUN, args, env).wait(GUARD)
}

/// `rpmi-probe info` lines: rank -> its `key=value` fields.
fn info(stdout: &str) -> BTreeMap<u32, BTreeMap<String, String>> {
    let mut ranks = BTreeMap::new();
    for line in stdout.lines().filter(|l| l.starts_with("rank=") && l.contains(" appnum=")) {
        let fields: BTreeMap<String, String> =
            line.split_whitespace().filter_map(|t| t.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect();
        ranks.insert(fields["rank"].parse().expect("rank"), fields);
    }
    ranks
}

// ---------------------------------------------------------------------------------------------------------
// MPMD and the universe.

#[test]
fn mpmd_ranks_follow_each_other_with_their_appnum_in_one_job() {
    let done = rpmi_run_env(&os(&["-n", "2", "--nodes", "2", PROBE, "info", ":", "-n", "3", PROBE, "info"]), &[]);
    done.assert_success("an MPMD launch of rpmi-probe info");
    let ranks = info(&done.stdout);
    assert_eq!(ranks.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3, 4], "{}", done.dump());
    for (rank, fields) in &ranks {
        assert_eq!(fields["size"], "5", "{}", done.dump());
        assert_eq!(fields["appnum"], if *rank < 2 { "0" } else { "1" }, "rank {rank}:\n{}", done.dump());
        assert_eq!(fields["kvsname"], ranks[&0]["kvsname"], "one job, one KVS:\n{}", done.dump());
        // Five ranks in blocks over two nodes: 0-2 on node 0, 3-4 on node 1, whatever their program.
        assert_eq!(fields["mapping"], "(vector,(0,1,3),(1,1,2))", "{}", done.dump());
        assert_eq!(fields["universe"], "5", "the universe is the job's size by default:\n{}", done.dump());
    }
}

#[test]
fn universe_is_what_the_option_says() {
    let done = rpmi_run_env(&os(&["-n", "2", "--universe", "9", PROBE, "info"]), &[]);
    done.assert_success("rpmi-run --universe 9");
    let ranks = info(&done.stdout);
    assert!(ranks.len() == 2 && ranks.values().all(|f| f["universe"] == "9"), "{}", done.dump());
}

/// Each application's ranks read their appnum through MPICH (MPI_APPNUM) and share one MPI_COMM_WORLD.
fn mpmd_mpich(program: &str) {
    let p = programs().get(program);
    let p = p.to_str().expect("UTF-8 path");
    let done = rpmi_run_env(&os(&["-n", "2", "--nodes", "2", p, "a", ":", "-n", "3", p, "b"]), &[]);
    done.assert_success(&format!("rpmi-run -n 2 {program} a : -n 3 {program} b"));
    for (rank, appnum, label) in [(0, 0, "a"), (1, 0, "a"), (2, 1, "b"), (3, 1, "b"), (4, 1, "b")] {
        let line = format!("rank {rank} appnum {appnum} label {label}");
        assert!(done.stdout.lines().any(|l| l == line), "no `{line}`:\n{}", done.dump());
    }
    assert!(done.stdout.contains("mpi_mpmd: 5 ranks in one MPI_COMM_WORLD"), "{}", done.dump());
}

#[test]
fn mpmd_with_mpich_4() {
    mpmd_mpich("mpi_mpmd4");
}

#[test]
fn mpmd_with_mpich_5() {
    mpmd_mpich("mpi_mpmd5");
}

#[test]
fn only_the_task_count_may_follow_a_colon() {
    let done = rpmi_run_env(&os(&["-n", "1", PROBE, "info", ":", "--nodes", "2", PROBE, "info"]), &[]);
    assert_eq!(done.code(), Some(2), "{}", done.dump());
    assert!(done.stderr.contains("only -n may follow ':', not '--nodes'"), "{}", done.dump());
    let done = rpmi_run_env(&os(&["-n", "1", PROBE, "info", ":", "-n", "2"]), &[]);
    assert_eq!(done.code(), Some(2), "{}", done.dump());
    assert!(done.stderr.contains("no program after ':'"), "{}", done.dump());
}

// ---------------------------------------------------------------------------------------------------------
// The name service.

/// 4 ranks: rank 0 publishes its port, the others look it up; a second publish of the name, a lookup of a
/// name never published and one of the name once unpublished all fail.
fn names(program: &str, opts: &[&str], env: &[(&str, &OsStr)]) {
    let p = programs().get(program);
    let mut args = os(&["-n", "4"]);
    args.extend(os(opts));
    args.push(p.to_string_lossy().into_owned());
    let done = rpmi_run_env(&args, env);
    done.assert_success(&format!("rpmi-run -n 4 {} {program}", opts.join(" ")));
    let line = "mpi_names: 3 ranks looked up the port; duplicate publish, unknown and unpublished lookups failed";
    assert!(done.stdout.contains(line), "{}", done.dump());
}

/// MPICH 4.0.2 cannot open a port (ch4:ucx): the program publishes a stand-in of the same shape.
#[test]
fn names_on_one_node_with_mpich_4() {
    names("mpi_names4", &[], &[]);
}

#[test]
fn names_on_several_nodes_with_mpich_4() {
    names("mpi_names4", &["--nodes", "3", "--map", "cyclic"], &[]);
}

/// MPICH 5 over OFI opens a real port (over UCX its port is longer than MPI_MAX_PORT_NAME).
#[test]
fn names_on_one_node_with_mpich_5() {
    names("mpi_names5", &[], &[("MPIR_CVAR_CH4_NETMOD", OsStr::new("ofi"))]);
}

#[test]
fn names_on_several_nodes_with_mpich_5_event_loop() {
    names("mpi_names5", &["--nodes", "4", "--event-loop"], &[("MPIR_CVAR_CH4_NETMOD", OsStr::new("ofi"))]);
}

// ---------------------------------------------------------------------------------------------------------
// Spawn.

const MODES: &[&[&str]] = &[&[], &["--event-loop"], &["--nodes", "2"]];

fn spawn_ok(program: &str, args: &[&str], opts: &[&str], line: &str) {
    let p = programs().get(program);
    let mut all = os(&["-n", "2"]);
    all.extend(os(opts));
    all.push(p.to_string_lossy().into_owned());
    all.extend(os(args));
    let done = rpmi_run_env(&all, &[]);
    eprintln!("rpmi-run {} {program} {}: {:.2?}", opts.join(" "), args.join(" "), done.elapsed);
    done.assert_success(&format!("rpmi-run -n 2 {} {program} {}", opts.join(" "), args.join(" ")));
    assert!(done.stdout.contains(line), "no `{line}`:\n{}", done.dump());
    assert!(done.stragglers.is_empty(), "{}", done.dump());
}

#[test]
fn spawn_of_three_from_two_merged_and_checked_in_every_mode() {
    for mode in MODES {
        let line = "mpi_spawn: 2 parents, 3 children, depth 1 (3 processes below the parents): merged and checked";
        spawn_ok("mpi_spawn5", &["3"], mode, line);
    }
}

#[test]
fn spawn_nested_two_levels() {
    let line = "mpi_spawn: 2 parents, 3 children, depth 2 (6 processes below the parents): merged and checked";
    spawn_ok("mpi_spawn5", &["3", "2"], &["--nodes", "2", "--tree-width", "1"], line);
}

#[test]
fn spawn_multiple_gives_each_command_its_appnum() {
    let line =
        "mpi_spawn_multiple: 2 parents, 1 child of command 0 and 2 of command 1: appnums, argvs and merge checked";
    spawn_ok("mpi_spawn_multiple5", &[], &[], line);
}

/// A spawn of a program that does not exist: every process's error code reaches the parents (MPICH's
/// spawner waits for children unless all codes are errors), rpmi-run says why, and nothing hangs.
#[test]
fn spawn_of_a_missing_program_fails_with_error_codes() {
    let p = programs().get("spawn_missing_left");
    for mode in [&[][..], &["--nodes", "2"]] {
        let mut args = os(&["-n", "2"]);
        args.extend(os(mode));
        args.push(p.to_string_lossy().into_owned());
        let done = rpmi_run_env(&args, &[]);
        done.assert_success("a spawn of a missing program");
        assert!(done.stdout.contains("mpi_spawn_missing: spawn failed as expected"), "{}", done.dump());
        assert!(done.stdout.contains("errcodes -1 -1"), "every process's code is PMI_FAIL:\n{}", done.dump());
        let why = "cannot start ./no-such-program-rpmi: No such file or directory (os error 2); the spawn fails";
        assert!(done.stderr.contains(why), "{}", done.dump());
        assert!(running_exe(&p).is_empty() && done.stragglers.is_empty(), "{}", done.dump());
    }
}

/// A spawned task's MPI_Abort ends every job of the launch, with its code; nothing is left running.
#[test]
fn an_abort_in_a_spawned_job_ends_the_launch_with_its_code() {
    for (copy, level, args, opts) in [
        ("spawn_abort_left", "1", &["3"][..], &[][..]),
        ("spawn_abort_nested_left", "2", &["2", "2"][..], &["--nodes", "2"][..]),
    ] {
        let p = programs().get(copy);
        let mut all = os(&["-n", "2"]);
        all.extend(os(opts));
        all.push(p.to_string_lossy().into_owned());
        all.extend(os(args));
        let done = rpmi_run_env(&all, &[("MPI_SPAWN_ABORT_LEVEL", OsStr::new(level))]);
        assert_eq!(done.code(), Some(42), "level {level}:\n{}", done.dump());
        let job = if level == "1" { ".1):" } else { ".2):" };
        let said = done.stderr.lines().find(|l| l.contains("rank 0 called PMI_Abort with exit code 42"));
        assert!(said.is_some_and(|l| l.starts_with("rpmi-run (spawned job run") && l.contains(job)), "{}", done.dump());
        assert!(running_exe(&p).is_empty() && done.stragglers.is_empty(), "{}", done.dump());
    }
}

/// Spawn on the wire: each command's appnum, the preputs in the new job's KVS, `path` and `wdir`,
/// `PMI_SPAWNED=1`, the universe size; a spawn on another host is refused with a message.
#[test]
fn spawn_on_the_wire_gives_the_new_job_what_pmi_promises() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_spawn.sh");
    let script = script.to_string_lossy().into_owned();
    let done = rpmi_run_env(&os(&["--universe", "7", &script, PROBE]), &[]);
    done.assert_success("pmi_spawn.sh");
    let answers: Vec<&str> = done.stdout.lines().filter(|l| l.starts_with("spawner: ")).collect();
    assert_eq!(
        answers,
        [
            "spawner: cmd=spawn_result rc=0 errcodes=0,0,0",
            "spawner: cmd=spawn_result rc=0 errcodes=0,0",
            "spawner: cmd=spawn_result rc=0 errcodes=0"
        ],
        "{}",
        done.dump()
    );
    let ranks = info(&done.stdout);
    assert_eq!(ranks.len(), 3, "{}", done.dump());
    for (rank, fields) in &ranks {
        assert_eq!(fields["appnum"], if *rank == 0 { "0" } else { "1" }, "{}", done.dump());
        assert_eq!(fields["size"], "3", "{}", done.dump());
        assert_eq!(fields["universe"], "7", "{}", done.dump());
        assert!(fields["kvsname"].starts_with("rpmi_run") && fields["kvsname"].ends_with(".1"), "{}", done.dump());
    }
    for line in ["rank=0 greeting=hello world", "rank=1 greeting=hello world"] {
        assert!(done.stdout.lines().any(|l| l == line), "no `{line}`:\n{}", done.dump());
    }
    assert!(done.stdout.lines().any(|l| l == "1"), "PMI_SPAWNED=1:\n{}", done.dump());

    let done = rpmi_run_env(&os(&[&script, PROBE, "elsewhere.example"]), &[]);
    done.assert_success("pmi_spawn.sh elsewhere.example");
    let refused = done.stdout.lines().find(|l| l.starts_with("spawner: cmd=spawn_result rc=-1 msg="));
    assert!(refused.is_some_and(|l| l.contains("not_on_'elsewhere.example'")), "{}", done.dump());
}

/// `tests/programs/pmi_spawn_blocks.sh` sending `requests` under `rpmi-run ARGS`, from `dir`, with `env`:
/// the run, and the spawner's answers.
fn spawn_blocks(dir: &Path, args: &[&str], requests: &[&str], env: &[(&str, &OsStr)]) -> (Done, Vec<String>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_spawn_blocks.sh");
    let run = args.first().map_or(RUN, |a| if a.ends_with("rpmi-run") { a } else { RUN });
    let mut all: Vec<String> = os(if run == RUN { args } else { &args[1..] });
    all.push(script.to_string_lossy().into_owned());
    all.extend(os(requests));
    let mut cmd = std::process::Command::new(run);
    cmd.current_dir(dir);
    let done = start_in(cmd, &all, env).wait(GUARD);
    let answers = done.stdout.lines().filter_map(|l| l.strip_prefix("spawner: ")).map(str::to_string).collect();
    (done, answers)
}

const TRUE_ONCE: &str = "mcmd=spawn\\nnprocs=1\\nexecname=/bin/true\\ntotspawns=1\\nspawnssofar=1\\nendcmd";

/// What a spawn cannot be is refused or fails as a whole, and the launch goes on: too many processes, a
/// preput a put could not be, a `wdir` that is no directory. A relative `wdir` and `./prog` are found as
/// the task finds them.
#[test]
fn spawns_that_cannot_be_fail_and_the_launch_goes_on() {
    let dir = programs().dir.join("wdir-test");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::copy("/bin/true", dir.join("sub/prog")).unwrap();
    let requests = [
        "mcmd=spawn\\nnprocs=4000000000\\nexecname=/bin/true\\ntotspawns=1\\nspawnssofar=1\\nendcmd",
        "mcmd=spawn\\nnprocs=1\\nexecname=/bin/true\\ntotspawns=1\\nspawnssofar=1\\npreput_num=1\\npreput_key_0=k\\n\
         preput_val_0=\\nendcmd",
        "mcmd=spawn\\nnprocs=2\\nexecname=./prog\\ntotspawns=1\\nspawnssofar=1\\ninfo_num=1\\ninfo_key_0=wdir\\n\
         info_val_0=sub\\nendcmd",
        "mcmd=spawn\\nnprocs=1\\nexecname=./prog\\ntotspawns=1\\nspawnssofar=1\\ninfo_num=1\\ninfo_key_0=wdir\\n\
         info_val_0=/no/such\\nendcmd",
    ];
    for mode in [&[][..], &["--event-loop"][..]] {
        let (done, answers) = spawn_blocks(&dir, mode, &requests, &[]);
        done.assert_success("spawns that cannot be");
        assert_eq!(
            answers,
            [
                "cmd=spawn_result rc=-1 msg=a_spawn_of_4000000000_processes,_more_than_the_65536_one_spawn_starts",
                "cmd=spawn_result rc=0 errcodes=-1",
                "cmd=spawn_result rc=0 errcodes=0,0",
                "cmd=spawn_result rc=0 errcodes=-1",
            ],
            "{}",
            done.dump()
        );
        assert!(done.stderr.contains("the preput 'k': empty value; the spawn fails"), "{}", done.dump());
        assert!(done.stderr.contains("cannot start ./prog in /no/such: not a directory"), "{}", done.dump());
    }
}

/// rpmi-run removed while it runs (a package upgraded, `cargo clean`): a spawn fails with why, nothing
/// else does.
#[test]
fn a_spawn_without_rpmi_run_to_start_fails_with_a_message() {
    let dir = programs().dir.join("deleted-run");
    std::fs::create_dir_all(&dir).unwrap();
    for mode in [&[][..], &["--nodes", "2", "-n", "2"][..]] {
        let run = dir.join("rpmi-run");
        std::fs::copy(RUN, &run).unwrap();
        std::fs::copy(Path::new(RUN).with_file_name("librpmi.so"), dir.join("librpmi.so")).unwrap();
        let run = run.to_string_lossy().into_owned();
        let args: Vec<&str> = std::iter::once(run.as_str()).chain(mode.iter().copied()).collect();
        let (done, answers) = spawn_blocks(&dir, &args, &[TRUE_ONCE], &[("DELETE", OsStr::new(&run))]);
        done.assert_success("a spawn after rpmi-run was removed");
        let want = "cmd=spawn_result rc=-1 msg=cannot_start_rpmi-run_for_the_spawned_job:_No_such_file_or_directory_(os_error_2)";
        assert!(!answers.is_empty() && answers.iter().all(|a| a == want), "{}", done.dump());
    }
}

#[test]
fn a_colon_needs_a_program_on_each_side() {
    for args in [&[":", "-n", "1", "true"][..], &["-n", "1", ":", "true"][..], &["-n", "1", "true", ":"][..]] {
        let done = rpmi_run_env(&os(args), &[]);
        assert_eq!(done.code(), Some(2), "{args:?}: {}", done.dump());
    }
}

/// Each ended spawned job's connection is closed: 400 spawns in turn, with at most 256 fds open.
#[test]
fn spawns_in_turn_do_not_use_up_the_fds() {
    use std::os::unix::process::CommandExt;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_spawn_blocks.sh");
    let mut cmd = std::process::Command::new(RUN);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 256, rlim_max: 256 };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let mut args = vec![script.to_string_lossy().into_owned()];
    args.extend(std::iter::repeat_n(TRUE_ONCE.to_string(), 400));
    let done = start_in(cmd, &args, &[]).wait(GUARD);
    done.assert_success("400 spawns in turn");
    let answers: Vec<&str> = done.stdout.lines().filter_map(|l| l.strip_prefix("spawner: ")).collect();
    assert_eq!(answers.len(), 400, "{}", done.dump());
    assert!(answers.iter().all(|a| *a == "cmd=spawn_result rc=0 errcodes=0"), "{}", done.dump());
}

/// MPICH 5's sessions program over virtual nodes: communicators from the session's WORLD process set and from
/// a subgroup only the even ranks take part in. MPICH 5.0 asks for PMI 1.1 and is answered 1.1 (RFC 13:
/// never above what the client asked for), so its barriers are untagged; its own builds send no group
/// barrier either way (docs/protocol.md, "PMI 1.2").
#[test]
fn mpi_sessions_with_mpich_5() {
    let program = programs().get("mpi_sessions5");
    for opts in [&["-n", "6", "--nodes", "3"][..], &["-n", "5", "--nodes", "2", "--map", "cyclic", "--event-loop"]] {
        let mut args = os(opts);
        args.extend(os(&["--trace", program.to_str().unwrap()]));
        let done = rpmi_run_env(&args, &[]);
        done.assert_success(&format!("{opts:?}"));
        let (n, evens) = if opts[1] == "6" { (6, 3) } else { (5, 3) };
        let want = format!("mpi_sessions: {n} ranks, world and {evens} even ranks checked");
        assert!(done.stdout.contains(&want), "{opts:?}: no `{want}`:\n{}", done.dump());
        assert!(done.stderr.contains("C: cmd=init pmi_version=1 pmi_subversion=1"), "{}", done.dump());
        assert!(done.stderr.contains("S: cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"), "{}", done.dump());
        assert!(!done.stderr.contains("pmi_subversion=2"), "{opts:?}: answered above what was asked:\n{}", done.dump());
        assert!(!done.stderr.contains("tag="), "{opts:?}: a 1.1 client got a tagged barrier:\n{}", done.dump());
    }
}

/// Intel MPI through Slurm's own PMI-2 library (Debian's `libpmi2-0`), the strictest reader of PMI-2
/// answers (docs/clients.md: `fullinit-response` needs its version fields, booleans are `TRUE` or `FALSE`
/// only; before rpmi wrote them so, it failed at `PMI2_Init`), and through Intel MPI's own PMI-1 client.
#[test]
fn intel_mpi_through_slurms_libpmi2_and_its_own_client() {
    let intel = impi::intel_mpi();
    for library in [Some((Path::new(impi::SLURM_LIBPMI2), "pmi2")), None] {
        let mut args = os(&["-n", "4", "--trace"]);
        args.extend(intel.imb(4));
        let env = intel.env(library);
        let env: Vec<(&str, &OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        let done = rpmi_run_env(&args, &env);
        done.assert_success(&format!("IMB-MPI1 through {library:?}"));
        assert!(impi::imb_ran(&done.stdout, 4), "{library:?}:\n{}", done.dump());
        let pmi2 = done.stderr.contains("S:     ") && done.stderr.contains("cmd=fullinit-response;rc=0;");
        assert_eq!(pmi2, library.is_some(), "{library:?}: spoke PMI-2 {pmi2}:\n{}", done.dump());
    }
}
