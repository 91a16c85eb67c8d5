//! `libpmi.so.0`: RFC 13's PMI-1 API (`include/pmi.h`) for programs and runtimes that link or load a PMI
//! library (Intel MPI's `I_MPI_PMI_LIBRARY`, Open MPI's s1 component, MPICH built against a third-party PMI),
//! over any server of the PMI-1 wire: rpmi's, Hydra's, Slurm's `--mpi=pmi2`. Without a launcher (no
//! `PMI_FD`, no `PMI_PORT`) the process is a job of one, as MPI's singleton init expects.
//!
//! Every call checks its arguments as RFC 13 lists (NULL pointers, lengths, names that do not fit the wire),
//! then takes the one session under a lock: calls from several threads are served one at a time, which is
//! what a lock-step protocol allows anyway, but for PMI 1.2's group barriers, which are waited for without it
//! (the client crate's mailbox). A panic never crosses into C: it becomes `PMI_FAIL`. A protocol error, or a server that goes
//! away, is said once on stderr, naming the rank and the call.

#![deny(unsafe_op_in_unsafe_fn)]

mod session;

use rpmi_client::cabi::{copy_out, guard, is_string, is_word, say, set, set_errcodes, text};
use rpmi_client::held::{Held, Ranked};
use rpmi_client::{Failed, ERR_INVALID_ARG, ERR_INVALID_KEY, ERR_INVALID_LENGTH, ERR_INVALID_VAL, ERR_NOMEM, SUCCESS};
use rpmi_wire::spawn::{Pairs, SpawnCommand, SpawnRequest};
use session::{Session, PORT_MAX};
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Not in RFC 13's table of codes, though its text returns it from the key-value calls: MPICH's value.
const PMI_ERR_INVALID_KVS: c_int = 14;

/// The process's session, from `PMI_Init` to `PMI_Finalize`.
static SESSION: Held<Session> = Held::new("libpmi");

fn with_session(name: &str, f: impl FnOnce(&mut Session) -> Result<(), Failed>) -> c_int {
    SESSION.with(name, f)
}

/// Reads one number of the session into `*out`.
///
/// # Safety
/// `out` is NULL or points to a writable int.
unsafe fn query(name: &str, out: *mut c_int, what: impl FnOnce(&mut Session) -> Result<c_int, Failed>) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { SESSION.query(name, out, what) }
}

/// # Safety
/// `spawned` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Init(spawned: *mut c_int) -> c_int {
    if spawned.is_null() {
        return ERR_INVALID_ARG;
    }
    // SAFETY: checked above, as the caller's contract allows.
    SESSION.init("PMI_Init", Session::start, |s| unsafe { set(spawned, s.spawned as c_int) })
}

/// # Safety
/// `initialized` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Initialized(initialized: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { set(initialized, SESSION.initialized() as c_int) }
}

#[no_mangle]
pub extern "C" fn PMI_Finalize() -> c_int {
    SESSION.finalize("PMI_Finalize", Session::finalize)
}

/// Prints `error_msg` on stderr, tells the server the job ends with `exit_code`, and exits.
///
/// # Safety
/// `error_msg` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI_Abort(exit_code: c_int, error_msg: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    let message = if error_msg.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(error_msg) }.to_string_lossy().into_owned()
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        say(&message);
        // Another thread may hold the session in a barrier: then the server learns of the end from this
        // process's exit instead.
        SESSION.abort();
        SESSION.try_with(|s| s.abort(exit_code, &message));
    }));
    std::process::exit(exit_code)
}

macro_rules! length_max {
    ($name:ident, $field:ident) => {
        /// # Safety
        /// `length` is NULL or points to a writable int.
        #[no_mangle]
        pub unsafe extern "C" fn $name(length: *mut c_int) -> c_int {
            // SAFETY: the caller's contract.
            unsafe { query(stringify!($name), length, |s| Ok(s.maxes.$field as c_int)) }
        }
    };
}

length_max!(PMI_KVS_Get_name_length_max, kvsname);
length_max!(PMI_KVS_Get_key_length_max, key);
length_max!(PMI_KVS_Get_value_length_max, value);
// The id is the key-value space's name.
length_max!(PMI_Get_id_length_max, kvsname);

/// # Safety
/// `size` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_size(size: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { query("PMI_Get_size", size, |s| Ok(s.size as c_int)) }
}

/// # Safety
/// `rank` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_rank(rank: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { query("PMI_Get_rank", rank, |s| Ok(s.rank as c_int)) }
}

/// # Safety
/// `size` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_universe_size(size: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { query("PMI_Get_universe_size", size, Session::universe) }
}

/// # Safety
/// `appnum` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_appnum(appnum: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { query("PMI_Get_appnum", appnum, Session::appnum) }
}

/// # Safety
/// `size` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_clique_size(size: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { query("PMI_Get_clique_size", size, |s| Ok(s.clique()?.len() as c_int)) }
}

/// # Safety
/// `ranks` is NULL or points to `length` writable ints.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_clique_ranks(ranks: *mut c_int, length: c_int) -> c_int {
    if ranks.is_null() {
        return ERR_INVALID_ARG;
    }
    with_session("PMI_Get_clique_ranks", |s| {
        let clique = s.clique()?;
        if usize::try_from(length).map_or(true, |l| l < clique.len()) {
            return Err(Failed::arg(ERR_INVALID_LENGTH));
        }
        for (i, &r) in clique.iter().enumerate() {
            // SAFETY: the caller's contract; i < clique.len() <= length.
            unsafe { *ranks.add(i) = r as c_int };
        }
        Ok(())
    })
}

/// The key-value space's name into `out[..length]`.
///
/// # Safety
/// `out` is NULL or points to `length` writable bytes.
unsafe fn kvsname_into(name: &str, out: *mut c_char, length: c_int) -> c_int {
    if out.is_null() {
        return ERR_INVALID_ARG;
    }
    let Ok(length) = usize::try_from(length) else { return ERR_INVALID_LENGTH };
    with_session(name, |s| {
        // SAFETY: the caller's contract.
        unsafe { copy_out(s.kvsname.as_bytes(), out, length, ERR_INVALID_LENGTH) }
    })
}

/// # Safety
/// `kvsname` is NULL or points to `length` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI_KVS_Get_my_name(kvsname: *mut c_char, length: c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { kvsname_into("PMI_KVS_Get_my_name", kvsname, length) }
}

/// # Safety
/// `id_str` is NULL or points to `length` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_id(id_str: *mut c_char, length: c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { kvsname_into("PMI_Get_id", id_str, length) }
}

/// # Safety
/// `id_str` is NULL or points to `length` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_kvs_domain_id(id_str: *mut c_char, length: c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { kvsname_into("PMI_Get_kvs_domain_id", id_str, length) }
}

/// A value a put can send and a get will return as it was: RFC 13's `string` (at least one character, no line
/// break), without spaces at either end, which servers trim.
fn is_value(v: &str, max: usize) -> bool {
    // By bytes: a space or a tab is one byte, and no byte of a longer character is either.
    let spaced = |b: Option<&u8>| b.is_some_and(|&b| b == b' ' || b == b'\t');
    let v = v.as_bytes();
    !v.is_empty() && is_string(v, max) && !spaced(v.first()) && !spaced(v.last())
}

/// Checks that `kvsname` names this process's key-value space.
fn own_kvs(s: &Session, kvsname: Option<&str>) -> Result<(), Failed> {
    match kvsname {
        Some(k) if k == s.kvsname => Ok(()),
        _ => Err(Failed::arg(PMI_ERR_INVALID_KVS)),
    }
}

/// # Safety
/// Each argument is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI_KVS_Put(kvsname: *const c_char, key: *const c_char, value: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    let (kvsname, key, value) = unsafe { (text(kvsname), text(key), text(value)) };
    with_session("PMI_KVS_Put", |s| {
        own_kvs(s, kvsname)?;
        let key = key.filter(|k| is_word(k, s.maxes.key)).ok_or(Failed::arg(ERR_INVALID_KEY))?;
        let value = value.filter(|v| is_value(v, s.maxes.value)).ok_or(Failed::arg(ERR_INVALID_VAL))?;
        s.put(key, value)
    })
}

/// Puts reach the server as they are made: there is nothing to commit.
///
/// # Safety
/// `kvsname` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI_KVS_Commit(kvsname: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    let kvsname = unsafe { text(kvsname) };
    with_session("PMI_KVS_Commit", |s| own_kvs(s, kvsname).map_err(|_| Failed::arg(ERR_INVALID_ARG)))
}

/// # Safety
/// `kvsname` and `key` are NULL or NUL-terminated strings; `value` is NULL or points to `length` writable
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI_KVS_Get(
    kvsname: *const c_char,
    key: *const c_char,
    value: *mut c_char,
    length: c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    let (kvsname, key) = unsafe { (text(kvsname), text(key)) };
    if value.is_null() {
        return ERR_INVALID_VAL;
    }
    let Ok(length) = usize::try_from(length) else { return ERR_INVALID_LENGTH };
    with_session("PMI_KVS_Get", |s| {
        own_kvs(s, kvsname)?;
        let key = key.filter(|k| is_word(k, s.maxes.key)).ok_or(Failed::arg(ERR_INVALID_KEY))?;
        // SAFETY: the caller's contract.
        s.get(key, |got| unsafe { copy_out(got.as_bytes(), value, length, ERR_INVALID_LENGTH) })
    })
}

#[no_mangle]
pub extern "C" fn PMI_Barrier() -> c_int {
    with_session("PMI_Barrier", Session::barrier)
}

/// MPICH's PMI 1.2 group barrier: the ranks `group[..count]` (this rank among them), told apart from other
/// barriers over the same ranks by `stringtag`. `PMI_FAIL` where the server serves 1.1 only.
///
/// # Safety
/// `group` is NULL or points to `count` ints; `stringtag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI_Barrier_group(group: *const c_int, count: c_int, stringtag: *const c_char) -> c_int {
    let Ok(count) = usize::try_from(count) else { return ERR_INVALID_ARG };
    if group.is_null() || count == 0 {
        return ERR_INVALID_ARG;
    }
    // SAFETY: the caller's contract.
    let members = unsafe { std::slice::from_raw_parts(group, count) };
    // SAFETY: the caller's contract.
    let tag = tag_of(if stringtag.is_null() { b"" } else { unsafe { CStr::from_ptr(stringtag) }.to_bytes() });
    const NAME: &str = "PMI_Barrier_group";
    guard("libpmi", NAME, || {
        let (mut ranks, mut mail) = (Vec::new(), None);
        let rc = with_session(NAME, |s| {
            if count > s.size as usize {
                return Err(Failed::arg(ERR_INVALID_ARG));
            }
            for &r in members {
                match u32::try_from(r) {
                    Ok(r) if r < s.size => ranks.push(r),
                    _ => return Err(Failed::arg(ERR_INVALID_ARG)),
                }
            }
            ranks.sort_unstable();
            ranks.dedup();
            if ranks.len() != count || !ranks.contains(&s.rank) {
                return Err(Failed::arg(ERR_INVALID_ARG));
            }
            mail = s.group_mailbox()?;
            Ok(())
        });
        let Some(mail) = mail.filter(|_| rc == SUCCESS) else { return rc };
        // Sent under the session's lock, waited for without it: other threads' calls, and their group
        // barriers, go on meanwhile.
        // Forgotten if it is not sent (the session ended, the send failed).
        let expected = mail.expect_tagged(tag, "barrier_out");
        SESSION.with_then(
            NAME,
            |s| s.send_group(&ranks, tag),
            |()| expected.take().and_then(|line| session::group_ended(&line)),
        )
    })
}

/// The integer tag of a barrier's string tag (FNV-1a, kept positive, never 0: a plain barrier's answer has tag
/// 0): equal strings give equal tags in every process.
fn tag_of(text: &[u8]) -> i64 {
    let hash = text.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    ((hash >> 1) as i64).max(1)
}

/// Copies the C key-value pairs `v[..n]` into the request's pairs.
///
/// # Safety
/// `v` is NULL (with `n` 0) or points to `n` pairs whose `key` and `val` are NUL-terminated strings.
unsafe fn pairs(v: *const PmiKeyval, n: c_int) -> Option<Pairs> {
    let n = usize::try_from(n).ok()?;
    if n == 0 {
        return Some(Vec::new());
    }
    if v.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let v = unsafe { std::slice::from_raw_parts(v, n) };
    v.iter()
        .map(|kv| {
            // SAFETY: the caller's contract.
            let (key, val) = unsafe { (text(kv.key), text(kv.val)) };
            Some((key?.as_bytes().to_vec(), val?.as_bytes().to_vec()))
        })
        .collect()
}

/// `PMI_keyval_t`.
#[repr(C)]
pub struct PmiKeyval {
    key: *const c_char,
    val: *mut c_char,
}

/// # Safety
/// The arrays are as RFC 13 describes, each of `count` entries (`argvs[i]` NULL-terminated or NULL; the
/// info arrays NULL where their sizes are 0); `errors` has room for the sum of `maxprocs`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn PMI_Spawn_multiple(
    count: c_int,
    cmds: *const *const c_char,
    argvs: *const *const *const c_char,
    maxprocs: *const c_int,
    info_keyval_sizes: *const c_int,
    info_keyval_vectors: *const *const PmiKeyval,
    preput_keyval_size: c_int,
    preput_keyval_vector: *const PmiKeyval,
    errors: *mut c_int,
) -> c_int {
    // Reading the caller's arrays is inside the guard too: no panic reaches the caller.
    guard("libpmi", "PMI_Spawn_multiple", || {
        let Ok(count) = usize::try_from(count) else { return ERR_INVALID_ARG };
        if count == 0 || cmds.is_null() || maxprocs.is_null() || errors.is_null() {
            return ERR_INVALID_ARG;
        }
        // SAFETY: the caller's contract.
        let Some(preputs) = (unsafe { pairs(preput_keyval_vector, preput_keyval_size) }) else {
            return ERR_INVALID_ARG;
        };
        let mut commands = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: the caller's contract: each array has `count` entries.
            let (cmd, nprocs) = unsafe { (text(*cmds.add(i)), *maxprocs.add(i)) };
            let (Some(cmd), Ok(nprocs)) = (cmd, u32::try_from(nprocs)) else { return ERR_INVALID_ARG };
            let mut args = Vec::new();
            // SAFETY: the caller's contract.
            let argv = if argvs.is_null() { std::ptr::null() } else { unsafe { *argvs.add(i) } };
            if !argv.is_null() {
                for j in 0.. {
                    // SAFETY: the caller's contract: NULL-terminated.
                    let arg = unsafe { *argv.add(j) };
                    if arg.is_null() {
                        break;
                    }
                    // SAFETY: the caller's contract.
                    let Some(arg) = (unsafe { text(arg) }) else { return ERR_INVALID_ARG };
                    args.push(arg.as_bytes().to_vec());
                }
            }
            let infos = match (info_keyval_sizes.is_null(), info_keyval_vectors.is_null()) {
                (true, _) => Some(Vec::new()),
                // SAFETY: the caller's contract.
                (false, true) => (unsafe { *info_keyval_sizes.add(i) } == 0).then(Vec::new),
                // SAFETY: the caller's contract.
                (false, false) => unsafe { pairs(*info_keyval_vectors.add(i), *info_keyval_sizes.add(i)) },
            };
            let Some(infos) = infos else { return ERR_INVALID_ARG };
            commands.push(SpawnCommand {
                nprocs,
                execname: cmd.as_bytes().to_vec(),
                args,
                preputs: preputs.clone(),
                infos,
            });
        }
        let request = SpawnRequest { commands };
        let procs = request.total_procs() as usize;
        with_session("PMI_Spawn_multiple", |s| {
            let codes = s.spawn(&request)?;
            // SAFETY: the caller's contract: `errors` has room for every process asked for.
            unsafe { set_errcodes(errors, procs, &codes) };
            Ok(())
        })
    })
}

/// # Safety
/// Both arguments are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn PMI_Publish_name(service_name: *const c_char, port: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    let (Some(service), Some(port)) = (unsafe { text(service_name) }, unsafe { text(port) }) else {
        return ERR_INVALID_ARG;
    };
    if !is_word(service, PORT_MAX) || !is_word(port, PORT_MAX) {
        return ERR_INVALID_ARG;
    }
    let request = format!("cmd=publish_name service={service} port={port}");
    with_session("PMI_Publish_name", |s| s.name(&request, "publish_result").map(drop))
}

/// # Safety
/// `service_name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI_Unpublish_name(service_name: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    let Some(service) = (unsafe { text(service_name) }).filter(|s| is_word(s, PORT_MAX)) else {
        return ERR_INVALID_ARG;
    };
    let request = format!("cmd=unpublish_name service={service}");
    with_session("PMI_Unpublish_name", |s| s.name(&request, "unpublish_result").map(drop))
}

/// The port published for `service_name`, into `port`, which holds 256 bytes (MPICH's `MPI_MAX_PORT_NAME`).
///
/// # Safety
/// `service_name` is NULL or a NUL-terminated string; `port` is NULL or points to 256 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Lookup_name(service_name: *const c_char, port: *mut c_char) -> c_int {
    // SAFETY: the caller's contract.
    let Some(service) = (unsafe { text(service_name) }).filter(|s| is_word(s, PORT_MAX)) else {
        return ERR_INVALID_ARG;
    };
    if port.is_null() {
        return ERR_INVALID_ARG;
    }
    let request = format!("cmd=lookup_name service={service}");
    with_session("PMI_Lookup_name", |s| {
        let found = s.name(&request, "lookup_result")?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(found.as_bytes(), port, PORT_MAX, ERR_NOMEM) }
    })
}

/// What RFC 13 leaves OPTIONAL and the PMI-1 wire cannot serve: `PMI_FAIL` once the arguments are checked.
fn unserved(name: &str, args_ok: bool) -> c_int {
    match args_ok {
        false => ERR_INVALID_ARG,
        true => with_session(name, |_| Err(Failed::quiet())),
    }
}

/// # Safety
/// `kvsname` is NULL or points to `length` bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI_KVS_Create(kvsname: *mut c_char, length: c_int) -> c_int {
    unserved("PMI_KVS_Create", !kvsname.is_null() && length > 0)
}

/// # Safety
/// `kvsname` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI_KVS_Destroy(kvsname: *const c_char) -> c_int {
    unserved("PMI_KVS_Destroy", !kvsname.is_null())
}

/// `PMI_KVS_Iter_first` and `PMI_KVS_Iter_next`: one signature, neither served.
macro_rules! kvs_iter {
    ($name:ident) => {
        /// # Safety
        /// Pointers as RFC 13 describes.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            kvsname: *const c_char,
            key: *mut c_char,
            key_len: c_int,
            val: *mut c_char,
            val_len: c_int,
        ) -> c_int {
            let ok = !kvsname.is_null() && !key.is_null() && !val.is_null() && key_len > 0 && val_len > 0;
            unserved(stringify!($name), ok)
        }
    };
}

kvs_iter!(PMI_KVS_Iter_first);
kvs_iter!(PMI_KVS_Iter_next);

/// # Safety
/// Pointers as RFC 13 describes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Parse_option(
    num_args: c_int,
    args: *mut *mut c_char,
    num_parsed: *mut c_int,
    keyvalp: *mut *mut PmiKeyval,
    size: *mut c_int,
) -> c_int {
    let ok = num_args >= 0 && !args.is_null() && !num_parsed.is_null() && !keyvalp.is_null() && !size.is_null();
    unserved("PMI_Parse_option", ok)
}

/// # Safety
/// Pointers as RFC 13 describes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Args_to_keyval(
    argcp: *mut c_int,
    argvp: *mut *mut *mut c_char,
    keyvalp: *mut *mut PmiKeyval,
    size: *mut c_int,
) -> c_int {
    unserved("PMI_Args_to_keyval", !argcp.is_null() && !argvp.is_null() && !keyvalp.is_null() && !size.is_null())
}

/// # Safety
/// Pointers as RFC 13 describes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Free_keyvals(keyvalp: *mut PmiKeyval, size: c_int) -> c_int {
    unserved("PMI_Free_keyvals", !keyvalp.is_null() && size >= 0)
}

/// # Safety
/// Pointers as RFC 13 describes.
#[no_mangle]
pub unsafe extern "C" fn PMI_Get_options(str: *mut c_char, length: *mut c_int) -> c_int {
    unserved("PMI_Get_options", !str.is_null() && !length.is_null())
}

impl Ranked for Session {
    fn rank(&self) -> u32 {
        self.rank
    }
}
