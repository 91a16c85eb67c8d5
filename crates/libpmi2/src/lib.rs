//! `libpmi2.so.0`: the PMI-2 API (`include/pmi2.h`, every call MPICH's and Slurm's `pmi2.h` declare) for
//! programs and runtimes that link or load a PMI-2 library (Intel MPI's `I_MPI_PMI_LIBRARY` with
//! `I_MPI_PMI=pmi2`, Open MPI's s2 component), over any PMI-2 server: rpmi's, Slurm's `--mpi=pmi2`. Without a
//! launcher the process is a job of one.
//!
//! As `libpmi.so.0`: arguments are checked, one lock serves every thread, a panic never crosses into C, and a
//! server that breaks the protocol or goes away is said once on stderr, naming the rank and the call.

#![deny(unsafe_op_in_unsafe_fn)]

mod session;

use rpmi_client::cabi::{bytes, copy_cut, copy_out, guard, is_string, is_word, say, set, set_errcodes, text};
use rpmi_client::held::{Held, Ranked};
use rpmi_client::{Failed, ERR_INVALID_ARG, ERR_INVALID_KEY, ERR_INVALID_LENGTH, ERR_INVALID_VAL, SUCCESS};
use rpmi_wire::spawn::{SpawnCommand, SpawnRequest};
use session::{Attrs, Looked, Session};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// `PMI2_MAX_KEYLEN`, `PMI2_MAX_VALLEN` (each with its NUL).
const KEY_MAX: usize = 64;
const VALUE_MAX: usize = 1024;

/// The process's session, from `PMI2_Init` to `PMI2_Finalize`.
static SESSION: Held<Session> = Held::new("libpmi2");

fn with_session(name: &str, f: impl FnOnce(&mut Session) -> Result<(), Failed>) -> c_int {
    SESSION.with(name, f)
}

/// An MPI info entry as MPICH lays it out (`struct MPID_Info`): only `key` and `value` are read.
#[repr(C)]
pub struct MpidInfo {
    handle: c_int,
    pobj_mutex: c_int,
    ref_count: c_int,
    next: *mut MpidInfo,
    key: *mut c_char,
    value: *mut c_char,
}

/// A key of the wire: a word without `;`, shorter than `PMI2_MAX_KEYLEN`.
fn key_ok(k: &str) -> bool {
    is_word(k, KEY_MAX) && !k.contains(';')
}

/// # Safety
/// Each argument is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Init(
    spawned: *mut c_int,
    size: *mut c_int,
    rank: *mut c_int,
    appnum: *mut c_int,
) -> c_int {
    if spawned.is_null() || size.is_null() || rank.is_null() || appnum.is_null() {
        return ERR_INVALID_ARG;
    }
    SESSION.init("PMI2_Init", Session::start, |s| {
        // SAFETY: checked above, as the caller's contract allows.
        unsafe {
            set(spawned, s.spawned as c_int);
            set(size, s.size as c_int);
            set(rank, s.rank as c_int);
            set(appnum, s.appnum)
        }
    })
}

#[no_mangle]
pub extern "C" fn PMI2_Initialized() -> c_int {
    SESSION.initialized() as c_int
}

#[no_mangle]
pub extern "C" fn PMI2_Finalize() -> c_int {
    SESSION.finalize("PMI2_Finalize", |s| if s.alone_now() { Ok(()) } else { s.ask("finalize", &[]).map(drop) })
}

/// # Safety
/// `msg` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Abort(flag: c_int, msg: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    let message =
        if msg.is_null() { String::new() } else { unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned() };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        say(&message);
        // Another thread may hold the session in a fence: then the server learns of the end from this
        // process's exit instead.
        SESSION.abort();
        SESSION.try_with(|s| {
            let world: &[u8] = if flag != 0 { b"TRUE" } else { b"FALSE" };
            // Slurm's server reads isworld and msg; rpmi's reads exitcode and message.
            let fields: &[(&str, &[u8])] =
                &[("isworld", world), ("msg", message.as_bytes()), ("exitcode", b"1"), ("message", message.as_bytes())];
            s.tell("abort", fields);
        });
    }));
    std::process::exit(1)
}

/// # Safety
/// As `pmi2.h` describes: `count` entries in `cmds`, `argcs`, `argvs`, `maxprocs` (and the info arrays, where
/// given); `preput_keyval_size` pointers in `preput_keyval_vector`; `errors` has room for every process asked
/// for; `jobId` is NULL or holds `jobIdSize` bytes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn PMI2_Job_Spawn(
    count: c_int,
    cmds: *const *const c_char,
    argcs: *const c_int,
    argvs: *const *const *const c_char,
    maxprocs: *const c_int,
    info_keyval_sizes: *const c_int,
    info_keyval_vectors: *const *const MpidInfo,
    preput_keyval_size: c_int,
    preput_keyval_vector: *const *const MpidInfo,
    job_id: *mut c_char,
    job_id_size: c_int,
    errors: *mut c_int,
) -> c_int {
    // Reading the caller's arrays is inside the guard too: no panic reaches the caller.
    guard("libpmi2", "PMI2_Job_Spawn", || {
        let Ok(count) = usize::try_from(count) else { return ERR_INVALID_ARG };
        let Ok(preput_count) = usize::try_from(preput_keyval_size) else { return ERR_INVALID_ARG };
        if count == 0
            || cmds.is_null()
            || maxprocs.is_null()
            || errors.is_null()
            || (preput_count > 0 && preput_keyval_vector.is_null())
        {
            return ERR_INVALID_ARG;
        }
        let pair = |kv: *const MpidInfo| -> Option<(Vec<u8>, Vec<u8>)> {
            // SAFETY: the caller's contract: entries as pmi2.h lays them out.
            let kv = unsafe { kv.as_ref() }?;
            // SAFETY: as above.
            let (k, v) = unsafe { (text(kv.key)?, text(kv.value)?) };
            Some((k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        };
        // SAFETY: the caller's contract.
        let preputs: Option<Vec<_>> =
            (0..preput_count).map(|i| pair(unsafe { *preput_keyval_vector.add(i) })).collect();
        let Some(preputs) = preputs else { return ERR_INVALID_ARG };
        let mut commands = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: the caller's contract: each array has `count` entries.
            let (cmd, nprocs) = unsafe { (text(*cmds.add(i)), *maxprocs.add(i)) };
            let (Some(cmd), Ok(nprocs)) = (cmd, u32::try_from(nprocs)) else { return ERR_INVALID_ARG };
            // SAFETY: as above.
            let argc = if argcs.is_null() { 0 } else { unsafe { *argcs.add(i) } };
            let Ok(argc) = usize::try_from(argc) else { return ERR_INVALID_ARG };
            // SAFETY: as above.
            let argv = if argvs.is_null() { std::ptr::null() } else { unsafe { *argvs.add(i) } };
            if argc > 0 && argv.is_null() {
                return ERR_INVALID_ARG;
            }
            // SAFETY: `argc` entries, the caller's contract.
            let args: Option<Vec<_>> =
                (0..argc).map(|j| unsafe { text(*argv.add(j)) }.map(|a| a.as_bytes().to_vec())).collect();
            let Some(args) = args else { return ERR_INVALID_ARG };
            // SAFETY: as above.
            let ninfos = if info_keyval_sizes.is_null() { 0 } else { unsafe { *info_keyval_sizes.add(i) } };
            let Ok(ninfos) = usize::try_from(ninfos) else { return ERR_INVALID_ARG };
            // SAFETY: as above.
            let infos_of =
                if info_keyval_vectors.is_null() { std::ptr::null() } else { unsafe { *info_keyval_vectors.add(i) } };
            if ninfos > 0 && infos_of.is_null() {
                return ERR_INVALID_ARG;
            }
            // SAFETY: `ninfos` entries, the caller's contract.
            let infos: Option<Vec<_>> = (0..ninfos).map(|j| pair(unsafe { infos_of.add(j) })).collect();
            let Some(infos) = infos else { return ERR_INVALID_ARG };
            let preputs = if i == 0 { preputs.clone() } else { Vec::new() };
            commands.push(SpawnCommand { nprocs, execname: cmd.as_bytes().to_vec(), args, preputs, infos });
        }
        let request = SpawnRequest { commands };
        let procs = request.total_procs() as usize;
        let job_id_size = usize::try_from(job_id_size).unwrap_or(0);
        with_session("PMI2_Job_Spawn", |s| {
            let (jobid, codes) = s.spawn(&request)?;
            // SAFETY: the caller's contract: `errors` has room for every process asked for.
            unsafe { set_errcodes(errors, procs, &codes) };
            if !job_id.is_null() && job_id_size > 0 {
                // Cut to the buffer: the processes started, and the call must say so.
                // SAFETY: the caller's contract.
                unsafe { copy_cut(&jobid, job_id, job_id_size) };
            }
            Ok(())
        })
    })
}

/// # Safety
/// `jobid` is NULL or points to `jobid_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Job_GetId(jobid: *mut c_char, jobid_size: c_int) -> c_int {
    if jobid.is_null() {
        return ERR_INVALID_ARG;
    }
    let Ok(size) = usize::try_from(jobid_size) else { return ERR_INVALID_LENGTH };
    // SAFETY: the caller's contract.
    with_session("PMI2_Job_GetId", |s| unsafe { copy_out(s.jobid.as_bytes(), jobid, size, ERR_INVALID_LENGTH) })
}

/// # Safety
/// `rank` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Job_GetRank(rank: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { SESSION.query("PMI2_Job_GetRank", rank, |s| Ok(s.rank as c_int)) }
}

/// # Safety
/// `size` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Info_GetSize(size: *mut c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { SESSION.query("PMI2_Info_GetSize", size, |s| Ok(s.size as c_int)) }
}

/// Connecting to another job is not served: `PMI2_FAIL` once the arguments are checked.
///
/// # Safety
/// `jobid` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Job_Connect(jobid: *const c_char, conn: *mut c_void) -> c_int {
    if jobid.is_null() || conn.is_null() {
        return ERR_INVALID_ARG;
    }
    with_session("PMI2_Job_Connect", |_| Err(Failed::quiet()))
}

/// # Safety
/// `jobid` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Job_Disconnect(jobid: *const c_char) -> c_int {
    if jobid.is_null() {
        return ERR_INVALID_ARG;
    }
    with_session("PMI2_Job_Disconnect", |_| Err(Failed::quiet()))
}

/// # Safety
/// Both arguments are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn PMI2_KVS_Put(key: *const c_char, value: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { put("PMI2_KVS_Put", key, value, Session::put) }
}

/// A put call: `key` and `value` checked, then `store` of them.
///
/// # Safety
/// `key` and `value` are NULL or NUL-terminated strings.
unsafe fn put(
    call: &str,
    key: *const c_char,
    value: *const c_char,
    store: impl FnOnce(&mut Session, &str, &[u8]) -> Result<(), Failed>,
) -> c_int {
    // SAFETY: the caller's contract.
    // A value is any bytes a frame carries (PMI-2 frames are counted, not lines), but a line break, which
    // a server's trace or a PMI-1 reader of the same store could not take.
    let (key, value) = unsafe { (text(key), bytes(value)) };
    let Some(key) = key.filter(|k| key_ok(k)) else { return ERR_INVALID_KEY };
    let Some(value) = value.filter(|v| is_string(v, VALUE_MAX)) else { return ERR_INVALID_VAL };
    with_session(call, |s| store(s, key, value))
}

#[no_mangle]
pub extern "C" fn PMI2_KVS_Fence() -> c_int {
    with_session("PMI2_KVS_Fence", Session::fence)
}

/// # Safety
/// `jobid` and `key` are NULL or NUL-terminated strings; `value` is NULL or holds `maxvalue` bytes; `vallen` is
/// NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn PMI2_KVS_Get(
    jobid: *const c_char,
    src_pmi_id: c_int,
    key: *const c_char,
    value: *mut c_char,
    maxvalue: c_int,
    vallen: *mut c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    let (job, key) = unsafe { (text(jobid), text(key)) };
    let Some(key) = key.filter(|k| key_ok(k)) else { return ERR_INVALID_KEY };
    if value.is_null() || (!jobid.is_null() && job.is_none()) {
        return ERR_INVALID_ARG;
    }
    let Ok(max) = usize::try_from(maxvalue) else { return ERR_INVALID_LENGTH };
    with_session("PMI2_KVS_Get", |s| {
        let job = job.unwrap_or(&s.jobid).to_owned();
        s.get(&job, src_pmi_id, key, |got| {
            // A value cut to the buffer says so as MPICH's and Slurm's clients do: its length, negative.
            // SAFETY: the caller's contract.
            let cut = unsafe { copy_cut(got, value, max) };
            if !vallen.is_null() {
                let len = got.len() as c_int;
                // SAFETY: the caller's contract.
                unsafe { *vallen = if cut { -len } else { len } };
            }
            Ok(())
        })
    })
}

/// A found value into the caller's `value[..len]` and `*found`.
///
/// # Safety
/// `value` holds `len` bytes; `found` points to a writable int.
unsafe fn deliver(got: Option<Vec<u8>>, value: *mut c_char, len: usize, found: *mut c_int) -> Result<(), Failed> {
    if let Some(v) = &got {
        // Cut to the buffer, as MPICH's and Slurm's clients deliver it.
        // SAFETY: the caller's contract.
        unsafe { copy_cut(v, value, len) };
    }
    // SAFETY: the caller's contract.
    unsafe { *found = got.is_some() as c_int };
    Ok(())
}

/// The integers of a comma-separated attribute into `array[..len]` (those that fit), their count into
/// `*outlen`.
///
/// # Safety
/// `array` holds `len` ints; `outlen` and `found` point to writable ints.
unsafe fn deliver_ints(
    got: Option<Vec<u8>>,
    array: *mut c_int,
    len: usize,
    outlen: *mut c_int,
    found: *mut c_int,
) -> Result<(), Failed> {
    let mut n = 0;
    if let Some(v) = &got {
        let text = String::from_utf8_lossy(v);
        for item in text.split(',').filter(|i| !i.trim().is_empty()) {
            let x: c_int = item
                .trim()
                .parse()
                .map_err(|_| Failed::said(format!("the attribute '{text}' is not a list of integers")))?;
            // Cut to the array, as MPICH's client does.
            if n == len {
                break;
            }
            // SAFETY: n < len, the caller's contract.
            unsafe { *array.add(n) = x };
            n += 1;
        }
    }
    // SAFETY: the caller's contract.
    unsafe {
        *outlen = n as c_int;
        *found = got.is_some() as c_int;
    }
    Ok(())
}

/// An attribute call: `name` checked, then its value among `attrs` into the caller's `value[..valuelen]` and
/// `*found`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `value` is NULL or holds `valuelen` bytes; `found` is NULL or
/// writable.
unsafe fn attr(
    call: &str,
    attrs: Attrs,
    name: *const c_char,
    value: *mut c_char,
    valuelen: c_int,
    found: *mut c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    let (name, len) = match unsafe { attr_args(name, value, valuelen, found) } {
        Ok(checked) => checked,
        Err(rc) => return rc,
    };
    // SAFETY: checked above, the caller's contract.
    looked_up(call, attrs, name, |got| unsafe { deliver(got, value, len, found) })
}

/// Attribute `name` of `attrs`, as it is now, handed to `deliver` under the session's lock. One held back
/// behind another thread's wait ([`Looked::Behind`]) is waited for without the lock, then asked for again.
fn looked_up(
    call: &str,
    attrs: Attrs,
    name: &str,
    mut deliver: impl FnMut(Option<Vec<u8>>) -> Result<(), Failed>,
) -> c_int {
    loop {
        let mut behind = None;
        let rc = with_session(call, |s| match s.attr(attrs, name)? {
            Looked::Value(got) => deliver(got),
            Looked::Behind(mail) => {
                behind = Some(mail);
                Ok(())
            }
        });
        match behind {
            Some(mail) => session::wait_turn(&mail),
            None => return rc,
        }
    }
}

/// An attribute call's arguments checked: the name, and the value's length.
///
/// # Safety
/// As [`attr`]'s.
unsafe fn attr_args<'a>(
    name: *const c_char,
    value: *mut c_char,
    valuelen: c_int,
    found: *mut c_int,
) -> Result<(&'a str, usize), c_int> {
    // SAFETY: the caller's contract.
    let Some(name) = (unsafe { text(name) }).filter(|n| key_ok(n)) else { return Err(ERR_INVALID_KEY) };
    let Ok(len) = usize::try_from(valuelen) else { return Err(ERR_INVALID_LENGTH) };
    if value.is_null() || found.is_null() {
        return Err(ERR_INVALID_ARG);
    }
    Ok((name, len))
}

/// An attribute call for a list of integers: `name` checked, then its value among `attrs`, comma-separated
/// integers, into the caller's `array[..arraylen]`, their count into `*outlen`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `array` is NULL or holds `arraylen` ints; `outlen` and `found`
/// are NULL or writable.
unsafe fn attr_ints(
    call: &str,
    attrs: Attrs,
    name: *const c_char,
    array: *mut c_int,
    arraylen: c_int,
    outlen: *mut c_int,
    found: *mut c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(name) = (unsafe { text(name) }).filter(|n| key_ok(n)) else { return ERR_INVALID_KEY };
    let Ok(len) = usize::try_from(arraylen) else { return ERR_INVALID_LENGTH };
    if array.is_null() || outlen.is_null() || found.is_null() {
        return ERR_INVALID_ARG;
    }
    // SAFETY: checked above, the caller's contract.
    looked_up(call, attrs, name, |got| unsafe { deliver_ints(got, array, len, outlen, found) })
}

/// # Safety
/// As `attr` says.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Info_GetNodeAttr(
    name: *const c_char,
    value: *mut c_char,
    valuelen: c_int,
    found: *mut c_int,
    waitfor: c_int,
) -> c_int {
    const NAME: &str = "PMI2_Info_GetNodeAttr";
    if waitfor == 0 {
        // SAFETY: the caller's contract.
        return unsafe { attr(NAME, Attrs::Node, name, value, valuelen, found) };
    }
    // SAFETY: the caller's contract.
    let (key, len) = match unsafe { attr_args(name, value, valuelen, found) } {
        Ok(checked) => checked,
        Err(rc) => return rc,
    };
    guard("libpmi2", NAME, || {
        let mut mail = None;
        let rc = with_session(NAME, |s| {
            mail = s.mailbox();
            Ok(())
        });
        let Some(mail) = mail.filter(|_| rc == SUCCESS) else {
            // A job of one (nobody else could put it), or no session.
            // SAFETY: the caller's contract.
            return if rc == SUCCESS { unsafe { attr(NAME, Attrs::Node, name, value, valuelen, found) } } else { rc };
        };
        // Asked under the session's lock, waited for without it: another thread of the process may be the
        // one to put the attribute meanwhile.
        let expected = session::expect_node_attr(&mail);
        SESSION.with_then(
            NAME,
            |s| s.send_node_wait(key),
            |()| {
                let got = session::node_waited(expected)?;
                // SAFETY: checked above, the caller's contract.
                unsafe { deliver(got, value, len, found) }
            },
        )
    })
}

/// `PMI2_Info_GetNodeAttrIntArray` and `PMI2_Info_GetJobAttrIntArray`: one signature, over `attrs`.
macro_rules! int_array_attr {
    ($name:ident, $attrs:expr) => {
        /// # Safety
        /// As `attr_ints` says.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            name: *const c_char,
            array: *mut c_int,
            arraylen: c_int,
            outlen: *mut c_int,
            found: *mut c_int,
        ) -> c_int {
            // SAFETY: the caller's contract.
            unsafe { attr_ints(stringify!($name), $attrs, name, array, arraylen, outlen, found) }
        }
    };
}

int_array_attr!(PMI2_Info_GetNodeAttrIntArray, Attrs::Node);
int_array_attr!(PMI2_Info_GetJobAttrIntArray, Attrs::Job);

/// # Safety
/// Both arguments are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Info_PutNodeAttr(name: *const c_char, value: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { put("PMI2_Info_PutNodeAttr", name, value, Session::put_node_attr) }
}

/// # Safety
/// As `attr` says.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Info_GetJobAttr(
    name: *const c_char,
    value: *mut c_char,
    valuelen: c_int,
    found: *mut c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { attr("PMI2_Info_GetJobAttr", Attrs::Job, name, value, valuelen, found) }
}

/// The longest service name or port, NUL included.
const NAME_MAX: usize = 256;

/// # Safety
/// `service_name` and `port` are NULL or NUL-terminated strings; `info_ptr` is not read.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Nameserv_publish(
    service_name: *const c_char,
    _info_ptr: *const MpidInfo,
    port: *const c_char,
) -> c_int {
    // SAFETY: the caller's contract.
    let (Some(service), Some(port)) = (unsafe { text(service_name) }, unsafe { text(port) }) else {
        return ERR_INVALID_ARG;
    };
    if !key_ok_name(service) || !key_ok_name(port) {
        return ERR_INVALID_ARG;
    }
    let fields: &[(&str, &[u8])] = &[("name", service.as_bytes()), ("port", port.as_bytes()), ("infokeycount", b"0")];
    with_session("PMI2_Nameserv_publish", |s| s.name("name-publish", fields).map(drop))
}

/// # Safety
/// `service_name` is NULL or a NUL-terminated string; `port` holds `port_len` bytes; `info_ptr` is not read.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Nameserv_lookup(
    service_name: *const c_char,
    _info_ptr: *const MpidInfo,
    port: *mut c_char,
    port_len: c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(service) = (unsafe { text(service_name) }).filter(|s| key_ok_name(s)) else { return ERR_INVALID_ARG };
    let Ok(len) = usize::try_from(port_len) else { return ERR_INVALID_LENGTH };
    if port.is_null() {
        return ERR_INVALID_ARG;
    }
    let fields: &[(&str, &[u8])] = &[("name", service.as_bytes()), ("infokeycount", b"0")];
    with_session("PMI2_Nameserv_lookup", |s| {
        let found = s.name("name-lookup", fields)?;
        // SAFETY: checked above, the caller's contract.
        unsafe { copy_out(&found, port, len, ERR_INVALID_LENGTH) }
    })
}

/// # Safety
/// `service_name` is NULL or a NUL-terminated string; `info_ptr` is not read.
#[no_mangle]
pub unsafe extern "C" fn PMI2_Nameserv_unpublish(service_name: *const c_char, _info_ptr: *const MpidInfo) -> c_int {
    // SAFETY: the caller's contract.
    let Some(service) = (unsafe { text(service_name) }).filter(|s| key_ok_name(s)) else { return ERR_INVALID_ARG };
    let fields: &[(&str, &[u8])] = &[("name", service.as_bytes()), ("infokeycount", b"0")];
    with_session("PMI2_Nameserv_unpublish", |s| s.name("name-unpublish", fields).map(drop))
}

/// A service name or port: a word without `;`, shorter than [`NAME_MAX`].
fn key_ok_name(s: &str) -> bool {
    is_word(s, NAME_MAX) && !s.contains(';')
}

impl Ranked for Session {
    fn rank(&self) -> u32 {
        self.rank
    }
}
