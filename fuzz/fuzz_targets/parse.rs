//! Fuzz target `parse`: arbitrary bytes as one request line (`rpmi_core::wire::parse`), as the lines of
//! spawn requests (`rpmi_core::wire::SpawnBuilder`), and as a PMI 1.2 group (`rpmi_core::wire::group::Group`).
//!
//! Checks: no panic; a successful parse allocates nothing (the parser borrows from the line); leading and
//! trailing blanks do not change the result; the fields of a request hold what the grammar allows; a
//! finished spawn request is within the builder's bounds; a group that reads is written in one form, which
//! reads back as the same group and holds no rank outside the job or twice.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi_core::wire::group::{Group, Members};
use rpmi_core::wire::spawn::{Progress, MAX_COMMANDS, MAX_ITEMS};
use rpmi_core::wire::{parse, Request, SpawnBuilder};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counts allocations so the target can check that parsing a good line allocates nothing.
struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A spawn request's lines may total this many bytes in this target.
const SPAWN_BYTES: usize = 64 << 10;

fn blank(b: u8) -> bool {
    b == b' ' || b == b'\t' || b == b'\r'
}

fn check_request(r: &Request<'_>) {
    assert!(!r.name().is_empty());
    // Fields other than value= and message= are single tokens.
    let token = |t: &[u8]| assert!(!t.iter().any(|&b| blank(b)), "a field holds a blank: {r:?}");
    match *r {
        Request::Put { kvsname, key, value } => {
            token(kvsname);
            token(key);
            assert!(!value.last().is_some_and(|&b| blank(b)), "value= keeps trailing blanks: {r:?}");
        }
        Request::Get { kvsname, key } => {
            token(kvsname);
            token(key);
        }
        Request::Abort { message: Some(m), .. } => {
            assert!(!m.last().is_some_and(|&b| blank(b)), "message= keeps trailing blanks: {r:?}");
        }
        Request::PublishName { service, port } => {
            token(service);
            token(port);
        }
        Request::UnpublishName { service } | Request::LookupName { service } => token(service),
        _ => {}
    }
}

fn check_parse(line: &[u8]) {
    let before = ALLOCS.load(Relaxed);
    let parsed = parse(line);
    let allocs = ALLOCS.load(Relaxed) - before;
    if let Ok(r) = &parsed {
        assert_eq!(allocs, 0, "parsing a good line allocated: {r:?}");
        check_request(r);
    }
    // Blanks around the line change nothing.
    let mut padded = b" \t".to_vec();
    padded.extend_from_slice(line);
    padded.extend_from_slice(b" \r");
    assert_eq!(parse(&padded), parsed, "blanks around the line changed the result");
}

fn check_spawn(data: &[u8]) {
    let mut builder = SpawnBuilder::new(SPAWN_BYTES);
    let mut fed = 0usize;
    for line in data.split(|&b| b == b'\n') {
        fed += line.len() + 1;
        match builder.line(line) {
            Ok(Progress::More) => {}
            Ok(Progress::Done(req)) => {
                assert!(fed <= SPAWN_BYTES);
                assert!(!req.commands.is_empty() && req.commands.len() <= MAX_COMMANDS as usize);
                for c in &req.commands {
                    assert!(c.args.len() <= MAX_ITEMS as usize);
                    assert!(c.preputs.len() <= MAX_ITEMS as usize && c.infos.len() <= MAX_ITEMS as usize);
                }
                let _ = req.total_procs();
                builder = SpawnBuilder::new(SPAWN_BYTES);
                fed = 0;
            }
            Err(e) => {
                let _ = e.to_string();
                builder = SpawnBuilder::new(SPAWN_BYTES);
                fed = 0;
            }
        }
    }
}

/// The job a group is read for.
const GROUP_JOB: u32 = 600;

fn check_group(text: &[u8]) {
    let Ok(group) = Group::parse(text, GROUP_JOB) else { return };
    if let Members::Ranks(ranks) = &group.members {
        assert!(ranks.windows(2).all(|w| w[0] < w[1]), "ranks not ascending and unique: {group:?}");
        assert!(ranks.last().is_some_and(|&r| r < GROUP_JOB), "a rank outside the job: {group:?}");
    }
    let written = group.to_string();
    assert_eq!(Group::parse(written.as_bytes(), GROUP_JOB).as_ref(), Ok(&group), "{written} reads back otherwise");
}

fuzz_target!(|data: &[u8]| {
    check_group(data);
    check_parse(data);
    for line in data.split(|&b| b == b'\n') {
        check_parse(line);
    }
    check_spawn(data);
});
